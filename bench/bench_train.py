#!/usr/bin/env python3
"""Training-step benchmark: lathe vs PyTorch on the same GPT-2 configs, in one run, fp32 and bf16.

  /usr/bin/python3 bench/bench_train.py [--build build] [--steps 5] [--quick] [--dtypes fp32,bf16]
  /usr/bin/python3 bench/bench_train.py --memory     # recompute none/selective/full: peak RSS vs estimate
  /usr/bin/python3 bench/bench_train.py --cpu-time   # also CPU ms/step (all threads) and its ratios

For each config (GPT-2 124M and L=4 C=256 H=4 V=50257, at B=4 T=64 and B=4 T=256) it runs
build/bench/bench_train_step (lathe, --dtype fp32 and bf16) and bench/torch_gpt2.py (PyTorch, 2
threads, AdamW; fp32, and torch.autocast(cpu, bfloat16) as the bf16 peer) and prints ms/step,
tokens/s, MFU and the speed ratios. lathe's MFU is against its own GEMM probe of the same dtype (fp32
sgemm, or oneDNN bf16 at the model's largest GEMM shape); torch's MFU against the same peak.
PyTorch runs with jemalloc (if installed) with decay disabled and the same OPENBLAS_CORETYPE lathe
uses, once with OMP_WAIT_POLICY=PASSIVE and once with ACTIVE; the faster of the two is reported.

--cpu-time: on a machine that other jobs keep busy, wall time measures the other jobs as much as the
step. Each row then also shows the process CPU time per step (all of its threads, warm-up step
excluded, from the same runs), the ratios are given for CPU time too, and of torch's two wait
policies the one with less CPU time is reported (spinning workers burn CPU time while they wait).
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


def torch_step(L, C, H, V, B, T, steps, env, blas_kernel, autocast, key="ms_per_step"):
    """torch_gpt2.py's result with the wait policy that gives the smaller `key`."""
    best = None
    for policy in ("PASSIVE", "ACTIVE"):
        tenv = dict(env, OMP_WAIT_POLICY=policy)
        tenv.setdefault("OPENBLAS_CORETYPE", blas_kernel)
        jem = "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"
        if os.path.exists(jem):
            tenv["LD_PRELOAD"] = jem
            tenv["MALLOC_CONF"] = "dirty_decay_ms:-1,muzzy_decay_ms:-1"
        r = run_json([sys.executable, os.path.join(HERE, "torch_gpt2.py"), *map(str, (L, C, H, V, B, T, steps))] +
                     (["--autocast"] if autocast else []), tenv)
        r["policy"] = policy
        if best is None or r[key] < best[key]:
            best = r
    return best


def speed(a, env):
    lathe_bin = os.path.join(a.build, "bench", "bench_train_step")
    dtypes = a.dtypes.split(",")
    configs = CONFIGS[:2] if a.quick else CONFIGS
    cpu = a.cpu_time
    key = "cpu_ms_per_step" if cpu else "ms_per_step"
    cpu_head = f" {'CPU ms':>9}" if cpu else ""
    print(f"{'config':<26} {'impl':<22} {'ms/step':>9}{cpu_head} {'tok/s':>7} {'MFU':>6} {'RSS MB':>7} {'est MB':>7}")
    summary = []
    for preset, L, C, H, V, B, T in configs:
        name = f"{preset} B={B} T={T}"
        rows = {}
        for dt in dtypes:
            lt = run_json([lathe_bin, preset, str(B), str(T), str(a.steps), "--dtype", dt], env)
            rows[f"lathe {dt}"] = lt
            print(f"{name:<26} {'lathe ' + dt:<22} {lt['ms_per_step']:>9.1f}{cpu_col(lt, cpu)} "
                  f"{lt['tokens_per_s']:>7.0f} {100 * lt['mfu']:>5.1f}% {lt['peak_rss_mb']:>7.0f} "
                  f"{lt['estimate_mb']:>7.0f}   (peak {lt['peak_gflops']:.0f} GFLOP/s {dt})", flush=True)
            tt = torch_step(L, C, H, V, B, T, a.steps, env, lt["blas_kernel"], dt == "bf16", key)
            label = "torch fp32" if dt == "fp32" else "torch autocast bf16"
            rows[label] = tt
            t_mfu = tt["flops_per_token"] * tt["tokens_per_s"] / (lt["peak_gflops"] * 1e9)
            print(f"{name:<26} {label:<22} {tt['ms_per_step']:>9.1f}{cpu_col(tt, cpu)} "
                  f"{tt['tokens_per_s']:>7.0f} {100 * t_mfu:>5.1f}% {tt['peak_rss_mb']:>7.0f} {'':>7}   "
                  f"(OMP_WAIT_POLICY {tt['policy']})", flush=True)
        summary.append((name, rows))
    for k in ("ms_per_step", "cpu_ms_per_step") if cpu else ("ms_per_step",):
        what = "ms/step" if k == "ms_per_step" else "CPU ms/step"
        print(f"\nratios ({what} of the first over the second; > 1 means the second is faster):")
        for name, rows in summary:
            print(f"  {name:<26} " + " | ".join(ratios(rows, k)))
    lt = next(iter(summary[0][1].values()))
    print(f"threads {lt['threads']}, OpenBLAS kernel {lt['blas_kernel']}")


def cpu_col(r, shown):
    return f" {r['cpu_ms_per_step']:>9.1f}" if shown else ""


def ratios(rows, k):
    """The speed ratios of one config's rows by `k` (ms_per_step or cpu_ms_per_step)."""
    parts = []
    if "lathe fp32" in rows:
        parts.append(f"torch fp32 / lathe fp32 {rows['torch fp32'][k] / rows['lathe fp32'][k]:.2f}x")
    if "lathe bf16" in rows:
        parts.append(f"torch autocast / lathe bf16 {rows['torch autocast bf16'][k] / rows['lathe bf16'][k]:.2f}x")
    if "lathe fp32" in rows and "lathe bf16" in rows:
        parts.append(f"lathe fp32 / lathe bf16 {rows['lathe fp32'][k] / rows['lathe bf16'][k]:.2f}x")
    return parts


def memory(a, env):
    """Peak RSS per recompute mode against lathe's estimate (params, grads, moments, activations)."""
    lathe_bin = os.path.join(a.build, "bench", "bench_train_step")
    print(f"{'config':<28} {'dtype':<5} {'recompute':<10} {'act MB':>8} {'RSS MB':>8} {'est MB':>8} {'est/RSS':>8}")
    for dt in a.dtypes.split(","):
        for rc in ("none", "selective", "full"):
            r = run_json([lathe_bin, "gpt2-124m", "4", "256", "2", "--dtype", dt, "--recompute", rc], env)
            print(f"{'gpt2-124m B=4 T=256':<28} {dt:<5} {rc:<10} {r.get('activation_mb', float('nan')):>8.0f} "
                  f"{r['peak_rss_mb']:>8.0f} {r['estimate_mb']:>8.0f} {r['estimate_mb'] / r['peak_rss_mb']:>8.2f}",
                  flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=os.path.join(HERE, "..", "build"))
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="only the two T=64 configs")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--memory", action="store_true", help="peak memory per recompute mode instead of speed")
    ap.add_argument("--cpu-time", action="store_true",
                    help="also process CPU ms per step (all threads) and ratios by CPU time, for busy machines")
    a = ap.parse_args()
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "2")
    if a.memory:
        memory(a, env)
    else:
        speed(a, env)


if __name__ == "__main__":
    main()
