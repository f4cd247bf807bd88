#!/usr/bin/env python3
"""Hostile tokenizer files (issue 14): tokenizer.json, encoder.json + vocab.bpe, tokenizer_config.json
and SentencePiece .model files that are malformed, oversized, self-amplifying or not files at all.
Every case must end with exit 1 and an error naming the file and the field, in bounded time and
memory (tests/hostile.py), through `lathe encode`, `lathe decode` or `lathe tokenize`.

Env: LATHE_BIN, LATHE_SOURCE_DIR. Run: /usr/bin/python3 test_hostile_tokenizer.py
"""
import json
import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.join(os.environ.get("LATHE_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", "..")),
                                "tests"))
from hostile import Cases, run_lathe  # noqa: E402

cases = Cases()
DEEP = 60000  # nesting levels: overflowed the stack in recursive copies / dumps before the depth check


def byte_to_unicode():
    """GPT-2's byte -> printable unicode character map."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


B2U = byte_to_unicode()
BASE_VOCAB = {B2U[b]: b for b in range(256)}
BASE_VOCAB.update({"Ġt": 256, "he": 257, "Ġthe": 258, "<|endoftext|>": 259})
BASE_MERGES = ["Ġ t", "h e", "Ġt he"]


def tok_json(**over):
    """A small valid byte-level BPE tokenizer.json (GPT-2 style), with top-level fields replaced."""
    cfg = {
        "version": "1.0",
        "added_tokens": [{"id": 259, "content": "<|endoftext|>", "special": True, "normalized": False}],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True},
        "post_processor": None,
        "decoder": {"type": "ByteLevel"},
        "model": {"type": "BPE", "vocab": dict(BASE_VOCAB), "merges": list(BASE_MERGES)},
    }
    cfg.update(over)
    return cfg


def write_dir(name, files):
    """Writes {filename: str|bytes|dict} into a fresh directory; returns its path."""
    d = cases.path(name, "x")[:-2]
    os.makedirs(d, exist_ok=True)
    for fn, data in files.items():
        if isinstance(data, dict) or isinstance(data, list):
            data = json.dumps(data)
        cases.write(os.path.join(name, fn), data)
    return d


def encode(path, must, text="hello the world", rc=1, **kw):
    return run_lathe(["encode", "--tokenizer", path], rc=rc, must=must, stdin=text.encode(), timeout=30, **kw)


def model_with(**model_over):
    cfg = tok_json()
    cfg["model"].update(model_over)
    return cfg


# ---------------------------------------------------------------- sanity: the fixtures load
with cases.case("valid fixtures encode"):
    d = write_dir("ok_json", {"tokenizer.json": tok_json()})
    p = encode(d, [], text="hello the world<|endoftext|>", rc=0)
    assert p.stdout.split()[-1] == b"259", p.stdout
    g = write_dir("ok_gpt2", {"encoder.json": BASE_VOCAB, "vocab.bpe": "#version: 0.2\n" + "\n".join(BASE_MERGES) + "\n"})
    p = encode(g, [], rc=0)
    assert p.stdout.split() == encode(d, [], rc=0).stdout.split()

# ---------------------------------------------------------------- 1. deep nesting
with cases.case("deep JSON in a tokenizer.json merges entry"):
    text = json.dumps(tok_json()).replace('"merges": [', '"merges": [' + "[" * DEEP + "]" * DEEP + ",", 1)
    d = write_dir("deep_merges", {"tokenizer.json": text})
    encode(d, ["tokenizer.json", "nests deeper"])

with cases.case("deep JSON in tokenizer.json added_tokens"):
    text = json.dumps(tok_json()).replace('"added_tokens": [', '"added_tokens": [' + "[" * DEEP + "]" * DEEP + ",", 1)
    d = write_dir("deep_added", {"tokenizer.json": text})
    encode(d, ["tokenizer.json", "nests deeper"])

with cases.case("deep JSON in encoder.json"):
    enc = json.dumps(BASE_VOCAB)[:-1] + ', "deep": ' + "[" * DEEP + "]" * DEEP + "}"
    d = write_dir("deep_encoder", {"encoder.json": enc, "vocab.bpe": "\n".join(BASE_MERGES)})
    encode(d, ["encoder.json", "nests deeper"])

with cases.case("deep JSON in tokenizer_config.json"):
    d = write_dir("deep_tcfg", {"tokenizer.json": tok_json(),
                                "tokenizer_config.json": '{"bos_token": ' + "[" * DEEP + "]" * DEEP + "}"})
    encode(d, ["tokenizer_config.json", "nests deeper"])

# ---------------------------------------------------------------- 2. token ids near 2^31
with cases.case("vocab id 2^31-1 in tokenizer.json"):
    d = write_dir("big_vocab_id", {"tokenizer.json": model_with(vocab=dict(BASE_VOCAB, zz=2**31 - 1))})
    encode(d, ["tokenizer.json", "model.vocab", "2147483647"], mem_mb=2048)

with cases.case("vocab id 2^40 in tokenizer.json (silently truncated to int32 before)"):
    d = write_dir("huge_vocab_id", {"tokenizer.json": model_with(vocab=dict(BASE_VOCAB, zz=2**40))})
    encode(d, ["tokenizer.json", "model.vocab", "1099511627776"], mem_mb=2048)

with cases.case("negative vocab id in tokenizer.json"):
    d = write_dir("neg_vocab_id", {"tokenizer.json": model_with(vocab=dict(BASE_VOCAB, zz=-3))})
    encode(d, ["tokenizer.json", "model.vocab", "-3"])

with cases.case("added_tokens id 2^31-1"):
    cfg = tok_json(added_tokens=[{"id": 2**31 - 1, "content": "<x>", "special": True}])
    d = write_dir("big_added_id", {"tokenizer.json": cfg})
    encode(d, ["tokenizer.json", "added_tokens[0].id", "2147483647"], mem_mb=2048)

with cases.case("added_tokens id far beyond the vocabulary"):
    cfg = tok_json(added_tokens=[{"id": 50_000_000, "content": "<x>", "special": True}])
    d = write_dir("far_added_id", {"tokenizer.json": cfg})
    encode(d, ["tokenizer.json", "added_tokens[0].id", "50000000"], mem_mb=2048)

with cases.case("encoder.json id 2^31-1"):
    d = write_dir("big_enc_id", {"encoder.json": dict(BASE_VOCAB, zz=2**31 - 1), "vocab.bpe": "\n".join(BASE_MERGES)})
    encode(d, ["encoder.json", "zz", "2147483647"], mem_mb=2048)

with cases.case("encoder.json <|endoftext|> id 2^31-1"):
    d = write_dir("big_eot_id", {"encoder.json": dict(BASE_VOCAB, **{"<|endoftext|>": 2**31 - 1}),
                                 "vocab.bpe": "\n".join(BASE_MERGES)})
    encode(d, ["encoder.json", "<|endoftext|>", "2147483647"], mem_mb=2048)

# ---------------------------------------------------------------- 3. loops on empty configured strings
with cases.case("Metaspace pre-tokenizer with an empty replacement"):
    d = write_dir("meta_empty", {"tokenizer.json": tok_json(
        pre_tokenizer={"type": "Metaspace", "replacement": "", "prepend_scheme": "always", "split": True})})
    encode(d, ["tokenizer.json", "pre_tokenizer", "replacement"])

with cases.case("Metaspace decoder with an empty replacement"):
    d = write_dir("meta_dec_empty", {"tokenizer.json": tok_json(decoder={"type": "Metaspace", "replacement": ""})})
    run_lathe(["decode", "--tokenizer", d], rc=1, must=["tokenizer.json", "decoder", "replacement"], stdin=b"1 2",
              timeout=30)

# Guards (these terminated before too): an empty Split / Replace pattern never matches (as in HF,
# whose &str Pattern returns no match for ""), and regex matches that are empty are skipped, so
# the scan always advances.
with cases.case("Split pre-tokenizer with an empty pattern terminates (guard)"):
    d = write_dir("split_empty", {"tokenizer.json": tok_json(pre_tokenizer={
        "type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"String": ""}, "behavior": "Isolated", "invert": False},
            {"type": "Split", "pattern": {"Regex": "x*"}, "behavior": "Removed", "invert": True},
            {"type": "ByteLevel", "add_prefix_space": False, "use_regex": False}]})})
    encode(d, [], rc=0)

with cases.case("Replace normalizers with empty patterns terminate (guard)"):
    d = write_dir("replace_empty", {"tokenizer.json": tok_json(normalizer={"type": "Sequence", "normalizers": [
        {"type": "Replace", "pattern": {"String": ""}, "content": "x"},
        {"type": "Replace", "pattern": {"Regex": "q*"}, "content": "y"}]})})
    encode(d, [], rc=0)

# ---------------------------------------------------------------- 4. self-amplifying normalizers
with cases.case("30 chained Replace normalizers a -> aa"):
    reps = [{"type": "Replace", "pattern": {"String": "a"}, "content": "aa"}] * 30
    d = write_dir("replace_chain", {"tokenizer.json": tok_json(normalizer={"type": "Sequence", "normalizers": reps})})
    encode(d, ["tokenizer.json", "normalizer", "Replace", "grow"], text="banana " * 100, mem_mb=1024)

with cases.case("30 chained Replace normalizers on a rare character (caught at run time)"):
    reps = [{"type": "Replace", "pattern": {"String": "\u2603"}, "content": "\u2603\u2603"}] * 30
    d = write_dir("replace_chain_rare", {"tokenizer.json": tok_json(normalizer={"type": "Sequence",
                                                                                "normalizers": reps})})
    encode(d, [], text="plain text loads and encodes", rc=0)
    encode(d, ["tokenizer.json", "normalizer", "Replace", "grow"], text="snow \u2603 man", mem_mb=1024)

with cases.case("30 chained Replace decoders a -> aa"):
    reps = [{"type": "Replace", "pattern": {"String": "a"}, "content": "aa"}] * 30
    d = write_dir("replace_dec_chain", {"tokenizer.json": tok_json(decoder={"type": "Sequence", "decoders": reps})})
    run_lathe(["decode", "--tokenizer", d], rc=1, must=["tokenizer.json", "decoder", "Replace", "grow"],
              stdin=b"97 97 97 97", timeout=30, mem_mb=1024)

# ---------------------------------------------------------------- 5. post-processor ids
def template(ids_bos):
    return {"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [], "special_tokens": {"<s>": {"id": "<s>", "ids": ids_bos, "tokens": ["<s>"]}}}


for label, ids in (("out of range", [99999]), ("negative", [-5]), ("2^31", [2**31])):
    with cases.case(f"TemplateProcessing special token id {label}"):
        d = write_dir(f"tmpl_{label.replace(' ', '_').replace('^', '')}", {"tokenizer.json": tok_json(
            post_processor=template(ids))})
        encode(d, ["tokenizer.json", "post_processor", "special_tokens", str(ids[0])])

with cases.case("RobertaProcessing cls id out of range"):
    d = write_dir("roberta_cls", {"tokenizer.json": tok_json(
        post_processor={"type": "RobertaProcessing", "cls": ["<s>", 123456], "sep": ["</s>", 259]})})
    encode(d, ["tokenizer.json", "post_processor", "cls", "123456"])

with cases.case("BertProcessing sep id negative"):
    d = write_dir("bert_sep", {"tokenizer.json": tok_json(
        post_processor={"type": "BertProcessing", "cls": ["[CLS]", 259], "sep": ["[SEP]", -1]})})
    encode(d, ["tokenizer.json", "post_processor", "sep", "-1"])

# ---------------------------------------------------------------- 6. SentencePiece
with cases.case("garbage SentencePiece .model"):
    p = cases.write("spm_garbage/tokenizer.model", os.urandom(4096))
    encode(p, ["tokenizer.model", "not a valid SentencePiece model"], must_not=["Internal:", ".cc("])

with cases.case("empty SentencePiece .model"):
    p = cases.write("spm_empty/tokenizer.model", b"")
    encode(p, ["tokenizer.model", "the file is empty"], must_not=["Internal:"])

# Inputs found by fuzz_sentencepiece (tests/fuzz/regressions/sentencepiece): a corrupt normalization
# table was read out of bounds by libsentencepiece (silent garbage in Release, a crash under ASan),
# an empty piece made its darts-clone builder throw a foreign exception.
REG = os.path.join(os.environ.get("LATHE_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", "..")),
                   "tests", "fuzz", "regressions", "sentencepiece")
for fn, must in (("charsmap_offset_out_of_trie.model", "precompiled_charsmap is corrupt"),
                 ("charsmap_bad_leaf.model", "precompiled_charsmap is corrupt"),
                 ("darts_zero_length_key.model", "not a valid SentencePiece model")):
    with cases.case(f"SentencePiece {fn}"):
        encode(os.path.join(REG, fn), [fn, must], text="Hello world! It's 2024: caf\u00e9 \u2581x <s></s>")

with cases.case("FIFO in place of tokenizer.model"):
    d = cases.path("spm_fifo", "x")[:-2]
    os.makedirs(d, exist_ok=True)
    os.mkfifo(os.path.join(d, "tokenizer.model"))
    encode(d, ["tokenizer.model", "FIFO"])

with cases.case("directory named x.model"):
    d = cases.path("spm_dir", "x.model")
    os.makedirs(d, exist_ok=True)
    encode(d, ["x.model", "contains none"])

# ---------------------------------------------------------------- 7. wrong JSON types name the field
TYPE_CASES = [
    ("vocab value a string", model_with(vocab=dict(BASE_VOCAB, zz="x")), ["model.vocab", "zz", "integer", "a string"]),
    ("vocab is a list", model_with(vocab=[1, 2]), ["model.vocab", "object", "an array"]),
    ("merges entry a number", model_with(merges=BASE_MERGES + [5]), ["model.merges[3]", "an integer"]),
    ("merges is an object", model_with(merges={"a": 1}), ["model.merges", "an object"]),
    ("model.type a number", model_with(type=5), ["model.type", "an integer"]),
    ("fuse_unk a string", model_with(fuse_unk="no"), ["model.fuse_unk", "boolean", "a string"]),
    ("dropout a string", model_with(dropout="x"), ["model.dropout", "a string"]),
    ("unk_token a number", model_with(unk_token=3), ["model.unk_token", "an integer"]),
    ("added_tokens[3].id a string", tok_json(added_tokens=[
        {"id": 259, "content": "<|endoftext|>", "special": True}, {"id": 260, "content": "<a>"},
        {"id": 261, "content": "<b>"}, {"id": "x", "content": "<c>"}]), ["added_tokens[3].id", "a string"]),
    ("added_tokens[0].content a number", tok_json(added_tokens=[{"id": 259, "content": 7}]),
     ["added_tokens[0].content", "an integer"]),
    ("added_tokens[0].special a string", tok_json(added_tokens=[{"id": 259, "content": "<x>", "special": "yes"}]),
     ["added_tokens[0].special", "a string"]),
    ("added_tokens is an object", tok_json(added_tokens={"a": 1}), ["added_tokens", "an object"]),
    ("normalizer Replace content a number", tok_json(normalizer={"type": "Replace", "pattern": {"String": "a"},
                                                                 "content": 3}), ["normalizer", "content", "an integer"]),
    ("normalizer Sequence normalizers a string", tok_json(normalizer={"type": "Sequence", "normalizers": "x"}),
     ["normalizer.normalizers", "a string"]),
    ("pre_tokenizer add_prefix_space a string", tok_json(pre_tokenizer={"type": "ByteLevel", "add_prefix_space": "y"}),
     ["pre_tokenizer", "add_prefix_space", "a string"]),
    ("pre_tokenizer Split pattern a number", tok_json(pre_tokenizer={"type": "Split", "pattern": 3,
                                                                     "behavior": "Isolated"}),
     ["pre_tokenizer", "pattern", "an integer"]),
    ("pre_tokenizer Split pattern String a number", tok_json(pre_tokenizer={"type": "Split", "pattern": {"String": 3},
                                                                            "behavior": "Isolated"}),
     ["pre_tokenizer", "pattern.String", "an integer"]),
    ("decoder Strip start a string", tok_json(decoder={"type": "Strip", "content": " ", "start": "1", "stop": 0}),
     ["decoder", "start", "a string"]),
    ("decoder Strip start negative", tok_json(decoder={"type": "Strip", "content": " ", "start": -1, "stop": 0}),
     ["decoder", "start", "-1"]),
    ("post_processor single not a list", tok_json(post_processor={"type": "TemplateProcessing", "single": 3,
                                                                  "special_tokens": {}}),
     ["post_processor", "single", "an integer"]),
    ("post_processor special ids a string", tok_json(post_processor=dict(template([1]), special_tokens={
        "<s>": {"id": "<s>", "ids": "1", "tokens": ["<s>"]}})), ["post_processor", "special_tokens", "ids", "a string"]),
    ("post_processor Roberta cls a string", tok_json(post_processor={"type": "RobertaProcessing", "cls": "x",
                                                                     "sep": ["</s>", 2]}),
     ["post_processor", "cls", "a string"]),
    ("post_processor type a number", tok_json(post_processor={"type": 3}), ["post_processor", "type"]),
    ("top level an array", [1, 2], ["top level", "an array"]),
]
for label, cfg, must in TYPE_CASES:
    with cases.case(f"type error: {label}"):
        d = write_dir("type_" + "".join(c if c.isalnum() else "_" for c in label), {"tokenizer.json": cfg})
        p = encode(d, ["tokenizer.json"] + must, must_not=["json.exception"])

with cases.case("type error: encoder.json value a string"):
    d = write_dir("enc_type", {"encoder.json": dict(BASE_VOCAB, zz="x"), "vocab.bpe": "\n".join(BASE_MERGES)})
    encode(d, ["encoder.json", "zz", "a string"], must_not=["json.exception"])

with cases.case("type error: tokenizer_config.json bos_token a number"):
    d = write_dir("tcfg_type", {"tokenizer.json": tok_json(), "tokenizer_config.json": {"bos_token": 5}})
    encode(d, ["tokenizer_config.json", "bos_token", "an integer"], must_not=["json.exception"])

with cases.case("type error: tokenizer_config.json bos_token.content a number"):
    d = write_dir("tcfg_type2", {"tokenizer.json": tok_json(), "tokenizer_config.json": {"bos_token": {"content": 5}}})
    encode(d, ["tokenizer_config.json", "bos_token.content", "an integer"], must_not=["json.exception"])

with cases.case("tokenizer_config.json not an object"):
    d = write_dir("tcfg_arr", {"tokenizer.json": tok_json(), "tokenizer_config.json": [1]})
    encode(d, ["tokenizer_config.json", "object", "an array"])

# ---------------------------------------------------------------- 8. not regular files
def special_dir(name, fn, kind):
    d = cases.path(name, "x")[:-2]
    os.makedirs(d, exist_ok=True)
    p = os.path.join(d, fn)
    if kind == "fifo":
        os.mkfifo(p)
    elif kind == "dir":
        os.makedirs(p)
    else:
        os.symlink(p, p)  # a link to itself: ELOOP
    return d


for fn, kind, must in (("tokenizer.json", "fifo", "FIFO"), ("tokenizer.json", "dir", "directory"),
                       ("tokenizer.json", "loop", "symbolic links")):
    with cases.case(f"{fn} is a {kind}"):
        d = special_dir(f"nf_{kind}", fn, kind)
        encode(d, [fn, must], must_not=["filesystem error"])

with cases.case("encoder.json is a FIFO"):
    d = special_dir("nf_enc", "encoder.json", "fifo")
    cases.write("nf_enc/vocab.bpe", "\n".join(BASE_MERGES))
    encode(d, ["encoder.json", "FIFO"])

with cases.case("vocab.bpe is a FIFO"):
    d = special_dir("nf_bpe", "vocab.bpe", "fifo")
    cases.write("nf_bpe/encoder.json", json.dumps(BASE_VOCAB))
    encode(d, ["vocab.bpe", "FIFO"])

with cases.case("tokenizer_config.json is a FIFO"):
    d = special_dir("nf_tcfg", "tokenizer_config.json", "fifo")
    cases.write("nf_tcfg/tokenizer.json", json.dumps(tok_json()))
    encode(d, ["tokenizer_config.json", "FIFO"])

with cases.case("tokenizer.json symlink loop given as the file"):
    d = special_dir("nf_loop_file", "tokenizer.json", "loop")
    encode(os.path.join(d, "tokenizer.json"), ["tokenizer.json", "symbolic links"])

# ---------------------------------------------------------------- through the other commands
with cases.case("lathe tokenize with a hostile tokenizer.json"):
    d = write_dir("via_tokenize", {"tokenizer.json": model_with(vocab=dict(BASE_VOCAB, zz=2**31 - 1))})
    inp = cases.write("via_tokenize_in/a.txt", "hello the world\n")
    run_lathe(["tokenize", "--tokenizer", d, "--input", inp, "--output", cases.path("via_tokenize_out", "ds"),
               "--no-progress"], rc=1, must=["tokenizer.json", "model.vocab", "2147483647"], timeout=30, mem_mb=2048)

with cases.case("lathe decode with a deep tokenizer.json"):
    text = json.dumps(tok_json()).replace('"merges": [', '"merges": [' + "[" * DEEP + "]" * DEEP + ",", 1)
    d = write_dir("via_decode", {"tokenizer.json": text})
    run_lathe(["decode", "--tokenizer", d], rc=1, must=["tokenizer.json", "nests deeper"], stdin=b"1 2", timeout=30)

cases.finish()
