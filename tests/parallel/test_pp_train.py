"""Pipeline-parallel training under mpirun against the single-process run (issue 10, item 3).

The oracle is lathe in one process with the same recipe and global batch: a pipeline runs the
same micro-batches through the same layers, split over stages, with the activations and their
gradients passed as messages, so the losses differ from one process only by float summation order
(the tied wte's gradient is summed as head part + embedding part instead of interleaved per
micro-batch; the replica's loss is summed over stages). Tolerance 1e-5 relative on the losses,
gradient norms and validation losses over 5 steps (measured ~1e-8), 1e-4 on the final weights
gathered from the stages into the HF model (they pass through 5 AdamW steps).
Also bf16 with full recompute, interleaved, against one process in bf16.
Layouts: GPT-2 (tied wte) and Llama (untied lm_head) with 6 layers; PP=2 and PP=3, 1F1B and
interleaved (virtual_stages), uneven parallel.stage_layers; DP=2 x PP=2 on 4 ranks (ZeRO 0 and
2); a PP=2 checkpoint resumed in one process and a one-process checkpoint resumed at PP=3 (the
checkpoints hold the whole model); and the errors for layouts the model or the step cannot take.
1 OpenMP thread per rank (the ranks share this machine's cores)."""
import functools
import os
import shutil
import subprocess
import sys
import tempfile


HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from mpi_train import (ENV, LATHE, MPIRUN, check, failures, rel, same_run, val_losses,  # noqa: E402
                       weights_close)
import mpi_train  # noqa: E402

TMP = tempfile.mkdtemp(prefix="lathe_pp_")
# The 6-layer GPT-2 / Llama runs of the pipeline tests (mpi_train.py).
recipe = mpi_train.pipeline_recipe
train = functools.partial(mpi_train.pipeline_train, TMP)


