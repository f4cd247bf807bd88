"""bf16 on a CPU without AVX512-BF16 (issue 9): oneDNN then runs the bf16 GEMMs on a slower path.
This machine has AVX512-BF16, so the path is forced with oneDNN's own ISA limit
(DNNL_MAX_CPU_ISA=AVX512_CORE): the run must print a one-line notice, must really use another
kernel (ONEDNN_VERBOSE names it), and must give the same losses as the native bf16 run within
0.5% (the same tolerance as bf16 against fp32 in test_precision_lowp.py; measured: equal to 4
digits)."""
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_helpers import LATHE, check, finish, losses, patterned_data, write_recipe  # noqa: E402


def main():
    import numpy as np
    tmp = tempfile.mkdtemp(prefix="lathe_bf16_fallback_")
    data = patterned_data(tmp, np.random.default_rng(6))
    runs = {}
    for name, env in (("native", {}), ("limited", {"DNNL_MAX_CPU_ISA": "AVX512_CORE"})):
        out = os.path.join(tmp, name)
        recipe = write_recipe(out, data, {"micro_batch_size": 4, "seq_len": 32, "steps": 6, "eval_interval": 0,
                                          "threads": 2, "peak_gflops": 100, "seed": 5},
                              precision={"compute": "bf16"})
        e = dict(os.environ, ONEDNN_VERBOSE="1", **env)
        e.pop("ONEDNN_MAX_CPU_ISA", None)
        p = subprocess.run([LATHE, "train", recipe], capture_output=True, text=True, timeout=300, env=e)
        check(p.returncode == 0, f"bf16 training ({name})")
        kernels = {l.split(",")[4] for l in p.stdout.splitlines() if l.startswith("onednn_verbose,exec,cpu,matmul")}
        runs[name] = (p.stdout, kernels, losses(out))
    nat, lim = runs["native"], runs["limited"]
    check(nat[1] and lim[1] and nat[1] != lim[1] and not any("bf16" in k for k in lim[1]),
          f"the limited run uses other GEMM kernels (native {sorted(nat[1])}, limited {sorted(lim[1])})")
    check("oneDNN is limited to ISA AVX512_CORE" in lim[0] and "oneDNN is limited" not in nat[0],
          "a one-line notice in the limited run only")
    worst = max(abs(a - b) / abs(b) for a, b in zip(lim[2], nat[2]))
    check(len(lim[2]) == 6 and worst < 5e-3, f"losses equal within 0.5% (worst {worst:.2e})")
    return finish(tmp)


if __name__ == "__main__":
    sys.exit(main())
