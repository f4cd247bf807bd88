"""Exactness of lathe's tokenizers against the reference implementations.

Oracles: HF `tokenizers` (PyPI, pinned by CI) for tokenizer.json / GPT-2 files, and the
`sentencepiece` Python package (libsentencepiece) for .model files trained by spm_train here.
Every tokenizer is compared through `lathe encode --nul` / `lathe decode --nul` (one process per
corpus) on: tinyshakespeare lines, the whole of tinyshakespeare as one string, mixed-script text
(Chinese, Japanese, emoji, tabs, runs of spaces, CRLF, digits) and random valid UTF-8. Byte-level
tokenizers must also round-trip random bytes, invalid UTF-8 included.
"""
import json
import os
import random
import subprocess
import sys
import tempfile

try:
    import tokenizers
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from tokenizers import AddedToken
    import sentencepiece as spm
except ImportError as e:  # the oracle is a hard requirement: CI installs it
    sys.exit(f"missing oracle package ({e}); install: /usr/bin/python3 -m pip install --break-system-packages "
             "tokenizers==0.20.3 sentencepiece==0.2.3")

LATHE = os.environ.get("LATHE_BIN", "lathe")
SRC = os.environ.get("LATHE_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))
SHARED = "/work/shared/data"
if not os.path.exists(os.path.join(SHARED, "tinyshakespeare.txt")):
    SHARED = os.path.join(SRC, "..", "shared", "data")
SHAKES = os.path.join(SHARED, "tinyshakespeare.txt")
if not os.path.exists(SHAKES):
    SHAKES = os.path.join(SRC, "data", "tinyshakespeare.txt")
GPT2 = os.path.join(SHARED, "gpt2")

rng = random.Random(1234)
failures = []


def run(args, data):
    p = subprocess.run([LATHE] + args, input=data, capture_output=True)
    if p.returncode != 0:
        raise RuntimeError(f"lathe {' '.join(args)} failed ({p.returncode}): {p.stderr.decode(errors='replace')}")
    return p.stdout


def lathe_encode(tok, texts, special=False):
    data = b"".join((t.encode("utf-8") if isinstance(t, str) else t) + b"\0" for t in texts)
    out = run(["encode", "--tokenizer", tok, "--nul"] + (["--add-special-tokens"] if special else []), data)
    lines = out.decode().split("\n")[:-1]
    assert len(lines) == len(texts), (len(lines), len(texts))
    return [[int(x) for x in l.split()] for l in lines]


def lathe_decode(tok, seqs):
    data = "".join(" ".join(map(str, s)) + "\n" for s in seqs).encode()
    out = run(["decode", "--tokenizer", tok, "--nul"], data).split(b"\0")[:-1]
    assert len(out) == len(seqs)
    return out


def compare(name, texts, got, want):
    bad = [i for i in range(len(texts)) if got[i] != want[i]]
    if bad:
        i = bad[0]
        failures.append(f"{name}: {len(bad)}/{len(texts)} differ; first: text={texts[i]!r:.200} "
                        f"lathe={got[i][:40]} reference={want[i][:40]}")
        print("FAIL", failures[-1])
    else:
        print(f"ok   {name}: {len(texts)} texts identical")


# ---------------------------------------------------------------- corpora
shakes = open(SHAKES, encoding="utf-8").read()
shakes_lines = shakes.split("\n")

FRAGS = ["你好，世界！", "中文分词测试", "日本語のテキスト", "カタカナとひらがな", "😀", "👍🏽", "🇯🇵", "👨‍👩‍👧",
         "\t", "\t\t", "  ", "    ", "\r\n", "\n", "\n\n", "123", "4567890", "3.14159", "2024-06-01", "Hello",
         " world", "it's", "THEY'LL", "we've", "don't", "  leading", "trailing  ", "ümlaut", "café", "naïve",
         "Ελληνικά", "русский", "עברית", "عربى", "हिन्दी", "한국어", "<s>", "</s>", "<mask>", "<|endoftext|>",
         "<|begin_of_text|>", "[SPECIAL]", "e\u0301", "\u00a0", "\u3000", "x" * 300, "ab" * 50, "!!!", "...",
         "$%^&*", "\u2581", "▁▁", " ", "", "\x0b", "\x0c", "\x85", "\u2028"]


def mixed_text():
    return "".join(rng.choice(FRAGS) for _ in range(rng.randint(1, 12)))


mixed = [mixed_text() for _ in range(1500)] + FRAGS + [" " * k for k in range(1, 6)]

RANGES = [(0x01, 0x7F), (0x01, 0x7F), (0x80, 0x7FF), (0x800, 0xFFFF), (0x4E00, 0x9FFF), (0x3040, 0x30FF),
          (0x1F300, 0x1FAFF), (0x0300, 0x036F), (0x10000, 0x10FFFF), (0x2000, 0x206F)]


def rand_char():
    while True:
        lo, hi = rng.choice(RANGES)
        c = rng.randint(lo, hi)
        if not (0xD800 <= c <= 0xDFFF):
            return chr(c)


rand_utf8 = ["".join(rand_char() for _ in range(rng.randint(0, 40))) for _ in range(2000)]
rand_bytes = [bytes(rng.choice([rng.randint(1, 255), rng.randint(0x80, 0xFF), 0x20, 0x41])
                    for _ in range(rng.randint(0, 60))) for _ in range(1500)]


# Long single documents: lathe pre-tokenizes text over 64 KB in windows cut where the regex scan
# restarts; whitespace runs, mixed scripts and random characters put those cuts everywhere.
long_mixed = "".join(t + rng.choice(["", " ", "  ", "\n", "\n\n", "\t", " \n ", "   "]) for t in mixed) * 3
long_random = "".join(rand_utf8)


def check_hf(name, tok_path, hf, special=False, corpora=None, byte_level=False):
    corpora = corpora or [("shakespeare-lines", shakes_lines), ("shakespeare-whole", [shakes]),
                          ("mixed", mixed), ("random-utf8", rand_utf8), ("long-mixed", [long_mixed]),
                          ("long-random-utf8", [long_random])]
    for cname, texts in corpora:
        want = [e.ids for e in hf.encode_batch(texts, add_special_tokens=special)]
        got = lathe_encode(tok_path, texts, special)
        compare(f"{name} encode {cname}", texts, got, want)
        if cname in ("mixed", "random-utf8"):
            # HF ends ByteLevel decoding with a lossy UTF-8 step; lathe returns the raw bytes (so
            # any bytes round-trip), which must equal HF's text after the same lossy step.
            dec = [d.decode("utf-8", errors="replace") for d in lathe_decode(tok_path, want)]
            want_dec = [hf.decode(w, skip_special_tokens=False) for w in want]
            compare(f"{name} decode {cname}", texts, dec, want_dec)
    if byte_level:
        ids = lathe_encode(tok_path, rand_bytes)
        dec = lathe_decode(tok_path, ids)
        compare(f"{name} round-trip random bytes", rand_bytes, dec, rand_bytes)
        blob = bytes(rng.randint(0, 255) for _ in range(20000))  # NULs included: whole-stdin protocol
        ids = run(["encode", "--tokenizer", tok_path], blob)
        back = run(["decode", "--tokenizer", tok_path], ids)
        compare(f"{name} round-trip 20 KB random blob", [blob], [back], [blob])


tmp = tempfile.mkdtemp(prefix="lathe_tok_test_")


def save(hf, name, legacy_merges=False, config=None):
    d = os.path.join(tmp, name)
    os.makedirs(d, exist_ok=True)
    p = os.path.join(d, "tokenizer.json")
    hf.save(p)
    if legacy_merges:  # rewrite [["a","b"]] merges into the "a b" form of older files
        j = json.load(open(p, encoding="utf-8"))
        j["model"]["merges"] = [m if isinstance(m, str) else " ".join(m) for m in j["model"]["merges"]]
        json.dump(j, open(p, "w", encoding="utf-8"), ensure_ascii=False)
    if config:
        json.dump(config, open(os.path.join(d, "tokenizer_config.json"), "w"))
    return d


def gpt2_hf():
    t = Tokenizer(models.BPE.from_file(os.path.join(GPT2, "encoder.json"), os.path.join(GPT2, "vocab.bpe")))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.add_special_tokens(["<|endoftext|>"])
    return t


print(f"tokenizers {tokenizers.__version__}, sentencepiece {spm.__version__}")

# 1. GPT-2 from the legacy files (encoder.json + vocab.bpe) and as tokenizer.json with "a b" merges.
g = gpt2_hf()
check_hf("gpt2-legacy", GPT2, g, byte_level=True)
check_hf("gpt2-json-legacy-merges", save(g, "gpt2", legacy_merges=True), g,
         corpora=[("mixed", mixed), ("random-utf8", rand_utf8)])

# 2. Llama-3 style: Split(regex) + ByteLevel(use_regex=false), ignore_merges, BOS template.
LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
          r"\s*[\r\n]+|\s+(?!\S)|\s+")
