#!/usr/bin/env python3
"""GGUF exports run by llama.cpp itself (through the PyPI package llama-cpp-python, pinned in
scripts/requirements-llama-cpp.txt, which builds llama.cpp from source; CPU only) against lathe.

Models (tiny, random weights with std ~0.1 so that logits are O(1) and greedy choices are not
near-ties), each exported with `lathe convert --from-hf DIR --to-gguf FILE` (f32):
  * gpt2   GPT-2 with GPT-2's own tokenizer (shared/data/gpt2 encoder.json + vocab.bpe)  -> pre gpt-2
  * llama  Llama, GQA, untied head, with a Llama-3-regex byte-level BPE trained by
           `lathe tokenizer train --pretokenizer llama3`                                  -> pre dbrx
           (and the same tokenizer with ignore_merges true                                -> pre llama-bpe)
  * qwen2  Qwen2 (q/k/v biases, tied) with a Qwen2-regex tokenizer (NFC normalizer, ChatML
           specials), config.json without BOS/EOS ids: EOS must come from tokenizer_config.json
  * spm    Llama with a SentencePiece BPE tokenizer.model (identity normalization, byte fallback)
  * byte   Llama with lathe's byte tokenizer (`--gguf-tokenizer byte`)
  * mistral_hd  Mistral with an explicit head_dim (4 x 32 != hidden 64), byte tokenizer
  * phi3   Phi-3 (fused qkv_proj / gate_up_proj -> llama.cpp's phi3 architecture), byte tokenizer;
           and with partial_rotary_factor 0.5, and with longrope (check_phi3)
  * gemma2 Gemma 2 (1 + w norms, sandwich norms, soft caps, sliding window, query_pre_attn_scalar),
           byte tokenizer, against transformers with llama.cpp's fp16 GELU (check_gemma2)
  * olmo2  OLMo 2 (post norms only, whole-projection q/k norms), untied and tied, byte tokenizer
           (check_olmo2)
For each:
  * tokenization: llama.cpp's tokenize() (no BOS; special tokens parsed for byte-level BPE as lathe
    and HF match added tokens; not for SentencePiece, whose control pieces are plain text to
    libsentencepiece) equals `lathe encode` on 14 tricky texts (contractions in both cases,
    whitespace runs, tabs, CR/LF, blank lines, digits, unicode, emoji, special tokens, code)
  * logits: llama.cpp's f32 logits for a 20-token prompt within 1e-4 (absolute; the logits are
    O(1-10)) of `lathe logits`. GPT-2 exception: llama.cpp's GELU looks its result up in a fp16
    table (ggml-cpu vec.h GGML_GELU_FP16), so GPT-2 is compared (a) to transformers' GPT-2 with
    that fp16 GELU emulated (the export itself is exact), within 1e-4 plus a bound derived for one
    fp16 ulp per GELU element (gelu_fp16_bound below), and (b) to lathe within 5e-3, the measured
    effect of the table being 1.4e-3 on these logits (printed). Gemma 2's GeGLU reads the same
    table: compared the same way (a), and (b) lathe to transformers' exact-GELU Gemma 2 within 1e-4
  * greedy generation: 50 tokens by llama.cpp (KV cache, argmax), decoded by `lathe decode` and
    printed by `lathe generate`'s rule, equal `lathe generate --temperature 0 --max-new-tokens 50`
    (so the generated ids are compared, not llama.cpp's detokenizer)
  * metadata llama.cpp reads back: tokenizer.ggml.pre, EOS id, context length
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
    import torch
    import transformers
    import sentencepiece as spm
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers, decoders, Regex
except ImportError as e:
    print(f"FAIL torch/transformers/sentencepiece/tokenizers not importable ({e}); run scripts/setup.sh")
    sys.exit(1)
try:
    import llama_cpp
except ImportError as e:
    print(f"FAIL llama_cpp not importable ({e}); run scripts/setup.sh (installs llama-cpp-python, "
          "scripts/requirements-llama-cpp.txt)")
    sys.exit(1)
transformers.logging.set_verbosity_error()

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.environ.get("LATHE_SOURCE_DIR", os.path.join(HERE, "..", ".."))
LATHE = os.environ.get("LATHE_BIN", "build/lathe")
SHARED = "/work/shared/data"
if not os.path.exists(os.path.join(SHARED, "gpt2")):
    SHARED = os.path.join(SRC, "..", "shared", "data")
GPT2_TOK = os.path.join(SHARED, "gpt2")
failures = []

TEXTS = [
    "Hello world",
    "I'm sure they'll say it's what we've done, isn't it? He'd go.",
    "DON'T SHOUT, WE'LL HEAR YOU'RE THERE",
    "a  b   c    d\t\te     f",
    "line one\nline two\n\n\nline three\r\nwindows\r\n  indented\n",
    "   leading and trailing spaces   ",
    "12345 3.14159 1,000,000 2026-11-30 x2y3",
    "naïve café Ünïcödé 日本語のテキスト Ελληνικά",
    "emoji 🙂👍🏽 and symbols ©®™ €£¥",
    "special<|endoftext|>token<|endoftext|> end",
    "def f(x):\n    return x**2  # square\n",
    "tabs\tand\u00a0nbsp and — dashes",
    "\n\nstarts with newlines",
    "ends with spaces and newline  \n",
]


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what, flush=True)
    if not cond:
        failures.append(what)


def lathe(args, stdin=None):
    p = subprocess.run([LATHE] + args, input=stdin, capture_output=True)
    if p.returncode != 0:
        raise RuntimeError(f"lathe {' '.join(args)} failed ({p.returncode}):\n{p.stdout.decode()}\n{p.stderr.decode()}")
    return p.stdout


def lathe_encode(tok, texts):
    out = lathe(["encode", "--tokenizer", tok, "--nul"], stdin=b"\0".join(t.encode() for t in texts))
    lines = out.decode().split("\n")
    return [[int(x) for x in lines[i].split()] for i in range(len(texts))]


def randomize(m, seed):
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.1)
            elif "norm" in name or "ln_" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.05)
    return m


def fp16_gelu(m, sites=None):
    """transformers GPT-2 or Gemma 2 with llama.cpp's GELU (ggml-cpu vec.h ggml_vec_gelu_f32 /
    ggml_vec_geglu_f32 under GGML_GELU_FP16): tanh GELU of the fp16-rounded input, looked up in a
    fp16 table (so the output is fp16-rounded too); x <= -10 -> 0, x >= 10 -> x. Gemma 2's GeGLU
    multiplies that by up_proj's output, as llama.cpp's geglu does. With `sites` (a list), each
    call appends (input, fp32 output before its fp16 rounding, output) and each GELU's input
    projection (GPT-2's c_fc, Gemma 2's gate_proj) records the sum of |terms| of its outputs in
    `sites_mag` (for gelu_fp16_bound)."""
    act = transformers.activations.NewGELUActivation()  # = gelu_pytorch_tanh's function

    class F(torch.nn.Module):
        def forward(self, x):
            y32 = act(x.half().float())
            y = torch.where(x <= -10, torch.zeros_like(x), torch.where(x >= 10, x, y32.half().float()))
            if sites is not None:
                y.retain_grad()
                sites.append((x.detach(), y32.detach(), y))
            return y

    if hasattr(m, "transformer"):  # GPT-2: transformers Conv1D, x @ weight[C, 4C] + bias
        mlps = [(blk.mlp, "act", blk.mlp.c_fc,
                 lambda mod, x: x.abs() @ mod.weight.detach().abs() + mod.bias.detach().abs())
                for blk in m.transformer.h]
    else:  # Gemma 2: act_fn(gate_proj(x)) * up_proj(x), Linear without bias
        mlps = [(layer.mlp, "act_fn", layer.mlp.gate_proj, lambda mod, x: x.abs() @ mod.weight.detach().abs().T)
                for layer in m.model.layers]
    for mlp, attr, fc, mag in mlps:
        setattr(mlp, attr, F())
        if sites is not None:
            hooks.append(fc.register_forward_hook(
                lambda mod, inp, out, mag=mag: sites_mag.append(mag(mod, inp[0].detach()).numpy())))
    return m


sites_mag, hooks = [], []


def fp16_ulp(v):
    """The fp16 ulp at |v|: 2^(e-10) for 2^e <= |v| < 2^(e+1) (11 significant bits), 2^-24 below
    the smallest normal 2^-14 (subnormal spacing)."""
    e = np.floor(np.log2(np.maximum(np.abs(v), 2.0 ** -14)))
    return 2.0 ** (e - 10)


def fp16_tie_distance(v):
    """Distance from fp32 values v to the nearest fp16 rounding boundary (midpoint between two fp16
    values): a value that moves by less than this rounds to the same fp16. Conservative at a power
    of two (the spacing below it is half the spacing above)."""
    v = np.asarray(v, dtype=np.float64)
    h = v.astype(np.float16).astype(np.float64)
    u = fp16_ulp(h)
    pow2 = (np.abs(h) >= 2.0 ** -14) & (np.abs(h) == 2.0 ** np.floor(np.log2(np.maximum(np.abs(h), 2.0 ** -24))))
    return np.where(pow2, u / 2, u) / 2 - np.abs(v - h)


def gelu_fp16_bound(m, ids, rows, cols):
    """How far llama.cpp's fp16-table GELU may move each logit (rows[k], cols[k]) from the emulation
    (GPT-2's c_fc or Gemma 2's gate_proj, 64 products and no bias in these models: the same gamma).

    Derivation. Both round the GELU input x to fp16, take the tanh GELU in fp32 and round that to
    fp16 (llama.cpp when it builds its table), round to nearest, but from fp32 values that differ
    slightly, so a rounding can land one fp16 ulp away (ulp16 <= 2^-10 of the value: 11
    significant bits) -- only where the fp32 value lies closer to a rounding boundary than the
    two fp32 values may differ:
      * x: the c_fc GEMM sums 64 products + bias in some order: gamma_65 = 65 * 2^-24 < 2^-18 of
        its sum of |terms|; the layers before it (LayerNorm, attention: as many roundings again)
        are allowed as much: dx_i = 2^-17 * sum|terms|_i;
      * y: tanhf (libm, at table build) and torch's vectorised tanh (its implementation depends on
        the CPU's ISA, hence a difference that moves from one CPU to the next) are each within a
        few fp32 ulps; with the polynomial around them, dy_i = 16 ulp32(y_i) = 2^-19 |y_i|.
    Where the fp16 input is the same in both, only y's rounding can flip: the output moves by
    ulp16(y_i). Where the input may flip, the two GELU values differ by at most max|gelu'| *
    ulp16(x_i) = 1.13 ulp16(x_i) (the tanh GELU's slope peaks at 1.13, x ~ 1.5), and their two
    roundings by half an ulp each: 1.13 ulp16(x_i) + ulp16(y_i). |x| >= 10 takes the same branch
    in both. To first order a perturbation e with
    |e_i| <= b_i moves logit j by at most sum_i |d logit_j / d y_i| b_i: one backward pass per
    logit. Second-order terms are ~b_i^2 (1e-6 relative), below the fp32 allowance of 1e-4 kept
    beside this bound for the summation-order noise of the rest of the model (as for the other
    models). No CPU's measurement enters: the bound is computed from this model and prompt."""
    sites = []
    sites_mag.clear()
    mm = fp16_gelu(m, sites)
    logits = mm(torch.tensor([ids]), use_cache=False).logits[0]
    b = []
    for (x, y32, _), mag in zip(sites, sites_mag):
        x, y32 = x.numpy().astype(np.float64), y32.numpy().astype(np.float64)
        x_flip = fp16_tie_distance(x) <= 2.0 ** -17 * mag
        y_flip = fp16_tie_distance(y32) <= 2.0 ** -19 * np.abs(y32)
        bi = np.where(x_flip, 1.13 * fp16_ulp(x) + fp16_ulp(y32), np.where(y_flip, fp16_ulp(y32), 0.0))
        b.append(torch.from_numpy(np.where(np.abs(x) >= 10, 0.0, bi).astype(np.float32)))
    out = []
    for r, c in zip(rows, cols):
        for _, _, y in sites:
            y.grad = None
        logits[r, c].backward(retain_graph=True)
        out.append(sum(float((y.grad.abs() * bi).sum()) for (_, _, y), bi in zip(sites, b)))
    for h in hooks:
        h.remove()
    hooks.clear()
    return np.array(out)


def make_bpe_json(path, regex, nfc, specials, extra=None):
    tok = Tokenizer(models.BPE())
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tr = trainers.BpeTrainer(vocab_size=600, special_tokens=specials,
                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), tr)
    tok.save(path)
    return tok.get_vocab_size()


