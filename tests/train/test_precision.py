#!/usr/bin/env python3
"""Loss scaling and the skipping of non-finite steps through the `lathe train` binary, in fp32
compute (the scaler is dtype-independent; precision.loss_scale.enabled: true turns it on without
an fp16 model). The bf16/fp16 end-to-end runs are in test_precision_lowp.py.

LATHE_TEST_NONFINITE_STEPS=3,5 makes the gradients of those steps +Inf (as an fp16 overflow would).
Checked here:
  * scaling is exact in fp32: a run with dynamic scaling (power-of-two scales) has bit-identical
    losses, gradient norms and final weights to one without
  * a skipped step: logged with the count; its checkpoint's weights and moments are byte-identical
    to the previous step's; the data position, the step counter and the learning rate advance;
    the next step trains again on the next batch
  * the loss scale halves on each overflow and doubles after growth_interval clean steps (the
    sequence derived by hand from the rules), in metrics.jsonl and state.json
  * without scaling (plain fp32) a non-finite step is skipped too, the scale stays 1
  * training.max_skipped_steps consecutive skips stop the run naming the steps; 0 never stops;
    an overflow at precision.loss_scale.min stops naming the step and the scale
  * resume: interrupted + resumed == uninterrupted (losses, scales, skipped counts, weights), with
    the cut inside a run of skips and inside a growth interval
  * data parallelism (mpirun -np 2, ZeRO 0, 1 and 2, when mpirun exists): every rank skips the same
    steps, with the scale and losses of the single-process run
  * a checkpoint written before the scaler fields (no precision section, no counters) resumes
  * precision.compute errors: an unknown dtype names the valid ones; a dtype this build cannot
    compute in is refused naming precision.compute and the missing op (until the tables exist);
    loss_scale keys for fp32 are ignored with a note (`lathe check`)
"""
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from kill_test_lib import ENV, LATHE, make_data, run, xxh64  # noqa: E402
from train_helpers import check, finish, records  # noqa: E402

RECIPE = """
model: {{preset: gpt2-debug, vocab_size: 256}}
data: {{train: {data}, valid_fraction: 0.1, prefetch: 2}}
optimizer: {{name: adamw, lr: 3.0e-3, grad_clip: 1.0}}
schedule: {{name: cosine, warmup_steps: 2, min_lr: 1.0e-4}}
training: {{micro_batch_size: 4, seq_len: 32, steps: 8, seed: 7, eval_interval: 0, peak_gflops: 100, threads: 1}}
output: {{dir: {out}, checkpoint_every: 1}}
"""
SCALED = ["--set", "precision.loss_scale.enabled=true", "--set", "precision.loss_scale.growth_interval=2"]


def field(out, key):
    return [r[key] for r in records(out)]


def ckpt(out, step):
    return os.path.join(out, "checkpoints", f"step_{step:08d}")


def state(out, step):
    return json.load(open(os.path.join(ckpt(out, step), "state.json")))["body"]


def same(a, b):
    return open(a, "rb").read() == open(b, "rb").read()


def read_st(path):
    """safetensors -> {name: float32 array} (lathe's checkpoints hold F32 only)."""
    data = open(path, "rb").read()
    (n,) = struct.unpack("<Q", data[:8])
    out = {}
    for name, info in json.loads(data[8:8 + n]).items():
        if name != "__metadata__" and info["dtype"] == "F32":
            a, b = info["data_offsets"]
            out[name] = np.frombuffer(data[8 + n + a:8 + n + b], dtype=np.float32)
    return out


def adamw_step_count(before, after, lr):
    """Which AdamW step count t (bias correction) turns checkpoint `before` into `after`, from the
    moments alone: p' = p - lr/(1-b1^t) * m' / (sqrt(v')/sqrt(1-b2^t) + eps) (torch.optim.AdamW;
    norm and bias tensors, which get no weight decay). Returns {t: relative mismatch}."""
    p0, p1 = read_st(os.path.join(before, "model.safetensors")), read_st(os.path.join(after, "model.safetensors"))
    o1 = read_st(os.path.join(after, "optimizer.safetensors"))
    out = {}
    for t in range(1, 9):
        bc1, bc2 = 1 - 0.9 ** t, 1 - 0.95 ** t
        err = scale = 0.0
        for name in p0:
            if not (name.endswith(".bias") or ".ln" in name):
                continue
            m, v = o1["exp_avg/" + name], o1["exp_avg_sq/" + name]
            pred = p0[name] + np.float32(-(lr / bc1)) * (m / (np.sqrt(v) / np.float32(np.sqrt(bc2)) + np.float32(1e-8)))
            err = max(err, float(np.max(np.abs(pred - p1[name]))))
            scale = max(scale, float(np.max(np.abs(p1[name] - p0[name]))))
        out[t] = err / scale
    return out


