"""bf16 on every x86-64 CPU (issues 9 and 22): the bf16 GEMMs run on oneDNN where it can create a
bf16 matmul (AVX-512 and up; natively with AVX512-BF16), else on the fp32 path (operands widened to
fp32, the fp32 GEMM). Each run is compared against the path it takes, whatever this CPU is; the
lower paths are forced with oneDNN's own ISA cap (DNNL_MAX_CPU_ISA) and with lathe's
(LATHE_CPU_ISA):
  * default     the CPU's own path
  * avx512      DNNL_MAX_CPU_ISA=AVX512_CORE: oneDNN without AVX512-BF16 (on a CPU with AVX-512)
  * avx2        DNNL_MAX_CPU_ISA=AVX2: what an AVX2-only CPU runs: the fp32 path, no oneDNN matmul
  * lathe_avx2  LATHE_CPU_ISA=avx2 alone: the same path, chosen by lathe's own switch
Every run must print exactly one start line naming the instruction set and the GEMM path (and, on
the fp32 path, that bf16 will not be faster than fp32 here), record them in run_info.json (isa,
bf16_gemm), use oneDNN matmul kernels (ONEDNN_VERBOSE) exactly when it names oneDNN, never a bf16
kernel below avx512_bf16, and give the same losses as the default run within 0.5% (the tolerance
of bf16 against fp32 in test_precision_lowp.py: the paths differ only in fp32 summation order)."""
import json
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_helpers import LATHE, check, finish, losses, patterned_data, write_recipe  # noqa: E402

RUNS = (("default", {}), ("avx512", {"DNNL_MAX_CPU_ISA": "AVX512_CORE"}), ("avx2", {"DNNL_MAX_CPU_ISA": "AVX2"}),
        ("lathe_avx2", {"LATHE_CPU_ISA": "avx2"}))
LEVELS = ["x86-64", "avx2", "avx512", "avx512_bf16", "amx"]


def main():
    import numpy as np
    tmp = tempfile.mkdtemp(prefix="lathe_bf16_fallback_")
    data = patterned_data(tmp, np.random.default_rng(6))
    runs = {}
    for name, env in RUNS:
        out = os.path.join(tmp, name)
        recipe = write_recipe(out, data, {"micro_batch_size": 4, "seq_len": 32, "steps": 6, "eval_interval": 0,
                                          "threads": 2, "peak_gflops": 100, "seed": 5},
                              precision={"compute": "bf16"})
        e = dict(os.environ, ONEDNN_VERBOSE="1")
        for k in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "LATHE_CPU_ISA"):
            e.pop(k, None)
        e.update(env)
        p = subprocess.run([LATHE, "train", recipe], capture_output=True, text=True, timeout=300, env=e)
        check(p.returncode == 0, f"bf16 training ({name}) {p.stderr.strip()[-300:]}")
        if p.returncode != 0:
            return finish(tmp)
        kernels = {l.split(",")[4] for l in p.stdout.splitlines() if l.startswith("onednn_verbose,exec,cpu,matmul")}
        lines = [l for l in (p.stdout + p.stderr).splitlines() if "cpu instruction set" in l]
        info = json.load(open(os.path.join(out, "run_info.json")))
        runs[name] = (lines, kernels, losses(out), info)

    hw = None
    for name, env in RUNS:
        lines, kernels, ls, info = runs[name]
        check(len(lines) == 1, f"{name}: one start line naming the instruction set ({len(lines)}: {lines})")
        if len(lines) != 1:
            continue
        line = lines[0]
        m = re.search(r"cpu instruction set ([\w.-]+)", line)
        isa = m.group(1) if m else "?"
        check(isa in LEVELS and info.get("isa") == isa, f"{name}: isa {isa} (run_info.json {info.get('isa')})")
        if name == "default":
            hw = isa
        onednn = "GEMMs on oneDNN" in line
        check(info.get("bf16_gemm") == ("onednn" if onednn else "fp32"),
              f"{name}: run_info.json bf16_gemm {info.get('bf16_gemm')} matches the line: {line.strip()}")
        check(bool(kernels) == onednn, f"{name}: oneDNN matmul kernels ran exactly when the line names oneDNN "
              f"({sorted(kernels)})")
        if not onednn:
            check("bf16 will not be faster than fp32 on this CPU" in line, f"{name}: the fp32 path says it is not faster")
        if isa in LEVELS and LEVELS.index(isa) < LEVELS.index("avx512_bf16"):
            check(not any("bf16" in k for k in kernels), f"{name}: no bf16 instruction kernels below avx512_bf16 "
                  f"({sorted(kernels)})")
        if name in ("avx2", "lathe_avx2"):
            check(isa in ("avx2", "x86-64") and not onednn and "(capped by " + next(iter(env)) in line
                  or hw in ("avx2", "x86-64"),
                  f"{name}: the AVX2 path, capped by {next(iter(env))}: {line.strip()}")
        if name == "avx512" and hw in ("avx512_bf16", "amx"):
            check(isa == "avx512" and onednn, f"{name}: oneDNN at avx512 without bf16 instructions: {line.strip()}")
        base = runs["default"][2]
        worst = max(abs(a - b) / abs(b) for a, b in zip(ls, base)) if ls else 1.0
        check(len(ls) == 6 and worst < 5e-3, f"{name}: losses equal to the default run's within 0.5% "
              f"(worst {worst:.2e})")
    return finish(tmp)


if __name__ == "__main__":
    sys.exit(main())
