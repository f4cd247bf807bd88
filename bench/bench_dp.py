#!/usr/bin/env python3
"""Data-parallel benchmark (issue 8): the same global batch trained by one process with 2 OpenMP
threads and by `mpirun -np 2` with 1 thread per rank, in one run; then peak memory per rank under
ZeRO 0/1/2 against the estimate lathe prints.

  /usr/bin/python3 bench/bench_dp.py [--build build] [--steps 4] [--preset gpt2-124m] [--batch 4] [--seq 256]

Prints ms/step and tokens/s (median of the steps after the first), the DP/single ratio, the exposed
communication (time waiting for gradient reduction that backward did not hide) in ms and % of the
step, and for each ZeRO stage the largest rank's peak RSS and lathe's per-rank estimate.
"""
import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "train"))
import megatron_writer  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=os.path.join(HERE, "..", "build"))
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--preset", default="gpt2-124m")
    ap.add_argument("--batch", type=int, default=4, help="micro-batch per rank (the single process accumulates 2)")
    ap.add_argument("--seq", type=int, default=256)
    a = ap.parse_args()
    lathe = os.path.join(a.build, "lathe")
    tmp = tempfile.mkdtemp(prefix="lathe_bench_dp_")
    rng = np.random.default_rng(0)
    tokens = (a.steps + 2) * 2 * a.batch * (a.seq + 1) * 2
    megatron_writer.write(os.path.join(tmp, "d"), [rng.integers(0, 50257, tokens)], dtype=np.uint16)
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1")

    def run(np_, threads, accum, zero, name):
        out = os.path.join(tmp, name)
        rec = {"model": {"preset": a.preset}, "data": {"train": os.path.join(tmp, "d"), "valid_fraction": 0.0},
               "optimizer": {"name": "adamw", "lr": 1e-4},
               "training": {"micro_batch_size": a.batch, "seq_len": a.seq, "grad_accum_steps": accum,
                            "steps": a.steps, "eval_interval": 0, "threads": threads, "log_interval": 1},
               "parallel": {"zero": zero}, "output": {"dir": out}}
        path = out + ".yaml"
        json.dump(rec, open(path, "w"))
        cmd = (["mpirun", "-np", str(np_), "--bind-to", "none"] if np_ > 1 else []) + [lathe, "train", path]
        p = subprocess.run(cmd, capture_output=True, text=True, env=dict(env, OMP_NUM_THREADS=str(threads)))
        if p.returncode != 0:
            sys.exit(f"{name} failed:\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
        recs = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl"))]
        steps = [r for r in recs if "loss" in r][1:]  # the first step warms up
        est = float(re.search(r"= ([0-9.]+) MB", p.stdout.split("memory estimate per rank")[1]).group(1))
        peak = [r for r in recs if "peak_rss_mb_max_rank" in r][-1]["peak_rss_mb_max_rank"]
        return {"ms": statistics.median(r["ms_per_step"] for r in steps),
                "tok_s": statistics.median(r["tokens_per_s"] for r in steps),
                "comm_ms": statistics.median(r.get("comm_exposed_ms", 0.0) for r in steps),
                "comm_pct": statistics.median(r.get("comm_exposed_pct", 0.0) for r in steps),
                "loss": [r["loss"] for r in recs if "loss" in r], "peak": peak, "est": est}

    g = 2 * a.batch
    print(f"{a.preset}, global batch {g} x {a.seq} tokens, {a.steps} steps (median of steps 2..)")
    one = run(1, 2, 2, 0, "single")
    dp = run(2, 1, 1, 0, "dp2")
    print(f"{'layout':<34} {'ms/step':>9} {'tok/s':>8} {'exposed comm':>16}")
    print(f"{'1 process x 2 threads':<34} {one['ms']:9.0f} {one['tok_s']:8.1f} {'-':>16}")
    print(f"{'mpirun -np 2 x 1 thread (ZeRO 0)':<34} {dp['ms']:9.0f} {dp['tok_s']:8.1f} "
          f"{dp['comm_ms']:8.0f} ms {dp['comm_pct']:4.1f}%")
    print(f"DP=2 / single tokens/s: {dp['tok_s'] / one['tok_s']:.3f}")
    print(f"losses agree: max rel diff {max(abs(x - y) / abs(y) for x, y in zip(dp['loss'], one['loss'])):.1e}")
    print(f"\n{'ZeRO':<6} {'peak RSS MB (largest rank)':>28} {'lathe estimate MB/rank':>24}")
    for z in (0, 1, 2):
        r = dp if z == 0 else run(2, 1, 1, z, f"z{z}")
        print(f"{z:<6} {r['peak']:28.0f} {r['est']:24.0f}")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
