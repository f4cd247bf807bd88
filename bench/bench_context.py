#!/usr/bin/env python3
"""Context parallelism on this machine (issue 27): a small Llama (4 layers, hidden 256, 4 heads of 64,
2 kv heads, GQA, RoPE) trained on 1 sample of T tokens per step, T = 1024, 2048, 4096, by

  context 1: one process with the machine's threads (--threads, default 2),
  context 2 and 4 under mpirun (1 OpenMP thread per rank; context 4 on a 2-core machine shares
             the cores: the ranks wait for each other's compute, so its exposed communication is
             mostly oversubscription, not the network), ring and all-gather,

and, beside them, PyTorch 1.13 in one process (transformers' LlamaForCausalLM, the same shapes,
AdamW, the same threads) as the single-process peer.

  /usr/bin/python3 bench/bench_context.py [--build build] [--seq 1024,2048,4096] [--steps 4]
                                          [--contexts 1,2,4] [--threads 2] [--no-torch]

Prints the CPU model, then per T and layout: ms/step and tokens/s of the whole group (median of the
steps after the first), context_comm_exposed_ms (median per step: the waits for the ring's K/V and
dK/dV, the all-gathers and reduce-scatters that compute did not hide), and the peak RSS of the
largest rank during training (train_peak_rss_mb_max_rank; the activation part falls about 1/N with
the rows each rank holds, the weights, gradients and optimizer state do not).
"""
import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "train"))
import megatron_writer  # noqa: E402

VOCAB = 512
SHAPE = {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 688, "vocab_size": VOCAB}


def cpu_model():
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def lathe_run(a, tmp, env, T, ctx, impl):
    out = os.path.join(tmp, f"T{T}_c{ctx}_{impl}")
    threads = a.threads if ctx == 1 else 1
    model = dict(SHAPE, preset="llama-debug", max_position_embeddings=T)
    rec = {"model": model, "data": {"train": os.path.join(tmp, "d"), "valid_fraction": 0.0},
           "optimizer": {"name": "adamw", "lr": 1e-4},
           "training": {"micro_batch_size": 1, "seq_len": T, "grad_accum_steps": 1, "steps": a.steps,
                        "eval_interval": 0, "threads": threads, "log_interval": 1},
           "parallel": {"context": ctx, "context_impl": impl} if ctx > 1 else {},
           "output": {"dir": out}}
    path = out + ".yaml"
    json.dump(rec, open(path, "w"))
    cmd = (["mpirun", "-np", str(ctx), "--bind-to", "none"] if ctx > 1 else []) + [os.path.join(a.build, "lathe"),
                                                                                  "train", path, "--quiet"]
    p = subprocess.run(cmd, capture_output=True, text=True, env=dict(env, OMP_NUM_THREADS=str(threads)))
    if p.returncode != 0:
        err = [l for l in (p.stdout + p.stderr).splitlines() if "error" in l.lower()]
        return f"failed: {(err or [p.stderr[-200:]])[0][:160]}"
    recs = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl"))]
    steps = [r for r in recs if "loss" in r][1:]
    end = [r for r in recs if "train_peak_rss_mb_max_rank" in r]
    res = {"ms": statistics.median(r["ms_per_step"] for r in steps),
           "exposed_ms": statistics.median(r.get("context_comm_exposed_ms", 0.0) for r in steps),
           "rss_mb": end[-1]["train_peak_rss_mb_max_rank"] if end else float("nan")}
    res["tok_s"] = T / res["ms"] * 1e3
    shutil.rmtree(out, ignore_errors=True)
    return res


def torch_run(T, steps, threads):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=SHAPE["hidden_size"], intermediate_size=SHAPE["intermediate_size"],
                      num_hidden_layers=SHAPE["num_hidden_layers"], num_attention_heads=SHAPE["num_attention_heads"],
                      num_key_value_heads=SHAPE["num_key_value_heads"], max_position_embeddings=T,
                      attn_implementation="eager")
    m = LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    x = torch.randint(0, VOCAB, (1, T))
    times = []
    for _ in range(steps):
        t0 = time.time()
        loss = m(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.time() - t0)
    ms = statistics.median(times[1:]) * 1e3
    return {"ms": ms, "tok_s": T / ms * 1e3}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=os.path.join(HERE, "..", "build"))
    ap.add_argument("--seq", default="1024,2048,4096")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--contexts", default="1,2,4")
    ap.add_argument("--threads", type=int, default=2, help="threads of the one-process runs (lathe and torch)")
    ap.add_argument("--no-torch", action="store_true")
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="lathe_bench_ctx_")
    seqs = [int(s) for s in a.seq.split(",")]
    rng = np.random.default_rng(0)
    megatron_writer.write(os.path.join(tmp, "d"), [rng.integers(0, VOCAB, (a.steps + 2) * (max(seqs) + 1) * 2)],
                          dtype=np.uint16)
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1")
    print(f"CPU: {cpu_model()}, {os.cpu_count()} cores; Llama {SHAPE}; 1 sample of T tokens a step, "
          f"{a.steps} steps (median of steps 2..); context 1: 1 process x {a.threads} threads, context N: "
          f"N processes x 1 thread")
    print(f"{'T':>5} {'layout':<18} {'ms/step':>9} {'tok/s':>8} {'exposed ms':>11} {'peak RSS MB/rank':>17}")
    for T in seqs:
        for ctx in [int(c) for c in a.contexts.split(",")]:
            for impl in (["ring"] if ctx == 1 else ["ring", "allgather"]):
                name = "context 1" if ctx == 1 else f"context {ctx} {impl}"
                r = lathe_run(a, tmp, env, T, ctx, impl)
                if isinstance(r, str):
                    print(f"{T:>5} {name:<18} {r}")
                    continue
                print(f"{T:>5} {name:<18} {r['ms']:9.0f} {r['tok_s']:8.0f} {r['exposed_ms']:11.1f} "
                      f"{r['rss_mb']:17.0f}", flush=True)
        if not a.no_torch:
            try:
                r = torch_run(T, a.steps, a.threads)
                print(f"{T:>5} {'torch 1 process':<18} {r['ms']:9.0f} {r['tok_s']:8.0f} {'-':>11} {'-':>17}",
                      flush=True)
            except Exception as e:  # noqa: BLE001 (the peer is optional: say why it is missing)
                print(f"{T:>5} torch: {type(e).__name__}: {e}"[:200])
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