def main():
    if not MPIRUN:
        print("FAIL mpirun not found (apt-get install openmpi-bin)")
        return 1
    data = mpi_train.make_data(TMP)

    # GPT-2, tied wte: one process with 4 micro-batches against PP=2, PP=3 (uneven) and interleaved.
    one = train(1, data, "gpt2", "gpt2_one")
    layouts = [("PP=2 1f1b", 2, {"parallel__pipeline": 2}),
               ("PP=3 1f1b, stage_layers [1, 3, 2]", 3, {"parallel__pipeline": 3, "parallel__stage_layers": [1, 3, 2]}),
               ("PP=2 interleaved (3 virtual stages)", 2, {"parallel__pipeline": 2, "parallel__virtual_stages": 3})]
    for i, (what, np_, kw) in enumerate(layouts):
        out = train(np_, data, "gpt2", f"gpt2_pp{i}", **kw)
        same_run(out, one, f"gpt2 {what}")
        if i == 0:
            e = rel(val_losses(out), val_losses(one))
            check(e <= 1e-5, f"gpt2 {what}: validation losses match (max rel {e:.2e})")
            ok, worst = weights_close(out, one, 1e-4)
            check(ok, f"gpt2 {what}: final weights gathered from the stages match (worst {worst:.2e} <= 1e-4)")
            log = open(os.path.join(out, "recipe.yaml")).read()
            check("pipeline: 2" in log, "the resolved recipe records parallel.pipeline")

    # Llama, untied lm_head: 6 micro-batches (interleaved needs a multiple of the 3 stages).
    lone = train(1, data, "llama", "llama_one", training__grad_accum_steps=6)
    for i, (what, np_, kw) in enumerate([
            ("PP=3 1f1b", 3, {"parallel__pipeline": 3}),
            ("PP=3 interleaved (2 virtual stages)", 3, {"parallel__pipeline": 3, "parallel__virtual_stages": 2}),
            ("PP=2 stage_layers [2, 4]", 2, {"parallel__pipeline": 2, "parallel__stage_layers": [2, 4]})]):
        out = train(np_, data, "llama", f"llama_pp{i}", training__grad_accum_steps=6, **kw)
        same_run(out, lone, f"llama {what}")
        if i == 0:
            ok, worst = weights_close(out, lone, 1e-4)
            check(ok, f"llama {what}: final weights match (worst {worst:.2e} <= 1e-4)")

    # bf16 activations as messages, and full recompute (one arena per micro-batch in flight each):
    # the same kernels on the same values as one process in bf16 (measured bit-identical).
    bf_one = train(1, data, "gpt2", "gpt2_one_bf16", precision__compute="bf16")
    bf_pp = train(2, data, "gpt2", "gpt2_pp2_bf16_full", precision__compute="bf16", parallel__pipeline=2,
                  parallel__virtual_stages=3, recompute="full")
    same_run(bf_pp, bf_one, "gpt2 bf16, recompute full, PP=2 interleaved")

    # DP=2 x PP=2 on 4 ranks: 2 micro-batches per replica, the same global batch of 8 samples.
    for zero in (0, 2):
        out = train(4, data, "gpt2", f"gpt2_dp2_pp2_zero{zero}", training__grad_accum_steps=2, parallel__pipeline=2,
                    parallel__zero=zero)
        same_run(out, one, f"gpt2 DP=2 x PP=2 (4 ranks) ZeRO {zero}")

    # Checkpoints hold the whole model: PP=2 -> one process, one process -> PP=3.
    half = train(2, data, "gpt2", "gpt2_pp2_half", parallel__pipeline=2, output__checkpoint_every=3,
                 extra=("--stop-after", "3"))
    check(os.path.isfile(os.path.join(half, "checkpoints", "step_00000003", "state.json")),
          "PP=2 wrote a checkpoint at step 3")
    p, _ = mpi_train.run(1, ["train", recipe(data, "gpt2", half, output__checkpoint_every=3), "--quiet", "--resume",
                             "auto"], 300, ENV)
    check(p.returncode == 0, "the PP=2 checkpoint resumes in one process" + ("" if p.returncode == 0 else p.stderr[-800:]))
    if p.returncode == 0:
        same_run(half, one, "PP=2 -> one process, steps 4-5", slice(3, None))
    single = train(1, data, "gpt2", "gpt2_one_half", output__checkpoint_every=3, extra=("--stop-after", "3"))
    p, _ = mpi_train.run(3, ["train", recipe(data, "gpt2", single, output__checkpoint_every=3, parallel__pipeline=3),
                             "--quiet", "--resume", "auto"], 300, ENV)
    check(p.returncode == 0, "a one-process checkpoint resumes at PP=3" + ("" if p.returncode == 0 else p.stderr[-800:]))
    if p.returncode == 0:
        same_run(single, one, "one process -> PP=3, steps 4-5", slice(3, None))

    # Layouts the step or the model cannot take are refused before any work, naming the value
    # (`lathe check --world N` runs the trainer's preflight).
    def refused(name, world, must, **kw):
        path = recipe(data, "gpt2", os.path.join(TMP, name), **kw)
        p = subprocess.run([LATHE, "check", path, "--world", str(world)], capture_output=True, text=True, timeout=120,
                           env=ENV)
        text = p.stdout + p.stderr
        ok = p.returncode != 0 and all(m in text for m in must)
        check(ok, f"{name}: refused naming {must}" + ("" if ok else f" (rc {p.returncode}: {text[-600:]})"))

    refused("few_microbatches", 2, ["1 micro-batches", "training.grad_accum_steps", "2 pipeline stages"],
            parallel__pipeline=2, training__grad_accum_steps=1)
    refused("stage_layers_sum", 2, ["parallel.stage_layers [1, 1]", "sums to 2", "6 layers"], parallel__pipeline=2,
            parallel__stage_layers=[1, 1])
    refused("stage_layers_count", 2, ["parallel.stage_layers [6]", "1 entries", "2 stages"], parallel__pipeline=2,
            parallel__stage_layers=[6])
    refused("not_dividing", 4, ["parallel.pipeline 4", "6 layers", "parallel.stage_layers"], parallel__pipeline=4)
    refused("interleaved_groups", 2, ["interleaved", "3 (training.grad_accum_steps)", "multiple of 2"],
            parallel__pipeline=2, parallel__virtual_stages=3, training__grad_accum_steps=3)
    refused("virtual_without_pipeline", 1, ["parallel.virtual_stages", "parallel.pipeline > 1"],
            parallel__virtual_stages=2)

    shutil.rmtree(TMP, ignore_errors=True)
    if failures:
        print(f"{len(failures)} check(s) failed")
        return 1
    print("all pipeline-parallel training checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
