#!/usr/bin/env python3
"""Before/after bit-identity check for behaviour-preserving refactors (issue 24).

    python3 scripts/bit_identity.py LATHE_BINARY OUT_DIR      -> OUT_DIR/manifest.txt
    diff baseline/manifest.txt OUT_DIR/manifest.txt           (must print nothing)

Runs small trainings over the presets and layouts the tests cover (gpt2 / llama; fp32, bf16, fp16
with loss scaling; recompute; documents; eval tasks; anomaly rollback; resume; DP=2 ZeRO-1/2,
TP=2 + SP, PP=2, TP=2 x PP=2 under mpirun) and writes one line per output:
  - each checkpoint and model file: its SHA-256 (the bytes: weights, moments, state);
  - metrics.jsonl and anomalies.jsonl: SHA-256 of every record without wall-clock fields;
  - the log: SHA-256 of its lines without timing figures (log lines are behaviour too).
Files that hold the time or the machine (run_info.json, trace, timing fields) are left out and
named in the manifest as such, so the comparison is over everything deterministic.
"""
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "train"))
import megatron_writer  # noqa: E402
import numpy as np  # noqa: E402

# Record keys that measure time, speed or memory (machine-dependent), not the arithmetic.
TIMING_KEYS = re.compile(r"(_ms|_s|_s_total|_pct|_mb|_mib|_gb|_seconds|_time|xxh64)$|^(ms_|time|wall|elapsed|eta)|^bytes$|rss|mfu|"
                         r"gflops|throughput")
# Files whose bytes hold the time, host or absolute paths.
SKIP_FILES = {"run_info.json", "recipe.yaml", "trace.json", "train.log"}  # train.log: dates and pids in its markers
# Log text that varies from run to run: numbers followed by a time/speed unit, paths of the run.
LOG_NOISE = [re.compile(p) for p in (r"[0-9.]+ ?(ms|s|µs|us|min|h|tok/s|GFLOP/s|TFLOP/s|%|MiB|GiB|KiB|MB|GB|B/s|GB/s)(?![A-Za-z])",
                                     r"ETA [0-9:]+", r"[0-9.]+ (tokens/s|Gbit/s|GB/s|GFLOP/s)",
                                     r"\d{4}-\d\d-\d\dT[\d:.]+Z?", r"mfu [0-9.]+", r"pid \d+")]


def sha(b):
    return hashlib.sha256(b).hexdigest()[:16]


def safetensors_hash(path):
    """The tensors (name, dtype, shape, bytes) and metadata of a safetensors file, not its layout:
    lathe's O_DIRECT writer pads the header and adds __lathe_pad__ tensors so each tensor keeps its
    memory address modulo 4096, which differs from run to run (train/checkpoint.cpp)."""
    import struct
    b = open(path, "rb").read()
    n = struct.unpack("<Q", b[:8])[0]
    head = json.loads(b[8:8 + n])
    h = hashlib.sha256(json.dumps(head.get("__metadata__"), sort_keys=True).encode())
    for name in sorted(k for k in head if k != "__metadata__" and not k.startswith("__lathe_pad__/")):
        e = head[name]
        lo, hi = e["data_offsets"]
        h.update(json.dumps([name, e["dtype"], e["shape"]]).encode())
        h.update(b[8 + n + lo:8 + n + hi])
    return h.hexdigest()[:16]


def without_timing(v):
    if isinstance(v, dict):
        return {k: without_timing(x) for k, x in v.items() if not TIMING_KEYS.search(k)}
    if isinstance(v, list):
        return [without_timing(x) for x in v]
    return v


def record_hash(path):
    lines = []
    for l in open(path):
        r = json.loads(l.replace(ROOT[0], "ROOT"))
        lines.append(json.dumps(without_timing(r), sort_keys=True))
    return sha("\n".join(lines).encode())


def log_hash(text, root):
    keep = []
    for l in text.splitlines():
        l = l.replace(root, "ROOT")
        for p in LOG_NOISE:
            l = p.sub("#", l)
        keep.append(l)
    return sha("\n".join(keep).encode()), len(keep)


