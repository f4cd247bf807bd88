#!/usr/bin/env python3
"""Parallel layouts on this machine (issue 10): the same global batch of GPT-2 124M (vocabulary
padded to 50304 so that tensor parallelism can split it) trained by one process with 2 OpenMP
threads and by 2 processes with 1 thread each as DP=2, TP=2 and PP=2 (the step's micro-batches are
the pipeline's), in one run; beside each, `lathe plan`'s prediction for that layout from the same
machine's GEMM probe and copy bandwidth.

  /usr/bin/python3 bench/bench_parallel.py [--build build] [--steps 4] [--seq 128] [--micro 8]

Prints ms/step and tokens/s (median of the steps after the first), exposed communication (time
waiting on collectives that compute did not hide, % of the step), the pipeline bubble the
schedule implies, and the plan's predicted step time, tokens/s and bubble.
A layout lathe refuses (for example PP before pipeline execution exists) prints its error line.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "train"))
import megatron_writer  # noqa: E402

MODEL = {"preset": "gpt2-124m", "vocab_size": 50304}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=os.path.join(HERE, "..", "build"))
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--micro", type=int, default=8, help="micro-batches of 1 sample per step (the global batch)")
    ap.add_argument("--layouts", default="single,dp2,tp2,pp2")
    a = ap.parse_args()
    lathe = os.path.join(a.build, "lathe")
    tmp = tempfile.mkdtemp(prefix="lathe_bench_par_")
    rng = np.random.default_rng(0)
    tokens = (a.steps + 2) * a.micro * (a.seq + 1) * 2
    megatron_writer.write(os.path.join(tmp, "d"), [rng.integers(0, 50257, tokens)], dtype=np.uint16)
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1")

    def recipe(name, parallel, accum, threads):
        out = os.path.join(tmp, name)
        rec = {"model": MODEL, "data": {"train": os.path.join(tmp, "d"), "valid_fraction": 0.0},
               "optimizer": {"name": "adamw", "lr": 1e-4},
               "training": {"micro_batch_size": 1, "seq_len": a.seq, "grad_accum_steps": accum,
                            "steps": a.steps, "eval_interval": 0, "threads": threads, "log_interval": 1},
               "parallel": parallel, "output": {"dir": out}}
        path = out + ".yaml"
        json.dump(rec, open(path, "w"))
        return path, out

    def plan(path, world, layout, threads):
        # The same global batch as the run, and the GEMM probe with the run's threads per rank (the
        # ranks share this machine's cores, so one rank's peak is the 1-thread probe).
        p = subprocess.run([lathe, "plan", path, "--world", str(world), "--json", "--global-batch", str(a.micro)],
                           capture_output=True, text=True, env=dict(env, OMP_NUM_THREADS=str(threads)))
        if p.returncode != 0:
            return None
        rows = json.loads(p.stdout)
        rows = rows.get("layouts", rows) if isinstance(rows, dict) else rows
        for e in rows:
            if e.get("valid") and all(e.get(k) == v for k, v in layout.items()):
                return e
        return None

    layouts = {  # name: processes, threads, parallel section, accumulation per data rank, plan layout
        "single": (1, 2, {}, a.micro, {"data": 1, "tensor": 1, "pipeline": 1}),
        "dp2": (2, 1, {"data": 2}, a.micro // 2, {"data": 2, "tensor": 1, "pipeline": 1}),
        "tp2": (2, 1, {"tensor": 2}, a.micro, {"data": 1, "tensor": 2, "pipeline": 1}),
        "pp2": (2, 1, {"pipeline": 2}, a.micro, {"data": 1, "tensor": 1, "pipeline": 2}),
    }
    print(f"GPT-2 124M (vocab 50304), global batch {a.micro} x {a.seq} tokens, {a.steps} steps "
          f"(median of steps 2..); 1 process x 2 threads or 2 processes x 1 thread")
    print(f"{'layout':<8} {'ms/step':>9} {'tok/s':>8} {'exposed comm':>13} {'bubble':>7} | "
          f"{'plan ms':>8} {'plan tok/s':>10} {'plan bubble':>11}")
    base = None
    for name in a.layouts.split(","):
        np_, threads, par, accum, lay = layouts[name]
        path, out = recipe(name, dict(par, zero=0), accum, threads)
        cmd = (["mpirun", "-np", str(np_), "--bind-to", "none"] if np_ > 1 else []) + [lathe, "train", path]
        p = subprocess.run(cmd, capture_output=True, text=True, env=dict(env, OMP_NUM_THREADS=str(threads)))
        e = plan(path, np_, dict(lay, zero=0, sequence=False, recompute="none"), threads)
        pl = (f"{e['time']['step_s'] * 1e3:8.0f} {e['tokens_per_s']:10.1f} {100 * e['time']['bubble']:10.1f}%"
              if e else f"{'-':>8} {'-':>10} {'-':>11}")
        if p.returncode != 0:
            err = [l for l in (p.stdout + p.stderr).splitlines() if "error" in l]
            print(f"{name:<8} refused: {(err or ['?'])[0][:150]}")
            continue
        recs = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl"))]
        steps = [r for r in recs if "loss" in r][1:]
        ms = statistics.median(r["ms_per_step"] for r in steps)
        tok = statistics.median(r["tokens_per_s"] for r in steps)
        comm = statistics.median(r.get("comm_exposed_pct", 0.0) for r in steps)
        bubble = statistics.median(r.get("bubble_pct", 0.0) for r in steps) if name == "pp2" else 0.0
        base = base or tok
        print(f"{name:<8} {ms:9.0f} {tok:8.1f} {comm:12.1f}% {bubble:6.1f}% | {pl}   ({tok / base:.2f}x single)")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
