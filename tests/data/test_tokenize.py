#!/usr/bin/env python3
"""`lathe tokenize` end to end: outputs read back by an independent numpy reader of the Megatron
.bin/.idx format (shared/reference/megatron-indexed-dataset.md) and compared with ids from HF
`tokenizers` (pin: tokenizers==0.20.3) or straight from the bytes (byte tokenizer).

Covers: byte tokenizer, GPT-2 (HF oracle), JSONL + .gz + .zst inputs, --workers 1 vs 2
byte-identical (with tiny batches so the writer must reorder), sharding and its naming rule,
counted skips with file:line, --strict, --append-eos without EOS, SIGINT leaves no output.

Env: LATHE_BIN (lathe binary), LATHE_SOURCE_DIR (repository). Run: /usr/bin/python3 test_tokenize.py
"""
import gzip
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

try:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
except ImportError as e:
    sys.exit(f"missing oracle package ({e}); install: /usr/bin/python3 -m pip install --break-system-packages "
             "tokenizers==0.20.3")

SRC = os.environ.get("LATHE_SOURCE_DIR", os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
LATHE = os.environ.get("LATHE_BIN", os.path.join(SRC, "build", "lathe"))


def find_shared(*parts):
    for base in (os.path.join(SRC, "..", "shared"), "/work/shared"):
        p = os.path.join(base, *parts)
        if os.path.exists(p):
            return os.path.abspath(p)
    sys.exit(f"cannot find shared/{'/'.join(parts)} (looked next to {SRC} and in /work/shared)")


SHAKESPEARE = find_shared("data", "tinyshakespeare.txt")
GPT2_DIR = find_shared("data", "gpt2")

# ---------------------------------------------------------------------------------------------
# Independent Megatron reader (byte layout from the reference document, section 3)
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16}


def read_megatron(prefix):
    idx = open(prefix + ".idx", "rb").read()
    assert idx[:9] == b"MMIDIDX\x00\x00", "bad magic"
    version = int(np.frombuffer(idx, np.uint64, 1, 9)[0])
    assert version == 1
    dtype = DTYPES[idx[17]]
    s = int(np.frombuffer(idx, np.uint64, 1, 18)[0])
    d = int(np.frombuffer(idx, np.uint64, 1, 26)[0])
    off = 34
    lengths = np.frombuffer(idx, np.int32, s, off); off += 4 * s
    pointers = np.frombuffer(idx, np.int64, s, off); off += 8 * s
    doc_idx = np.frombuffer(idx, np.int64, d, off); off += 8 * d
    assert off == len(idx), f"{prefix}.idx has {len(idx) - off} trailing bytes"
    assert d == s + 1 and list(doc_idx) == list(range(s + 1)), "document_indices must be 0..S"
    bin_ = np.fromfile(prefix + ".bin", dtype=dtype)
    item = np.dtype(dtype).itemsize
    assert bin_.size == int(lengths.sum()), ".bin size != sum(lengths)"
    expect_ptr = np.concatenate([[0], np.cumsum(lengths.astype(np.int64))[:-1] * item]) if s else np.zeros(0)
    assert np.array_equal(pointers, expect_ptr), "sequence_pointers inconsistent with lengths"
    docs, pos = [], 0
    for n in lengths:
        docs.append(bin_[pos:pos + n].astype(np.int64).tolist())
        pos += n
    return np.dtype(dtype), docs


