#!/usr/bin/env python3
"""Convergence: the quickstart (configs/quickstart.yaml, byte-level GPT-2 on tinyshakespeare,
600 steps) must reach a validation loss below a threshold derived from PyTorch.

The reference is tests/train/torch_quickstart_reference.py: the same model, data split and
hyper-parameters in plain PyTorch (its own init and shuffle). Measured there (torch 1.13.1,
2 threads, 2026-11-29): final validation loss 2.2527 over the 871 held-out windows. lathe with
seed 1234 measured 2.2496 on the same windows. The limit allows MARGIN for the different init
and data order of the two runs (a loss plateau of ~2.25 here, versus ~2.5 after a third of the
steps: a broken optimizer, schedule or gradient lands far above the limit).
"""
import json
import os
import subprocess
import sys
import tempfile

TORCH_VAL_LOSS = 2.2527  # tests/train/torch_quickstart_reference.py, 600 steps
MARGIN = 0.05

LATHE = os.environ.get("LATHE_BIN", "build/lathe")
SRC = os.environ.get("LATHE_SOURCE_DIR", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


def main():
    tmp = tempfile.mkdtemp(prefix="lathe_conv_")
    data = os.path.join(tmp, "shk")
    subprocess.run([LATHE, "tokenize", "--tokenizer", "byte", "--input", os.path.join(SRC, "data", "tinyshakespeare.txt"),
                    "--output", data, "--no-progress"], check=True)
    out = os.path.join(tmp, "run")
    p = subprocess.run([LATHE, "train", os.path.join(SRC, "configs", "quickstart.yaml"), "--set", f"data.train={data}",
                        "--set", f"output.dir={out}"], capture_output=True, text=True)
    print(p.stdout[-3000:], p.stderr[-2000:])
    if p.returncode != 0:
        return 1
    recs = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl"))]
    val = [r["val_loss"] for r in recs if "val_loss" in r][-1]
    limit = TORCH_VAL_LOSS + MARGIN
    print(f"lathe final validation loss {val:.4f}; PyTorch reference {TORCH_VAL_LOSS:.4f}; limit {limit:.4f}")
    ok = val < limit
    print("1 passed, 0 failed" if ok else "0 passed, 1 failed")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
