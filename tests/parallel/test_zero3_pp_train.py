"""ZeRO 3 x pipeline parallelism (parallel.zero: 3 with parallel.pipeline > 1, issue 26) under mpirun.

Each pipeline stage's tensors are sharded over its data group; the pipeline executor gathers a
chunk's blocks for each Forward and Backward action of the schedule and releases them after it
(src/parallel/param_gather.h: gather per use, 2 x micro-batches gathers of the stage per step). The
stage's gradients accumulate whole over the step and are reduce-scattered once after the schedule,
the same rank-ordered sums as ZeRO 1's reduction, and every gather is an exact copy, so the oracle is
the same layout at ZeRO 1, BIT-identical:

  * DP=2 x PP=2 (4 ranks, 2 micro-batches per replica, 1F1B): gpt2-debug (tied wte on the first and
    last stage) and llama-debug with 6 layers, prefetch 1; Llama interleaved (virtual_stages 3,
    several chunks per rank) with prefetch 2; gpt2 bf16: losses, gradient norms, validation losses
    and the final model.safetensors equal to ZeRO 1's;
  * bf16: the weight gathers move the GEMM weights and embeddings in bf16: metrics weight_gather_mb
    between 0.5x and 0.6x the fp32 run's (norms and biases stay fp32), with the same bits as above;
  * a DP=2 x PP=2 ZeRO 3 checkpoint of step 3 resumed in one process: steps 4-5 within 1e-5 of the
    uninterrupted run (one process sums the micro-batches in another order);
  * `lathe check --world 4` accepts the layout and counts the stage's weight shard.
1 OpenMP thread per rank."""
import functools
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from mpi_train import ENV, LATHE, MPIRUN, check, same_run, series, val_losses  # noqa: E402
from run_harness import finish  # noqa: E402
import mpi_train  # noqa: E402

TMP = tempfile.mkdtemp(prefix="lathe_zero3_pp_")
recipe = mpi_train.pipeline_recipe
train = functools.partial(mpi_train.pipeline_train, TMP)
DP2_PP2 = dict(training__grad_accum_steps=2, parallel__pipeline=2, output__checkpoint_every=3)


def blob(out):
    return open(os.path.join(out, "model", "model.safetensors"), "rb").read()


def same_bits(a, ref, what):
    la, lr = series(a, "loss"), series(ref, "loss")
    ok = la == lr and len(la) == 5 and series(a, "grad_norm") == series(ref, "grad_norm")
    ok = ok and val_losses(a) == val_losses(ref) and len(val_losses(a)) >= 1 and blob(a) == blob(ref)
    check(ok, f"{what}: losses, gradient norms, validation losses and final weights bit-identical to ZeRO 1")
    if not ok:
        print("  zero3:", la, val_losses(a), "\n  zero1:", lr, val_losses(ref))


def main():
    if not MPIRUN:
        print("SKIPPED: mpirun not found (apt-get install openmpi-bin); this is not a pass")
        return 77
    data = mpi_train.make_data(TMP)
    r = recipe(data, "gpt2", os.path.join(TMP, "check"), parallel__zero=3, **DP2_PP2)
    p = subprocess.run([LATHE, "check", r, "--world", "4"], capture_output=True, text=True, env=ENV, timeout=120)
    check(p.returncode == 0 and "1/2 shard + " in p.stdout + p.stderr,
          "lathe check --world 4 accepts ZeRO 3 with parallel.pipeline 2 and counts the stage's weight shard")
    if p.returncode != 0:
        print(p.stdout[-1500:], p.stderr[-1500:])

    cases = [("gpt2", "gpt2", {}), ("llama", "llama", {}),
             ("llama_interleaved_pf2", "llama", dict(parallel__virtual_stages=3, parallel__prefetch=2)),
             ("gpt2_bf16", "gpt2", dict(precision__compute="bf16"))]
    runs = {}
    for name, family, kw in cases:
        z1_kw = {k: v for k, v in kw.items() if k != "parallel__prefetch"}
        z1 = train(4, data, family, f"{name}_zero1", parallel__zero=1, **DP2_PP2, **z1_kw)
        z3 = train(4, data, family, f"{name}_zero3", parallel__zero=3, **DP2_PP2, **kw)
        same_bits(z3, z1, f"{family} DP=2 x PP=2 ZeRO 3 {kw}")
        runs[name] = z1
        runs[name + "_zero3"] = z3

    # bf16: the GEMM weights and embeddings gathered in bf16 (half the bytes; norms and biases fp32).
    mb = {k: series(runs[k], "weight_gather_mb") for k in ("gpt2_zero3", "gpt2_bf16_zero3")}
    ratio = mb["gpt2_bf16_zero3"][-1] / mb["gpt2_zero3"][-1] if mb["gpt2_zero3"] and mb["gpt2_zero3"][-1] else 0
    check(0.5 <= ratio < 0.6, f"bf16 weight gathers move {ratio:.3f} x the bytes of fp32 ones (metrics "
          f"weight_gather_mb {mb['gpt2_bf16_zero3'][-1:]} vs {mb['gpt2_zero3'][-1:]})")

    # The ZeRO 3 checkpoint (the whole model, gathered) resumed in one process (4 micro-batches).
    src = train(4, data, "gpt2", "resume_src", parallel__zero=3, extra=("--stop-after", "3"), **DP2_PP2)
    check(os.path.isdir(os.path.join(src, "checkpoints", "step_00000003")), "DP=2 x PP=2 ZeRO 3 saves at step 3")
    dst = os.path.join(TMP, "resume_one")
    shutil.copytree(src, dst)
    p, _ = mpi_train.run(1, ["train", recipe(data, "gpt2", dst, output__checkpoint_every=3), "--quiet", "--resume",
                             "auto"], 300, ENV)
    check(p.returncode == 0, "the DP=2 x PP=2 ZeRO 3 checkpoint resumes in one process" +
          ("" if p.returncode == 0 else p.stderr[-800:]))
    if p.returncode == 0:
        same_run(dst, runs["gpt2"], "ZeRO 3 DP=2 x PP=2 -> one process, steps 4-5", slice(3, None),
                 ref_name="the uninterrupted DP=2 x PP=2 run")
    return finish(TMP)


if __name__ == "__main__":
    sys.exit(main())
