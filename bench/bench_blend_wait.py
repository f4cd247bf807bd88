#!/usr/bin/env python3
"""Data wait with a blend (issue 11): `lathe train` on a blend of 3 datasets vs one dataset, same
model (GPT-2 L=4 C=256, B=8, T=256, 2 threads, 40 steps); prints the mean and max data_wait_pct of
metrics.jsonl (step 1 excluded: the prefetcher starts with the run) and the median step time.
Run: /usr/bin/python3 bench/bench_blend_wait.py [--lathe build/lathe] [--steps 40]"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "train"))
import megatron_writer  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lathe", default=os.path.join(HERE, "..", "build", "lathe"))
    ap.add_argument("--steps", type=int, default=40)
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="lathe_blend_wait_")
    rng = np.random.default_rng(1)
    for name, n, lo in (("web", 400, 0), ("code", 200, 100), ("books", 50, 200)):
        megatron_writer.write(os.path.join(tmp, name), [rng.integers(lo, lo + 50, rng.integers(100, 2000)) for _ in range(n)])
    blend = [{"prefix": os.path.join(tmp, n), "weight": w} for n, w in (("web", 0.6), ("code", 0.3), ("books", 0.1))]
    for tag, data in (("blend of 3", {"blend": blend}), ("one dataset", {"train": blend[0]["prefix"], "valid_fraction": 0})):
        out = os.path.join(tmp, tag.replace(" ", "_"))
        r = {"model": {"preset": "gpt2-debug", "vocab_size": 256, "n_embd": 256, "n_layer": 4, "n_head": 4,
                       "n_positions": 256},
             "data": data, "optimizer": {"name": "adamw", "lr": 1e-3}, "schedule": {"name": "constant"},
             "training": {"micro_batch_size": 8, "seq_len": 256, "steps": a.steps, "eval_interval": 0,
                          "peak_gflops": 100, "threads": 2},
             "output": {"dir": out}}
        json.dump(r, open(out + ".yaml", "w"))
        subprocess.run([a.lathe, "train", out + ".yaml", "--quiet"], check=True,
                       env=dict(os.environ, OMP_WAIT_POLICY="PASSIVE"))
        m = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl")) if '"data_wait_pct"' in l][1:]
        w = [x["data_wait_pct"] for x in m]
        print(f"{tag:>12}: data wait mean {np.mean(w):.3f}% max {np.max(w):.3f}% of the step | "
              f"step {np.median([x['ms_per_step'] for x in m]):.0f} ms (median of {len(m)})")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
