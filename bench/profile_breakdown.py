#!/usr/bin/env python3
"""Where a training step's time goes, per kernel kind, from lathe's own profiler (issue 9).

  /usr/bin/python3 bench/profile_breakdown.py [--build build] [--preset gpt2-small-bench] [--B 4] [--T 64]
         [--dtype fp32] [--steps 6] [--threads 2]

Trains `steps` steps of the preset on random tokens with --profile-steps over the last half, reads
OUTPUT/trace/rank00000.json and prints, per kernel kind (the `kernel` spans of the traced op table:
matmul_forward, attention_backward, lm_head_loss, ...) and for the optimizer, the total time and
its share of the step spans; GEMM FLOPs are not separated from the lm head here: lm_head_loss is
its own fused kernel (logits GEMM + softmax/CE + two GEMMs). The remainder is everything outside
those spans (data, hooks, bookkeeping).
"""
import argparse
import collections
import json
import os
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
    ap.add_argument("--preset", default="gpt2-small-bench")
    ap.add_argument("--B", type=int, default=4)
    ap.add_argument("--T", type=int, default=64)
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="lathe_prof_")
    rng = np.random.default_rng(0)
    megatron_writer.write(os.path.join(tmp, "data"), [rng.integers(0, 50257, 4096) for _ in range(64)])
    out = os.path.join(tmp, "run")
    recipe = os.path.join(tmp, "r.yaml")
    with open(recipe, "w") as f:
        json.dump({"model": {"preset": a.preset}, "data": {"train": os.path.join(tmp, "data"), "valid_fraction": 0.05},
                   "precision": {"compute": a.dtype},
                   "training": {"micro_batch_size": a.B, "seq_len": a.T, "steps": a.steps, "eval_interval": 0,
                                "threads": a.threads, "log_interval": 1},
                   "output": {"dir": out}}, f)
    first = a.steps // 2 + 1
    lathe = os.path.join(a.build, "lathe")
    subprocess.run([lathe, "train", recipe, "--quiet", "--profile-steps", f"{first}-{a.steps}"], check=True,
                   env=dict(os.environ, OMP_NUM_THREADS=str(a.threads)))
    ev = json.load(open(os.path.join(out, "trace", "rank00000.json")))
    ev = ev["traceEvents"] if isinstance(ev, dict) else ev
    spans = [e for e in ev if e.get("ph") == "X"]
    step_us = sum(e["dur"] for e in spans if e["name"] == "step")
    by = collections.defaultdict(float)
    for e in spans:
        if e.get("cat") == "kernel" or e["name"] in ("grad norm + optimizer",):
            by[e["name"]] += e["dur"]
    nsteps = a.steps - first + 1
    print(f"{a.preset} B={a.B} T={a.T} {a.dtype}, {a.threads} threads: {step_us / nsteps / 1e3:.1f} ms/step "
          f"over {nsteps} profiled steps")
    print(f"{'span':<28} {'ms/step':>9} {'share':>7}")
    total = 0.0
    for name, us in sorted(by.items(), key=lambda kv: -kv[1]):
        total += us
        print(f"{name:<28} {us / nsteps / 1e3:>9.2f} {100 * us / step_us:>6.1f}%")
    print(f"{'(outside these spans)':<28} {(step_us - total) / nsteps / 1e3:>9.2f} {100 * (step_us - total) / step_us:>6.1f}%")


if __name__ == "__main__":
    main()
