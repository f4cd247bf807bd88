"""What the single-recipe training tests share (test_bf16_fallback.py, test_recompute.py,
test_eval_tasks_training.py, test_profile.py; test_anomaly.py and test_precision.py take the
check/records bookkeeping): on top of tests/common/run_harness.py (the binary, the environment for
mpirun ranks, the check/failure bookkeeping, metrics.jsonl), a small patterned dataset and the
recipe they start from. Not a test itself (tests/CMakeLists.txt registers only test_*.py)."""
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "common"))
import megatron_writer  # noqa: E402
from run_harness import ENV, LATHE, MPIRUN, check, failures, finish, records  # noqa: E402,F401 (re-exported)


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


def losses(out):
    return [r["loss"] for r in records(out)]
