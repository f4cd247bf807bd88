#!/usr/bin/env python3
"""GGUF export of what llama.cpp cannot represent: each refusal names the file, the field or the
value and says what to do (tests/hostile.py harness: exit 1, the message, bounded time/memory).
Tiny llama model directories written with numpy + safetensors; tokenizers written by hand or
trained with sentencepiece."""
import io
import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
from hostile import Cases, run_lathe  # noqa: E402

try:
    from safetensors.numpy import save_file
    import sentencepiece as spm
except ImportError as e:
    print(f"FAIL safetensors/sentencepiece not importable ({e}); run scripts/setup.sh")
    sys.exit(1)

cases = Cases()


def byte_chars():
    # GPT-2's byte -> printable character table
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def tokenizer_json(pre=None, normalizer=None, specials=("<|endoftext|>",), ignore_merges=False):
    vocab = {c: b for b, c in byte_chars().items()}
    return {"version": "1.0", "added_tokens": [{"id": 256 + i, "content": s, "special": True, "single_word": False,
                                                "lstrip": False, "rstrip": False, "normalized": False}
                                               for i, s in enumerate(specials)],
            "normalizer": normalizer,
            "pre_tokenizer": pre or {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                                     "use_regex": True},
            "post_processor": None, "decoder": {"type": "ByteLevel"},
            "model": {"type": "BPE", "vocab": vocab, "merges": [], "ignore_merges": ignore_merges}}


def model_dir(name, V, tok=None, spm_model=None, **cfg):
    d = cases.path(name, "x")[:-2]
    C, F, L = 16, 32, 1
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": C,
              "num_hidden_layers": L, "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": F,
              "vocab_size": V, "max_position_embeddings": 32, "tie_word_embeddings": False, "rms_norm_eps": 1e-5,
              "bos_token_id": None, "eos_token_id": None}  # null as HF writes them: not LlamaConfig's 1 and 2
    config.update(cfg)
    rng = np.random.default_rng(0)
    w = lambda *s: rng.standard_normal(s).astype(np.float32) * 0.02  # noqa: E731
    t = {"model.embed_tokens.weight": w(V, C), "lm_head.weight": w(V, C), "model.norm.weight": np.ones(C, np.float32)}
    for i in range(L):
        p = f"model.layers.{i}."
        t.update({p + "input_layernorm.weight": np.ones(C, np.float32),
                  p + "post_attention_layernorm.weight": np.ones(C, np.float32),
                  p + "self_attn.q_proj.weight": w(C, C), p + "self_attn.k_proj.weight": w(C // 2, C),
                  p + "self_attn.v_proj.weight": w(C // 2, C), p + "self_attn.o_proj.weight": w(C, C),
                  p + "mlp.gate_proj.weight": w(F, C), p + "mlp.up_proj.weight": w(F, C),
                  p + "mlp.down_proj.weight": w(C, F)})
    save_file(t, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    json.dump(config, open(os.path.join(d, "config.json"), "w"))
    if tok is not None:
        json.dump(tok, open(os.path.join(d, "tokenizer.json"), "w"))
    if spm_model is not None:
        open(os.path.join(d, "tokenizer.model"), "wb").write(spm_model)
    return d


def sp_model(**kw):
    buf = io.BytesIO()
    text = ["the quick brown fox jumps over the lazy dog", "lathe trains language models"] * 20
    spm.SentencePieceTrainer.train(sentence_iterator=iter(text), model_writer=buf, vocab_size=60,
                                   hard_vocab_limit=False, minloglevel=2, **kw)
    return buf.getvalue()


def gguf(d, *extra):
    return ["convert", "--from-hf", d, "--to-gguf", os.path.join(d, "out.gguf")] + list(extra)


with cases.case("baseline: a representable tokenizer exports (pre gpt-2)"):
    d = model_dir("ok", 257, tokenizer_json())
    run_lathe(gguf(d), rc=0, must=["tokenizer.ggml.pre = gpt-2", "eos 256"], stream="stdout")

with cases.case("Metaspace (SentencePiece-style) tokenizer.json"):
    d = model_dir("metaspace", 257, tokenizer_json(pre={"type": "Metaspace", "replacement": "\u2581",
                                                         "prepend_scheme": "always", "split": False}))
    run_lathe(gguf(d), must=["tokenizer.json", "pre_tokenizer", "Metaspace", "tokenizer.model"])

with cases.case("a split regex llama.cpp has no name for"):
    d = model_dir("regex", 257, tokenizer_json(pre={"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": "[A-Za-z]+|[0-9]"}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "use_regex": False}]}))
    run_lathe(gguf(d), must=["tokenizer.json", "no pre-tokenizer that splits like this", "[A-Za-z]+|[0-9]",
                             "llama-bpe", "--gguf-pre NAME"])
    # ... and the user may name one (then llama.cpp uses that name's rules)
    run_lathe(gguf(d, "--gguf-pre", "gpt-2"), rc=0, must=["tokenizer.ggml.pre = gpt-2 (from --gguf-pre)"],
              stream="stdout")

