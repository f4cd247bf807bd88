#!/usr/bin/env python3
"""`lathe tokenizer train` against HF `tokenizers`' BpeTrainer (pin: tokenizers==0.20.3).

Same corpus, same settings (ByteLevel pre-tokenizer or Split(Llama-3 regex)+ByteLevel,
initial_alphabet = ByteLevel.alphabet(), special tokens, min_frequency) -> the merge list and the
vocabulary must be identical, merge for merge. Then HF loads lathe's tokenizer.json and must give
the same ids as lathe itself (`lathe tokenize` with the byte-exact document, and `lathe encode`
when that command exists) on mixed text.

Env: LATHE_BIN, LATHE_SOURCE_DIR.
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

try:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
except ImportError as e:
    sys.exit(f"missing oracle package ({e}); install: /usr/bin/python3 -m pip install --break-system-packages "
             "tokenizers==0.20.3")

SRC = os.environ.get("LATHE_SOURCE_DIR", os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
LATHE = os.environ.get("LATHE_BIN", os.path.join(SRC, "build", "lathe"))
LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
          r"\s*[\r\n]+|\s+(?!\S)|\s+")


def find_shared(*parts):
    for base in (os.path.join(SRC, "..", "shared"), "/work/shared"):
        p = os.path.join(base, *parts)
        if os.path.exists(p):
            return os.path.abspath(p)
    sys.exit(f"cannot find shared/{'/'.join(parts)}")


SHAKESPEARE = find_shared("data", "tinyshakespeare.txt")

MIXED = ("日本語のテキストです。中文文本，还有更多的中文。🎉🎉 emoji 🚀🚀🚀\n"
         "\tTabs\tand   runs of   spaces\r\nCRLF lines\r\n"
         "Digits 1234567890 3.14159 2024-06-01 and 'contractions' it's we'll they've I'M\n"
         "Ünïcödé àccents, Ελληνικά, русский текст, العربية\n" * 3)


def hf_train(files, vocab_size, pretok, specials, min_freq, iterator=None):
    tok = Tokenizer(models.BPE())
    if pretok == "gpt2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(LLAMA3), "isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tr = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_freq, special_tokens=specials,
                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    if iterator is not None:
        tok.train_from_iterator(iterator, tr)
    else:
        tok.train(files, tr)
    return tok


def merges_of(tj):
    return [m.split(" ") if isinstance(m, str) else list(m) for m in tj["model"]["merges"]]


def read_megatron_docs(prefix):
    idx = open(prefix + ".idx", "rb").read()
    assert idx[:9] == b"MMIDIDX\x00\x00"
    dtype = {4: np.int32, 8: np.uint16}[idx[17]]
    s = int(np.frombuffer(idx, np.uint64, 1, 18)[0])
    lengths = np.frombuffer(idx, np.int32, s, 34)
    data = np.fromfile(prefix + ".bin", dtype=dtype).astype(np.int64)
    out, pos = [], 0
    for n in lengths:
        out.append(data[pos:pos + n].tolist())
        pos += n
    return out


def main():
    tmp = tempfile.mkdtemp(prefix="lathe_test_bpe_trainer_")
    T = lambda *p: os.path.join(tmp, *p)
    failures = []
    corpus = T("corpus.txt")
    with open(SHAKESPEARE, "rb") as f:
        data = f.read(200_000)
    with open(corpus, "wb") as f:
        f.write(data + MIXED.encode())
    has_encode = "encode" in subprocess.run([LATHE, "--help"], capture_output=True, text=True).stderr

    def case(name, pretok, vocab, specials, min_freq, inputs=None, iterator=None, extra=()):
        t0 = time.time()
        out = T(name)
        try:
            inputs = inputs or [corpus]
            args = [LATHE, "tokenizer", "train", "--input", *inputs, "--vocab-size", str(vocab), "--out", out,
                    "--pretokenizer", pretok, "--min-frequency", str(min_freq), "--no-progress", *extra]
            if specials:
                args += ["--special-tokens", ",".join(specials)]
            p = subprocess.run(args, capture_output=True, text=True)
            assert p.returncode == 0, f"lathe tokenizer train failed:\n{p.stderr}"
            lt = json.load(open(os.path.join(out, "tokenizer.json")))
            hf = hf_train(inputs, vocab, pretok, specials, min_freq, iterator)
            ht = json.loads(hf.to_str())
            lm, hm = merges_of(lt), merges_of(ht)
            for i, (a, b) in enumerate(zip(lm, hm)):
                assert a == b, f"merge {i} differs: lathe {a} HF {b}"
            assert len(lm) == len(hm), f"{len(lm)} merges, HF {len(hm)}"
            assert lt["model"]["vocab"] == ht["model"]["vocab"], "vocabularies differ"
            assert [t["content"] for t in lt["added_tokens"]] == specials
            # HF loads lathe's file and encodes like lathe does
            hl = Tokenizer.from_file(os.path.join(out, "tokenizer.json"))
            probes = [MIXED, data[:3000].decode(), "x", "  leading spaces and trailing   ", "\n\n\n", "a\u00a0b c"]
            for i, s in enumerate(probes):
                with open(T(f"{name}_probe{i}.txt"), "w", newline="") as f:
                    f.write(s)
            inputs_p = [T(f"{name}_probe{i}.txt") for i in range(len(probes))]
            p = subprocess.run([LATHE, "tokenize", "-t", out, "-i", *inputs_p, "-o", T(f"{name}_enc"),
                                "--no-progress"], capture_output=True, text=True)
            assert p.returncode == 0, p.stderr
            docs = read_megatron_docs(T(f"{name}_enc"))
            for s, d in zip(probes, docs):
                ref = hl.encode(s).ids
                assert d == ref, f"lathe tokenize != HF on {s[:40]!r}: {d[:12]} vs {ref[:12]}"
                assert hl.decode(ref) == s, "HF decode of lathe's tokenizer does not round-trip"
            if has_encode:
                for s in probes[:3]:
                    p = subprocess.run([LATHE, "encode", "--tokenizer", out], input=s.encode(), capture_output=True)
                    assert p.returncode == 0, p.stderr.decode()
                    ids = [int(x) for x in p.stdout.split()]
                    assert ids == hl.encode(s).ids, f"lathe encode != HF on {s[:40]!r}"
            cfg = json.load(open(os.path.join(out, "tokenizer_config.json")))
            if "<|endoftext|>" in specials:
                assert cfg["eos_token"] == "<|endoftext|>", cfg
            print(f"ok   {name}: {len(lm)} merges identical to HF ({time.time() - t0:.1f} s)")
        except AssertionError as e:
            failures.append(name)
            print(f"FAIL {name}: {e}")

    case("gpt2_v1000", "gpt2", 1000, ["<|endoftext|>"], 2)
    case("llama3_v1000", "llama3", 1000, ["<|begin_of_text|>", "<|end_of_text|>"], 2)
    case("gpt2_nospecial_minfreq0", "gpt2", 700, [], 0)
    # min_frequency stops early (vocabulary smaller than asked), HF stops at the same merge
    case("gpt2_minfreq40", "gpt2", 5000, ["<|endoftext|>"], 40)
    # JSONL input: one sequence per document, as HF train_from_iterator over the documents
    docs = [data[i:i + 3000].decode("utf-8", "ignore") for i in range(0, 60000, 3000)] + [MIXED]
    with open(T("docs.jsonl"), "w") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")
    case("jsonl_llama3", "llama3", 800, ["<|endoftext|>"], 2, inputs=[T("docs.jsonl")], iterator=docs,
         extra=["--threads", "3"])

    # A bad option value fails with a message naming it
    p = subprocess.run([LATHE, "tokenizer", "train", "--input", corpus, "--vocab-size", "100", "--out", T("bad")],
                       capture_output=True, text=True)
    if p.returncode == 0 or "vocab-size" not in p.stderr:
        failures.append("small vocab error")
        print(f"FAIL --vocab-size 100 should fail naming the option: {p.stderr}")

    if failures:
        print(f"{len(failures)} failed: {failures} (temp dir kept: {tmp})")
        sys.exit(1)
    shutil.rmtree(tmp)
    print("all passed")


if __name__ == "__main__":
    main()
