#!/usr/bin/env python3
"""GPT-2 124M bf16 training throughput on one GPU (issue 12's speed target), for run_on_gpu.sh.

Writes a random-token Megatron dataset (GPT-2 vocabulary, so no tokenizer or download is needed),
then for each micro-batch size B (T = 1024) trains a few steps with `device: cuda` and
`precision.compute: bf16` and prints the median tokens/s and MFU of the steps after the first two
(warm-up: cuBLASLt heuristics, workspace growth). MFU is lathe's own figure (metrics.jsonl `mfu`,
against training.peak_gflops or its GPU table) and, as a cross-check, 6N + 12 L T C flops per token
(llm.c's count) against --peak-tflops.

  python3 tests/cuda/bench_gpu.py --build build-gpu [--batches 16,32,64] [--steps 8]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "train"))
import megatron_writer  # noqa: E402

N_PARAMS = 124_475_904  # GPT-2 124M with vocab 50304 (tied embeddings)
L, C, V = 12, 768, 50304


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=os.path.join(HERE, "..", "..", "build-gpu"))
    ap.add_argument("--batches", default="16,32,64")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak (H100/H200 SXM: 989)")
    ap.add_argument("--timeout", type=float, default=150.0, help="seconds per run")
    ap.add_argument("--attention-kernel", default="lathe", help="model.attention_kernel: lathe | cudnn")
    a = ap.parse_args()
    lathe = os.path.join(a.build, "lathe")
    tmp = tempfile.mkdtemp(prefix="lathe_bench_gpu_")
    batches = [int(b) for b in a.batches.split(",")]
    rng = np.random.default_rng(0)
    tokens = (a.steps + 2) * max(batches) * (a.seq + 1) + 1
    megatron_writer.write(os.path.join(tmp, "d"), [rng.integers(0, 50257, tokens)], dtype=np.uint16)
    flops_tok = 6 * N_PARAMS + 12 * L * a.seq * C
    print(f"GPT-2 124M bf16 (attention: {a.attention_kernel}), T={a.seq}, {a.steps} steps per B (median of steps 3..), cross-check "
          f"{flops_tok / 1e9:.2f} GFLOP/token vs {a.peak_tflops:.0f} TFLOP/s")
    print(f"{'B':>4} {'tokens/s':>10} {'ms/step':>9} {'MFU lathe':>10} {'MFU 6N+12LTC':>13}")
    for B in batches:
        out = os.path.join(tmp, f"b{B}")
        rec = {"model": {"preset": "gpt2-124m", "vocab_size": V, "attention_kernel": a.attention_kernel},
               "device": "cuda",
               "precision": {"compute": "bf16"},
               "data": {"train": os.path.join(tmp, "d"), "valid_fraction": 0.0},
               "optimizer": {"name": "adamw", "lr": 6e-4},
               "training": {"micro_batch_size": B, "seq_len": a.seq, "grad_accum_steps": 1, "steps": a.steps,
                            "eval_interval": 0, "log_interval": 1},
               "output": {"dir": out}}
        path = out + ".yaml"
        json.dump(rec, open(path, "w"))
        t0 = time.time()
        try:
            p = subprocess.run([lathe, "train", path], capture_output=True, text=True, timeout=a.timeout)
        except subprocess.TimeoutExpired:
            print(f"{B:>4} timed out after {a.timeout:.0f} s")
            continue
        if p.returncode != 0:
            err = [l for l in (p.stdout + p.stderr).splitlines() if "error" in l.lower()]
            print(f"{B:>4} failed (rc {p.returncode}, {time.time() - t0:.0f} s): {(err or [p.stderr[-300:]])[0][:300]}")
            continue
        recs = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl")) if l.strip()]
        steps = [r for r in recs if "loss" in r and "tokens_per_s" in r][2:]
        if not steps:
            print(f"{B:>4} no step metrics in {out}/metrics.jsonl")
            continue
        tok = statistics.median(r["tokens_per_s"] for r in steps)
        ms = statistics.median(r.get("ms_per_step", 0.0) for r in steps)
        mfu = statistics.median(r.get("mfu", 0.0) for r in steps)
        print(f"{B:>4} {tok:10.0f} {ms:9.1f} {100 * mfu:9.1f}% {100 * tok * flops_tok / (a.peak_tflops * 1e12):12.1f}%",
              flush=True)


if __name__ == "__main__":
    main()