def corpus():
    base = ["The quick brown fox jumps over the lazy dog. It's 2026 and we'll train 12 models.",
            "Don't panic: lathe's tokenizer handles 3.14 and 1,000 digits.\n\tIndented line\n",
            "naïve café résumé, Ünïcödé strings, and   spaces.", "def f(x):\n    return x * 2\n"]
    return base * 30


QWEN2_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
            r"|\s+(?!\S)|\s+")


def load_llama(gguf, vocab_only=False):
    # f32 KV cache (llama.cpp's default is f16, which alone moves these logits by ~1e-3)
    return llama_cpp.Llama(model_path=gguf, n_ctx=128, n_threads=2, logits_all=True, verbose=False,
                           vocab_only=vocab_only, type_k=0, type_v=0)


def check_model(tag, model_dir, gguf, want_pre, special, hf_model=None, gpt2=False, tok=None):
    """hf_model (GPT-2 or Gemma 2, whose GELU llama.cpp reads from a fp16 table): the logits are
    compared to it with that table emulated, within the derived gelu_fp16_bound."""
    tok = tok or model_dir
    t0 = time.time()
    llm = load_llama(gguf)
    md = llm.metadata
    if want_pre is not None:
        check(md.get("tokenizer.ggml.pre") == want_pre, f"{tag}: llama.cpp reads tokenizer.ggml.pre = "
              f"{md.get('tokenizer.ggml.pre')} (want {want_pre})")
    # tokenization
    want = lathe_encode(tok, TEXTS)
    bad = []
    for t, w in zip(TEXTS, want):
        got = llm.tokenize(t.encode(), add_bos=False, special=special)
        if got != w:
            bad.append(f"{t!r}: llama.cpp {got[:12]} lathe {w[:12]}")
    check(not bad, f"{tag}: tokenization equals lathe encode on {len(TEXTS)} texts" + "".join("\n     " + b for b in bad))

    # logits on a 20-token prompt
    ids = (want[1] + want[4] + want[7])[:20]
    tmp = gguf + ".logits"
    lathe(["logits", "--model", model_dir, "--tokens", ",".join(map(str, ids)), "--out", tmp])
    V = llm.n_vocab()
    ref = np.fromfile(tmp, dtype=np.float32).reshape(len(ids), V)
    llm.reset()
    llm.eval(ids)
    got = np.array(llm.scores[:len(ids)], dtype=np.float32)
    d = float(np.abs(got - ref).max())
    scale = float(np.abs(ref).max())
    if hf_model is None:
        check(d <= 1e-4, f"{tag}: llama.cpp f32 logits vs lathe logits: max |diff| {d:.2e} <= 1e-4 (max |logit| {scale:.2f})")
    else:
        with torch.no_grad():
            exact = hf_model(torch.tensor([ids]), use_cache=False).logits[0].numpy()
            emu = fp16_gelu(hf_model)(torch.tensor([ids]), use_cache=False).logits[0].numpy()
        diff = np.abs(got - emu)
        de = float(diff.max())
        # Each of the 64 largest differences against its own derived bound (gelu_fp16_bound): the
        # rest are smaller, and one backward pass per checked logit keeps this quick.
        top = np.argsort(diff, axis=None)[-64:]
        rows, cols = np.unravel_index(top, diff.shape)
        bound = 1e-4 + gelu_fp16_bound(hf_model, ids, rows, cols)
        worst = int(np.argmax(diff[rows, cols] / bound))
        check(bool(np.all(diff[rows, cols] <= bound)),
              f"{tag}: llama.cpp logits vs transformers with llama.cpp's fp16 GELU: max |diff| {de:.2e}; "
              f"worst against its bound {diff[rows[worst], cols[worst]]:.2e} <= 1e-4 + one fp16 ulp per GELU "
              f"element propagated = {bound[worst]:.2e} (max |logit| {scale:.2f})")
        if gpt2:
            check(d <= 5e-3, f"{tag}: llama.cpp logits vs lathe logits (exact GELU): max |diff| {d:.2e} <= 5e-3 "
                  "(llama.cpp's fp16 GELU table)")
        else:  # the chain's other link: lathe's exact-GELU logits are transformers' (fp32 noise)
            dl = float(np.abs(ref - exact).max())
            check(dl <= 1e-4, f"{tag}: lathe logits vs transformers (exact GELU): max |diff| {dl:.2e} <= 1e-4 "
                  f"(llama.cpp vs lathe, the fp16 GELU table's effect: {d:.2e})")
    # greedy generation, 50 tokens, llama.cpp's KV cache
    prompt = "It's 2026 and"
    pids = llm.tokenize(prompt.encode(), add_bos=False, special=special)
    llm.reset()
    llm.eval(pids)
    gen = []
    for _ in range(50):
        nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        gen.append(nxt)
        llm.eval([nxt])
    # lathe generate prints the prompt, then the decoded continuation whenever decoding the tokens
    # so far extends what it printed (bytes); the same rule applied to llama.cpp's ids, decoded
    # by lathe, must give the same output.
    out = lathe(["generate", "--model", model_dir, "--tokenizer", tok, "--prompt", prompt, "--temperature", "0",
                 "--max-new-tokens", "50"])
    printed = lathe(["decode", "--tokenizer", tok], stdin=" ".join(map(str, gen)).encode())
    if prompt.encode() + printed + b"\n" != out:  # the rule matters only then (one call per prefix)
        printed = b""
        for k in range(1, len(gen) + 1):
            t = lathe(["decode", "--tokenizer", tok], stdin=" ".join(map(str, gen[:k])).encode())
            if len(t) > len(printed) and t.startswith(printed):
                printed = t
    text = (prompt.encode() + printed).decode("utf-8", "replace")
    lt = out.decode("utf-8", "replace")
    lt = lt[:-1] if lt.endswith("\n") else lt
    check(text == lt, f"{tag}: greedy 50 tokens by llama.cpp == lathe generate ({time.time() - t0:.1f} s)\n     llama.cpp {text[:100]!r}\n"
          f"     lathe     {lt[:100]!r}")
    return llm


