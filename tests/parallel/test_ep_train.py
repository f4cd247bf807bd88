#!/usr/bin/env python3
"""Expert parallelism (parallel.expert, issue 28) trained through the lathe binary.

The oracle is lathe in one process (mixtral-debug with 4 experts, 5 steps of 4 micro-batches of
2x32). Expert parallelism moves each token's rows to the rank owning the expert and runs each
expert's GEMMs over the rows of the whole expert group at once, so the sums inside those GEMMs (and
the weight-gradient sums over tokens) are taken in another order than one process's: losses,
gradient norms and moe_aux_loss must agree within 1e-5 relative (fp32 reordering over a few hundred
terms stays ~1e-6; the DP tests use the same bound), not bit for bit.
  * expert 2 over data 2 (np 2; ZeRO 0 and 1), expert 2 x 2 expert groups (np 4, data 4);
  * validation (val_loss) runs every expert locally: it must match one process too;
  * a run with expert 2 stopped after step 3 and resumed with expert 1 (checkpoints are layout-free)
    continues as the uninterrupted run;
  * refused naming parallel.expert: experts not divisible (5 experts), data degree not divisible
    (np 1), ZeRO 2, a model without experts.
"""
import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import mpi_train  # noqa: E402
from mpi_train import ENV, MPIRUN, PIPELINE_TRAINING, check, failures, model_recipe, rel, run, series, val_losses  # noqa: E402

TMP = tempfile.mkdtemp(prefix="lathe_ep_train_")
MODEL = {"preset": "mixtral-debug", "initializer_range": 0.2, "num_local_experts": 4}


def train(np_, data, name, extra=(), model=MODEL, **kw):
    out = os.path.join(TMP, name)
    return mpi_train.train_checked(np_, model_recipe(data, model, out, PIPELINE_TRAINING, **kw), out, name, extra)


def refused(np_, data, name, needle, model=MODEL, **kw):
    out = os.path.join(TMP, name)
    p, _ = run(np_, ["train", model_recipe(data, model, out, PIPELINE_TRAINING, **kw), "--quiet"], 300, ENV)
    msg = (p.stdout + p.stderr).strip()
    check(p.returncode != 0 and "parallel.expert" in msg and needle in msg,
          f"{name}: refused naming parallel.expert and '{needle}' ({msg[-240:]})")


def main():
    if MPIRUN is None:
        print("FAIL mpirun not found (apt-get install openmpi-bin)")
        return 1
    data = mpi_train.make_data(TMP)
    one = train(1, data, "one")
    aux = series(one, "moe_aux_loss")
    check(len(aux) == 5, f"one process reports moe_aux_loss every step: {aux}")
    runs = [("expert 2 data 2 ZeRO 0", 2, dict(parallel__data=2, parallel__expert=2, training__grad_accum_steps=2)),
            ("expert 2 data 2 ZeRO 1", 2,
             dict(parallel__data=2, parallel__expert=2, parallel__zero=1, training__grad_accum_steps=2)),
            ("expert 2 data 4", 4, dict(parallel__data=4, parallel__expert=2, training__grad_accum_steps=1))]
    for what, np_, kw in runs:
        out = train(np_, data, what.replace(" ", "_"), **kw)
        mpi_train.same_run(out, one, what)
        e = rel(series(out, "moe_aux_loss"), aux)
        check(e <= 1e-5, f"{what}: moe_aux_loss matches one process (max rel {e:.2e})")
        e = rel(val_losses(out), val_losses(one))
        check(e <= 1e-5, f"{what}: val_loss matches one process (max rel {e:.2e})")
    # expert 2 stopped after step 3, resumed with expert 1 (same data degree): the checkpoint holds
    # the whole expert tensors.
    cut = os.path.join(TMP, "cut")
    kw = dict(parallel__data=2, training__grad_accum_steps=2, output__checkpoint_every=3)
    path = model_recipe(data, MODEL, cut, PIPELINE_TRAINING, parallel__expert=2, **kw)
    mpi_train.train_checked(2, path, cut, "expert 2 stop after 3", ("--stop-after", "3"))
    path = model_recipe(data, MODEL, cut, PIPELINE_TRAINING, parallel__expert=1, **kw)
    mpi_train.train_checked(2, path, cut, "resume with expert 1", ("--resume", "auto"))
    mpi_train.same_run(cut, one, "expert 2 -> resume expert 1")
    refused(2, data, "five_experts", "5 experts", model={"preset": "mixtral-debug"}, parallel__expert=2)
    refused(1, data, "np1", "data degree 1", parallel__expert=2)
    refused(2, data, "zero2", "parallel.zero = 2", parallel__expert=2, parallel__zero=2)
    refused(2, data, "dense", "no experts", model={"preset": "llama-debug"}, parallel__expert=2)
    if failures:
        print(f"{len(failures)} FAILED")
        return 1
    print("all passed")
    shutil.rmtree(TMP, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
