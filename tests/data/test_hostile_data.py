#!/usr/bin/env python3
"""Hostile corpora, datasets and command lines (issue 14) through `lathe tokenize`, `lathe eval`,
`lathe encode` and `lathe decode`. Every case failed before its fix (exit 0 with part of the data, a
hang, a wrapped or defaulted value, or an error that did not name the file, the field or the cause);
cases marked "coverage" guard behaviour that was already right. Each case asserts the exit code (1:
bad input, 2: usage error), an error naming the file / option, and bounded time and memory
(tests/hostile.py). A failed tokenize run must leave no output behind.

Env: LATHE_BIN, LATHE_SOURCE_DIR. Run: /usr/bin/python3 test_hostile_data.py
"""
import glob
import gzip
import json
import os
import shutil
import struct
import subprocess
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.environ.get("LATHE_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", "..")),
                                "tests"))
from hostile import Cases, run_lathe  # noqa: E402

cases = Cases()
DOCS = "".join(json.dumps({"text": f"document number {i} " * 12}) + "\n" for i in range(1500)).encode()


def tokenize(inputs, out, *extra, **kw):
    args = ["tokenize", "--tokenizer", "byte", "--no-progress", "--output", cases.path("out", out)]
    for i in inputs:
        args += ["--input", i]
    p = run_lathe(args + list(extra), **kw)
    if p.returncode != 0:
        left = glob.glob(cases.path("out", out) + "*")
        assert not left, f"a failed run left outputs behind: {left}"
    return p


# ---- compressed corpora -------------------------------------------------------------------------
GZ = gzip.compress(DOCS)
have_zstd = shutil.which("zstd") is not None
if have_zstd:
    plain = cases.write("plain.jsonl", DOCS)
    subprocess.run(["zstd", "-q", "-f", plain, "-o", plain + ".zst"], check=True)
    ZST = open(plain + ".zst", "rb").read()

with cases.case("control: whole gzip / zstd files and concatenated gzip members tokenize"):
    full = tokenize([cases.write("full.jsonl.gz", GZ)], "full", rc=0, stream="stdout", must=["1500 written"])
    two = cases.write("two.jsonl.gz", gzip.compress(DOCS[:5000]) + gzip.compress(DOCS[5000:]))
    tokenize([two], "two", rc=0, stream="stdout", must=["1500 written"])
    if have_zstd:
        tokenize([cases.write("full.jsonl.zst", ZST)], "fullz", rc=0, stream="stdout", must=["1500 written"])

