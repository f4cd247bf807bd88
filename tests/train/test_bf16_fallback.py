"""bf16 on a CPU without AVX512-BF16 (issue 9): oneDNN then runs the bf16 GEMMs on a slower path.
This machine has AVX512-BF16, so the path is forced with oneDNN's own ISA limit
(DNNL_MAX_CPU_ISA=AVX512_CORE): the run must print a one-line notice, must really use another
kernel (ONEDNN_VERBOSE names it), and must give the same losses as the native bf16 run within
0.5% (the same tolerance as bf16 against fp32 in test_precision_lowp.py; measured: equal to 4
digits)."""
import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import megatron_writer  # noqa: E402

LATHE = os.environ.get("LATHE_BIN") or os.path.join(os.environ.get("LATHE_BINARY_DIR", os.path.join(HERE, "..", "..", "build")), "lathe")
failures = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what, flush=True)
    if not ok:
        failures.append(what)


def main():
    import numpy as np
    tmp = tempfile.mkdtemp(prefix="lathe_bf16_fallback_")
    rng = np.random.default_rng(6)
    data = os.path.join(tmp, "data")
    megatron_writer.write(data, [(np.arange(300) * (d % 5 + 1) + rng.integers(0, 3, 300)) % 96 for d in range(40)])
    runs = {}
    for name, env in (("native", {}), ("limited", {"DNNL_MAX_CPU_ISA": "AVX512_CORE"})):
        out = os.path.join(tmp, name)
        r = {"model": {"preset": "gpt2-debug"}, "data": {"train": data, "valid_fraction": 0.1},
             "optimizer": {"name": "adamw", "lr": 3e-3}, "schedule": {"name": "cosine", "warmup_steps": 2},
             "training": {"micro_batch_size": 4, "seq_len": 32, "steps": 6, "eval_interval": 0, "threads": 2,
                          "peak_gflops": 100, "seed": 5},
             "precision": {"compute": "bf16"}, "output": {"dir": out}}
        json.dump(r, open(out + ".yaml", "w"))
        e = dict(os.environ, ONEDNN_VERBOSE="1", **env)
        e.pop("ONEDNN_MAX_CPU_ISA", None)
        p = subprocess.run([LATHE, "train", out + ".yaml"], capture_output=True, text=True, timeout=300, env=e)
        check(p.returncode == 0, f"bf16 training ({name})")
        kernels = {l.split(",")[4] for l in p.stdout.splitlines() if l.startswith("onednn_verbose,exec,cpu,matmul")}
        losses = [json.loads(l)["loss"] for l in open(os.path.join(out, "metrics.jsonl")) if '"loss"' in l]
        runs[name] = (p.stdout, kernels, losses)
    nat, lim = runs["native"], runs["limited"]
    check(nat[1] and lim[1] and nat[1] != lim[1] and not any("bf16" in k for k in lim[1]),
          f"the limited run uses other GEMM kernels (native {sorted(nat[1])}, limited {sorted(lim[1])})")
    check("oneDNN is limited to ISA AVX512_CORE" in lim[0] and "oneDNN is limited" not in nat[0],
          "a one-line notice in the limited run only")
    worst = max(abs(a - b) / abs(b) for a, b in zip(lim[2], nat[2]))
    check(len(lim[2]) == 6 and worst < 5e-3, f"losses equal within 0.5% (worst {worst:.2e})")
    if not failures:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{len(failures)} failed" if failures else "all passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
