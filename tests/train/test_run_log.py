#!/usr/bin/env python3
"""OUTPUT/train.log (issue 29 item 3): everything rank 0 prints, flushed per line.
  * a fresh run: train.log starts with a "==== lathe ... started" marker and then holds exactly the
    lines stdout holds (startup report, step lines, validation, the final summary)
  * --stop-after then --resume auto: the log is appended after "==== resumed at step N (...) ====",
    the first session's lines kept, the second session's lines (resume decision, steps 4..6) after it
  * --quiet keeps the step lines off stdout but not out of train.log
  * an error that ends the run after the run directory is claimed is in train.log ("error: ...")
  * the runtime note (core/blas_env.h: oversubscribed CPUs, printed to stderr by the process that
    re-executes itself, before the run directory exists) is train.log's line after the marker
The runs set OMP_WAIT_POLICY (the note is printed only when lathe chooses the wait policy), except
the one that forces the note with more OpenMP threads than CPUs (training.threads 1 trains on one).
"""
import json
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import numpy as np  # noqa: E402
from train_helpers import ENV, LATHE, check, finish, patterned_data, write_recipe  # noqa: E402

STEP = re.compile(r"^step +\d+/\d+ \| loss ")


# A wait policy of the user's: no runtime note, whatever the load of the machine.
QUIET_ENV = dict(ENV, OMP_WAIT_POLICY="PASSIVE")


def lathe(args, ok=True, env=QUIET_ENV):
    p = subprocess.run([LATHE] + args, capture_output=True, text=True, env=env, timeout=600)
    if ok and p.returncode != 0:
        print(p.stdout, p.stderr)
    return p


def step_lines(text):
    return [l for l in text.splitlines() if STEP.match(l)]


def main():
    tmp = tempfile.mkdtemp(prefix="lathe_run_log_")
    data = patterned_data(tmp, np.random.default_rng(0))
    training = {"micro_batch_size": 2, "seq_len": 16, "steps": 6, "log_interval": 1, "eval_interval": 3,
                "peak_gflops": 100}

    out = os.path.join(tmp, "fresh")
    p = lathe(["train", write_recipe(out, data, training)])
    check(p.returncode == 0, "fresh run trains")
    log = open(os.path.join(out, "train.log")).read().splitlines()
    check(log[0].startswith("==== lathe ") and "started" in log[0], f"first line is the start marker: {log[0]!r}")
    check(log[1:] == p.stdout.splitlines(), "train.log holds exactly the lines stdout holds")
    check(len(step_lines(p.stdout)) == 6, "6 step lines on stdout")
    check(any("validation" in l for l in log), "validation lines in train.log")
    check(any(l.startswith("peak resident memory") for l in log), "the final summary in train.log")

    # More OpenMP threads than CPUs, the wait policy left to lathe: the note goes to stderr before
    # lathe re-executes itself, and from there into train.log right after the marker.
    out = os.path.join(tmp, "noted")
    env = {k: v for k, v in ENV.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "LATHE_RUNTIME_SET",
                                                     "LATHE_RUNTIME_NOTE")}
    env["OMP_NUM_THREADS"] = str((os.cpu_count() or 1) + 1)
    p = lathe(["train", write_recipe(out, data, dict(training, threads=1))], env=env)
    notes = [l for l in p.stderr.splitlines() if l.startswith("lathe: note: ") and "OpenMP threads" in l]
    log = open(os.path.join(out, "train.log")).read().splitlines()
    check(p.returncode == 0 and len(notes) == 1, f"oversubscribed: one runtime note on stderr ({len(notes)})")
    check(log[1:2] == notes and log[2:] == p.stdout.splitlines(),
          f"the runtime note is train.log's line after the marker, then stdout's lines: {log[1:2]!r}")

    out = os.path.join(tmp, "resumed")
    recipe = write_recipe(out, data, training)
    p1 = lathe(["train", recipe, "--stop-after", "3"])
    p2 = lathe(["train", recipe, "--resume", "auto"])
    check(p1.returncode == 0 and p2.returncode == 0, "stop after 3 and resume")
    log = open(os.path.join(out, "train.log")).read().splitlines()
    marks = [i for i, l in enumerate(log) if l.startswith("==== resumed at step 3 (")]
    check(len(marks) == 1 and log[marks[0]].endswith(") ===="), "one resume marker naming step 3")
    if marks:
        m = marks[0]
        check(log[1:m] == p1.stdout.splitlines(), "the first session's lines kept before the marker")
        check(log[m + 1:] == p2.stdout.splitlines(), "the resumed session's lines appended after it")
        check(step_lines("\n".join(log[m + 1:])) == step_lines(p2.stdout) and len(step_lines(p2.stdout)) == 3,
              "steps 4..6 after the marker")

    out = os.path.join(tmp, "quiet")
    p = lathe(["train", write_recipe(out, data, training), "--quiet"])
    check(p.returncode == 0 and not step_lines(p.stdout), "--quiet: no step lines on stdout")
    check(len(step_lines(open(os.path.join(out, "train.log")).read())) == 6, "--quiet: the 6 step lines in train.log")

    # An error that ends the run mid-training: non-finite gradients at steps 2 and 3 (test hook,
    # train/fault_plan.h) with training.max_skipped_steps 2 stop it.
    out = os.path.join(tmp, "broken")
    recipe = write_recipe(out, data, dict(training, max_skipped_steps=2))
    p = subprocess.run([LATHE, "train", recipe], capture_output=True, text=True, timeout=600,
                       env=dict(QUIET_ENV, LATHE_TEST_NONFINITE_STEPS="1,2"))
    err = [l for l in p.stderr.splitlines() if ": error: " in l]
    check(p.returncode == 1 and bool(err), "non-finite steps end the run with an error")
    last = open(os.path.join(out, "train.log")).read().splitlines()[-1]
    check(last.startswith("error: ") and bool(err) and err[-1].endswith(last[len("error: "):]),
          f"the error is the last line of train.log: {last[:80]!r}")
    return finish(tmp)


if __name__ == "__main__":
    sys.exit(main())