with cases.case("a gzip file cut in half is an error (it tokenized 'successfully' with half the documents)"):
    tokenize([cases.write("half.jsonl.gz", GZ[: len(GZ) // 2])], "half",
             must=["half.jsonl.gz", "truncated gzip stream", "bytes read"])

with cases.case("a gzip file cut inside its 8-byte trailer (CRC/length) is an error"):
    tokenize([cases.write("trailer.jsonl.gz", GZ[:-3])], "trailer", must=["trailer.jsonl.gz", "truncated gzip"])

with cases.case("bytes after the last gzip member are refused (they were ignored)"):
    tokenize([cases.write("trail.jsonl.gz", GZ + b"not gzip at all")], "trail",
             must=["trail.jsonl.gz", "not a gzip member"])

with cases.case("coverage: a gzip file with a bad CRC is an error naming the file"):
    bad = bytearray(GZ)
    bad[-8] ^= 0xFF
    tokenize([cases.write("crc.jsonl.gz", bytes(bad))], "crc", must=["crc.jsonl.gz", "incorrect data check"])

if have_zstd:
    with cases.case("a zstd file cut in half is named as a truncated zstd stream"):
        tokenize([cases.write("half.jsonl.zst", ZST[: len(ZST) // 2])], "halfz",
                 must=["half.jsonl.zst", "truncated zstd stream", "bytes read"])

    with cases.case("coverage: garbage after a zstd frame is an error naming the file"):
        tokenize([cases.write("trail.jsonl.zst", ZST + b"garbage!")], "trailz",
                 must=["trail.jsonl.zst", "zstd decompression failed"])

# ---- records ------------------------------------------------------------------------------------
bad_utf8 = cases.write("bad.txt", b"good line\nbad \xff\xfe line\nmore\n")

with cases.case("--split-lines --strict refuses invalid UTF-8 with a byte-level tokenizer (it was accepted)"):
    tokenize([bad_utf8], "utf8_lines", "--split-lines", "--strict", must=["bad.txt:2", "invalid UTF-8", "byte 4"])

with cases.case("--strict refuses invalid UTF-8 in a whole-file document"):
    tokenize([bad_utf8], "utf8_file", "--strict", must=["bad.txt:", "invalid UTF-8"], must_not=["bad.txt:0"])

with cases.case("control: without --strict a byte-level tokenizer still encodes any bytes"):
    tokenize([bad_utf8], "utf8_ok", "--split-lines", rc=0, stream="stdout", must=["3 written"])

# 20 MB of '[': nlohmann built the whole DOM before failing (about 1.5 GB, per worker).
deep = cases.write("deep.jsonl", b'{"text": "fine"}\n' + b"[" * (20 << 20) + b"\n")

with cases.case("a deeply nested JSONL line is a --strict error without building its DOM (memory bound)"):
    tokenize([deep], "deep_strict", "--strict", must=["deep.jsonl:2", "nests deeper than 512"], mem_mb=700,
             timeout=60)

with cases.case("a deeply nested JSONL line is skipped and counted without --strict"):
    tokenize([deep], "deep", rc=0, stream="stdout", must=["1 written", "nests deeper than 512"], mem_mb=700,
             timeout=60)

# ---- corpus inputs that are not regular files ----------------------------------------------------
with cases.case("a FIFO given as corpus input is named as a FIFO"):
    fifo = cases.path("fifo.jsonl")
    os.mkfifo(fifo)
    tokenize([fifo], "fifo", must=["fifo.jsonl", "FIFO"], timeout=30)

with cases.case("a directory given as corpus input is named as a directory"):
    d = cases.path("adir.jsonl", "x")[:-2]
    os.makedirs(d, exist_ok=True)
    tokenize([d], "dir", must=["adir.jsonl", "is a directory"])

with cases.case("coverage: a corpus input behind a symlink loop is named"):
    loop = cases.path("loop.jsonl")
    os.symlink(loop, loop)
    tokenize([loop], "loop", must=["loop.jsonl", "symbolic links"])

# ---- numeric options ----------------------------------------------------------------------------
usage = [
    ("eval --seq-len 0 (silently used the default)", ["eval", "--model", "m", "--data", "d", "--seq-len", "0"],
     ["--seq-len", "positive"]),
    ("eval --seq-len -5", ["eval", "--model", "m", "--data", "d", "--seq-len", "-5"], ["--seq-len", "positive"]),
    ("eval --batch 0 (silently became 1)", ["eval", "--model", "m", "--data", "d", "--batch", "0"],
     ["--batch", "positive"]),
    ("tokenize --workers 0", ["tokenize", "-t", "byte", "-i", "x", "-o", "y", "--workers", "0"], ["--workers"]),
    ("tokenize --batch-bytes 0", ["tokenize", "-t", "byte", "-i", "x", "-o", "y", "--batch-bytes", "0"],
     ["--batch-bytes"]),
    ("tokenize --max-shard-size 0", ["tokenize", "-t", "byte", "-i", "x", "-o", "y", "--max-shard-size", "0"],
     ["--max-shard-size", "at least 1 byte"]),
    ("tokenize --max-shard-size '.' (std::stod threw)", ["tokenize", "-t", "byte", "-i", "x", "-o", "y",
                                                        "--max-shard-size", "."], ["--max-shard-size", "expected a size"]),
    ("tokenize --max-shard-size 1.2.3MB (read as 1.2 MB)", ["tokenize", "-t", "byte", "-i", "x", "-o", "y",
                                                           "--max-shard-size", "1.2.3MB"], ["--max-shard-size"]),
    ("tokenize --max-shard-size beyond 2^64 (undefined conversion)",
     ["tokenize", "-t", "byte", "-i", "x", "-o", "y", "--max-shard-size", "99999999999999999999999TB"],
     ["--max-shard-size", "larger than 1 PB"]),
    ("tokenize --format xml", ["tokenize", "-t", "byte", "-i", "x", "-o", "y", "--format", "xml"], ["--format"]),
    ("encode: unknown option", ["encode", "--tokenizer", "byte", "--bogus"], ["usage error", "--bogus"]),
    ("decode: missing --tokenizer", ["decode"], ["usage error", "--tokenizer"]),
]
for name, args, must in usage:
    with cases.case(name):
        run_lathe(args, rc=2, must=must, timeout=30, stdin=b"")

with cases.case("decode: an id beyond int32 is an error (4294967296 was decoded as id 0)"):
    run_lathe(["decode", "--tokenizer", "byte"], stdin=b"104 4294967296\n", must=["stdin line 1", "4294967296",
                                                                                 "out of range"])

with cases.case("decode: a 23-digit id is an error naming it (std::stol threw out_of_range)"):
    run_lathe(["decode", "--tokenizer", "byte"], stdin=b"99999999999999999999999", must=["stdin line 1",
                                                                                        "out of range"])

# ---- datasets through eval ----------------------------------------------------------------------
V, C, P = 64, 8, 16


def tiny_model():
    """A 1-layer GPT-2 of width 8 (config.json + model.safetensors, F32)."""
    d = os.path.dirname(cases.path("model", "config.json"))
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": V, "n_embd": C,
                   "n_head": 2, "n_layer": 1, "n_positions": P}, f)
    rng = np.random.default_rng(0)
    shapes = {"wte.weight": (V, C), "wpe.weight": (P, C), "ln_f.weight": (C,), "ln_f.bias": (C,)}
    for k, s in {"ln_1.weight": (C,), "ln_1.bias": (C,), "attn.c_attn.weight": (C, 3 * C), "attn.c_attn.bias": (3 * C,),
                 "attn.c_proj.weight": (C, C), "attn.c_proj.bias": (C,), "ln_2.weight": (C,), "ln_2.bias": (C,),
                 "mlp.c_fc.weight": (C, 4 * C), "mlp.c_fc.bias": (4 * C,), "mlp.c_proj.weight": (4 * C, C),
                 "mlp.c_proj.bias": (C,)}.items():
        shapes["h.0." + k] = s
    hdr, data, off = {}, b"", 0
    for k, s in shapes.items():
        b = (rng.standard_normal(s) * 0.02 + (1.0 if k.endswith("ln_1.weight") or k.endswith("ln_2.weight")
                                               or k == "ln_f.weight" else 0.0)).astype(np.float32).tobytes()
        hdr[k] = {"dtype": "F32", "shape": list(s), "data_offsets": [off, off + len(b)]}
        data += b
        off += len(b)
    h = json.dumps(hdr, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(os.path.join(d, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + data)
    return d


def write_dataset(prefix, docs, dtype=np.uint16):
    code = {np.uint16: 8, np.int32: 4, np.int64: 5}[dtype]
    item = np.dtype(dtype).itemsize
    lengths = np.array([len(d) for d in docs], np.int32)
    ptr = np.zeros(len(docs), np.int64)
    ptr[1:] = np.cumsum(lengths[:-1].astype(np.int64) * item)
    with open(prefix + ".bin", "wb") as f:
        for d in docs:
            f.write(np.asarray(d, dtype).tobytes())
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, code, len(docs), len(docs) + 1))
        f.write(lengths.tobytes() + ptr.tobytes() + np.arange(len(docs) + 1, dtype=np.int64).tobytes())


model = tiny_model()
DOCS_IDS = [list(range(1, 40)), list(range(5, 60))]


def evaluate(prefix, **kw):
    return run_lathe(["eval", "--model", model, "--data", prefix, "--seq-len", "8"], **kw)


with cases.case("control: eval on a valid dataset"):
    p = cases.path("ds", "ok")
    write_dataset(p, DOCS_IDS)
    evaluate(p, rc=0, stream="stdout", must=["loss"])

with cases.case("negative token ids in an int32 dataset are named with the file"):
    for dt in (np.int32, np.int64):
        p = cases.path("ds", "neg" + np.dtype(dt).name)
        write_dataset(p, [DOCS_IDS[0], [3, 4, -100000000] + DOCS_IDS[1]], dt)
        evaluate(p, must=[p + ".bin", "negative token ids", "at token 41"])

with cases.case("a FIFO in place of the .bin is refused, not waited on"):
    p = cases.path("ds", "fifo")
    write_dataset(p, DOCS_IDS)
    os.remove(p + ".bin")
    os.mkfifo(p + ".bin")
    evaluate(p, must=[p + ".bin", "FIFO"], timeout=30)

with cases.case("a directory in place of the .idx is named as one"):
    p = cases.path("ds", "dir")
    write_dataset(p, DOCS_IDS)
    os.remove(p + ".idx")
    os.makedirs(p + ".idx")
    evaluate(p, must=[p + ".idx", "is a directory"])

with cases.case("data inspect --eod 2^31 is a usage error (it cast to int32 -2^31 and crashed, SIGSEGV)"):
    p = cases.path("ds", "inspect")
    write_dataset(p, DOCS_IDS)
    run_lathe(["data", "inspect", p, "--eod", "2147483648"], rc=2, must=["--eod", "2147483647"])
    run_lathe(["data", "inspect", p, "--eod", "2147483647"], rc=0, stream="stdout", must=["2147483647"])

with cases.case("tokenize --stats-json on its own --input, or on the .idx it writes, is refused"):
    src = cases.write("stats_in.txt", "one line\ntwo lines\n")
    before = open(src).read()
    tokenize([src], "st", "--split-lines", "--stats-json", src, rc=1, must=["--stats-json", "--input"])
    assert open(src).read() == before
    tokenize([src], "st2", "--split-lines", "--stats-json", cases.path("out", "st2") + ".idx", rc=1,
             must=["--stats-json", "same path"])

cases.finish()