def manifest_of(name, out, log, root):
    rows = []
    h, n = log_hash(log, root)
    rows.append(f"{name} log {h} ({n} lines)")
    for dp, dns, fns in sorted(os.walk(out)):
        dns.sort()
        for f in sorted(fns):
            p = os.path.join(dp, f)
            rel = os.path.relpath(p, out)
            if "trace" in rel.split(os.sep)[0] or f in SKIP_FILES or f.endswith(".yaml"):
                rows.append(f"{name} {rel} (skipped: time/host/paths)")
            elif f.endswith(".safetensors"):
                rows.append(f"{name} {rel} tensors {safetensors_hash(p)}")
            elif f.endswith(".jsonl"):
                rows.append(f"{name} {rel} records {record_hash(p)}")
            elif f == "state.json":
                # state.json carries the save time; everything else in it is the run's state.
                st = json.loads(open(p).read().replace(root, "ROOT"))
                clean = without_timing(st.get("body", st))
                text = json.dumps(clean, sort_keys=True).replace(root, "ROOT")
                rows.append(f"{name} {rel} state {sha(text.encode())}")
            else:
                rows.append(f"{name} {rel} {sha(open(p, 'rb').read().replace(root.encode(), b'ROOT'))}")
    return rows


ROOT = [""]


def main():
    lathe, root = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
    ROOT[0] = root
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    rng = np.random.default_rng(11)
    eod = 95
    docs = []
    for d in range(48):
        n = int(rng.integers(40, 300))
        docs.append(list((np.arange(n) * (d % 7 + 1) + rng.integers(0, 3, n)) % 95) + [eod])
    data = os.path.join(root, "data")
    megatron_writer.write(data, docs)
    tasks = os.path.join(root, "tasks.jsonl")
    with open(tasks, "w") as f:
        for i in range(12):
            ctx = [int(x) for x in rng.integers(0, 95, 6)]
            ends = [[int(x) for x in rng.integers(0, 95, 3)] for _ in range(3)]
            f.write(json.dumps({"context_ids": ctx, "ending_ids": ends, "label": i % 3}) + "\n")

    env1 = dict(os.environ, OMP_NUM_THREADS="2", LATHE_PROGRESS="0")
    envm = dict(os.environ, OMP_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                OMPI_MCA_rmaps_base_oversubscribe="1", LATHE_PROGRESS="0")

    def recipe(name, preset="gpt2-debug", steps=6, training=None, **sections):
        out = os.path.join(root, name)
        t = {"micro_batch_size": 4, "seq_len": 64, "grad_accum_steps": 2, "steps": steps, "eval_interval": 3,
             "eval_batches": 2, "log_interval": 1, "peak_gflops": 100, "seed": 5}
        t.update(training or {})
        r = {"model": {"preset": preset, "vocab_size": 96}, "data": {"train": data, "valid_fraction": 0.1},
             "optimizer": {"name": "adamw", "lr": 3e-3, "grad_clip": 1.0},
             "schedule": {"name": "cosine", "warmup_steps": 2}, "training": t,
             "output": {"dir": out, "checkpoint_every": 3}}
        for k, v in sections.items():
            if "__" in k:
                sec, key = k.split("__")
                r.setdefault(sec, {})[key] = v
            else:
                r[k] = v
        with open(out + ".yaml", "w") as f:
            json.dump(r, f)
        return out

    DEVICE = {"LATHE_TEST_DEVICE_PATH_ON_HOST": "1"}
    runs = [
        # (name, output dir, processes, extra environment)
        ("gpt2_fp32", recipe("gpt2_fp32"), 1, {}),
        ("llama_fp32", recipe("llama_fp32", "llama-debug"), 1, {}),
        ("gpt2_bf16", recipe("gpt2_bf16", precision__compute="bf16"), 1, {}),
        ("llama_fp16", recipe("llama_fp16", "llama-debug", precision__compute="fp16"), 1, {}),
        ("gpt2_recompute", recipe("gpt2_recompute", recompute="full"), 1, {}),
        ("llama_docs", recipe("llama_docs", "llama-debug", data__attention="document", data__reset_position_ids=True,
                              data__mask_loss_after_eod=True, data__eod_token=eod), 1, {}),
        ("gpt2_tasks", recipe("gpt2_tasks", training={"eval_tasks": tasks, "eval_tasks_interval": 3}), 1, {}),
        ("gpt2_lamb_wsd", recipe("gpt2_lamb_wsd", optimizer__name="lamb", schedule__name="wsd"), 1, {}),
        ("gpt2_dp2_zero1", recipe("gpt2_dp2_zero1", training={"micro_batch_size": 2}, parallel__zero=1), 2, {}),
        ("llama_dp2_zero2", recipe("llama_dp2_zero2", "llama-debug", training={"micro_batch_size": 2},
                                   parallel__zero=2), 2, {}),
        ("gpt2_tp2_sp", recipe("gpt2_tp2_sp", parallel__tensor=2, parallel__sequence=True), 2, {}),
        ("llama_pp2", recipe("llama_pp2", "llama-debug", parallel__pipeline=2), 2, {}),
        ("gpt2_tp2_pp2", recipe("gpt2_tp2_pp2", parallel__tensor=2, parallel__pipeline=2), 4, {}),
        # The device step path on the host (parallel/dist_optimizer.h's test hook: CPU model, device wiring).
        ("dev_gpt2_dp2_zero1", recipe("dev_gpt2_dp2_zero1", training={"micro_batch_size": 2}, parallel__zero=1), 2,
         DEVICE),
        ("dev_llama_tp2", recipe("dev_llama_tp2", "llama-debug", parallel__tensor=2), 2, DEVICE),
        ("dev_gpt2_one", recipe("dev_gpt2_one", precision__compute="bf16"), 1, DEVICE),
    ]
    rows = []
    for name, out, np_, extra_env in runs:
        cmd = ([shutil.which("mpirun"), "-np", str(np_)] if np_ > 1 else []) + [lathe, "train", out + ".yaml"]
        env = dict(envm if np_ > 1 else env1, **extra_env)
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
        if extra_env is DEVICE and "trains through the device path" not in p.stderr:
            rows.append(f"{name} FAILED: the device path on the host was not taken")
            print(rows[-1], flush=True)
            continue
        if p.returncode != 0:
            rows.append(f"{name} FAILED rc={p.returncode}: {p.stderr.strip()[-300:]}")
            print(rows[-1], flush=True)
            continue
        rows += manifest_of(name, out, p.stdout, root)
        print(f"{name}: ok", flush=True)

    # Resume: a copy of gpt2_fp32 cut back to its step-3 checkpoint, resumed to the end.
    res = os.path.join(root, "gpt2_resume")
    src = os.path.join(root, "gpt2_fp32")
    if os.path.isdir(src):
        shutil.copytree(src, res)
        ck = os.path.join(res, "checkpoints")
        for n in os.listdir(ck):
            if not n.startswith("step_00000003"):
                shutil.rmtree(os.path.join(ck, n), ignore_errors=True)
        for n in ("model", "metrics.jsonl"):
            p = os.path.join(res, n)
            shutil.rmtree(p) if os.path.isdir(p) else (os.remove(p) if os.path.exists(p) else None)
        p = subprocess.run([lathe, "train", os.path.join(root, "gpt2_fp32.yaml"), "--resume", "auto", "--set",
                            f"output.dir={res}"], capture_output=True, text=True, env=env1, timeout=900)
        rows += ([f"gpt2_resume FAILED rc={p.returncode}: {p.stderr.strip()[-300:]}"] if p.returncode
                 else manifest_of("gpt2_resume", res, p.stdout, root))

    # Anomaly rollback with injected loss spikes (LATHE_TEST_* are read by the CLI).
    an = recipe("gpt2_anomaly", steps=12, training={"anomaly": {
        "enabled": True, "warmup_steps": 4, "grad_norm_z_threshold": 0, "lr_steps": 2, "lr_factor": 0.25,
        "rollback_after": 2, "rollback_window": 3, "max_rollbacks": 2}, "eval_interval": 0}, schedule__name="constant")
    p = subprocess.run([lathe, "train", an + ".yaml"], capture_output=True, text=True, timeout=900,
                       env=dict(env1, LATHE_TEST_LOSS_SPIKE_STEPS="7,8"))
    rows += ([f"gpt2_anomaly FAILED rc={p.returncode}: {p.stderr.strip()[-300:]}"] if p.returncode
             else manifest_of("gpt2_anomaly", an, p.stdout, root))

    with open(os.path.join(root, "manifest.txt"), "w") as f:
        f.write("\n".join(rows) + "\n")
    failed = [r for r in rows if " FAILED " in r]
    print(f"{len(rows)} manifest lines, {len(failed)} failed runs -> {os.path.join(root, 'manifest.txt')}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
