"""Long-context continued pretraining end to end (README "Long-context continuation"): a tiny Llama
trained at seq_len 64, then continued at 4x the length with RoPE scaling (llama3) and document
attention, two ways:
  (a) from its checkpoint (--resume auto --force-resume-changes): the run starts at the checkpoint's
      step, the learning rate is the schedule's at that step (not a restarted warmup), the AdamW
      moments are the checkpoint's (v of the first resumed step >= beta2 x the saved v, element by
      element: fresh moments would hold (1 - beta2) g^2), the data position is mapped onto the longer
      samples and logged (a smaller global batch too), the first long loss is near the short run's last loss (not a fresh
      model's), the new RoPE is in use (the loss differs from a continuation without rope_scaling),
      and the exported config.json carries rope_scaling; without --force-resume-changes the resume
      is refused naming model.rope_scaling, and a shape key is refused even with it;
  (b) from the run's exported Hugging Face directory (model.init_from + rope_scaling): a new run
      whose first loss is again near the short run's last one, its config.json with rope_scaling.
Small and fast: 50k parameters, a few dozen steps of at most 2 x 256 tokens."""
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import megatron_writer  # noqa: E402
from train_helpers import ENV, LATHE, check, finish, records, write_recipe  # noqa: E402

SHORT, LONG = 64, 256
STEPS, MORE = 40, 6
LR, WARMUP, BETA2 = 1e-2, 2, 0.99
EOD = 0
ROPE = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": SHORT}


def run(args, ok=True):
    p = subprocess.run([LATHE] + args, capture_output=True, text=True, timeout=300, env=ENV)
    if ok and p.returncode != 0:
        print(p.stdout[-3000:], p.stderr[-3000:])
        raise SystemExit(f"lathe {' '.join(args)} failed ({p.returncode})")
    return p


def recipe(path, data, out, seq_len, steps, model, **extra):
    # The long run takes 1 sample of 256 tokens a step (the global batch changes too, as it may with
    # --force-resume-changes: state.json's consumed_samples are the checkpoint's steps x its batch).
    training = {"seq_len": seq_len, "micro_batch_size": 2 if seq_len == SHORT else 1, "steps": steps,
                "log_interval": 1}
    r = write_recipe(path, data, training, model=model, output={"dir": out, "checkpoint_every": 1 if seq_len == LONG
                                                                else steps}, **extra)
    j = json.load(open(r))  # the optimizer and schedule of this test
    j["optimizer"] = {"name": "adamw", "lr": LR, "beta2": BETA2}
    j["schedule"] = {"name": "cosine", "warmup_steps": WARMUP}
    json.dump(j, open(r, "w"))
    return r


def lr_at(step, total):  # src/optim/schedule.cpp lr_at for cosine, min_lr 0; `step` counted from 0
    if step < WARMUP:
        return LR * (step + 1) / WARMUP
    p = min(max((step - WARMUP) / (total - WARMUP), 0.0), 1.0)
    return 0.5 * LR * (1 + math.cos(math.pi * p))


def moments(ckpt):
    from safetensors.numpy import load_file
    return load_file(os.path.join(ckpt, "optimizer.safetensors"))


def exported_rope(out):
    cfg = json.load(open(os.path.join(out, "model", "config.json")))
    return cfg.get("rope_scaling"), cfg.get("max_position_embeddings")