j = json.loads(g.to_str())
j["model"]["ignore_merges"] = True
l3 = Tokenizer.from_str(json.dumps(j))
l3.pre_tokenizer = pre_tokenizers.Sequence([
    pre_tokenizers.Split(tokenizers.Regex(LLAMA3), behavior="isolated", invert=False),
    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
l3.add_special_tokens(["<|begin_of_text|>", "<|end_of_text|>"])
bot = l3.token_to_id("<|begin_of_text|>")
l3.post_processor = processors.Sequence([
    processors.ByteLevel(trim_offsets=False),
    processors.TemplateProcessing(single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bot)])])
check_hf("llama3-style", save(l3, "llama3"), l3, special=True, byte_level=True)

# 2b. Qwen2 style: NFC normalizer, Split(Qwen2 regex: single digits) + ByteLevel(use_regex=false).
QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
         r"\s*[\r\n]+|\s+(?!\S)|\s+")
q2 = Tokenizer.from_str(g.to_str())
q2.normalizer = normalizers.NFC()
q2.pre_tokenizer = pre_tokenizers.Sequence([
    pre_tokenizers.Split(tokenizers.Regex(QWEN2), behavior="isolated", invert=False),
    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
MARKS = [chr(c) for c in range(0x300, 0x370)] + ["\u0323", "\u031b", "\u0302", "\u3099", "\u309a", "\u05b4"]
BASES = list("aeiouAEIOUnNcCsSzZ") + ["\u1100", "\u1161", "\u11a8", "\uac00", "\u304b", "\u30cf", "\u212b",
                                      "\u00c5", "\u1e9b", "\u0fb2", "\u0f80", " "]
combining = ["".join(rng.choice(BASES + MARKS * 2) for _ in range(rng.randint(1, 25))) for _ in range(1500)]
check_hf("qwen2-style-nfc", save(q2, "qwen2"), q2, corpora=[
    ("shakespeare-lines", shakes_lines), ("mixed", mixed), ("random-utf8", rand_utf8), ("combining-marks", combining)])

# 3. Byte-level BPE trained by HF on tinyshakespeare (add_prefix_space, added tokens with
#    lstrip/rstrip/single_word/normalized).
bl = Tokenizer(models.BPE())
bl.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
bl.decoder = decoders.ByteLevel()
bl.train_from_iterator(shakes_lines, trainers.BpeTrainer(
    vocab_size=800, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    show_progress=False))
bl.add_special_tokens([AddedToken("<mask>", lstrip=True, rstrip=True), AddedToken("[SPECIAL]", single_word=True)])
bl.add_tokens([AddedToken("world", normalized=True), AddedToken("café", single_word=True)])
bl.post_processor = processors.RobertaProcessing(("<|endoftext|>", 0), ("<mask>", bl.token_to_id("<mask>")))
d = save(bl, "bytelevel")
# (no byte round-trip here: add_prefix_space inserts a space, in HF as in lathe)
check_hf("hf-trained-bytelevel", d, bl)
check_hf("hf-trained-bytelevel+special", d, bl, special=True, corpora=[("mixed", mixed)])

# 4. SentencePiece-style BPE (Llama-2 "legacy" layout): Prepend/Replace normalizers, no
#    pre-tokenizer, byte_fallback with <0xXX> tokens in the model vocab, fuse_unk, BOS template.
sp = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
sp.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
sp.train_from_iterator(shakes_lines, trainers.BpeTrainer(
    vocab_size=700, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False))
j = json.loads(sp.to_str())
n = len(j["model"]["vocab"])
for b in range(256):
    j["model"]["vocab"][f"<0x{b:02X}>"] = n + b
j["decoder"] = {"type": "Sequence", "decoders": [
    {"type": "Replace", "pattern": {"String": "▁"}, "content": " "}, {"type": "ByteFallback"}, {"type": "Fuse"},
    {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
sp = Tokenizer.from_str(json.dumps(j))
sp.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
d = save(sp, "spm-style", legacy_merges=True, config={"bos_token": "<s>", "eos_token": "</s>"})
check_hf("hf-trained-sentencepiece-style", d, sp,
         corpora=[("shakespeare-lines", shakes_lines), ("mixed", mixed), ("random-utf8", rand_utf8)])
check_hf("hf-trained-sentencepiece-style+special", d, sp, special=True, corpora=[("mixed", mixed)])

# 5. Metaspace pre-tokenizer (prepend_scheme=first, split) + Metaspace decoder, unk without fusing.
ms = Tokenizer(models.BPE(unk_token="<unk>"))
ms.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
ms.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first", split=True)
ms.train_from_iterator(shakes_lines, trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "<s>"],
                                                         show_progress=False))
check_hf("hf-trained-metaspace", save(ms, "metaspace"), ms,
         corpora=[("shakespeare-lines", shakes_lines), ("mixed", mixed)])

# 6. SentencePiece .model files trained by spm_train (BPE with byte fallback, and unigram).
train_txt = os.path.join(tmp, "train.txt")
open(train_txt, "w", encoding="utf-8").write("\n".join(shakes_lines[:20000]))
for mtype, extra in (("bpe", ["--byte_fallback=true"]), ("unigram", [])):
    prefix = os.path.join(tmp, f"spm_{mtype}")
    subprocess.run(["spm_train", f"--input={train_txt}", f"--model_prefix={prefix}", "--vocab_size=600",
                    f"--model_type={mtype}", "--minloglevel=2"] + extra, check=True, capture_output=True)
    proc = spm.SentencePieceProcessor(model_file=prefix + ".model")
    for cname, texts in (("shakespeare-lines", shakes_lines), ("mixed", mixed), ("random-utf8", rand_utf8)):
        want = proc.encode(texts)
        got = lathe_encode(prefix + ".model", texts)
        compare(f"spm_train-{mtype} encode {cname}", texts, got, want)
        dec = lathe_decode(prefix + ".model", want)
        compare(f"spm_train-{mtype} decode {cname}", texts, dec, [proc.decode(w).encode() for w in want])

if failures:
    print(f"\n{len(failures)} FAILURES")
    for f in failures:
        print(" -", f)
    sys.exit(1)
print("all tokenizer exactness checks passed")