def export(model_dir, gguf, extra=()):
    out = lathe(["convert", "--from-hf", model_dir, "--to-gguf", gguf] + list(extra)).decode()
    print("     " + out.strip().splitlines()[-1][:300])
    return out


def llama_cfg(V, **kw):
    return dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=96, vocab_size=V, max_position_embeddings=128, rms_norm_eps=1e-5, **kw)


def check_rope_scaling(tmp, llama_dir):
    """RoPE scaling as llama.cpp reads it: copies of the llama with each kind lathe exports
    (linear: rope.scaling.*, llama3: the rope_freqs tensor, yarn: rope.scaling.* with
    original_context_length): llama.cpp's f32 logits on a 20-token prompt within 1e-4 of lathe's
    (lathe's are checked against transformers in tests/models/test_rope_scaling); dynamic NTK and
    partial_rotary_factor (llama.cpp's llama refuses n_rot != head_dim) refused."""
    kinds = {
        "linear": {"rope_scaling": {"rope_type": "linear", "factor": 3.0}},
        "llama3": {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 32}},
        "yarn": {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
    }
    ids = list(range(3, 23))
    base = None
    for kind, edit in kinds.items():
        d = os.path.join(tmp, "rope_" + kind)
        shutil.copytree(llama_dir, d)
        cfg = json.load(open(os.path.join(d, "config.json")))
        cfg.update(edit)
        json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
        g = d + ".gguf"
        export(d, g)
        tmpf = g + ".logits"
        lathe(["logits", "--model", d, "--tokens", ",".join(map(str, ids)), "--out", tmpf])
        llm = load_llama(g)
        ref = np.fromfile(tmpf, dtype=np.float32).reshape(len(ids), llm.n_vocab())
        if base is None:
            lathe(["logits", "--model", llama_dir, "--tokens", ",".join(map(str, ids)), "--out", tmpf + ".0"])
            base = np.fromfile(tmpf + ".0", dtype=np.float32).reshape(ref.shape)
        llm.reset()
        llm.eval(ids)
        got = np.array(llm.scores[:len(ids)], dtype=np.float32)
        dd = float(np.abs(got - ref).max())
        moved = float(np.abs(ref - base).max())
        check(dd <= 1e-4 and moved > 1e-3, f"rope {kind}: llama.cpp f32 logits vs lathe: max |diff| {dd:.2e} <= 1e-4 "
              f"(the scaling moves lathe's logits by {moved:.2e})")
        del llm
    for kind, edit, needle in (("dynamic", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "no dynamic NTK"),
                               ("partial", {"partial_rotary_factor": 0.5}, "rope.dimension_count = head_dim")):
        d = os.path.join(tmp, "rope_" + kind)
        shutil.copytree(llama_dir, d)
        cfg = json.load(open(os.path.join(d, "config.json")))
        cfg.update(edit)
        json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
        p = subprocess.run([LATHE, "convert", "--from-hf", d, "--to-gguf", d + ".gguf"], capture_output=True, text=True)
        check(p.returncode == 1 and needle in p.stderr and not os.path.exists(d + ".gguf"),
              f"rope {kind}: refused ({p.stderr.strip()[-200:]})")