def train(tmp, data, name, *args, inject="", ok=True):
    out = os.path.join(tmp, name)
    recipe = os.path.join(tmp, name + ".yaml")
    open(recipe, "w").write(RECIPE.format(data=data, out=out))
    env = dict(ENV, LATHE_TEST_NONFINITE_STEPS=inject)
    p = run(["train", recipe, *args], ok=ok, env=env)
    return out, recipe, p


def main():
    tmp = tempfile.mkdtemp(prefix="lathe_precision_")
    data = make_data(tmp, "data", 60_000)

    # ---- loss scaling is exact in fp32 (power-of-two scales, no overflow)
    plain, _, _ = train(tmp, data, "plain")
    scaled, _, p = train(tmp, data, "scaled", *SCALED)
    check(field(plain, "loss") == field(scaled, "loss") and field(plain, "grad_norm") == field(scaled, "grad_norm"),
          "fp32 with dynamic loss scaling: bit-identical losses and gradient norms to no scaling")
    check(same(os.path.join(plain, "model", "model.safetensors"), os.path.join(scaled, "model", "model.safetensors")),
          "fp32 with dynamic loss scaling: byte-identical final weights")
    check(field(plain, "loss_scale") == [1.0] * 8 and field(plain, "skipped_steps") == [0] * 8,
          "metrics.jsonl: loss_scale 1 and skipped_steps 0 without scaling")
    # 65536, clean, clean -> x2, and so on every 2 clean steps.
    want = [65536.0, 65536.0, 131072.0, 131072.0, 262144.0, 262144.0, 524288.0, 524288.0]
    check(field(scaled, "loss_scale") == want, f"scale doubles every growth_interval=2 clean steps: "
          f"{field(scaled, 'loss_scale')}")
    check("fp32 scale 65536 |" in p.stdout and "precision fp32 (loss scale 65536)" in p.stdout,
          "the log shows the precision and the loss scale")

    # ---- injected overflows at steps 3 and 5 (the scaler path an fp16 overflow takes)
    skip, _, p = train(tmp, data, "skip", *SCALED, inject="3,5")
    rec = records(skip)
    check([r["skipped"] for r in rec] == [False, False, True, False, True, False, False, False],
          "steps 3 and 5 are marked skipped in metrics.jsonl")
    check(field(skip, "skipped_steps") == [0, 0, 1, 1, 2, 2, 2, 2], "metrics.jsonl counts the skipped steps")
    # Hand-derived: 65536 (good 1), 65536 (good 2 -> 131072), 131072 overflow -> 65536, 65536 (good 1),
    # 65536 overflow -> 32768, 32768 (good 1), 32768 (good 2 -> 65536), 65536.
    want = [65536.0, 65536.0, 131072.0, 65536.0, 65536.0, 32768.0, 32768.0, 65536.0]
    check(field(skip, "loss_scale") == want, f"loss scale halves on each overflow, grows after the interval: "
          f"{field(skip, 'loss_scale')}")
    for s in (3, 5):
        line = next((l for l in p.stdout.splitlines() if l.startswith(f"step {s:>6}/8 | SKIPPED")), "")
        check("gradient norm is not finite" in line and f"skipped {1 if s == 3 else 2}" in line and "->" in line,
              f"step {s}: the skip is logged with the count and the scale change: {line!r}")
    for s in (3, 5):
        for f in ("model.safetensors", "optimizer.safetensors"):
            check(same(os.path.join(ckpt(skip, s), f), os.path.join(ckpt(skip, s - 1), f)),
                  f"step {s} skipped: {f} byte-identical to step {s - 1}'s")
    check(not same(os.path.join(ckpt(skip, 4), "model.safetensors"), os.path.join(ckpt(skip, 3), "model.safetensors")),
          "step 4 updates the weights again")
    st3 = state(skip, 3)
    check(st3["step"] == 3 and st3["consumed_samples"] == 12 and st3["loader"]["position"] == 12,
          f"the skipped step consumed its batch (state.json step 3: consumed {st3['consumed_samples']}, "
          f"position {st3['loader']['position']})")
    check(st3["loss_scale"] == 65536.0 and st3["loss_scale_good_steps"] == 0 and st3["skipped_steps"] == 1 and
          st3["consecutive_skipped_steps"] == 1 and st3["loss_scale_dynamic"] is True,
          "state.json after the skip: next scale, good-step counter, skipped counts")
    st6 = state(skip, 6)
    check(st6["loss_scale"] == 32768.0 and st6["loss_scale_good_steps"] == 1 and st6["consecutive_skipped_steps"] == 0,
          "state.json inside a growth interval: scale 32768, 1 clean step")
    lp, ls = field(plain, "loss"), field(skip, "loss")
    check(ls[:3] == lp[:3] and ls[3] != lp[3],
          "steps 1-3 see the same weights and batches as the plain run; step 4 trains on batch 4 without "
          "step 3's update")
    check(field(skip, "lr") == field(plain, "lr"), "the schedule advances through skipped steps")
    # Bias correction counts applied updates (torch.optim under GradScaler): step 4 after one skip
    # is AdamW's 3rd update, step 6 after two skips its 4th.
    for s, t in ((4, 3), (6, 4)):
        fit = adamw_step_count(ckpt(skip, s - 1), ckpt(skip, s), field(skip, "lr")[s - 1])
        best = min(fit, key=fit.get)
        check(best == t and fit[t] < 1e-4, f"step {s}: AdamW bias correction uses update count {t} "
              f"(best fit {best}, mismatch {fit[t]:.1e} vs {fit[s]:.1e} for the step number)")
    check(os.path.isdir(os.path.join(skip, "model")), "a run with skipped steps finishes and writes the model")

    # ---- every precision: plain fp32 skips a non-finite step, the scale stays 1
    fp, _, p = train(tmp, data, "fp32skip", inject="2")
    check([r["skipped"] for r in records(fp)][:3] == [False, True, False] and field(fp, "loss_scale") == [1.0] * 8,
          "fp32 without scaling: a non-finite step is skipped, the scale stays 1")
    check(same(os.path.join(ckpt(fp, 2), "optimizer.safetensors"), os.path.join(ckpt(fp, 1), "optimizer.safetensors")),
          "fp32 without scaling: the skipped step leaves the moments alone")
    check("| fp32 | skipped 1 |" in p.stdout, "the log line carries the skipped count")

    # ---- stops
    out, _, p = train(tmp, data, "maxskip", *SCALED, "--set", "training.max_skipped_steps=3", inject="3,4,5",
                      ok=False)
    err = p.stderr
    check(p.returncode == 1 and "steps 3-5" in err and "3 consecutive" in err and
          "training.max_skipped_steps = 3" in err and "no weights written" in err and "Last finite" in err,
          f"max_skipped_steps consecutive skips stop the run naming the steps: {err.strip()[:300]}")
    check(not os.path.exists(os.path.join(out, "model")), "no model directory after that stop")
    out, _, p = train(tmp, data, "noskipstop", "--set", "training.max_skipped_steps=0", inject="2,3,4,5,6,7,8")
    check(field(out, "skipped_steps")[-1] == 7, "training.max_skipped_steps 0 never stops")
    out, _, p = train(tmp, data, "minscale", "--set", "precision.loss_scale.enabled=true", "--set",
                      "precision.loss_scale.initial=4", inject="2,3,4", ok=False)
    err = p.stderr
    check(p.returncode == 1 and "step 4" in err and "minimum loss scale 1" in err and
          "precision.loss_scale.min" in err, f"an overflow at the minimum scale stops naming step and scale: "
          f"{err.strip()[:300]}")

    # ---- resume continues the scaler exactly
    for stop in (3, 6):  # inside a run of skips (consecutive 1); inside a growth interval (good 1)
        out, recipe, _ = train(tmp, data, f"resume{stop}", *SCALED, "--stop-after", str(stop), inject="3,5")
        env = dict(ENV, LATHE_TEST_NONFINITE_STEPS="3,5")
        run(["train", recipe, *SCALED, "--resume", "auto"], env=env)
        for key in ("loss", "grad_norm", "loss_scale", "skipped", "skipped_steps"):
            check(field(out, key) == field(skip, key), f"stop at {stop} + resume == uninterrupted: {key}")
        check(same(os.path.join(out, "model", "model.safetensors"), os.path.join(skip, "model", "model.safetensors")),
              f"stop at {stop} + resume == uninterrupted: byte-identical final weights")
        check(state(out, 8) == {**state(skip, 8), "files": state(out, 8)["files"], "recipe": state(out, 8)["recipe"]},
              f"stop at {stop} + resume == uninterrupted: state.json of the last step")

    # ---- data parallelism: the same decision on every rank (the norm and the loss are global)
    mpirun = shutil.which("mpirun")
    if not mpirun:
        print("note mpirun not found: the data-parallel case is not checked here (tests/parallel needs it too)")
    for zero in (0, 1, 2) if mpirun else ():
        out = os.path.join(tmp, f"dp{zero}")
        recipe = os.path.join(tmp, f"dp{zero}.yaml")
        open(recipe, "w").write(RECIPE.format(data=data, out=out))
        env = dict(ENV, LATHE_TEST_NONFINITE_STEPS="3,5", OMP_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1",
                   OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_rmaps_base_oversubscribe="1")
        p = subprocess.run([mpirun, "-np", "2", LATHE, "train", recipe, *SCALED, "--quiet", "--set",
                            f"parallel.zero={zero}", "--set", "training.micro_batch_size=2"],
                           capture_output=True, text=True, env=env, timeout=300)
        ok = p.returncode == 0
        check(ok and field(out, "skipped") == field(skip, "skipped") and
              field(out, "loss_scale") == field(skip, "loss_scale") and
              max(abs(a - b) for a, b in zip(field(out, "loss"), field(skip, "loss"))) < 1e-5,
              f"mpirun -np 2 ZeRO {zero}: the same steps skipped, the same scales and losses as one process"
              f"{'' if ok else ': ' + p.stderr.strip()[-300:]}")
        if ok:
            check(same(os.path.join(ckpt(out, 3), "model.safetensors"), os.path.join(ckpt(out, 2), "model.safetensors")),
                  f"mpirun -np 2 ZeRO {zero}: the skipped step leaves the weights alone")

    # ---- a checkpoint from before the precision section and the scaler's fields still resumes
    old, recipe, _ = train(tmp, data, "old", "--stop-after", "4")
    sp = os.path.join(ckpt(old, 4), "state.json")
    doc = json.load(open(sp))
    body = doc["body"]
    for k in ("loss_scale_dynamic", "loss_scale_good_steps", "skipped_steps", "consecutive_skipped_steps"):
        body.pop(k)
    body["recipe"].pop("precision")
    body["recipe"]["training"].pop("max_skipped_steps")
    # recipe.yaml is listed with its checksum: rewrite it from the edited recipe.
    rp = os.path.join(ckpt(old, 4), "recipe.yaml")
    text = ("# resolved recipe of this checkpoint (JSON, which is valid YAML)\n" +
            json.dumps(body["recipe"], indent=2) + "\n").encode()
    open(rp, "wb").write(text)
    body["files"]["recipe.yaml"] = {"bytes": len(text), "xxh64": f"{xxh64(text):016x}"}
    canon = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    doc["body_xxh64"] = f"{xxh64(canon):016x}"
    open(sp, "w").write(json.dumps(doc))
    p = run(["train", recipe, "--resume", "auto"], ok=False)
    check(p.returncode == 0 and field(old, "loss") == field(plain, "loss"),
          f"a checkpoint without the precision section and scaler fields resumes exactly: {p.stderr.strip()[:300]}")

    # ---- precision.compute errors and notes
    _, _, p = train(tmp, data, "fp8", "--set", "precision.compute=fp8", ok=False)
    check(p.returncode != 0 and "precision.compute" in p.stderr and "fp32, bf16, fp16" in p.stderr,
          f"an unknown precision names the valid ones: {p.stderr.strip()[:200]}")
    for dt in ("bf16", "fp16"):
        out, _, p = train(tmp, data, "try_" + dt, "--set", f"precision.compute={dt}", "--set", "training.steps=2",
                          ok=False)
        if p.returncode == 0:
            print(f"note {dt} compute is implemented in this build: its refusal cannot be checked here "
                  f"(test_precision_lowp.py runs it)")
            continue
        check(p.returncode == 1 and f"precision.compute {dt}" in p.stderr and f"no {dt} implementation" in p.stderr and
              "implemented: fp32" in p.stderr, f"{dt} without a table: refused naming precision.compute and the "
              f"missing op: {p.stderr.strip()[:300]}")
        check(not os.path.exists(os.path.join(out, "metrics.jsonl")), f"{dt} refused before any training work")
    recipe = os.path.join(tmp, "note.yaml")
    open(recipe, "w").write(RECIPE.format(data=data, out=os.path.join(tmp, "note")))
    p = run(["check", recipe, "--set", "precision.loss_scale.initial=8"])
    check("note precision.loss_scale is ignored" in p.stdout and "ok   precision: fp32 compute" in p.stdout,
          "lathe check: precision line, and loss_scale keys for fp32 are ignored with a note")

    return finish(tmp, keep_on_failure=False)


if __name__ == "__main__":
    sys.exit(main())
