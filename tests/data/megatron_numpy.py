"""Independent numpy implementation of the Megatron indexed dataset format
(shared/reference/megatron-indexed-dataset.md section 3), used by test_indexed_dataset.cpp.

  check PREFIX EXPECTED_PREFIX : read PREFIX.bin/.idx with np.frombuffer and compare with
                                 EXPECTED_PREFIX.tokens / .lengths (raw int32) and .code (text)
  write PREFIX SEED CODE       : write a dataset with numpy (several sequences per document, as
                                 --split-sentences does) plus PREFIX.expected.{tokens,lengths,docs}
Exit code 0 on success; failures print what differs.
"""
import sys

import numpy as np

DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
          7: np.float32, 8: np.uint16}
MAGIC = b"MMIDIDX\x00\x00"


def read(prefix):
    idx = open(prefix + ".idx", "rb").read()
    assert idx[:9] == MAGIC, "bad magic"
    assert int(np.frombuffer(idx, "<u8", 1, 9)[0]) == 1, "bad version"
    code = idx[17]
    S = int(np.frombuffer(idx, "<u8", 1, 18)[0])
    D = int(np.frombuffer(idx, "<u8", 1, 26)[0])
    off = 34
    lengths = np.frombuffer(idx, "<i4", S, off); off += 4 * S
    pointers = np.frombuffer(idx, "<i8", S, off); off += 8 * S
    docs = np.frombuffer(idx, "<i8", D, off); off += 8 * D
    assert off == len(idx), f"idx size {len(idx)} != {off}"
    dt = np.dtype(DTYPES[code]).newbyteorder("<")
    binb = open(prefix + ".bin", "rb").read()
    assert len(binb) == int(lengths.astype(np.int64).sum()) * dt.itemsize, "bin size"
    seqs = [np.frombuffer(binb, dt, int(l), int(p)) for l, p in zip(lengths, pointers)]
    return code, lengths, pointers, docs, seqs


def check(prefix, expected):
    code, lengths, pointers, docs, seqs = read(prefix)
    exp_code = int(open(expected + ".code").read())
    exp_tokens = np.fromfile(expected + ".tokens", "<i4")
    exp_lengths = np.fromfile(expected + ".lengths", "<i4")
    ok = True
    if code != exp_code:
        print(f"dtype code {code} != {exp_code}"); ok = False
    if not np.array_equal(lengths, exp_lengths):
        print("lengths differ"); ok = False
    itemsize = np.dtype(DTYPES[code]).itemsize
    exp_ptr = np.concatenate([[0], np.cumsum(exp_lengths.astype(np.int64))[:-1]]) * itemsize
    if len(exp_lengths) and not np.array_equal(pointers, exp_ptr):
        print("pointers differ"); ok = False
    if not np.array_equal(docs, np.arange(len(exp_lengths) + 1)):
        print("document_indices differ"); ok = False
    got = np.concatenate(seqs).astype(np.int64) if seqs else np.zeros(0, np.int64)
    if not np.array_equal(got, exp_tokens.astype(np.int64)):
        print("tokens differ"); ok = False
    print("numpy reader:", "OK" if ok else "FAIL", len(exp_lengths), "sequences", got.size, "tokens")
    return ok


def write(prefix, seed, code):
    rng = np.random.default_rng(seed)
    dt = np.dtype(DTYPES[code]).newbyteorder("<")
    hi = min(np.iinfo(dt).max, 2**31 - 1)
    lengths, seqs, docs = [], [], [0]
    for d in range(int(rng.integers(3, 9))):
        for s in range(int(rng.integers(1, 4))):  # sentences of document d
            n = int(rng.integers(0, 50))
            seqs.append(rng.integers(0, hi, n, endpoint=True).astype(dt))
            lengths.append(n)
        docs.append(len(lengths))
    lengths = np.array(lengths, "<i4")
    pointers = np.concatenate([[0], np.cumsum(lengths.astype(np.int64))[:-1]]).astype("<i8") * dt.itemsize
    with open(prefix + ".bin", "wb") as f:
        for s in seqs:
            f.write(s.tobytes())
    with open(prefix + ".idx", "wb") as f:
        f.write(MAGIC)
        f.write(np.array([1], "<u8").tobytes())
        f.write(bytes([code]))
        f.write(np.array([len(lengths), len(docs)], "<u8").tobytes())
        f.write(lengths.tobytes())
        f.write(pointers.tobytes())
        f.write(np.array(docs, "<i8").tobytes())
    np.concatenate(seqs).astype("<i4").tofile(prefix + ".expected.tokens")
    lengths.tofile(prefix + ".expected.lengths")
    np.array(docs, "<i8").tofile(prefix + ".expected.docs")
    return True


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "check":
        sys.exit(0 if check(sys.argv[2], sys.argv[3]) else 1)
    if mode == "write":
        sys.exit(0 if write(sys.argv[2], int(sys.argv[3]), int(sys.argv[4])) else 1)
    sys.exit(f"unknown mode {mode}")
