"""Independent numpy writer of Megatron indexed datasets (.bin/.idx), from the spec in
shared/reference/megatron-indexed-dataset.md; used by the training tests to make data."""
import struct

import numpy as np

CODES = {np.uint8: 1, np.int8: 2, np.int16: 3, np.int32: 4, np.int64: 5, np.uint16: 8}


def write(prefix, docs, dtype=np.uint16):
    docs = [np.asarray(d, dtype=dtype) for d in docs]
    with open(prefix + ".bin", "wb") as f:
        for d in docs:
            f.write(d.tobytes())
    lengths = np.array([len(d) for d in docs], dtype=np.int32)
    pointers = np.zeros(len(docs), dtype=np.int64)
    if len(docs) > 1:
        pointers[1:] = np.cumsum(lengths[:-1].astype(np.int64) * np.dtype(dtype).itemsize)
    doc_idx = np.arange(len(docs) + 1, dtype=np.int64)
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", CODES[dtype]))
        f.write(struct.pack("<Q", len(docs)))
        f.write(struct.pack("<Q", len(doc_idx)))
        f.write(lengths.tobytes())
        f.write(pointers.tobytes())
        f.write(doc_idx.tobytes())


def write_text_bytes(prefix, text_bytes, doc_size=4096):
    """Byte-level 'tokenization': ids are the bytes, one document per doc_size chunk."""
    arr = np.frombuffer(text_bytes, dtype=np.uint8)
    docs = [arr[i : i + doc_size] for i in range(0, len(arr), doc_size)]
    write(prefix, docs)