def main():
    tmp = tempfile.mkdtemp(prefix="lathe-longctx-")
    rng = np.random.default_rng(0)
    # Documents of patterned tokens 1..95, each ended by the EOD token 0.
    data = os.path.join(tmp, "data")
    megatron_writer.write(data, [list((np.arange(299) * (d % 5 + 1) + rng.integers(0, 3, 299)) % 95 + 1) + [EOD]
                                 for d in range(40)])
    short = os.path.join(tmp, "short")
    run(["train", recipe(short, data, short, SHORT, STEPS, {"preset": "llama-debug"}), "--quiet"])
    s = records(short)
    fresh_loss, short_loss = s[0]["loss"], s[-1]["loss"]
    check(short_loss < fresh_loss - 1.0, f"the short run learns (loss {fresh_loss:.3f} -> {short_loss:.3f})")
    ckpt = os.path.join("checkpoints", f"step_{STEPS:08d}")

    long_model = {"preset": "llama-debug", "max_position_embeddings": LONG, "rope_scaling": ROPE}
    docs = {"attention": "document", "eod_token": EOD}

    def continuation(name, model):
        out = os.path.join(tmp, name)
        shutil.copytree(short, out)
        r = recipe(out, data, out, LONG, STEPS + MORE, model)
        j = json.load(open(r))
        j["data"].update(docs)
        json.dump(j, open(r, "w"))
        return out, r

    # ---- (a) resume from the checkpoint
    a, ra = continuation("a", long_model)
    p = run(["train", ra, "--quiet", "--resume", "auto"], ok=False)
    msg = p.stdout + p.stderr
    check(p.returncode == 1 and "model.rope_scaling: null -> " in msg and "training.seq_len: 64 -> 256" in msg
          and "--force-resume-changes" in msg, "without --force-resume-changes the resume is refused naming "
          "model.rope_scaling and training.seq_len:\n" + msg[-800:])
    p = run(["train", ra, "--quiet", "--resume", "auto", "--force-resume-changes",
             "--set", "model.num_hidden_layers=3"], ok=False)
    msg = p.stdout + p.stderr
    check(p.returncode == 1 and "model.num_hidden_layers: 2 -> 3" in msg and "shape" in msg,
          "a shape key is refused even with --force-resume-changes:\n" + msg[-600:])
    p = run(["train", ra, "--quiet", "--resume", "auto", "--force-resume-changes"])
    recs = [r for r in records(a) if r["step"] > STEPS]
    check([r["step"] for r in recs] == list(range(STEPS + 1, STEPS + MORE + 1)),
          f"the continuation starts at the checkpoint's step {STEPS + 1}: {[r['step'] for r in recs]}")
    want = lr_at(STEPS, STEPS + MORE)
    check(abs(recs[0]["lr"] - want) <= 1e-9 * LR, f"the schedule continues: lr {recs[0]['lr']:.6g} at step "
          f"{STEPS + 1} = cosine's {want:.6g} (a restart would give {lr_at(0, STEPS + MORE):.6g})")
    first = recs[0]["loss"]
    check(math.isfinite(first) and abs(first - short_loss) < 0.5 * (fresh_loss - short_loss),
          f"the first long loss {first:.4f} is near the short run's last {short_loss:.4f} (a fresh model: "
          f"{fresh_loss:.4f})")
    check("the checkpoint's data position (epoch 0, sample 80 of 64 tokens = 5120 tokens into the epoch) continues "
          "at epoch 0, sample 20 of 256 tokens" in p.stdout, "the data position is mapped onto the longer samples "
          "and logged")
    v0, v1 = moments(os.path.join(short, ckpt)), moments(os.path.join(a, "checkpoints", f"step_{STEPS + 1:08d}"))
    ratio = min(float(np.min(v1[k][v0[k] > 0] / v0[k][v0[k] > 0])) for k in v0 if k.startswith("exp_avg_sq/"))
    check(ratio >= BETA2 * (1 - 1e-5), f"the moments are the checkpoint's: min v(step {STEPS + 1}) / v(step {STEPS})"
          f" = {ratio:.6f} >= beta2 {BETA2} (fresh moments give (1 - beta2) g^2)")
    rope, pos = exported_rope(a)
    check(rope == dict(ROPE) and pos == LONG, f"the exported config.json carries rope_scaling {rope} and "
          f"max_position_embeddings {pos}")

    # The new RoPE is in use: the same continuation without rope_scaling computes another first loss.
    plain, rp = continuation("plain", {"preset": "llama-debug", "max_position_embeddings": LONG})
    run(["train", rp, "--quiet", "--resume", "auto", "--force-resume-changes"])
    other = [r for r in records(plain) if r["step"] > STEPS][0]["loss"]
    check(abs(other - first) > 1e-4, f"rope_scaling changes the math: first long loss {first:.5f} with llama3 "
          f"scaling, {other:.5f} without")

    # ---- (b) a new run from the exported Hugging Face directory
    b = os.path.join(tmp, "b")
    rb = recipe(b, data, b, LONG, MORE, dict(long_model, preset=None, init_from=os.path.join(short, "model")))
    j = json.load(open(rb))
    del j["model"]["preset"]
    j["data"].update(docs)
    json.dump(j, open(rb, "w"))
    p = run(["train", rb])
    rec_b = records(b)
    check(rec_b[0]["step"] == 1 and "the recipe overrides rope_scaling: null -> " in p.stdout + p.stderr,
          "init_from starts a new run at step 1 and reports the rope_scaling override")
    first_b = rec_b[0]["loss"]
    check(math.isfinite(first_b) and abs(first_b - short_loss) < 0.5 * (fresh_loss - short_loss),
          f"init_from: the first long loss {first_b:.4f} is near the short run's last {short_loss:.4f}")
    rope, pos = exported_rope(b)
    check(rope == dict(ROPE) and pos == LONG, f"init_from: the exported config.json carries rope_scaling {rope}")
    return finish(tmp)


if __name__ == "__main__":
    sys.exit(main())
