#!/usr/bin/env python3
"""ZeRO 3 throughput (issue 26): DP=2 (mpirun -np 2, 1 OpenMP thread per rank) on a small GPT-2,
ZeRO 1 against ZeRO 3 with prefetch 0 and 1 (and bf16 compute with --bf16), in one run.

  /usr/bin/python3 bench/bench_zero3.py [--build build] [--steps 6] [--rounds 3] [--preset gpt2-debug]
      [--layers 4] [--hidden 256] [--batch 4] [--seq 128] [--bf16]

The layouts run in turns, --rounds times (ZeRO 1, ZeRO 3 pf0, ZeRO 3 pf1, ZeRO 1, ...), so that
a machine other jobs keep busy loads them alike. Per layout: the median over rounds of the median
tokens/s of the steps after the first, the ZeRO 3 / ZeRO 1 ratio, the exposed communication (waits
for gathers and reductions compute did not hide, ms per step), the weight-gather MB per step (rank
0: metrics weight_gather_mb) and the CPU seconds per step of the whole mpirun tree (user + system:
on a loaded machine wall time measures the other jobs too; CPU time does not).
"""
import argparse
import json
import os
import resource
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
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--preset", default="gpt2-debug")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--bf16", action="store_true", help="precision.compute bf16 (gathers move bf16 GEMM weights)")
    a = ap.parse_args()
    lathe = os.path.join(a.build, "lathe")
    tmp = tempfile.mkdtemp(prefix="lathe_bench_zero3_")
    rng = np.random.default_rng(0)
    megatron_writer.write(os.path.join(tmp, "d"), [rng.integers(0, 96, (a.steps + 2) * 2 * a.batch * (a.seq + 1) * 2)],
                          dtype=np.uint16)
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1", OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE")
    model = {"preset": a.preset, "n_layer": a.layers, "n_embd": a.hidden, "n_positions": max(128, a.seq)}

    def run(zero, prefetch, name):
        out = os.path.join(tmp, name)
        par = {"data": 2, "zero": zero}
        if zero == 3:
            par["prefetch"] = prefetch
        rec = {"model": model, "data": {"train": os.path.join(tmp, "d"), "valid_fraction": 0.0},
               "optimizer": {"name": "adamw", "lr": 1e-4},
               "training": {"micro_batch_size": a.batch, "seq_len": a.seq, "grad_accum_steps": 1, "steps": a.steps,
                            "eval_interval": 0, "threads": 1, "log_interval": 1},
               "precision": {"compute": "bf16" if a.bf16 else "fp32"}, "parallel": par, "output": {"dir": out}}
        path = out + ".yaml"
        json.dump(rec, open(path, "w"))
        shutil.rmtree(out, ignore_errors=True)
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        p = subprocess.run(["mpirun", "-np", "2", "--bind-to", "none", lathe, "train", path, "--quiet"],
                           capture_output=True, text=True, env=env)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if p.returncode != 0:
            sys.exit(f"{name} failed:\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
        recs = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl"))]
        steps = [r for r in recs if "loss" in r][1:]  # the first step warms up
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        return {"tok_s": statistics.median(r["tokens_per_s"] for r in steps),
                "comm_ms": statistics.median(r.get("comm_exposed_ms", 0.0) for r in steps),
                "gather_mb": statistics.median(r.get("weight_gather_mb", 0.0) for r in steps),
                "cpu_s": cpu / a.steps, "loss": [r["loss"] for r in recs if "loss" in r]}

    layouts = [("ZeRO 1", 1, 1), ("ZeRO 3 prefetch 0", 3, 0), ("ZeRO 3 prefetch 1", 3, 1)]
    got = {n: [] for n, _, _ in layouts}
    for k in range(a.rounds):
        for n, z, pf in layouts:
            got[n].append(run(z, pf, f"{n.replace(' ', '_')}_{k}"))
    print(f"{a.preset} {a.layers} layers x {a.hidden}, DP=2 x batch {a.batch} x {a.seq} tokens, "
          f"{'bf16' if a.bf16 else 'fp32'}, {a.steps} steps x {a.rounds} rounds (medians; loaded machine: see CPU s)")
    print(f"{'layout':<20} {'tok/s':>8} {'x ZeRO 1':>9} {'exposed comm ms':>16} {'gather MB/step':>15} "
          f"{'CPU s/step':>11} {'x ZeRO 1':>9}  tok/s per round")
    base = statistics.median(r["tok_s"] for r in got["ZeRO 1"])
    base_cpu = statistics.median(r["cpu_s"] for r in got["ZeRO 1"])
    for n, _, _ in layouts:
        rs = got[n]
        t = statistics.median(r["tok_s"] for r in rs)
        c = statistics.median(r["cpu_s"] for r in rs)
        print(f"{n:<20} {t:8.0f} {t / base:9.2f} {statistics.median(r['comm_ms'] for r in rs):16.1f} "
              f"{statistics.median(r['gather_mb'] for r in rs):15.2f} {c:11.2f} {c / base_cpu:9.2f}  "
              + " ".join(f"{r['tok_s']:.0f}" for r in rs))
    same = all(r["loss"] == got["ZeRO 1"][0]["loss"] for rs in got.values() for r in rs)
    print(f"losses identical across layouts and rounds: {same}")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
