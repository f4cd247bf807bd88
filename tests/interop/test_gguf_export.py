#!/usr/bin/env python3
"""GGUF export (`lathe convert --to-gguf`, `lathe export --to-gguf`) read back with the PyPI `gguf`
package (llama.cpp's own gguf-py reader), against the transformers model it came from.

Checked, for f32 and f16, for a Llama with grouped-query attention (untied head) and a Qwen2
(q/k/v biases, tied head):
  * metadata keys, values and value types (uint32 counts, float32 rope/eps) as llama.cpp expects
  * the exact set of tensor names, the ggml dims (reverse of the PyTorch shape), the tensor types
    (2-D F16 in f16 files, 1-D always F32), data offsets aligned to 32 and the file size
  * values: llama q/k rows, after undoing llama.cpp's RoPE permutation with the inverse written
    here from the reference, equal the HF tensors; everything else equals directly (f16: equals
    the fp16-rounded source); qwen2 is NOT permuted (NEOX RoPE)
  * tokenizer.ggml.* from the HF tokenizer.json (tokens in id order, merges), and an export from a
    trained run carries the tokenizer file next to the HF weights and into the GGUF
  * gpt2 -> architecture gpt2 (fused qkv transposed from Conv1D, learned positions, tied head)
"""
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "train"))
import megatron_writer  # noqa: E402

try:
    import gguf
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers, decoders
except ImportError as e:
    print(f"FAIL gguf/transformers/tokenizers not importable ({e}); run scripts/setup.sh")
    sys.exit(1)
transformers.logging.set_verbosity_error()

LATHE = os.environ.get("LATHE_BIN", "build/lathe")
failures = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what, flush=True)
    if not cond:
        failures.append(what)


def run(args, ok=True):
    p = subprocess.run([LATHE] + args, capture_output=True, text=True, errors="replace")
    if ok and p.returncode != 0:
        raise RuntimeError(f"lathe {' '.join(args)} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    return p


def make_tokenizer(path, vocab_size):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tr = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = ["the quick brown fox jumps over the lazy dog " * 3, "lathe trains language models on cpus"] * 20
    tok.train_from_iterator(text, tr)
    tok.save(path)
    return tok


def make(kind, d, V, head_dim=None):
    torch.manual_seed(11 if kind == "llama" else 12)
    common = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=48, vocab_size=V, max_position_embeddings=64, rms_norm_eps=1e-5)
    if kind == "llama":
        # head_dim: explicit (q/o 4 x head_dim wide, not hidden 32), as Mistral-Nemo's 32 x 128 != 5120
        m = transformers.LlamaForCausalLM(transformers.LlamaConfig(tie_word_embeddings=False, rope_theta=5e5,
                                                                   head_dim=head_dim, **common))
    else:
        m = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(tie_word_embeddings=True, rope_theta=1e6, **common))
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.05 * torch.randn_like(p))
    m.save_pretrained(d)
    return m