def run(args, ok=True, **kw):
    p = subprocess.run([LATHE] + args, capture_output=True, text=True, **kw)
    if ok and p.returncode != 0:
        raise AssertionError(f"lathe {' '.join(args)} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    if not ok and p.returncode == 0:
        raise AssertionError(f"lathe {' '.join(args)} should have failed:\n{p.stdout}\n{p.stderr}")
    return p


def hf_gpt2():
    tok = Tokenizer(models.BPE.from_file(os.path.join(GPT2_DIR, "encoder.json"), os.path.join(GPT2_DIR, "vocab.bpe")))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return tok


def files_equal(a, b):
    return open(a, "rb").read() == open(b, "rb").read()


def main():
    tmp = tempfile.mkdtemp(prefix="lathe_test_tokenize_")
    T = lambda *p: os.path.join(tmp, *p)
    text = open(SHAKESPEARE, "rb").read()
    lines = text.decode("utf-8").split("\n")
    if text.endswith(b"\n"):
        lines.pop()  # the final newline ends the last line; it does not start an empty one
    failures = []

    def check(name, fn):
        t = time.time()
        try:
            fn()
            print(f"ok   {name} ({time.time() - t:.1f} s)")
        except AssertionError as e:
            failures.append(name)
            print(f"FAIL {name}: {e}")

    # 1. byte tokenizer, one document per file -> ids are the bytes
    def byte_whole_file():
        run(["tokenize", "-t", "byte", "-i", SHAKESPEARE, "-o", T("byte"), "--no-progress"])
        dt, docs = read_megatron(T("byte"))
        assert dt == np.uint16, dt
        assert len(docs) == 1 and docs[0] == list(text), "byte ids != file bytes"
        # Several workers cannot share one document: the summary says so (and how to fix it) ...
        p = run(["tokenize", "-t", "byte", "-i", SHAKESPEARE, "-o", T("byte2"), "--no-progress", "-j", "2",
                 "--batch-bytes", "65536", "--stats-json", T("byte2.json")])
        assert "is one document of 1.1 MB" in p.stdout and "--split-lines" in p.stdout, p.stdout
        assert json.load(open(T("byte2.json")))["largest_single_document"] == SHAKESPEARE
        # ... but not when the document is small against the batch size, or with one worker.
        for extra in (["-j", "2"], ["-j", "1", "--batch-bytes", "65536"]):
            p = run(["tokenize", "-t", "byte", "-i", SHAKESPEARE, "-o", T("byte3"), "--no-progress", "--overwrite"]
                    + extra)
            assert "one document of" not in p.stdout, (extra, p.stdout)
    check("byte tokenizer, whole file", byte_whole_file)

    # 2. GPT-2, one document per line, EOS appended; HF oracle
    hf = hf_gpt2()
    nonempty = [l for l in lines if l]
    ref = [e.ids + [50256] for e in hf.encode_batch(nonempty)]

    def gpt2_lines():
        p = run(["tokenize", "-t", GPT2_DIR, "-i", SHAKESPEARE, "-o", T("g1"), "--split-lines", "--append-eos",
                 "--no-progress", "--batch-bytes", "4096", "-j", "1", "--stats-json", T("g1.json")])
        dt, docs = read_megatron(T("g1"))
        assert dt == np.uint16
        assert len(docs) == len(ref), f"{len(docs)} documents, HF {len(ref)}"
        assert [len(d) for d in docs] == [len(r) for r in ref], "document lengths differ"
        for i, (a, b) in enumerate(zip(docs, ref)):
            assert a == b, f"document {i} ({nonempty[i]!r}): lathe {a} HF {b}"
        st = json.load(open(T("g1.json")))
        assert st["documents"] == len(ref) and st["skipped"]["empty"] == len(lines) - len(nonempty), st
        assert st["tokens"] == sum(map(len, ref))
        assert "bytes per token" in p.stdout
    check("gpt2 --split-lines --append-eos == HF", gpt2_lines)

    # 3. --workers 2 gives byte-identical output (tiny batches: hundreds of batches to reorder)
    def workers_identical():
        run(["tokenize", "-t", GPT2_DIR, "-i", SHAKESPEARE, "-o", T("g2"), "--split-lines", "--append-eos",
             "--no-progress", "--batch-bytes", "4096", "-j", "2"])
        run(["tokenize", "-t", GPT2_DIR, "-i", SHAKESPEARE, "-o", T("g3"), "--split-lines", "--append-eos",
             "--no-progress", "--batch-bytes", "1000", "-j", "3"])
        for p in ("g2", "g3"):
            for ext in (".bin", ".idx"):
                assert files_equal(T("g1" + ext), T(p + ext)), f"{p}{ext} differs from the 1-worker output"
    check("--workers 1/2/3 byte-identical", workers_identical)

    # 4. JSONL, plain, .gz and .zst inputs with unicode; one output, order kept across files
    docs_text = ["Hello world, it's 2024!\n\n  tabs\there", "日本語のテキストと中文，还有emoji 🎉🎉",
                 "CRLF line\r\nnext\r\n", "  runs   of    spaces 1234567890", text.decode()[:5000]]
    recs = [json.dumps({"id": i, "text": t}, ensure_ascii=(i % 2 == 0)) for i, t in enumerate(docs_text)]
    with open(T("a.jsonl"), "w") as f:
        f.write("\n".join(recs[:2]) + "\n")
    with gzip.open(T("b.jsonl.gz"), "wt") as f:
        f.write("\n".join(recs[2:]) + "\n")
    with open(T("c.jsonl"), "w") as f:
        f.write("\n".join(recs) + "\n")
    subprocess.run(["zstd", "-q", "-f", "--rm", T("c.jsonl"), "-o", T("c.jsonl.zst")], check=True)
    with open(T("d.txt"), "w") as f:
        f.write(docs_text[1])
    with gzip.open(T("e.txt.gz"), "wt") as f:
        f.write(docs_text[3])

    def jsonl_compressed():
        run(["tokenize", "-t", GPT2_DIR, "-i", T("a.jsonl"), T("b.jsonl.gz"), T("c.jsonl.zst"), T("d.txt"),
             T("e.txt.gz"), "-o", T("j"), "--no-progress", "--append-eos"])
        _, docs = read_megatron(T("j"))
        want = docs_text + docs_text + [docs_text[1], docs_text[3]]
        expect = [e.ids + [50256] for e in hf.encode_batch(want)]
        assert len(docs) == len(expect), f"{len(docs)} documents, expected {len(expect)}"
        for i, (a, b) in enumerate(zip(docs, expect)):
            assert a == b, f"document {i}: lathe {a[:20]}... HF {b[:20]}..."
        # glob input gives the same documents in sorted order
        run(["tokenize", "-t", GPT2_DIR, "-i", T("*.jsonl*"), "-o", T("jg"), "--no-progress", "--append-eos"])
        _, gdocs = read_megatron(T("jg"))
        assert gdocs == docs[:len(docs_text) * 2], "glob a.jsonl,b.jsonl.gz,c.jsonl.zst"
    check("JSONL/.gz/.zst/text inputs == HF", jsonl_compressed)

    # 5. sharding: limit 100 KB; naming PREFIX_00000...; each shard <= limit; concatenation == unsharded
    def sharding():
        p = run(["tokenize", "-t", GPT2_DIR, "-i", SHAKESPEARE, "-o", T("s"), "--split-lines", "--append-eos",
                 "--no-progress", "--max-shard-size", "100KB", "-j", "2", "--batch-bytes", "8192"])
        shards = sorted(f[:-4] for f in os.listdir(tmp) if f.startswith("s_") and f.endswith(".bin"))
        assert len(shards) >= 5, shards
        assert shards == [f"s_{k:05d}" for k in range(len(shards))], shards
        assert not os.path.exists(T("s.bin")), "single-shard name used for a multi-shard run"
        all_docs = []
        for s in shards:
            assert os.path.getsize(T(s + ".bin")) <= 100_000, f"{s}.bin over the limit"
            all_docs += read_megatron(T(s))[1]
        assert all_docs == read_megatron(T("g1"))[1], "sharded documents != unsharded"
        assert not [f for f in os.listdir(tmp) if "incomplete" in f or f.endswith(".tmp")], os.listdir(tmp)
        # a limit larger than the output -> one file named PREFIX.bin
        run(["tokenize", "-t", "byte", "-i", SHAKESPEARE, "-o", T("one"), "--max-shard-size", "1GB", "--no-progress"])
        assert os.path.exists(T("one.bin")) and not os.path.exists(T("one_00000.bin"))
        # existing outputs: error, or replaced with --overwrite (stale shards removed)
        run(["tokenize", "-t", "byte", "-i", SHAKESPEARE, "-o", T("one"), "--no-progress"], ok=False)
        run(["tokenize", "-t", GPT2_DIR, "-i", SHAKESPEARE, "-o", T("s"), "--split-lines", "--overwrite",
             "--no-progress"])
        assert os.path.exists(T("s.bin")) and not os.path.exists(T("s_00000.bin")), "stale shards left"
    check("sharding and naming", sharding)

    # 6. bad input: counted skips with file:line; --strict fails with file:line
    bad = [json.dumps({"text": "good one"}), "{not json", json.dumps({"txt": "no key"}), json.dumps({"text": 5}),
           "", json.dumps({"text": ""}), json.dumps({"text": "good two"}), "[1, 2]"]
    with open(T("bad.jsonl"), "w") as f:
        f.write("\n".join(bad) + "\n")

    def bad_input():
        p = run(["tokenize", "-t", GPT2_DIR, "-i", T("bad.jsonl"), "-o", T("bad"), "--no-progress",
                 "--stats-json", T("bad.json")])
        _, docs = read_megatron(T("bad"))
        assert docs == [e.ids for e in hf.encode_batch(["good one", "good two"])], docs
        st = json.load(open(T("bad.json")))
        sk = st["skipped"]
        assert sk["invalid JSON"] == 2 and sk["missing text key"] == 1 and sk["text value is not a string"] == 1, sk
        assert sk["empty"] == 2, sk
        lines_listed = [(e["line"], e["reason"]) for e in st["examples"]]
        assert lines_listed == [(2, "invalid JSON"), (3, "missing text key"), (4, "text value is not a string"),
                                (8, "invalid JSON")], lines_listed
        assert f"{T('bad.jsonl')}:2: invalid JSON" in p.stdout, p.stdout
        p = run(["tokenize", "-t", GPT2_DIR, "-i", T("bad.jsonl"), "-o", T("bad2"), "--no-progress", "--strict"],
                ok=False)
        assert f"bad.jsonl:2: invalid JSON" in p.stderr, p.stderr
        assert not [f for f in os.listdir(tmp) if f.startswith("bad2")], "failed run left files"
        # --append-eos with a tokenizer that has no EOS
        p = run(["tokenize", "-t", "byte", "-i", SHAKESPEARE, "-o", T("x"), "--append-eos"], ok=False)
        assert "EOS" in p.stderr, p.stderr
        # non-UTF-8 text with a non-byte-level tokenizer (SentencePiece-style BPE, byte_fallback)
        spdir = T("sp")
        os.makedirs(spdir)
        vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
        for b in range(256):
            vocab[f"<0x{b:02X}>"] = len(vocab)
        for ch in "\u2581abcdefghijklmnopqrstuvwxyz":
            vocab[ch] = len(vocab)
        tj = {"version": "1.0", "truncation": None, "padding": None,
              "added_tokens": [{"id": i, "content": c, "single_word": False, "lstrip": False, "rstrip": False,
                                "normalized": False, "special": True} for c, i in (("<unk>", 0), ("<s>", 1), ("</s>", 2))],
              "normalizer": {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "\u2581"},
                                                                 {"type": "Replace", "pattern": {"String": " "},
                                                                  "content": "\u2581"}]},
              "pre_tokenizer": None, "post_processor": None,
              "decoder": {"type": "Sequence", "decoders": [
                  {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "}, {"type": "ByteFallback"},
                  {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
              "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                        "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                        "vocab": vocab, "merges": []}}
        json.dump(tj, open(os.path.join(spdir, "tokenizer.json"), "w"))
        with open(T("u.txt"), "wb") as f:
            f.write(b"good line\nbad \xff\xfe line\nanother good\n")
        p = run(["tokenize", "-t", spdir, "-i", T("u.txt"), "-o", T("u"), "--split-lines", "--no-progress",
                 "--stats-json", T("u.json")])
        st = json.load(open(T("u.json")))
        assert st["skipped"]["invalid UTF-8"] == 1 and st["documents"] == 2, st
        assert st["examples"][0]["line"] == 2, st
        hsp = Tokenizer.from_file(os.path.join(spdir, "tokenizer.json"))
        _, docs = read_megatron(T("u"))
        assert docs == [e.ids for e in hsp.encode_batch(["good line", "another good"])], docs
        # the byte tokenizer takes the same file without skips
        run(["tokenize", "-t", "byte", "-i", T("u.txt"), "-o", T("ub"), "--split-lines", "--no-progress"])
        assert read_megatron(T("ub"))[1][1] == list(b"bad \xff\xfe line")
    check("bad input: skips, --strict, no EOS, invalid UTF-8", bad_input)

    # 7. SIGINT mid-run: no complete-looking file, temporaries removed
    def interrupted():
        big = [SHAKESPEARE] * 60
        proc = subprocess.Popen([LATHE, "tokenize", "-t", GPT2_DIR, "-i"] + big +
                                ["-o", T("int"), "--split-lines", "--no-progress", "-j", "1"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 30
        while time.time() < deadline and not any(f.startswith("int") for f in os.listdir(tmp)):
            time.sleep(0.02)
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode != 0, f"run finished before the interrupt; make the input larger\n{out}"
        assert "interrupted" in err, err
        left = [f for f in os.listdir(tmp) if f.startswith("int")]
        assert not left, f"interrupted run left {left}"
    check("SIGINT leaves nothing", interrupted)

    if failures:
        print(f"{len(failures)} failed: {failures}  (temp dir kept: {tmp})")
        sys.exit(1)
    shutil.rmtree(tmp)
    print("all passed")


if __name__ == "__main__":
    main()
