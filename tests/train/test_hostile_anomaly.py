#!/usr/bin/env python3
"""Bad training.anomaly values (train/anomaly.h): `lathe check` and `lathe train` exit 1 naming the
key, the value and the allowed range, before any training work; a good section passes check."""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.environ.get("LATHE_SOURCE_DIR", os.path.join(HERE, "..", "..")), "tests"))
sys.path.insert(0, HERE)
from hostile import Cases, run_lathe  # noqa: E402
from kill_test_lib import hostile_recipe, make_data  # noqa: E402

cases = Cases()
tmp = cases.tmp
data = make_data(tmp, "shake", 20000)
out = os.path.join(tmp, "out")
recipe = hostile_recipe(tmp, data, "r", out=out)
ON = ["--set", "training.anomaly.enabled=true", "--set", "output.checkpoint_every=2"]

BAD = [
    # (override, what stderr must name)
    ("training.anomaly.lr_factor=0", ["training.anomaly.lr_factor", "0 must be in (0, 1]"]),
    ("training.anomaly.lr_factor=1.5", ["training.anomaly.lr_factor", "1.5 must be in (0, 1]"]),
    ("training.anomaly.ema_decay=1", ["training.anomaly.ema_decay", "must be in (0, 1)"]),
    ("training.anomaly.loss_z_threshold=-3", ["training.anomaly.loss_z_threshold", "-3 must be >= 0"]),
    ("training.anomaly.grad_norm_z_threshold=.nan", ["training.anomaly.grad_norm_z_threshold", "expected a number"]),
    ("training.anomaly.min_rel_std=1e999", ["training.anomaly.min_rel_std", "not a finite number"]),
    ("training.anomaly.warmup_steps=-1", ["training.anomaly.warmup_steps", "-1 must be >= 1"]),
    ("training.anomaly.lr_steps=abc", ["training.anomaly.lr_steps", "expected an integer, got 'abc'"]),
    ("training.anomaly.rollback_window=0", ["training.anomaly.rollback_window", "0 must be >= 1"]),
    ("training.anomaly.skip_samples=-2", ["training.anomaly.skip_samples", "-2 must be >= -1"]),
    ("training.anomaly.max_rollbacks=99999999999999999999", ["training.anomaly.max_rollbacks",
                                                             "does not fit a 64-bit integer"]),
    ("training.anomaly.skip=maybe", ["training.anomaly.skip", "expected true or false"]),
    ("training.anomaly.rollbak_after=2", ["unknown key 'training.anomaly.rollbak_after'",
                                          "did you mean 'training.anomaly.rollback_after'"]),
    ("training.anomaly=[1, 2]", ["training.anomaly", "expected a mapping of keys"]),
]
for ov, must in BAD:
    with cases.case(f"--set {ov}"):
        for cmd in ("check", "train"):
            run_lathe([cmd, recipe, *ON, "--set", ov], rc=1, must=must + ["r.yaml"])
        assert not os.path.exists(os.path.join(out, "metrics.jsonl")), "train refused before any work"

with cases.case("rollback without checkpoints names both keys"):
    run_lathe(["check", recipe, "--set", "training.anomaly.enabled=true"], rc=1,
              must=["training.anomaly.rollback_after", "output.checkpoint_every > 0", "rollback_after: 0"])
with cases.case("a good section passes check (and rollback_after 0 needs no checkpoints)"):
    run_lathe(["check", recipe, *ON], rc=0, stream="stdout")
    run_lathe(["check", recipe, "--set", "training.anomaly.enabled=true", "--set",
               "training.anomaly.rollback_after=0"], rc=0, stream="stdout")

cases.finish()
