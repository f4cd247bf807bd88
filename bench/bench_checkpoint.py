#!/usr/bin/env python3
"""Checkpoint save throughput vs the disk's sequential write bandwidth.

  /usr/bin/python3 bench/bench_checkpoint.py [--lathe build/lathe] [--dir /tmp] [--steps 3]

1. Disk: `dd if=/dev/zero of=DIR/f bs=1M count=1424 oflag=direct conv=fsync` (O_DIRECT) and the
   same through the page cache (`conv=fsync` only, the path lathe's writes take); wall time of the
   whole command, fsync included.
2. lathe: `lathe train` of GPT-2 124M (seq_len 64, micro_batch 1) with output.checkpoint_every 1,
   so every step writes a complete, fsynced checkpoint of weights + AdamW moments (3 x 124.4M fp32
   = 1.49 GB). The seconds per save come from metrics.jsonl ("checkpoint_s": from the first byte
   to the updated `latest` pointer, fsyncs and renames included; keep_last 1 renames
   the previous checkpoint away (checkpoint_total_s) and a background thread deletes it).
dd and lathe alternate (--rounds times) because shared disks vary by 2x from one minute to the
next. Prints best and median of both and the ratios (target >= 70% of the O_DIRECT figure).
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "train"))
import megatron_writer  # noqa: E402


MIB = 1424  # about the size of the checkpoint (1.49 GB), so both write the same amount


def dd(path, direct):
    cmd = ["dd", "if=/dev/zero", f"of={path}", "bs=1M", f"count={MIB}", "conv=fsync"] + (["oflag=direct"] if direct else [])
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True)
    dt = time.perf_counter() - t0
    os.remove(path)
    return MIB * 1048576 / 1e6 / dt


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lathe", default=os.path.join(HERE, "..", "build", "lathe"))
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where to write (the disk under test)")
    ap.add_argument("--steps", type=int, default=3, help="steps = checkpoints written per round")
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="lathe_bench_ckpt_", dir=a.dir)
    direct, cached, saves, totals = [], [], [], []
    try:
        text = open(os.path.join(HERE, "..", "data", "tinyshakespeare.txt"), "rb").read()[:20000]
        data = os.path.join(work, "data")
        megatron_writer.write_text_bytes(data, text)
        recipe = os.path.join(work, "r.yaml")
        open(recipe, "w").write(f"""
model: {{preset: gpt2-124m}}
data: {{train: {data}, valid_fraction: 0.0}}
training: {{micro_batch_size: 1, seq_len: 64, steps: {a.steps}, eval_interval: 0, peak_gflops: 100}}
output: {{dir: {work}/run, checkpoint_every: 1, keep_last: 1}}
""")
        for _ in range(a.rounds):
            direct.append(dd(os.path.join(work, "dd.bin"), True))
            cached.append(dd(os.path.join(work, "dd.bin"), False))
            shutil.rmtree(os.path.join(work, "run"), ignore_errors=True)
            subprocess.run([a.lathe, "train", recipe, "--quiet"], check=True, capture_output=True)
            recs = [json.loads(l) for l in open(os.path.join(work, "run", "metrics.jsonl"))]
            saves += [r["checkpoint_s"] for r in recs if "checkpoint_s" in r]
            totals += [r["checkpoint_total_s"] for r in recs if "checkpoint_total_s" in r]
            last = os.path.join(work, "run", "checkpoints", f"step_{a.steps:08d}")
            size = sum(os.path.getsize(os.path.join(last, f)) for f in os.listdir(last))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = statistics.median
    fmt = lambda xs: ", ".join(f"{x:.0f}" for x in xs)  # noqa: E731
    mbps = [size / 1e6 / s for s in saves]
    print(f"disk: dd {MIB} MiB O_DIRECT+fsync: best {max(direct):.0f} MB/s, median {med(direct):.0f} (runs {fmt(direct)}); "
          f"page cache+fsync: best {max(cached):.0f}, median {med(cached):.0f} (runs {fmt(cached)})")
    print(f"lathe checkpoint GPT-2 124M + AdamW: {size / 1e6:.0f} MB; seconds to a complete checkpoint: "
          f"{', '.join(f'{s:.2f}' for s in saves)} -> best {min(saves):.2f} s ({max(mbps):.0f} MB/s), median "
          f"{med(saves):.2f} s ({med(mbps):.0f} MB/s); including moving the previous one away (deleted in the background): median {med(totals):.2f} s")
    print(f"ratio vs dd O_DIRECT: best/best {100 * max(mbps) / max(direct):.0f}%, median/median "
          f"{100 * med(mbps) / med(direct):.0f}% (target >= 70%)")
    print(json.dumps({"save_s": saves, "total_s": totals, "bytes": size, "dd_direct_mb_s": direct,
                      "dd_cached_mb_s": cached, "ratio_best": max(mbps) / max(direct),
                      "ratio_median": med(mbps) / med(direct)}))

if __name__ == "__main__":
    main()