def phi3_variant(tmp, base, name, edit):
    e = os.path.join(tmp, name)
    shutil.rmtree(e, ignore_errors=True)
    shutil.copytree(base, e)
    c = json.load(open(os.path.join(e, "config.json")))
    edit(c)
    json.dump(c, open(os.path.join(e, "config.json"), "w"))
    return e


def compare_logits(tag, d, g, ids, what, **llama_kw):
    """llama.cpp's f32 logits for `ids` (one pass) vs `lathe logits` within 1e-4; returns lathe's."""
    lathe(["logits", "--model", d, "--tokens", ",".join(map(str, ids)), "--out", g + ".logits"])
    kw = dict(n_ctx=128, n_threads=2, logits_all=True, verbose=False, type_k=0, type_v=0)
    kw.update(llama_kw)
    llm = llama_cpp.Llama(model_path=g, **kw)
    ref = np.fromfile(g + ".logits", dtype=np.float32).reshape(len(ids), llm.n_vocab())
    llm.eval(ids)
    got = np.array(llm.scores[:len(ids)], dtype=np.float32)
    dd = float(np.abs(got - ref).max())
    check(dd <= 1e-4, f"{tag}: llama.cpp f32 logits vs lathe, {what}: max |diff| {dd:.2e} <= 1e-4")
    return ref


