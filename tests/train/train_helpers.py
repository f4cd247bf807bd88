"""What the single-recipe training tests share (test_bf16_fallback.py, test_recompute.py,
test_eval_tasks_training.py, test_profile.py; test_anomaly.py and test_precision.py take the
check/records bookkeeping): the binary, the environment for mpirun ranks sharing this machine's
cores, a small patterned dataset, the recipe they start from, and the check/failure bookkeeping.
Not a test itself (tests/CMakeLists.txt registers only test_*.py)."""
import json
import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import megatron_writer  # noqa: E402

LATHE = os.environ.get("LATHE_BIN") or os.path.join(os.environ.get("LATHE_BINARY_DIR", os.path.join(HERE, "..", "..", "build")), "lathe")
MPIRUN = shutil.which("mpirun")
# 1 OpenMP thread per rank (the ranks share the cores); root and oversubscription allowed.
ENV = dict(os.environ, OMP_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
           OMPI_MCA_rmaps_base_oversubscribe="1")
failures = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what, flush=True)
    if not ok:
        failures.append(what)


def patterned_data(tmp, rng):
    """TMP/data: 40 documents of 300 tokens (vocabulary 96), a noisy repeating pattern per
    document so that a few steps already lower the loss. rng: the test's numpy Generator (the
    draws continue from it afterwards)."""
    import numpy as np
    data = os.path.join(tmp, "data")
    megatron_writer.write(data, [(np.arange(300) * (d % 5 + 1) + rng.integers(0, 3, 300)) % 96 for d in range(40)])
    return data


def write_recipe(out, data, training, model=None, **sections):
    """OUT.yaml: a gpt2-debug (or `model`) AdamW + cosine recipe on `data` with the given training
    section; `sections` (e.g. precision=..., recompute=...) stand between training and output, and
    output is {"dir": out} unless given. JSON is YAML, so the file is a json.dump. Returns the path."""
    output = sections.pop("output", {"dir": out})
    r = {"model": model or {"preset": "gpt2-debug"}, "data": {"train": data, "valid_fraction": 0.1},
         "optimizer": {"name": "adamw", "lr": 3e-3}, "schedule": {"name": "cosine", "warmup_steps": 2},
         "training": training, **sections, "output": output}
    json.dump(r, open(out + ".yaml", "w"))
    return out + ".yaml"


def records(out):
    """The metrics.jsonl records of OUT's training steps (those with a loss)."""
    return [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl")) if '"loss"' in l]


def losses(out):
    return [r["loss"] for r in records(out)]


def finish(tmp, keep_on_failure=True):
    """The summary line and the exit status (1 when a check failed). TMP is removed, but kept to
    look at when a check failed and keep_on_failure."""
    if not (failures and keep_on_failure):
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{len(failures)} failed" if failures else "all passed")
    return 1 if failures else 0