with cases.case("--gguf-pre with a name llama.cpp does not know"):
    d = model_dir("badpre", 257, tokenizer_json())
    run_lathe(gguf(d, "--gguf-pre", "gpt2"), must=["--gguf-pre \"gpt2\"", "not a pre-tokenizer llama.cpp knows",
                                                   "gpt-2"])

with cases.case("ByteLevel add_prefix_space true"):
    d = model_dir("prefix", 257, tokenizer_json(pre={"type": "ByteLevel", "add_prefix_space": True,
                                                      "use_regex": True}))
    run_lathe(gguf(d), must=["tokenizer.json", "pre_tokenizer.add_prefix_space = true", "never adds a prefix space"])

with cases.case("a normalizer llama.cpp does not apply"):
    d = model_dir("prepend", 257, tokenizer_json(normalizer={"type": "Prepend", "prepend": "_"}))
    run_lathe(gguf(d), must=["tokenizer.json", "normalizer", "Prepend", "no llama.cpp equivalent"])

with cases.case("Llama-3 regex with ignore_merges on a gpt-2 split"):
    d = model_dir("im", 257, tokenizer_json(ignore_merges=True))
    run_lathe(gguf(d), must=["model.ignore_merges true", "gpt-2"])

with cases.case("no end-of-text token anywhere"):
    d = model_dir("noeos", 256, tokenizer_json(specials=()))
    run_lathe(gguf(d), must=["no end-of-text id", "eos_token_id", "config.json"])
    # config.json's eos_token_id is enough
    d = model_dir("eoscfg", 256, tokenizer_json(specials=()), eos_token_id=10)
    run_lathe(gguf(d), rc=0, must=["eos 10"], stream="stdout")

with cases.case("tokenizer larger than the model's vocabulary"):
    d = model_dir("small", 200, tokenizer_json())
    run_lathe(gguf(d), must=["257 tokens", "vocab_size is 200"])

with cases.case("SentencePiece unigram model"):
    d = model_dir("unigram", 64, spm_model=sp_model(model_type="unigram", normalization_rule_name="identity"))
    run_lathe(gguf(d), must=["tokenizer.model", "model_type is unigram", "--model_type=bpe"])

with cases.case("SentencePiece with NFKC normalization"):
    d = model_dir("nfkc", 64, spm_model=sp_model(model_type="bpe"))
    run_lathe(gguf(d), must=["tokenizer.model", "normalizer_spec.name is 'nmt_nfkc'", "identity"])

with cases.case("mistral sliding window shorter than the context"):
    d = model_dir("swa", 257, tokenizer_json(), model_type="mistral", architectures=["MistralForCausalLM"],
                  sliding_window=16)
    run_lathe(gguf(d), must=["sliding_window 16 < context 32"])

cases.finish()