def check_phi3(tmp):
    """phi3 (GQA, untied) as llama.cpp's phi3 architecture: fused attn_qkv and ffn_up (gate rows
    first), NEOX RoPE; logits, tokenization and greedy generation as the others. Then:
      * partial_rotary_factor 0.5 (8 of 16 dims rotate; phi3.rope.dimension_count 8): logits;
      * longrope (rope_factors_long / rope_factors_short, rope.scaling.attn_factor,
        original_context_length, as convert_hf_to_gguf.py's Phi3MiniModel): llama.cpp picks the
        factors by its context size (long when n_ctx > original_max_position_embeddings 256),
        transformers' Phi3 (and lathe) by the pass length: compared where the two agree, a 300-token
        pass with n_ctx 512 (long) and a 40-token one with n_ctx 256 (short; llama.cpp rounds
        n_ctx up to 256). The factors and the attention factor move lathe's logits (printed), so a
        wrong one fails.
    A sliding window shorter than the context (llama.cpp 0.3.36's phi3 attended to the full context
    with phi3.attention.sliding_window set) is refused naming the reason."""
    # The directory name becomes general.name; llama.cpp 0.3.36 fails to load this byte vocabulary
    # ("unordered_map::at") when the name is "phi3" (a name-based special-token lookup), so "p3".
    d = os.path.join(tmp, "p3")
    randomize(transformers.Phi3ForCausalLM(transformers.Phi3Config(
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None, sliding_window=None,
        **llama_cfg(256))), 7).save_pretrained(d)
    g = os.path.join(tmp, "p3.gguf")
    export(d, g, ["--gguf-tokenizer", "byte"])
    llm = check_model("phi3", d, g, "gpt-2", False, tok="byte")
    check(llm.metadata.get("general.architecture") == "phi3", "phi3: general.architecture phi3")
    del llm
    ids = [(7 * i + 3) % 256 for i in range(20)]
    base = compare_logits("phi3", d, g, ids, "20 tokens")

    e = phi3_variant(tmp, d, "p3_partial", lambda c: c.update(partial_rotary_factor=0.5))
    export(e, e + ".gguf", ["--gguf-tokenizer", "byte"])
    ref = compare_logits("phi3 partial_rotary_factor 0.5", e, e + ".gguf", ids, "20 tokens")
    check(load_llama(e + ".gguf", vocab_only=True).metadata.get("phi3.rope.dimension_count") == "8",
          f"phi3 partial: phi3.rope.dimension_count 8 (the partial rotation moves lathe's logits by "
          f"{float(np.abs(ref - base).max()):.2e})")

    rng = np.random.default_rng(3)
    short, long_ = [float(x) for x in 1 + rng.random(8)], [float(x) for x in 2 + 6 * rng.random(8)]
    e = phi3_variant(tmp, d, "p3_longrope", lambda c: c.update(
        max_position_embeddings=512, original_max_position_embeddings=256,
        rope_scaling={"type": "longrope", "short_factor": short, "long_factor": long_}))
    out = export(e, e + ".gguf", ["--gguf-tokenizer", "byte"])
    check("llama.cpp uses the long factors whenever its context n_ctx > 256" in out,
          "phi3 longrope: the export says how llama.cpp picks the factors")
    long_ids = [(5 * i + 1) % 256 for i in range(300)]
    lr = compare_logits("phi3 longrope", e, e + ".gguf", long_ids, "a 300-token pass, n_ctx 512 (long factors)",
                        n_ctx=512)
    sr = compare_logits("phi3 longrope", e, e + ".gguf", long_ids[:40], "a 40-token pass, n_ctx 256 (short factors)",
                        n_ctx=256)
    lathe(["logits", "--model", d, "--tokens", ",".join(map(str, long_ids)), "--out", g + ".plain"])
    plain = np.fromfile(g + ".plain", dtype=np.float32).reshape(lr.shape)
    check(float(np.abs(lr - plain).max()) > 1e-2 and float(np.abs(sr - plain[:40]).max()) > 1e-2,
          f"phi3 longrope: the long / short factors move lathe's logits by {float(np.abs(lr - plain).max()):.2e} / "
          f"{float(np.abs(sr - plain[:40]).max()):.2e}")

    e = phi3_variant(tmp, d, "phi3_edit", lambda c: c.update(sliding_window=31))
    p = subprocess.run([LATHE, "convert", "--from-hf", e, "--to-gguf", e + ".gguf", "--gguf-tokenizer", "byte"],
                       capture_output=True, text=True)
    needle = "sliding_window 31 < context 128"
    check(p.returncode != 0 and needle in p.stderr, f"phi3: GGUF refused: {p.stderr.strip()[-160:]}")