# Independent name table from shared/reference/gguf.md section 6.
BLOCK = {"input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
         "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
         "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
         "self_attn.v_proj.bias": "attn_v.bias", "self_attn.o_proj.weight": "attn_output.weight",
         "post_attention_layernorm.weight": "ffn_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
         "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}


def gguf_name(hf):
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    parts = hf.split(".")
    return f"blk.{parts[2]}." + BLOCK[".".join(parts[3:])]


def unpermute(w, n_head):
    # gguf.md: inverse (GGUF/Meta -> HF) is W.reshape(n_head, hd/2, 2, D).swapaxes(1,2).reshape(...)
    shape = w.shape
    w2 = w.reshape(n_head, shape[0] // n_head // 2, 2, -1)
    return w2.swapaxes(1, 2).reshape(shape)


def field(r, key):
    f = r.get_field(key)
    if f is None:
        return None, None
    t = f.types[0]
    if t == gguf.GGUFValueType.STRING:
        return bytes(f.parts[f.data[0]]).decode(), t
    if t == gguf.GGUFValueType.ARRAY:
        if f.types[1] == gguf.GGUFValueType.STRING:
            return [bytes(f.parts[i]).decode() for i in f.data], t
        return [f.parts[i][0].item() for i in f.data], t
    return f.parts[f.data[0]][0].item(), t


def check_file(path, model, kind, f16, tok_vocab=None):
    tag = f"{kind} {'f16' if f16 else 'f32'}"
    r = gguf.GGUFReader(path)
    cfg = model.config
    arch = "llama" if kind == "llama" else "qwen2"
    U32, F32 = gguf.GGUFValueType.UINT32, gguf.GGUFValueType.FLOAT32
    D = getattr(cfg, "head_dim", None) or 32 // 4
    want = {"general.architecture": (arch, gguf.GGUFValueType.STRING),
            f"{arch}.context_length": (64, U32), f"{arch}.embedding_length": (32, U32),
            f"{arch}.block_count": (2, U32), f"{arch}.feed_forward_length": (48, U32),
            f"{arch}.attention.head_count": (4, U32), f"{arch}.attention.head_count_kv": (2, U32),
            f"{arch}.rope.dimension_count": (D, U32), "general.file_type": (1 if f16 else 0, U32),
            f"{arch}.rope.freq_base": (float(np.float32(cfg.rope_theta)), F32),
            f"{arch}.attention.layer_norm_rms_epsilon": (float(np.float32(1e-5)), F32)}
    # llama.cpp reads the head width from key_length / value_length when it is not n_embd / n_head
    # (absent otherwise, as convert_hf_to_gguf.py writes them only for an explicit head_dim).
    kl = (D, U32) if D * 4 != 32 else (None, None)
    want[f"{arch}.attention.key_length"] = kl
    want[f"{arch}.attention.value_length"] = kl
    bad = [f"{k}={field(r, k)} (want {v})" for k, v in want.items() if field(r, k) != v]
    check(not bad, f"{tag}: metadata keys, values and types" + (f": {bad}" if bad else ""))

    sd = {k: v.float().numpy() for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    names = {gguf_name(k): k for k in sd}
    got = {t.name: t for t in r.tensors}
    check(set(got) == set(names), f"{tag}: tensor names ({len(got)}) are exactly the mapped HF names"
          + ("" if set(got) == set(names) else f": extra {set(got) - set(names)}, missing {set(names) - set(got)}"))
    shape_ok = type_ok = val_ok = True
    worst = ""
    for gname, t in got.items():
        src = sd[names[gname]]
        shape_ok &= list(t.shape) == list(reversed(src.shape))
        want_type = gguf.GGMLQuantizationType.F16 if (f16 and src.ndim == 2) else gguf.GGMLQuantizationType.F32
        type_ok &= t.tensor_type == want_type
        data = np.asarray(t.data).reshape(src.shape).astype(np.float32)
        hfname = names[gname]
        if kind == "llama" and (".q_proj." in hfname or ".k_proj." in hfname):
            data = unpermute(data, cfg.num_attention_heads if ".q_proj." in hfname else cfg.num_key_value_heads)
        ref = src.astype(np.float16).astype(np.float32) if want_type == gguf.GGMLQuantizationType.F16 else src
        if not np.array_equal(data, ref):
            val_ok = False
            worst += f" {gname}"
        if t.data_offset % 32:
            val_ok = False
            worst += f" {gname}@unaligned"
    check(shape_ok, f"{tag}: ggml dims are the reversed PyTorch shapes")
    check(type_ok, f"{tag}: tensor types ({'2-D F16, 1-D F32' if f16 else 'all F32'})")
    check(val_ok, f"{tag}: every tensor equals the source" + (" (q/k after undoing the permutation)" if kind == "llama" else " (no permutation)") + worst)
    if kind == "llama":
        # the permutation is really there: the raw q rows differ from HF's
        q = np.asarray(got["blk.0.attn_q.weight"].data).reshape(4 * D, 32).astype(np.float32)
        check(not np.allclose(q, sd["model.layers.0.self_attn.q_proj.weight"], atol=1e-2),
              f"{tag}: attn_q is stored permuted (differs from HF row order)")
    last = max(r.tensors, key=lambda t: t.data_offset)
    end = last.data_offset + ((last.n_bytes + 31) // 32) * 32
    check(os.path.getsize(path) == end, f"{tag}: file ends after the last tensor's padding ({end} bytes)")
    if tok_vocab is not None:
        toks, _ = field(r, "tokenizer.ggml.tokens")
        model_kind, _ = field(r, "tokenizer.ggml.model")
        merges, _ = field(r, "tokenizer.ggml.merges")
        expect = [tok_vocab.get(i, f"[PAD{i}]") for i in range(cfg.vocab_size)]
        check(model_kind == "gpt2" and toks == expect and merges and len(merges[0].split(" ")) == 2,
              f"{tag}: tokenizer.ggml tokens in id order ({len(toks)}), {len(merges or [])} merges")
    else:
        check(field(r, "tokenizer.ggml.model")[0] == "no_vocab", f"{tag}: no tokenizer -> no_vocab")


def main():
    tmp = tempfile.mkdtemp(prefix="lathe_gguf_test_")
    # The model's vocabulary is the tokenizer's (lathe train samples text with it at the end).
    tok = make_tokenizer(os.path.join(tmp, "tokenizer.json"), 300)
    V = tok.get_vocab_size()
    llama_dir = os.path.join(tmp, "llama")
    llama = make("llama", llama_dir, V)
    shutil.copy(os.path.join(tmp, "tokenizer.json"), llama_dir)
    vocab = {i: s for s, i in tok.get_vocab().items()}
    for f16 in (False, True):
        out = os.path.join(tmp, f"llama_{f16}.gguf")
        p = run(["convert", "--from-hf", llama_dir, "--to-gguf", out, "--dtype", "fp16" if f16 else "fp32"])
        check("permuted" in p.stdout, "convert reports the q/k permutation: " + p.stdout.strip().splitlines()[-1])
        check_file(out, llama, "llama", f16, vocab)

    # explicit head_dim 16: q/o 64 wide with hidden 32
    hd_dir = os.path.join(tmp, "llama_hd")
    hd = make("llama", hd_dir, V, head_dim=16)
    out = os.path.join(tmp, "llama_hd.gguf")
    run(["convert", "--from-hf", hd_dir, "--to-gguf", out])
    check_file(out, hd, "llama", False)

    qwen_dir = os.path.join(tmp, "qwen2")
    qwen = make("qwen2", qwen_dir, V)
    for f16 in (False, True):
        out = os.path.join(tmp, f"qwen_{f16}.gguf")
        run(["convert", "--from-hf", qwen_dir, "--to-gguf", out, "--dtype", "fp16" if f16 else "fp32"])
        check_file(out, qwen, "qwen2", f16)

    # export from a trained run: tokenizer files next to the weights and in the GGUF
    data = os.path.join(tmp, "ids")
    rng = np.random.default_rng(0)
    megatron_writer.write(data, [rng.integers(0, V, 400) for _ in range(3)])
    recipe = os.path.join(tmp, "r.yaml")
    run_dir = os.path.join(tmp, "run")
    open(recipe, "w").write(f"""
model: {{init_from: {llama_dir}}}
data: {{train: {data}, valid_fraction: 0.0, tokenizer: {os.path.join(llama_dir, 'tokenizer.json')}}}
training: {{micro_batch_size: 2, seq_len: 16, steps: 1, eval_interval: 0, peak_gflops: 100}}
output: {{dir: {run_dir}, checkpoint_every: 1}}
""")
    run(["train", recipe])
    exp = os.path.join(tmp, "exported")
    gg = os.path.join(tmp, "exported.gguf")
    run(["export", run_dir, "--to", exp, "--to-gguf", gg])
    check(os.path.exists(os.path.join(exp, "tokenizer.json")), "export copies the run's tokenizer.json")
    trained = transformers.AutoModelForCausalLM.from_pretrained(exp)
    check_file(gg, trained, "llama", False, vocab)

    # gpt2 -> architecture gpt2: fused qkv stored [3C, C] (HF Conv1D [C, 3C] transposed), learned
    # positions, LayerNorm biases, no output.weight (tied; llama.cpp reuses token_embd)
    gpt2_dir = os.path.join(tmp, "gpt2")
    torch.manual_seed(13)
    g2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64,
                                                              n_positions=32))
    g2.save_pretrained(gpt2_dir)
    out = os.path.join(tmp, "g.gguf")
    run(["convert", "--from-hf", gpt2_dir, "--to-gguf", out])
    r = gguf.GGUFReader(out)
    got = {t.name: np.asarray(t.data).reshape(list(reversed([int(x) for x in t.shape]))) for t in r.tensors}
    sd = {k: v.float().numpy() for k, v in g2.state_dict().items()}
    want = {"token_embd.weight": sd["transformer.wte.weight"], "position_embd.weight": sd["transformer.wpe.weight"],
            "blk.0.attn_qkv.weight": sd["transformer.h.0.attn.c_attn.weight"].T,
            "blk.0.attn_qkv.bias": sd["transformer.h.0.attn.c_attn.bias"],
            "blk.0.ffn_up.weight": sd["transformer.h.0.mlp.c_fc.weight"].T,
            "blk.0.ffn_down.weight": sd["transformer.h.0.mlp.c_proj.weight"].T,
            "output_norm.bias": sd["transformer.ln_f.bias"]}
    check(field(r, "general.architecture")[0] == "gpt2" and len(got) == 16 and "output.weight" not in got
          and all(np.array_equal(got[k], v) for k, v in want.items())
          and field(r, "gpt2.attention.layer_norm_epsilon")[0] == float(np.float32(1e-5))
          and field(r, "gpt2.context_length")[0] == 32,
          f"gpt2 -> GGUF architecture gpt2, 16 tensors, Conv1D weights transposed, no output.weight: {sorted(got)}")

    shutil.rmtree(tmp)
    print(f"{0 if failures else 1} passed, {1 if failures else 0} failed")
    if failures:
        print("FAILURES:\n  " + "\n  ".join(failures))
        sys.exit(1)


if __name__ == "__main__":
    main()
