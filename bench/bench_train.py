#!/usr/bin/env python3
"""Training-step benchmark: lathe vs PyTorch on the same GPT-2 configs, in one run.

  /usr/bin/python3 bench/bench_train.py [--build build] [--steps 5] [--quick]

For each config (GPT-2 124M and L=4 C=256 H=4 V=50257, at B=4 T=64 and B=4 T=256) it runs
build/bench/bench_train_step (lathe) and bench/torch_gpt2.py (PyTorch, 2 threads, fp32, AdamW)
and prints ms/step, tokens/s, MFU (against lathe's GEMM probe) and the speed ratio.
PyTorch runs with jemalloc (if installed) with decay disabled and the same OPENBLAS_CORETYPE
lathe uses, once with OMP_WAIT_POLICY=PASSIVE and once with the ACTIVE spinning lathe uses; the
faster of the two is reported.
"""
import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIGS = [("gpt2-124m", 12, 768, 12, 50257, 4, 64), ("gpt2-small-bench", 4, 256, 4, 50257, 4, 64),
           ("gpt2-small-bench", 4, 256, 4, 50257, 4, 256), ("gpt2-124m", 12, 768, 12, 50257, 4, 256)]


def run_json(cmd, env):
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=os.path.join(HERE, "..", "build"))
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="only the two T=64 configs")
    a = ap.parse_args()
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "2")
    lathe_bin = os.path.join(a.build, "bench", "bench_train_step")
    configs = CONFIGS[:2] if a.quick else CONFIGS
    print(f"{'config':<28} {'lathe ms':>9} {'tok/s':>7} {'MFU':>6} {'RSS MB':>7} {'est MB':>7} | "
          f"{'torch ms':>9} {'tok/s':>7} {'MFU':>6} {'RSS MB':>7} | {'speedup':>7}")
    for preset, L, C, H, V, B, T in configs:
        lt = run_json([lathe_bin, preset, str(B), str(T), str(a.steps)], env)
        tt = None
        for policy in ({"OMP_WAIT_POLICY": "PASSIVE"}, {"OMP_WAIT_POLICY": "ACTIVE"}):
            tenv = dict(env)
            tenv.update(policy)
            tenv.setdefault("OPENBLAS_CORETYPE", lt["blas_kernel"])
            for jem in ("/usr/lib/x86_64-linux-gnu/libjemalloc.so.2",):
                if os.path.exists(jem):
                    tenv["LD_PRELOAD"] = jem
                    tenv["MALLOC_CONF"] = "dirty_decay_ms:-1,muzzy_decay_ms:-1"
            r = run_json([sys.executable, os.path.join(HERE, "torch_gpt2.py"), *map(str, (L, C, H, V, B, T, a.steps))],
                         tenv)
            r["policy"] = policy["OMP_WAIT_POLICY"]
            if tt is None or r["ms_per_step"] < tt["ms_per_step"]:
                tt = r
        t_mfu = tt["flops_per_token"] * tt["tokens_per_s"] / (lt["peak_gflops"] * 1e9)
        name = f"{preset} B={B} T={T}"
        print(f"{name:<28} {lt['ms_per_step']:>9.1f} {lt['tokens_per_s']:>7.0f} {100 * lt['mfu']:>5.1f}% "
              f"{lt['peak_rss_mb']:>7.0f} {lt['estimate_mb']:>7.0f} | {tt['ms_per_step']:>9.1f} {tt['tokens_per_s']:>7.0f} "
              f"{100 * t_mfu:>5.1f}% {tt['peak_rss_mb']:>7.0f} | {tt['ms_per_step'] / lt['ms_per_step']:>6.2f}x"
              f"  (torch {tt['policy']})",
              flush=True)
    print(f"peak (lathe GEMM probe): {lt['peak_gflops']:.1f} GFLOP/s, threads {lt['threads']}, "
          f"OpenBLAS kernel {lt['blas_kernel']}")


if __name__ == "__main__":
    main()