def check_gemma2(tmp):
    """Gemma 2 as llama.cpp's gemma2 architecture: 3 layers (0 and 2 slide, window 8 < the 20-token
    prompt), 4 heads of 16 over 2 kv heads in hidden 64, query_pre_attn_scalar 24 (not head_dim:
    lathe scales attn_q so that llama.cpp's fixed 1/sqrt(head_dim) gives 1/sqrt(24)), soft caps 2 / 2
    (small enough to bind on these O(1) logits, and not llama.cpp's defaults 50 / 30), norm weights
    w ~ 0.1 N(0, 1) written as 1 + w. Oracle: transformers 4.45.2 Gemma2 (eager) with llama.cpp's
    fp16 GELU table emulated, within 1e-4 + gelu_fp16_bound; lathe's own logits equal transformers'
    exact-GELU ones. Soft caps of null are refused (llama.cpp always caps)."""
    d = os.path.join(tmp, "g2")
    torch.manual_seed(8)
    m = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        num_hidden_layers=3, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=96, vocab_size=256, max_position_embeddings=128, query_pre_attn_scalar=24,
        sliding_window=8, attn_logit_softcapping=2.0, final_logit_softcapping=2.0, bos_token_id=None,
        eos_token_id=None, pad_token_id=None, attn_implementation="eager"))
    with torch.no_grad():
        for p_ in m.parameters():
            p_.normal_(0.0, 0.1) if p_.dim() >= 2 else p_.copy_(0.1 * torch.randn_like(p_))
    m.save_pretrained(d)
    g = os.path.join(tmp, "g2.gguf")
    export(d, g, ["--gguf-tokenizer", "byte"])
    llm = check_model("gemma2", d, g, "gpt-2", False, hf_model=m.eval(), tok="byte")
    md = llm.metadata
    check(md.get("general.architecture") == "gemma2" and md.get("gemma2.attention.sliding_window") == "8",
          f"gemma2: architecture gemma2, sliding_window 8 ({md.get('general.architecture')}, "
          f"{md.get('gemma2.attention.sliding_window')})")
    e = os.path.join(tmp, "g2_nocap")
    shutil.copytree(d, e)
    c = json.load(open(os.path.join(e, "config.json")))
    c["attn_logit_softcapping"] = None
    json.dump(c, open(os.path.join(e, "config.json"), "w"))
    p = subprocess.run([LATHE, "convert", "--from-hf", e, "--to-gguf", e + ".gguf", "--gguf-tokenizer", "byte"],
                       capture_output=True, text=True)
    check(p.returncode != 0 and "always soft-caps" in p.stderr, f"gemma2 without a cap: GGUF refused: "
          f"{p.stderr.strip()[-160:]}")


