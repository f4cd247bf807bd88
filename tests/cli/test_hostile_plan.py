"""lathe plan with hostile numbers: huge worlds and global batches, a model of 2^50 parameters, bad
option values. Every case ends quickly (the pipeline simulator is bounded: long steps are extended
from short simulations, too-deep pipelines rejected), within the memory limit, with exit 0 or a
named error; nothing is allocated for the model."""
import os
import sys

sys.path.insert(0, os.path.join(os.environ.get("LATHE_SOURCE_DIR", os.path.dirname(__file__) + "/../.."), "tests"))
from hostile import Cases, run_lathe  # noqa: E402

cases = Cases()
recipe = cases.write("r.yaml", "model: {preset: gpt2-debug}\ndata: {train: none}\n"
                               "training: {micro_batch_size: 2, seq_len: 32, grad_accum_steps: 2}\n")
fixed = ["--peak-gflops", "100", "--link-gbps", "10", "--memory-gb", "8"]

with cases.case("a world of 2^20 ranks"):
    run_lathe(["plan", recipe, "--world", 1 << 20, "--top", 3, *fixed], rc=0, timeout=120,
              must=["rejected", "tensor 8 does not divide num_attention_heads 4"], stream="stdout")

with cases.case("a global batch of 2^40 samples: the step extended, not simulated action by action"):
    run_lathe(["plan", recipe, "--world", 4, "--global-batch", 1 << 40, "--top", 3, *fixed], rc=0, timeout=120,
              must=["tokens/s"], stream="stdout")

with cases.case("a pipeline deeper than the simulator takes is rejected with the reason"):
    deep = cases.write("deep.yaml", "model: {preset: gpt2-debug, n_layer: 512, n_head: 1}\ndata: {train: none}\n"
                                    "training: {micro_batch_size: 1, seq_len: 16, grad_accum_steps: 4}\n")
    run_lathe(["plan", deep, "--world", 512, "--top", 1, *fixed], rc=0, timeout=120,
              must=["too deep for the schedule simulator"], stream="stdout")

with cases.case("a model of 2^50 parameters is planned, never allocated"):
    big = cases.write("big.yaml", "model: {preset: gpt2-debug, vocab_size: 1073741824, n_embd: 1048576, "
                                  "n_head: 8, n_positions: 16}\ndata: {train: none}\n"
                                  "training: {micro_batch_size: 1, seq_len: 16}\n")
    run_lathe(["plan", big, "--world", 8, "--top", 2, *fixed], rc=0, timeout=120, must=[" NO "], stream="stdout")

for name, extra, flag in [("--virtual-stages 0", ["--virtual-stages", "0"], "virtual-stages"),
                          ("--virtual-stages 2,x", ["--virtual-stages", "2,x"], "virtual-stages"),
                          ("--memory-gb -1", ["--memory-gb", "-1"], "memory-gb"),
                          ("--top -1", ["--top", "-1"], "top"),
                          ("--world 0", ["--world", "0"], "world"),
                          ("--peak-gflops 0", ["--peak-gflops", "0"], "peak-gflops"),
                          # S7: these replaced the value by the machine default (or ran the probe)
                          ("--memory-gb 0", ["--memory-gb", "0"], "memory-gb"),
                          ("--memory-gb nan", ["--memory-gb", "nan"], "memory-gb"),
                          ("--peak-gflops nan", ["--peak-gflops", "nan"], "peak-gflops"),
                          ("--link-gbps inf", ["--link-gbps", "inf"], "link-gbps"),
                          ("--gpus-per-node above --world", ["--gpus-per-node", "1048576"], "gpus-per-node")]:
    with cases.case(name):
        args = ["plan", recipe] + (["--world", "2"] if "--world" not in extra else []) + extra
        p = run_lathe(args, rc=2, timeout=30)
        assert flag in p.stderr.decode(), p.stderr.decode()

with cases.case("a missing recipe is named"):
    run_lathe(["plan", cases.path("none.yaml"), "--world", 2, *fixed], rc=1, must=["none.yaml"])

cases.finish()
