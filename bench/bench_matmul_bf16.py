#!/usr/bin/env python3
"""bf16 GEMMs at GPT-2 124M training shapes: lathe fp32 (OpenBLAS) vs lathe bf16 (oneDNN) vs
PyTorch bf16 (and fp32) on the same shapes, in one run, GFLOP/s side by side.

  /usr/bin/python3 bench/bench_matmul_bf16.py [--build build] [--threads 2] [--quick] [--repeat N]

"own bf16" is the forward-only AVX512-BF16 prototype kernel of bench_matmul_bf16.cpp (the
measurement behind using oneDNN). Runs build/bench/bench_matmul_bf16 --json, then times torch on each of its GEMMs with
torch.set_num_threads(THREADS) (default 2, the same OMP_NUM_THREADS lathe gets):
  fwd  F.linear(x[M,K], w[N,K])   dinp  dout[M,N] @ w[N,K]   dw  dout[M,N].T @ x[M,K]
torch's bf16 GEMMs return bf16 (lathe's fp32 outputs write twice the bytes). --quick skips the lm head.
"""
import argparse
import json
import os
import subprocess
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def best_seconds(fn, reps, budget):
    fn()
    best, spent, r = 1e30, 0.0, 0
    while r < reps or spent < budget:
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        best, spent, r = min(best, dt), spent + dt, r + 1
        if r >= 30:
            break
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=os.path.join(HERE, "..", "build"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="skip the 50257-wide lm head")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run everything N times and keep each figure's best (on a machine shared with other work)")
    a = ap.parse_args()
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(a.threads)
    cmd = [os.path.join(a.build, "bench", "bench_matmul_bf16"), "--json"] + (["--quick"] if a.quick else [])
    lathe = None
    for rep in range(a.repeat):
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout.strip().splitlines()
        if rep == 0:
            for line in out[:-1]:
                if line.startswith(("bench_matmul_bf16", "vdpbf16ps", "convert")):
                    print(line)
        run = json.loads(out[-1])
        if lathe is None:
            lathe = run
        else:
            lathe["peak_bf16"] = max(lathe["peak_bf16"], run["peak_bf16"])
            for r, q in zip(lathe["rows"], run["rows"]):
                for k in ("fp32", "bf16", "own"):
                    r[k] = max(r[k], q[k])
    if a.repeat > 1:
        print(f"best of {a.repeat} runs per figure; vdpbf16ps peak {lathe['peak_bf16']:.0f} GFLOP/s")

    import torch
    import torch.nn.functional as F
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, mkldnn bf16 "
          f"{'yes' if torch.backends.mkldnn.is_available() else 'no'}")
    print(f"{'layer':<10} {'gemm':<5} {'M':>5} {'K':>5} {'N':>6} | {'lathe fp32':>10} {'lathe bf16':>10} "
          f"{'own bf16':>8} {'torch bf16':>10} {'torch fp32':>10} | {'bf16/fp32':>9} {'lathe/torch bf16':>16}")
    tot = {"l32": 0.0, "l16": 0.0, "t16": 0.0, "t32": 0.0}
    flops_all = 0.0
    cache = {}
    for r in lathe["rows"]:
        M, K, N = r["M"], r["K"], r["N"]
        if (K, N) not in cache:
            x = torch.randn(M, K)
            w = torch.randn(N, K) * 0.02
            b = torch.randn(N)
            g = torch.randn(M, N)
            cache = {(K, N): (x, w, b, g, x.bfloat16(), w.bfloat16(), b.bfloat16(), g.bfloat16())}
        x, w, b, g, xh, wh, bh, gh = cache[(K, N)]
        flops = 2.0 * M * K * N
        reps, budget = (2, 0.0) if flops > 2e10 else (3, 0.3)
        fn = {
            "fwd": (lambda: F.linear(xh, wh, bh), lambda: F.linear(x, w, b)),
            "dinp": (lambda: gh @ wh, lambda: g @ w),
            "dw": (lambda: gh.t() @ xh, lambda: g.t() @ x),
        }[r["gemm"]]
        with torch.no_grad():
            t16 = max(flops / best_seconds(fn[0], reps, budget) * 1e-9 for _ in range(a.repeat))
            t32 = max(flops / best_seconds(fn[1], reps, budget) * 1e-9 for _ in range(a.repeat))
        for k, v in (("l32", r["fp32"]), ("l16", r["bf16"]), ("t16", t16), ("t32", t32)):
            tot[k] += flops / v
        flops_all += flops
        own = f"{r['own']:.1f}" if r.get("own") else "-"
        print(f"{r['name']:<10} {r['gemm']:<5} {M:>5} {K:>5} {N:>6} | {r['fp32']:>10.1f} {r['bf16']:>10.1f} "
              f"{own:>8} {t16:>10.1f} {t32:>10.1f} | {r['bf16'] / r['fp32']:>8.2f}x {r['bf16'] / t16:>15.2f}x", flush=True)
    g = {k: flops_all / v for k, v in tot.items()}
    print(f"{'all (time-weighted)':<30} | {g['l32']:>10.1f} {g['l16']:>10.1f} {'':>8} {g['t16']:>10.1f} {g['t32']:>10.1f} | "
          f"{g['l16'] / g['l32']:>8.2f}x {g['l16'] / g['t16']:>15.2f}x")
    if lathe.get("peak_bf16"):
        print(f"vdpbf16ps instruction peak {lathe['peak_bf16']:.0f} GFLOP/s: lathe bf16 reaches "
              f"{100 * g['l16'] / lathe['peak_bf16']:.0f}% of it, torch bf16 {100 * g['t16'] / lathe['peak_bf16']:.0f}%")


if __name__ == "__main__":
    main()