def check_olmo2(tmp):
    """OLMo 2 as llama.cpp's olmo2 architecture: no pre-norms, post_attention_norm / post_ffw_norm
    after the attention and the MLP, attn_q_norm / attn_k_norm over the whole q (64) and k (32)
    projections, NEOX RoPE. 2 layers, 4 heads of 16 over 2 kv heads in hidden 64, byte tokenizer;
    untied, and tied (llama.cpp's olmo2 requires output.weight: the embedding is written again).
    Oracle: lathe's logits within 1e-4 (transformers 4.45.2 has no Olmo2; lathe's are checked
    against tests/models/torch_reference_olmo2.py in tests/interop/test_olmo2_hf.py)."""
    sys.path.insert(0, os.path.join(HERE, "..", "models"))
    import torch_reference_olmo2 as o2
    for tag, tied in (("olmo2", False), ("olmo2_tied", True)):
        d = os.path.join(tmp, "o2" + ("t" if tied else ""))
        os.makedirs(d)
        cfg = {"architectures": ["Olmo2ForCausalLM"], "model_type": "olmo2", "attention_bias": False,
               "bos_token_id": None, "eos_token_id": None, "pad_token_id": None, "hidden_act": "silu",
               "hidden_size": 64, "intermediate_size": 96, "max_position_embeddings": 128,
               "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
               "rope_scaling": None, "rope_theta": 500000.0, "tie_word_embeddings": tied, "vocab_size": 256,
               "torch_dtype": "float32"}
        json.dump(cfg, open(os.path.join(d, "config.json"), "w"), indent=2)
        m = randomize(o2.Olmo2ForCausalLM(cfg), 9)
        params = dict(m.named_parameters())
        if tied:
            params.pop("lm_head.weight", None)
        o2.write_st(os.path.join(d, "model.safetensors"), params)
        g = d + ".gguf"
        export(d, g, ["--gguf-tokenizer", "byte"])
        llm = check_model(tag, d, g, "gpt-2", False, tok="byte")
        check(llm.metadata.get("general.architecture") == "olmo2", f"{tag}: general.architecture olmo2")
        del llm
    # What llama.cpp's olmo2 cannot do, refused naming the reason.
    for edit, needle in (({"head_dim": 32}, "olmo2 with head_dim 32 != hidden_size 64"),
                         ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "olmo2 with rope_scaling")):
        e = os.path.join(tmp, "o2_edit")
        shutil.rmtree(e, ignore_errors=True)
        os.makedirs(e)
        cfg = json.load(open(os.path.join(tmp, "o2", "config.json")))
        cfg.update(edit)
        json.dump(cfg, open(os.path.join(e, "config.json"), "w"))
        o2.write_st(os.path.join(e, "model.safetensors"), dict(o2.Olmo2ForCausalLM(cfg).named_parameters()))
        p = subprocess.run([LATHE, "convert", "--from-hf", e, "--to-gguf", e + ".gguf", "--gguf-tokenizer", "byte"],
                           capture_output=True, text=True)
        check(p.returncode != 0 and needle in p.stderr, f"olmo2: GGUF refused: {p.stderr.strip()[-160:]}")


