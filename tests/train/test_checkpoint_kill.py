#!/usr/bin/env python3
"""Kill test: `lathe train --resume auto` is SIGKILLed at random moments, 20 times, then allowed to
finish. LATHE_TEST_CKPT_SLEEP_MS makes each checkpoint write take most of the wall time, so many
kills land in the middle of a save (the test counts how many left a half-written step_X.tmp).
Checked:
  * before every start, the newest step_X directory verifies independently (Python XXH64 of
    every file against state.json) -- a kill never leaves a torn checkpoint under a final name
  * every start that got as far as choosing resumed from exactly that newest checkpoint
  * the final weights (HF model dir and the last checkpoint) and the loss of every step equal an
    uninterrupted run's, byte for byte
"""
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from kill_test_lib import (ENV, LATHE, losses, make_data, read_tensors, run, step_dirs,  # noqa: E402
                           verify_independently, write_recipe)

failures = []
KILLS = 20
STEPS = 400  # long enough that the 20 kills land before the end (240 finished early 4 times on an idle machine)


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what, flush=True)
    if not cond:
        failures.append(what)


def main():
    rnd = random.Random(int(os.environ.get("LATHE_KILL_SEED", "12345")))
    tmp = tempfile.mkdtemp(prefix="lathe_ckpt_kill_")
    data = make_data(tmp, "big", 60_000)
    ref = os.path.join(tmp, "ref")
    run(["train", write_recipe(tmp, "ref", data, ref, steps=STEPS, every=2, keep=3), "--quiet"])

    out = os.path.join(tmp, "run")
    recipe = write_recipe(tmp, "run", data, out, steps=STEPS, every=2, keep=3)
    env = dict(ENV, LATHE_TEST_CKPT_SLEEP_MS="8")
    resumed_ok = checked = torn = finished_early = 0
    seen = set()
    for i in range(KILLS):
        steps = step_dirs(out)
        seen.add(steps[-1] if steps else 0)
        expect = os.path.join(out, "checkpoints", f"step_{steps[-1]:08d}") if steps else None
        if expect:
            try:
                verify_independently(expect)
            except AssertionError as e:
                check(False, f"kill {i}: newest checkpoint {expect} is not complete: {e}")
        log = os.path.join(tmp, f"log{i}.txt")
        with open(log, "w") as f:
            proc = subprocess.Popen([LATHE, "train", recipe, "--quiet", "--resume", "auto"], stdout=f,
                                    stderr=subprocess.STDOUT, env=env)
            time.sleep(rnd.uniform(0.05, 0.6))
            proc.kill()
            rc = proc.wait()
        text = open(log).read()
        if rc == 0:
            finished_early += 1
        if "resume auto:" in text:
            checked += 1
            want = f"resuming from {expect}" if expect else "starting fresh"
            if want in text:
                resumed_ok += 1
            else:
                check(False, f"kill {i}: expected '{want}', log:\n{text[-800:]}")
        ck = os.path.join(out, "checkpoints")
        if os.path.isdir(ck) and any(re.fullmatch(r"step_\d{8}\.tmp", n) for n in os.listdir(ck)):
            torn += 1
    check(checked >= KILLS // 2 and resumed_ok == checked,
          f"{resumed_ok}/{checked} starts that logged their choice resumed from the newest complete checkpoint "
          f"({KILLS} kills, {finished_early} finished before the kill)")
    check(len(seen) >= KILLS // 2 and finished_early <= 2,
          f"the kills hit {len(seen)} different points of the run (newest checkpoints {sorted(seen)})")
    check(torn >= 3, f"{torn} kills interrupted a checkpoint write (left a step_X.tmp)")
    # A kill between a checkpoint's completion and the removal of the oldest one leaves one extra
    # until the next save.
    check(len(step_dirs(out)) <= 4, f"keep_last 3 holds through kills, +1 at most ({step_dirs(out)})")

    p = run(["train", recipe, "--quiet", "--resume", "auto"])
    check("resume auto:" in p.stdout, "final run resumes")
    check(step_dirs(out) == [STEPS - 4, STEPS - 2, STEPS], f"keep_last 3 at the end ({step_dirs(out)})")
    la, lb = losses(ref), losses(out)
    check(sorted(lb) == list(range(1, STEPS + 1)) and la == lb,
          f"loss of every step equals the uninterrupted run's "
          f"(first differing step: {next((s for s in la if la[s] != lb.get(s)), None)})")
    same = open(os.path.join(ref, "model", "model.safetensors"), "rb").read() == \
        open(os.path.join(out, "model", "model.safetensors"), "rb").read()
    check(same, "final HF weights byte-identical to the uninterrupted run")
    last = f"step_{STEPS:08d}"
    # Tensor bytes, not file bytes: the alignment padding of the files follows buffer addresses.
    same_ck = all(read_tensors(os.path.join(ref, "checkpoints", last, f))
                  == read_tensors(os.path.join(out, "checkpoints", last, f))
                  for f in ("model.safetensors", "optimizer.safetensors"))
    check(same_ck, "final checkpoint: every weight and moment tensor byte-identical")

    shutil.rmtree(tmp, ignore_errors=True)
    if failures:
        print(f"{len(failures)} FAILED")
        sys.exit(1)
    print("all passed")


if __name__ == "__main__":
    main()
