#!/usr/bin/env python3
"""Resume through the `lathe train` binary:
  * exactness: 20 steps straight == 10 steps (--stop-after) + --resume auto + 10 more: identical
    loss of every step and byte-identical final weights; AdamW and LAMB; across epoch boundaries
    (stopping exactly at one and in the middle of one) with gradient accumulation; 2 threads
  * the recorded XXH64 checksums match an independent Python XXH64 of each file
  * SIGTERM and SIGINT: a checkpoint at the next step boundary, exit code 75, resume continues exactly
  * recipe changes on resume: breaking ones refused naming each key, harmless ones allowed and
    logged, --force-resume-changes logs what differs
  * corruption: a flipped byte in each kind of checkpoint file -> --resume PATH fails naming the
    file; --resume auto falls back to the previous checkpoint, says so, and still ends bit-exact
"""
import os
import shutil
import signal
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from kill_test_lib import (ENV, LATHE, losses, make_data, run, step_dirs, verify_independently,  # noqa: E402
                           write_recipe)

failures = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what, flush=True)
    if not cond:
        failures.append(what)


def same_file(a, b):
    return open(a, "rb").read() == open(b, "rb").read()


def exactness(tmp, data, tag, stop, **kw):
    straight, split = os.path.join(tmp, tag + "_a"), os.path.join(tmp, tag + "_b")
    ra = write_recipe(tmp, tag + "_a", data, straight, **kw)
    rb = write_recipe(tmp, tag + "_b", data, split, **kw)
    run(["train", ra, "--quiet"])
    p1 = run(["train", rb, "--quiet", "--stop-after", str(stop)])
    p2 = run(["train", rb, "--quiet", "--resume", "auto"])
    la, lb = losses(straight), losses(split)
    n = kw.get("steps", 20)
    check(sorted(la) == list(range(1, n + 1)) and la == lb,
          f"{tag}: {n} steps straight == {stop} + resume + {n - stop}: identical losses "
          f"(first differing step: {next((s for s in la if la[s] != lb.get(s)), None)})")
    check(same_file(os.path.join(straight, "model", "model.safetensors"), os.path.join(split, "model", "model.safetensors")),
          f"{tag}: final weights byte-identical")
    check(f"resuming from {split}/checkpoints/step_{stop:08d}" in p2.stdout, f"{tag}: log names the checkpoint")
    return split, p1


