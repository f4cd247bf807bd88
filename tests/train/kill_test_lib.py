"""Shared helpers of the checkpoint tests (test_checkpoint_resume.py, test_checkpoint_kill.py):
tiny byte-level data, a recipe, running `lathe train`, reading losses, and an independent
pure-Python XXH64 (from the xxHash spec) to check the checksums lathe records in state.json."""
import json
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import megatron_writer  # noqa: E402

LATHE = os.environ.get("LATHE_BIN", "build/lathe")
SRC = os.environ.get("LATHE_SOURCE_DIR", os.path.join(HERE, "..", ".."))

# Passive OpenMP waiting: the tests run beside other jobs on few cores, where spinning workers
# slow everything down (results do not depend on it).
ENV = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
ENV.pop("LATHE_TEST_CKPT_SLEEP_MS", None)

RECIPE = """
model: {{preset: gpt2-debug, vocab_size: 256}}
data: {{train: {data}, valid_fraction: 0.1, prefetch: 2}}
optimizer: {{name: {opt}, lr: 3.0e-3, grad_clip: 1.0}}
schedule: {{name: cosine, warmup_steps: 2, min_lr: 1.0e-4}}
training: {{micro_batch_size: 4, seq_len: 32, steps: {steps}, seed: 7, eval_interval: 0, eval_batches: 2,
           peak_gflops: 100, threads: {threads}, grad_accum_steps: {accum}, log_interval: 1}}
output: {{dir: {out}, checkpoint_every: {every}, keep_last: {keep}}}
"""


# A 4-step gpt2-debug run (str.format with data=PREFIX, out=DIR) that the hostile-input tests of
# train and checkpoints start from.
HOSTILE_RECIPE = """
model: {{preset: gpt2-debug, vocab_size: 256}}
data: {{train: {data}, valid_fraction: 0.1, prefetch: 0}}
optimizer: {{name: adamw, lr: 3.0e-3}}
schedule: {{name: constant}}
training: {{micro_batch_size: 2, seq_len: 16, steps: 4, seed: 7, eval_interval: 0, peak_gflops: 100, threads: 1}}
output: {{dir: {out}}}
"""


def hostile_recipe(tmp, data, name, extra="", out=None):
    """TMP/NAME.yaml: HOSTILE_RECIPE on `data` into `out` (TMP/out_NAME unless given), plus the YAML
    lines `extra`. Returns the path."""
    p = os.path.join(tmp, name + ".yaml")
    with open(p, "w") as f:
        f.write(HOSTILE_RECIPE.format(data=data, out=out or os.path.join(tmp, "out_" + name)) + extra)
    return p


def make_data(tmp, name, nbytes):
    text = open(os.path.join(SRC, "data", "tinyshakespeare.txt"), "rb").read()[:nbytes]
    prefix = os.path.join(tmp, name)
    megatron_writer.write_text_bytes(prefix, text)
    return prefix


def write_recipe(tmp, name, data, out, steps=20, opt="adamw", every=0, keep=0, threads=1, accum=1):
    path = os.path.join(tmp, name + ".yaml")
    open(path, "w").write(RECIPE.format(data=data, out=out, steps=steps, opt=opt, every=every, keep=keep,
                                        threads=threads, accum=accum))
    return path


def run(args, ok=True, env=None):
    p = subprocess.run([LATHE] + args, capture_output=True, text=True, env=env or ENV)
    if ok and p.returncode != 0:
        raise RuntimeError(f"lathe {' '.join(args)} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    return p


def losses(out):
    """step -> loss from metrics.jsonl (every step must appear once)."""
    d = {}
    for line in open(os.path.join(out, "metrics.jsonl")):
        r = json.loads(line)
        if "loss" in r:
            assert r["step"] not in d, f"step {r['step']} twice in {out}/metrics.jsonl"
            d[r["step"]] = r["loss"]
    return d


def step_dirs(out):
    root = os.path.join(out, "checkpoints")
    if not os.path.isdir(root):
        return []
    return sorted(int(n[5:]) for n in os.listdir(root) if re.fullmatch(r"step_\d{8}", n))


# ---- XXH64, written from the xxHash specification (independent of src/train/checkpoint.cpp) ----
M64 = (1 << 64) - 1
P1, P2, P3, P4, P5 = (0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0x85EBCA77C2B2AE63,
                      0x27D4EB2F165667C5)


def _rotl(x, r):
    return ((x << r) | (x >> (64 - r))) & M64


def _round(acc, lane):
    return (_rotl((acc + lane * P2) & M64, 31) * P1) & M64


def xxh64(data, seed=0):
    n = len(data)
    i = 0
    if n >= 32:
        v1, v2, v3, v4 = (seed + P1 + P2) & M64, (seed + P2) & M64, seed, (seed - P1) & M64
        import struct
        words = struct.unpack_from("<%dQ" % (n // 32 * 4), data)
        for k in range(0, len(words), 4):
            v1 = _round(v1, words[k])
            v2 = _round(v2, words[k + 1])
            v3 = _round(v3, words[k + 2])
            v4 = _round(v4, words[k + 3])
        i = n // 32 * 32
        h = (_rotl(v1, 1) + _rotl(v2, 7) + _rotl(v3, 12) + _rotl(v4, 18)) & M64
        for v in (v1, v2, v3, v4):
            h = ((h ^ _round(0, v)) * P1 + P4) & M64
    else:
        h = (seed + P5) & M64
    h = (h + n) & M64
    while i + 8 <= n:
        h = (_rotl(h ^ _round(0, int.from_bytes(data[i:i + 8], "little")), 27) * P1 + P4) & M64
        i += 8
    if i + 4 <= n:
        h = (_rotl(h ^ ((int.from_bytes(data[i:i + 4], "little") * P1) & M64), 23) * P2 + P3) & M64
        i += 4
    while i < n:
        h = (_rotl(h ^ ((data[i] * P5) & M64), 11) * P1) & M64
        i += 1
    h ^= h >> 33
    h = (h * P2) & M64
    h ^= h >> 29
    h = (h * P3) & M64
    h ^= h >> 32
    return h


assert xxh64(b"") == 0xEF46DB3751D8E999  # published vector


def verify_independently(ckpt_dir):
    """Re-checks a checkpoint the way an outside tool would: every file listed in state.json has
    the recorded size and XXH64. Returns the state body."""
    doc = json.load(open(os.path.join(ckpt_dir, "state.json")))
    body = doc["body"]
    # (body_xxh64 covers nlohmann's compact dump of the body, whose float spelling Python does not
    # reproduce; the C++ tests flip bytes of state.json to check it.)
    for name, meta in body["files"].items():
        blob = open(os.path.join(ckpt_dir, name), "rb").read()
        assert len(blob) == meta["bytes"], f"{ckpt_dir}/{name}: size {len(blob)} != {meta['bytes']}"
        assert format(xxh64(blob), "016x") == meta["xxh64"], f"{ckpt_dir}/{name}: xxh64 mismatch"
    return body


def read_tensors(path):
    """name -> (dtype, shape, raw bytes) of a safetensors file, without lathe's alignment pads."""
    import struct
    blob = open(path, "rb").read()
    n = struct.unpack("<Q", blob[:8])[0]
    header = json.loads(blob[8:8 + n])
    out = {}
    for name, t in header.items():
        if name == "__metadata__" or name.startswith("__lathe_pad__/"):
            continue
        a, b = t["data_offsets"]
        out[name] = (t["dtype"], t["shape"], blob[8 + n + a:8 + n + b])
    return out
