"""Cross-check lathe's safetensors I/O against an independent numpy implementation of the spec
(shared/reference/safetensors.md): python reads the files lathe writes, and lathe reads a file python
writes with the reference writer's layout (dtype-descending then name order, compact header,
space padding). Driven through the StPyBridge tests of the test_safetensors binary."""
import json
import os
import struct
import subprocess
import sys
import tempfile

import numpy as np

NP = {"F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32, "U8": np.uint8}
# Reference writer sort order (enum order, descending): a subset is enough here.
ORDER = ["BOOL", "U8", "I8", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "C64", "F64", "I64", "U64"]


def bf16_to_f32(u16):
    return (u16.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x):
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    u = u + 0x7FFF + ((u >> 16) & 1)  # round to nearest even (no NaNs in this test)
    return (u >> 16).astype(np.uint16)


def read_st(path):
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n].decode("utf-8"))
    meta = header.pop("__metadata__", {})
    data = raw[8 + n:]
    spans = sorted((v["data_offsets"][0], v["data_offsets"][1], k) for k, v in header.items())
    pos = 0
    for b, e, k in spans:
        assert b == pos, f"{path}: {k} starts at {b}, expected {pos}"
        pos = e
    assert pos == len(data), f"{path}: data section {len(data)} != {pos}"
    out = {}
    for k, v in header.items():
        b, e = v["data_offsets"]
        buf = data[b:e]
        if v["dtype"] == "BF16":
            arr = bf16_to_f32(np.frombuffer(buf, dtype="<u2"))
        else:
            arr = np.frombuffer(buf, dtype=np.dtype(NP[v["dtype"]]).newbyteorder("<"))
        assert arr.size == int(np.prod(v["shape"])), k
        out[k] = (v["dtype"], arr.reshape(v["shape"]))
    return n, meta, out, raw[8:8 + n]


def pattern(n, scale):
    i = np.arange(n, dtype=np.int64)
    v = ((i * 37 % 101) - 50).astype(np.float64) * scale / 64.0 + scale / 4096.0  # exact in fp32
    return v.astype(np.float32)


def write_st(path, tensors, meta):
    items = sorted(tensors.items(), key=lambda kv: (-ORDER.index(kv[1][0]), kv[0]))
    header = {"__metadata__": meta}
    off = 0
    blobs = []
    for name, (dt, arr) in items:
        blob = arr.tobytes()
        header[name] = {"dtype": dt, "shape": list(arr.shape), "data_offsets": [off, off + len(blob)]}
        off += len(blob)
        blobs.append(blob)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def main():
    binary = os.path.join(os.environ.get("LATHE_BINARY_DIR", "build"), "tests", "test_safetensors")
    if not os.path.exists(binary):
        print(f"missing test binary {binary}; build target test_safetensors", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as d:
        env = dict(os.environ, LATHE_ST_BRIDGE_DIR=d)
        subprocess.run([binary, "--gtest_filter=StPyBridge.WriteForPython"], env=env, check=True,
                       stdout=subprocess.DEVNULL)
        a, b = pattern(24, 2.0).reshape(4, 6), pattern(5, 300.0)
        for dt in ["F32", "BF16", "F16"]:
            n, meta, ts, hdr = read_st(os.path.join(d, f"lathe_{dt}.safetensors"))
            assert n % 8 == 0 and hdr.rstrip(b" ").endswith(b"}") and hdr.startswith(b"{"), hdr
            assert meta == {"format": "pt", "who": "lathe"}, meta
            assert list(ts) == ["w.a", "b"], list(ts)
            for name, ref in [("w.a", a), ("b", b)]:
                got_dt, got = ts[name]
                assert got_dt == dt and got.shape == ref.shape, (name, got_dt, got.shape)
                if dt == "F32":
                    want = ref
                elif dt == "F16":
                    want = ref.astype(np.float16).astype(np.float32)
                else:
                    want = bf16_to_f32(f32_to_bf16(ref))
                np.testing.assert_array_equal(got.astype(np.float32), want, err_msg=f"{dt} {name}")
        _, _, ts, _ = read_st(os.path.join(d, "lathe_I64.safetensors"))
        np.testing.assert_array_equal(ts["ids"][1], np.array([3, -1, 1 << 50], dtype=np.int64))

        # Python -> lathe.
        rng = np.random.default_rng(0)
        x32 = rng.standard_normal((3, 5)).astype(np.float32)
        x16 = rng.standard_normal((7,)).astype(np.float16)
        xbf = f32_to_bf16(rng.standard_normal((2, 3)).astype(np.float32) * 50)
        ids = np.array([5, -9, 1 << 45], dtype=np.int64)
        tensors = {"z.f32": ("F32", x32), "a.f16": ("F16", x16), "m.bf16": ("BF16", xbf), "ids": ("I64", ids),
                   "empty": ("F32", np.zeros((0, 3), np.float32))}
        write_st(os.path.join(d, "py.safetensors"), tensors, {"format": "pt", "origin": "numpy"})
        exp = {"metadata": {"format": "pt", "origin": "numpy"}, "tensors": []}
        for name, (dt, arr) in tensors.items():
            vals = bf16_to_f32(arr) if dt == "BF16" else arr
            exp["tensors"].append({"name": name, "dtype": dt, "shape": list(arr.shape),
                                   "values": [int(v) for v in vals.ravel()] if dt == "I64"
                                   else [float(v) for v in vals.astype(np.float32).ravel()]})
        with open(os.path.join(d, "expected.json"), "w") as f:
            json.dump(exp, f)
        r = subprocess.run([binary, "--gtest_filter=StPyBridge.ReadFromPython"], env=env,
                           capture_output=True, text=True)
        if r.returncode != 0 or "1 test" not in r.stdout or "SKIPPED" in r.stdout:
            print(r.stdout, r.stderr, file=sys.stderr)
            return 1
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