def main():
    tmp = tempfile.mkdtemp(prefix="lathe_ckpt_resume_")
    big = make_data(tmp, "big", 60_000)
    small = make_data(tmp, "small", 1_200)  # 37 samples -> 33 train -> 8 batches of 4 per epoch

    # ---- exactness
    run_dir, _ = exactness(tmp, big, "adamw", 10, steps=20, opt="adamw")
    body = verify_independently(os.path.join(run_dir, "checkpoints", "step_00000010"))
    check(body["step"] == 10 and body["consumed_samples"] == 40 and body["loader"] == {"epoch": 0, "position": 40},
          f"state.json: step, consumed samples, loader position ({body['loader']})")
    check(all(t["slice"] == [[0, d] for d in t["global_shape"]] for t in body["tensors"]["model.safetensors"]),
          "state.json describes each tensor by global shape and slice")
    check(len(body["tensors"]["optimizer.safetensors"]) == 2 * len(body["tensors"]["model.safetensors"]),
          "optimizer.safetensors holds exp_avg and exp_avg_sq of every parameter")
    exactness(tmp, big, "lamb", 10, steps=20, opt="lamb")
    # Epoch boundaries: 8 batches per epoch; accumulation 2 -> 4 steps per epoch.
    exactness(tmp, small, "epoch_mid", 5, steps=14, accum=2)
    _, p = exactness(tmp, small, "epoch_edge", 8, steps=14, accum=1)
    exactness(tmp, big, "threads2", 7, steps=12, threads=2)

    # ---- SIGTERM / SIGINT at a step boundary
    for sig, name in ((signal.SIGTERM, "SIGTERM"), (signal.SIGINT, "SIGINT")):
        straight = os.path.join(tmp, f"sig_{name}_a")
        out = os.path.join(tmp, f"sig_{name}_b")
        ra = write_recipe(tmp, f"sig_{name}_a", big, straight, steps=60)
        rb = write_recipe(tmp, f"sig_{name}_b", big, out, steps=60)
        run(["train", ra, "--quiet"])
        proc = subprocess.Popen([LATHE, "train", rb], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
        for line in proc.stdout:
            if line.startswith("step      3/"):
                proc.send_signal(sig)
                break
        rest, err = proc.communicate(timeout=120)
        steps_done = step_dirs(out)
        check(proc.returncode == 75 and f"received {name}" in rest and len(steps_done) == 1 and 3 <= steps_done[0] < 60,
              f"{name}: checkpoint at the next step boundary (step {steps_done}), exit code {proc.returncode} (want 75)")
        run(["train", rb, "--quiet", "--resume", "auto"])
        check(losses(straight) == losses(out) and same_file(os.path.join(straight, "model", "model.safetensors"),
                                                            os.path.join(out, "model", "model.safetensors")),
              f"{name}: resume after the signal continues exactly")

    # ---- recipe changes on resume (adamw_b stopped at step 10 and finished at 20; resume its step 10)
    ck10 = os.path.join(run_dir, "checkpoints", "step_00000010")
    rb = os.path.join(tmp, "adamw_b.yaml")
    p = run(["train", rb, "--quiet", "--resume", ck10, "--set", "training.seq_len=16", "--set", "training.seed=8",
             "--set", "optimizer.lr=1e-3"], ok=False)
    msg = p.stdout + p.stderr
    check(p.returncode == 1 and all(k in msg for k in ("training.seq_len: 32 -> 16", "training.seed: 7 -> 8",
                                                        "optimizer.lr: 0.003 -> 0.001", "--force-resume-changes")),
          "breaking recipe changes are refused, each key named:\n" + msg[-600:])
    p = run(["train", rb, "--quiet", "--resume", ck10, "--set", "model.n_layer=3"], ok=False)
    check(p.returncode == 1 and "model.n_layer: 2 -> 3" in p.stderr, "a model shape change is refused")
    forced = os.path.join(tmp, "forced")
    shutil.copytree(run_dir, forced)
    p = run(["train", rb, "--quiet", "--resume", os.path.join(forced, "checkpoints", "step_00000010"),
             "--set", f"output.dir={forced}", "--set", "optimizer.lr=1e-3", "--force-resume-changes"])
    check("optimizer.lr: 0.003 -> 0.001" in p.stdout and "differ" in p.stdout and max(losses(forced)) == 20,
          "--force-resume-changes continues and logs what differs")
    p = run(["train", rb, "--quiet", "--resume", ck10, "--set", "training.steps=24", "--set", "training.log_interval=5"])
    check("training.steps: 20 -> 24" in p.stdout and "training.log_interval: 1 -> 5" in p.stdout
          and "recomputed" in p.stdout and sorted(losses(run_dir)) == list(range(1, 25)),
          "harmless changes (steps, log_interval) are allowed, logged, and training continues to the new total")

    # ---- corruption: flip one byte of each kind of file in the newest checkpoint
    base = os.path.join(tmp, "corr")
    rc = write_recipe(tmp, "corr", big, base, steps=6, every=2)
    run(["train", rc, "--quiet"])
    for fname in ("model.safetensors", "optimizer.safetensors", "state.json", "recipe.yaml"):
        out = os.path.join(tmp, "corr_" + fname.split(".")[0])
        shutil.copytree(base, out)
        path = os.path.join(out, "checkpoints", "step_00000006", fname)
        blob = bytearray(open(path, "rb").read())
        blob[len(blob) * 2 // 3] ^= 0x01
        open(path, "wb").write(bytes(blob))
        p = run(["train", rc, "--quiet", "--set", f"output.dir={out}", "--resume",
                 os.path.join(out, "checkpoints", "step_00000006")], ok=False)
        check(p.returncode == 1 and path in p.stderr and "corrupt" in p.stderr,
              f"{fname}: loading the corrupt checkpoint fails naming the file ({p.stderr.strip()[-200:]})")
        p = run(["train", rc, "--quiet", "--set", f"output.dir={out}", "--resume", "auto"])
        check(f"skipping checkpoint {out}/checkpoints/step_00000006" in p.stdout and path in p.stdout
              and f"resuming from {out}/checkpoints/step_00000004" in p.stdout and "falling back" in p.stdout,
              f"{fname}: --resume auto falls back to step 4 and says why")
        check("moved newer checkpoint" in p.stdout and any(
            n.startswith("step_00000006.abandoned") for n in os.listdir(os.path.join(out, "checkpoints"))),
              f"{fname}: the corrupt newer checkpoint is moved aside, not deleted")
        check(same_file(os.path.join(base, "model", "model.safetensors"), os.path.join(out, "model", "model.safetensors")),
              f"{fname}: after the fallback the run still ends bit-identical")

    shutil.rmtree(tmp, ignore_errors=True)
    if failures:
        print(f"{len(failures)} FAILED")
        sys.exit(1)
    print("all passed")


if __name__ == "__main__":
    main()
