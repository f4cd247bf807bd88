"""What the Python tests that train with the lathe binary share (through tests/parallel/mpi_train.py
and tests/train/train_helpers.py, which add their datasets and recipes): where the binary is, the
environment for mpirun ranks sharing this machine's cores, running lathe alone or under mpirun,
reading a run's metrics.jsonl, and the check/failure bookkeeping. Not a test itself
(tests/CMakeLists.txt registers only test_*.py); importers put this folder on sys.path."""
import json
import os
import shutil
import subprocess
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# CTest passes LATHE_BIN (tests/CMakeLists.txt); by hand, LATHE_BINARY_DIR or the source tree's build/.
LATHE = os.environ.get("LATHE_BIN") or os.path.join(
    os.environ.get("LATHE_BINARY_DIR", os.path.join(HERE, "..", "..", "build")), "lathe")
MPIRUN = shutil.which("mpirun")
# 1 OpenMP thread per rank (the ranks share the cores); root and oversubscription allowed.
ENV = dict(os.environ, OMP_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
           OMPI_MCA_rmaps_base_oversubscribe="1")
# The failed checks of this test process (one list, whichever module a test imports check from).
failures = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what, flush=True)
    if not ok:
        failures.append(what)


def finish(tmp, keep_on_failure=True):
    """The summary line and the exit status (1 when a check failed). TMP is removed, but kept to
    look at when a check failed and keep_on_failure."""
    if not (failures and keep_on_failure):
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{len(failures)} failed" if failures else "all passed")
    return 1 if failures else 0


def run(np_, args, timeout=300, env=None):
    """`lathe ARGS` on np_ ranks under mpirun (alone for np_ = 1): (CompletedProcess, seconds)."""
    cmd = ([MPIRUN, "-np", str(np_)] if np_ > 1 else []) + [LATHE] + args
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env or ENV)
    return p, time.time() - t0


def metrics(out):
    """Every record of OUT/metrics.jsonl."""
    return [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl"))]


def records(out):
    """The metrics.jsonl records of OUT's training steps (those with a loss)."""
    return [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl")) if '"loss"' in l]


# One step from an HF directory (`init_from`), checkpointed: the HF import / train / export tests
# format it with init=, data=, out= (tests/interop/test_hf_roundtrip.py and the family tests).
INIT_FROM_RECIPE = """
model:
  init_from: {init}
data:
  train: {data}
  valid_fraction: 0.0
optimizer:
  lr: 1.0e-2
training:
  micro_batch_size: 2
  seq_len: 16
  steps: 1
  eval_interval: 0
  peak_gflops: 100
output:
  dir: {out}
  checkpoint_every: 1
"""
