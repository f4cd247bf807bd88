#!/usr/bin/env python3
"""Qwen3 (per-head q/k norms, head_dim 16 with hidden 48) trained through the lathe binary.

The oracle is lathe in one process with the same recipe (mpi_train's pipeline recipe: 6 layers, 5
steps of 4 micro-batches of 2x32): TP=2, PP=2 and TP=2 x PP=2 must give its losses and gradient
norms within 1e-5 relative (the q/k norm weights are replicated and their per-rank partial
gradients summed over the tensor group); recompute selective and full give its bits; bf16 trains
and stays near fp32; a run stopped after step 3 and resumed from its checkpoint gives the
uninterrupted run's bits.
"""
import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import mpi_train  # noqa: E402
from mpi_train import (ENV, MPIRUN, PIPELINE_TRAINING, check, failures, model_recipe, rel, series,  # noqa: E402
                       train_checked)

TMP = tempfile.mkdtemp(prefix="lathe_qwen3_train_")
MODEL = {"preset": "qwen3-debug", "num_hidden_layers": 6}


def train(np_, data, name, extra=(), **kw):
    out = os.path.join(TMP, name)
    return train_checked(np_, model_recipe(data, MODEL, out, PIPELINE_TRAINING, **kw), out, name, extra)


def same_bits(a, b, what):
    la, lb = series(a, "loss"), series(b, "loss")
    ga, gb = series(a, "grad_norm"), series(b, "grad_norm")
    check(len(la) == 5 and la == lb and ga == gb, f"{what}: losses and gradient norms bit-identical ({la} vs {lb})")


def main():
    if MPIRUN is None:
        print("FAIL mpirun not found (apt-get install openmpi-bin)")
        return 1
    data = mpi_train.make_data(TMP)
    one = train(1, data, "one")
    losses = series(one, "loss")
    check(len(losses) == 5 and losses[-1] < losses[0], f"one process trains: losses {losses}")
    for name, np_, kw in (("tp2", 2, {"parallel__tensor": 2}), ("pp2", 2, {"parallel__pipeline": 2}),
                          ("tp2_sp", 2, {"parallel__tensor": 2, "parallel__sequence": True}),
                          ("tp2_pp2", 4, {"parallel__tensor": 2, "parallel__pipeline": 2})):
        mpi_train.same_run(train(np_, data, name, **kw), one, f"qwen3 {name}")
    for rc in ("selective", "full"):
        same_bits(train(1, data, "recompute_" + rc, recompute=rc), one, f"qwen3 recompute {rc}")
    bf16 = train(1, data, "bf16", precision__compute="bf16")
    e = rel(series(bf16, "loss"), losses)
    check(e < 3e-2, f"qwen3 bf16 tracks fp32: losses within {e:.2e} relative (< 3e-2)")
    # Stopped after step 3 (checkpoint at 3), resumed: the uninterrupted run's bits.
    cut = os.path.join(TMP, "cut")
    path = model_recipe(data, MODEL, cut, PIPELINE_TRAINING, output__checkpoint_every=3)
    train_checked(1, path, cut, "qwen3 stop after 3", ("--stop-after", "3"))
    train_checked(1, path, cut, "qwen3 resume", ("--resume", "auto"))
    same_bits(cut, one, "qwen3 stop at 3 + resume vs uninterrupted")
    if failures:
        print(f"{len(failures)} FAILED")
        return 1
    print("all passed")
    shutil.rmtree(TMP, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
