#!/usr/bin/env python3
"""Hostile safetensors files (issue 14) through `lathe eval --model DIR`: a tiny valid GPT-2 directory
whose model.safetensors is replaced by a malformed one. Every case must exit 1 with an error naming
model.safetensors and what is wrong, in bounded time and memory (tests/hostile.py). Each case failed
before the fix: a stack overflow (deep header JSON), a silent load (bytes after a NUL, a byte count
that wraps 64 bits), a hang (FIFO) or an mmap error that did not say "directory".

Env: LATHE_BIN, LATHE_SOURCE_DIR. Run: /usr/bin/python3 test_hostile_io.py
"""
import json
import os
import struct
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.environ.get("LATHE_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", "..")),
                                "tests"))
from hostile import Cases, run_lathe  # noqa: E402

cases = Cases()
V, C, P = 64, 8, 16
DEEP = 60000  # nesting levels: overflowed the stack when an error message dumped the value


def gpt2_tensors():
    rng = np.random.default_rng(0)
    t = {"wte.weight": rng.standard_normal((V, C)) * 0.02, "wpe.weight": rng.standard_normal((P, C)) * 0.02,
         "ln_f.weight": np.ones(C), "ln_f.bias": np.zeros(C)}
    shapes = {"ln_1.weight": (C,), "ln_1.bias": (C,), "attn.c_attn.weight": (C, 3 * C), "attn.c_attn.bias": (3 * C,),
              "attn.c_proj.weight": (C, C), "attn.c_proj.bias": (C,), "ln_2.weight": (C,), "ln_2.bias": (C,),
              "mlp.c_fc.weight": (C, 4 * C), "mlp.c_fc.bias": (4 * C,), "mlp.c_proj.weight": (4 * C, C),
              "mlp.c_proj.bias": (C,)}
    for k, s in shapes.items():
        t["h.0." + k] = np.ones(s) if k.endswith("ln_1.weight") or k.endswith("ln_2.weight") else \
            rng.standard_normal(s) * 0.02
    return {k: v.astype(np.float32) for k, v in t.items()}


def header_and_data(extra=None):
    """Header dict and data bytes of the valid file; `extra` entries are added to the header."""
    hdr, data, off = {}, b"", 0
    for k, v in gpt2_tensors().items():
        b = v.tobytes()
        hdr[k] = {"dtype": "F32", "shape": list(v.shape), "data_offsets": [off, off + len(b)]}
        data += b
        off += len(b)
    hdr.update(extra or {})
    return hdr, data


def st_file(header_bytes, data):
    return struct.pack("<Q", len(header_bytes)) + header_bytes + data


def padded(hdr):
    h = json.dumps(hdr, separators=(",", ":")).encode()
    return h + b" " * (-len(h) % 8)


def model_dir(name, st_bytes=None):
    d = os.path.dirname(cases.path(name, "config.json"))
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": V, "n_embd": C,
                   "n_head": 2, "n_layer": 1, "n_positions": P}, f)
    if st_bytes is not None:
        with open(os.path.join(d, "model.safetensors"), "wb") as f:
            f.write(st_bytes)
    return d


def write_dataset(prefix, docs):
    """Megatron uint16 dataset (the layout of tests/train/megatron_writer.py)."""
    lengths = np.array([len(d) for d in docs], np.int32)
    ptr = np.zeros(len(docs), np.int64)
    ptr[1:] = np.cumsum(lengths[:-1].astype(np.int64) * 2)
    with open(prefix + ".bin", "wb") as f:
        for d in docs:
            f.write(np.asarray(d, np.uint16).tobytes())
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, len(docs), len(docs) + 1))
        f.write(lengths.tobytes() + ptr.tobytes() + np.arange(len(docs) + 1, dtype=np.int64).tobytes())


data_prefix = cases.path("data", "d")
write_dataset(data_prefix, [list(range(1, 40)), list(range(5, 60))])


def evaluate(d, **kw):
    return run_lathe(["eval", "--model", d, "--data", data_prefix, "--seq-len", "8"], **kw)


hdr, data = header_and_data()
valid = padded(hdr)

with cases.case("control: the valid file loads, also padded with other JSON whitespace"):
    evaluate(model_dir("ok", st_file(valid, data)), rc=0, stream="stdout", must=["loss"])
    text = json.dumps(hdr).encode()  # spaces after ':' and ','
    evaluate(model_dir("ok_ws", st_file(b"\n " + text + b" \t\r\n", data)), rc=0, stream="stdout", must=["loss"])

with cases.case("bytes after a NUL inside the header are refused (they were ignored)"):
    h = valid.rstrip(b" ") + b"\0hidden"
    evaluate(model_dir("nul", st_file(h, data)), must=["model.safetensors", "NUL byte", "header byte"])

with cases.case("non-space bytes after the header JSON are named by offset"):
    h = valid.rstrip(b" ") + b"   # trailing"
    evaluate(model_dir("junk", st_file(h, data)), must=["model.safetensors", "after the end of the JSON object"])

with cases.case("60,000 levels of nesting in __metadata__ (stack overflow in the error message)"):
    h = b'{"__metadata__":{"format":' + b"[" * DEEP + b"]" * DEEP + b"}," + valid.rstrip(b" ")[1:]
    evaluate(model_dir("deep_meta", st_file(h, data)), must=["model.safetensors", "nests deeper than 64"])

with cases.case("60,000 levels of nesting in a tensor entry"):
    h = b'{"x":' + b"[" * DEEP + b"]" * DEEP + b"," + valid.rstrip(b" ")[1:]
    evaluate(model_dir("deep_entry", st_file(h, data)), must=["model.safetensors", "nests deeper than 64"])

with cases.case("a byte count that wraps 64 bits ([2^31, 2^31] F64 = 2^65 bytes in data_offsets [0, 0])"):
    # The wrapped tensor takes the empty slot at offset 0; the real tensors follow it.
    h2 = {"huge": {"dtype": "F64", "shape": [2**31, 2**31], "data_offsets": [0, 0]}}
    h2.update(hdr)
    evaluate(model_dir("wrap", st_file(padded(h2), data)), must=["model.safetensors", "'huge'",
                                                                 "more bytes than the whole file"])

with cases.case("a FIFO in place of model.safetensors is refused, not waited on"):
    d = model_dir("fifo")
    os.mkfifo(os.path.join(d, "model.safetensors"))
    evaluate(d, must=["model.safetensors", "FIFO"], timeout=30)

with cases.case("a directory in place of model.safetensors is named as one"):
    d = model_dir("dir")
    os.makedirs(os.path.join(d, "model.safetensors"))
    evaluate(d, must=["model.safetensors", "is a directory"])

cases.finish()
