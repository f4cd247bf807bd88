#!/usr/bin/env python3
"""fp32 training gives the same bits on any thread count, so its thread count may follow load that
arrives mid-run (core/parallel.h reduction parts, train/run_control.h, core/blas_env.h LoadFollower;
issue 22 item 5). For every family preset (B=4, T=64, 6 AdamW steps, enough rows that the norms'
parameter-gradient reductions fork), the saved model and the losses of
  * 2 threads (LATHE_FOLLOW_LOAD=0),
  * 1 thread with LATHE_REDUCTION_PARTS=2 (another machine's core count, the same parts),
  * 2 threads switched to 2, 1, 3, 2, 1, 3 threads step by step (LATHE_TEST_THREAD_CYCLE)
are equal byte for byte; the same with full recompute and with document attention. Then a real
late load: busy processes (2 per CPU) start once step 2 is logged; the run says once that it went on
with 1 thread and its model equals the unswitched one. Before the reduction parts, 1 and 2 threads
differed in the last bits of every family (the norms' partials and the lm head's tile width
followed the thread count)."""
import hashlib
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from train_helpers import LATHE, check, finish, losses, patterned_data, write_recipe  # noqa: E402

try:
    import numpy as np
except ImportError as e:  # the test extras are missing here: skipped, with the reason
    print(f"skip: {e}")
    sys.exit(77)

FAMILIES = ["gpt2-debug", "llama-debug", "qwen3-debug", "gemma2-debug", "phi3-debug", "gpt-neox-debug",
            "olmo2-debug", "mixtral-debug", "qwen2-moe-debug"]
NOTE = "running 1 thread(s) instead of 2"
BASE_ENV = {k: v for k, v in os.environ.items()
            if k not in ("LATHE_FOLLOW_LOAD", "LATHE_REDUCTION_PARTS", "LATHE_TEST_THREAD_CYCLE", "OMP_NUM_THREADS")}
RUNS = {
    "2 threads": {"OMP_NUM_THREADS": "2", "LATHE_FOLLOW_LOAD": "0"},
    "1 thread, 2 parts": {"OMP_NUM_THREADS": "1", "LATHE_REDUCTION_PARTS": "2"},
    "2-1-3 threads by step": {"OMP_NUM_THREADS": "2", "LATHE_TEST_THREAD_CYCLE": "2,1,3"},
}


def busy():
    while True:
        pass


def train(out, dataset, env, model, steps=6, load_at=None, data_extra=None, **sections):
    """Runs one recipe; returns (model bytes' md5, losses, stdout). load_at: the step after whose log
    line 2 x CPUs busy processes start (they stop when the run ends)."""
    rec = write_recipe(out, dataset, {"micro_batch_size": 4, "seq_len": 64, "steps": steps, "eval_interval": 0,
                                   "log_interval": 1}, model=model, **sections)
    if data_extra:  # more keys of the data section (write_recipe writes train and valid_fraction)
        r = json.load(open(rec))
        r["data"].update(data_extra)
        json.dump(r, open(rec, "w"))
    p = subprocess.Popen([LATHE, "train", rec, "--overwrite"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, env=dict(BASE_ENV, **env))
    text, procs = "", []
    try:
        for line in p.stdout:
            text += line
            if load_at is not None and not procs and line.startswith(f"step {load_at:>6}/"):
                procs = [multiprocessing.Process(target=busy, daemon=True)
                         for _ in range(2 * len(os.sched_getaffinity(0)))]
                for q in procs:
                    q.start()
        p.wait(timeout=600)
    finally:
        for q in procs:
            q.terminate()
            q.join()
    if p.returncode != 0:
        raise AssertionError(f"lathe train {rec} failed ({p.returncode}):\n{text[-2000:]}")
    with open(os.path.join(out, "model", "model.safetensors"), "rb") as f:
        digest = hashlib.md5(f.read()).hexdigest()
    return digest, losses(out), text


def same_bits(tag, dataset, model, **sections):
    got = {name: train(os.path.join(dataset + "_runs", f"{tag.replace(' ', '_')}_{i}"), dataset, env, model,
                       **sections)
           for i, (name, env) in enumerate(RUNS.items())}
    ref = got["2 threads"]
    for name, (digest, ls, text) in got.items():
        if name == "2 threads":
            continue
        check(digest == ref[0] and ls == ref[1],
              f"{tag}: {name} == 2 threads, model and losses bit for bit"
              + ("" if ls == ref[1] else f" (losses {ls[:3]} vs {ref[1][:3]})"))
    check(all(NOTE not in t for _, _, t in got.values()), f"{tag}: no load note (the follower is off in these runs)")


tmp = tempfile.mkdtemp(prefix="lathe_thread_follow_")
data = patterned_data(tmp, np.random.default_rng(0))
os.makedirs(data + "_runs")
for fam in FAMILIES:
    same_bits(fam, data, {"preset": fam, "vocab_size": 96})
same_bits("llama-debug recompute full", data, {"preset": "llama-debug", "vocab_size": 96}, recompute="full")
# Document attention, token 0 (about one in 96 tokens) ending the documents.
same_bits("gpt2-debug document attention", data, {"preset": "gpt2-debug", "vocab_size": 96},
          data_extra={"attention": "document", "eod_token": 0})
same_bits("llama-debug 40 steps", data, {"preset": "llama-debug", "vocab_size": 96}, steps=40)

# Real load, arriving after step 2 of a longer run (the follower decides on the median of 5 samples
# 50 ms apart, so the run needs a few hundred milliseconds under load).
steps = 400
quiet = train(os.path.join(data + "_runs", "late_quiet"), data, RUNS["2 threads"],
              {"preset": "llama-debug", "vocab_size": 96}, steps=steps)
late = train(os.path.join(data + "_runs", "late_load"), data, {"OMP_NUM_THREADS": "2", "GOMP_SPINCOUNT": "20000"},
             {"preset": "llama-debug", "vocab_size": 96}, steps=steps, load_at=2)
check(late[2].count(NOTE) == 1,
      f"late load: said once that it went on with 1 thread ({late[2].count(NOTE)} times; "
      f"{[l for l in late[2].splitlines() if 'note' in l][:3]})")
check(late[0] == quiet[0] and late[1] == quiet[1], "late load: switched 2 -> 1 mid-run == unswitched, bit for bit")
# bf16 keeps its thread count (oneDNN's 16-bit GEMMs may split K by thread count): no note.
bf16 = train(os.path.join(data + "_runs", "late_bf16"), data, {"OMP_NUM_THREADS": "2", "GOMP_SPINCOUNT": "20000"},
             {"preset": "llama-debug", "vocab_size": 96}, steps=100, load_at=2, precision={"compute": "bf16"})
check(NOTE not in bf16[2], "bf16 under late load keeps 2 threads (no note)")
sys.exit(finish(tmp))