def check_core(tmp):
    """gpt2, llama (+ RoPE scaling), qwen2, spm, byte, mistral_hd."""
    # --- GPT-2 with GPT-2's tokenizer files
    d = os.path.join(tmp, "gpt2")
    m = randomize(transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=50257, n_positions=128)), 1)
    m.save_pretrained(d)
    for f in ("encoder.json", "vocab.bpe"):
        shutil.copy(os.path.join(GPT2_TOK, f), d)
    g = os.path.join(tmp, "gpt2.gguf")
    export(d, g)
    check_model("gpt2", d, g, "gpt-2", True, hf_model=m.eval(), gpt2=True)

    # --- Llama (GQA, untied) with a lathe-trained Llama-3-regex tokenizer
    d = os.path.join(tmp, "llama")
    txt = os.path.join(tmp, "corpus.txt")
    open(txt, "w").write("\n".join(corpus()))
    lathe(["tokenizer", "train", "--input", txt, "--vocab-size", "600", "--pretokenizer", "llama3",
           "--special-tokens", "<|endoftext|>", "--out", d])
    V = json.load(open(os.path.join(d, "tokenizer.json")))
    V = len(V["model"]["vocab"]) + len(V["added_tokens"])
    randomize(transformers.LlamaForCausalLM(transformers.LlamaConfig(tie_word_embeddings=False, rope_theta=5e5,
                                                                     **llama_cfg(V))), 2).save_pretrained(d)
    g = os.path.join(tmp, "llama.gguf")
    export(d, g)
    check_model("llama", d, g, "dbrx", True)
    # the same vocabulary with ignore_merges (as Llama-3's tokenizer.json) -> llama-bpe
    d2 = os.path.join(tmp, "llama_im")
    shutil.copytree(d, d2)
    tj = json.load(open(os.path.join(d2, "tokenizer.json")))
    tj["model"]["ignore_merges"] = True
    json.dump(tj, open(os.path.join(d2, "tokenizer.json"), "w"))
    g2 = os.path.join(tmp, "llama_im.gguf")
    export(d2, g2)
    v = load_llama(g2, vocab_only=True)
    want = lathe_encode(d2, TEXTS)
    bad = [t for t, w in zip(TEXTS, want) if v.tokenize(t.encode(), add_bos=False, special=True) != w]
    check(v.metadata.get("tokenizer.ggml.pre") == "llama-bpe" and not bad,
          f"llama ignore_merges: pre llama-bpe, tokenization equals lathe encode (differs on {bad})")
    check_rope_scaling(tmp, d)

    # --- Qwen2 (q/k/v biases, tied), Qwen2 regex + NFC, config.json without BOS/EOS
    d = os.path.join(tmp, "qwen2")
    os.makedirs(d)
    V = make_bpe_json(os.path.join(d, "tokenizer.json"), QWEN2_RE, True,
                      ["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    json.dump({"bos_token": None, "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"},
              open(os.path.join(d, "tokenizer_config.json"), "w"))
    randomize(transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        tie_word_embeddings=True, rope_theta=1e6, bos_token_id=None, eos_token_id=None, **llama_cfg(V))),
        3).save_pretrained(d)
    g = os.path.join(tmp, "qwen2.gguf")
    export(d, g)
    llm = check_model("qwen2", d, g, "qwen2", True)
    check(llm.token_eos() == 0 and llm.metadata.get("tokenizer.ggml.eot_token_id") == "2",
          f"qwen2: EOS = <|endoftext|> (0) from tokenizer_config.json, EOT = <|im_end|> (2): "
          f"eos {llm.token_eos()} eot {llm.metadata.get('tokenizer.ggml.eot_token_id')}")

    # --- Llama with a SentencePiece BPE tokenizer.model
    d = os.path.join(tmp, "spm")
    os.makedirs(d)
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus()), model_prefix=os.path.join(d, "tokenizer"), vocab_size=400,
        model_type="bpe", normalization_rule_name="identity", remove_extra_whitespaces=False, byte_fallback=True,
        character_coverage=1.0, hard_vocab_limit=False, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        minloglevel=2)
    sp = spm.SentencePieceProcessor(model_file=os.path.join(d, "tokenizer.model"))
    V = sp.get_piece_size()
    randomize(transformers.LlamaForCausalLM(transformers.LlamaConfig(
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, **llama_cfg(V))), 4).save_pretrained(d)
    g = os.path.join(tmp, "spm.gguf")
    export(d, g)
    llm = check_model("spm", d, g, None, False)
    check(llm.metadata.get("tokenizer.ggml.model") == "llama" and llm.token_bos() == 1 and llm.token_eos() == 2,
          "spm: tokenizer.ggml.model llama, BOS 1, EOS 2")

    # --- Llama with lathe's byte tokenizer (the quickstart's): byte-level BPE without merges
    d = os.path.join(tmp, "byte")
    randomize(transformers.LlamaForCausalLM(transformers.LlamaConfig(
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, **llama_cfg(256))), 5).save_pretrained(d)
    g = os.path.join(tmp, "byte.gguf")
    export(d, g, ["--gguf-tokenizer", "byte"])
    check_model("byte", d, g, "gpt-2", False, tok="byte")

    # --- Mistral with an explicit head_dim (4 heads of 32: q/o 128 wide, hidden 64), byte tokenizer:
    # llama.cpp takes the head width from llama.attention.key_length / value_length
    d = os.path.join(tmp, "mistral_hd")
    randomize(transformers.MistralForCausalLM(transformers.MistralConfig(
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, head_dim=32, sliding_window=None,
        **llama_cfg(256))), 6).save_pretrained(d)
    g = os.path.join(tmp, "mistral_hd.gguf")
    export(d, g, ["--gguf-tokenizer", "byte"])
    llm = check_model("mistral_hd", d, g, "gpt-2", False, tok="byte")
    check(llm.metadata.get("llama.attention.key_length") == "32", "mistral_hd: llama.attention.key_length 32")



CHECKS = {"core": check_core, "phi3": check_phi3, "gemma2": check_gemma2, "olmo2": check_olmo2}


def main():
    t0 = time.time()
    tmp = tempfile.mkdtemp(prefix="lathe_gguf_llama_cpp_")

    # `test_gguf_llama_cpp.py gemma2 phi3`: only those groups (a quicker run); none = all, in order
    for name in sys.argv[1:] or CHECKS:
        CHECKS[name](tmp)

    shutil.rmtree(tmp)
    print(f"({time.time() - t0:.1f} s)")
    print(f"{0 if failures else 1} passed, {1 if failures else 0} failed")
    if failures:
        print("FAILURES:\n  " + "\n  ".join(f.splitlines()[0] for f in failures))
        sys.exit(1)


if __name__ == "__main__":
    main()
