#!/usr/bin/env python3
"""PyTorch oracle for Qwen3 (tests/models/test_qwen3.cpp, tests/models/test_qwen3_hf.py).

transformers 4.45.2 (pinned) has no Qwen3, so the reference is torch_reference.Model, which follows
the published Qwen3Attention: q = q_norm(q_proj(x).view(B, T, H, D)), k = k_norm(k_proj(x).view(B,
T, KV, D)) (RMSNorm over each head's D features, rms_norm_eps), then RoPE; no q/k/v bias by default;
head_dim explicit (config.json head_dim, default 128).

  check DIR [--drop-q-norm]   DIR as test_qwen3.cpp writes it (model/ HF dir, batches, outputs,
                              grads): logits, loss and every gradient of lathe (fp32) against the
                              float64 reference, relative error <= 1e-5. --drop-q-norm: the reference
                              without q_norm (a broken model; the test expects this to FAIL).
  write DIR                   a random Qwen3 HF directory as transformers' Qwen3ForCausalLM saves it
                              (config.json + model.safetensors, HF names), weights std 0.3 for the
                              projections and norm weights 1 + 0.1 N(0, 1).
  logits DIR OUT TOKENS...    float64 reference logits of DIR for each comma-separated token list,
                              written as float64 to OUT (concatenated).
Exit code 1 on a mismatch.
"""
import json
import os
import struct
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_reference as ref  # noqa: E402

TOL = 1e-5


def check(d, drop_q_norm):
    cfg = json.load(open(f"{d}/model/config.json"))
    sd = ref.read_st(f"{d}/model/model.safetensors")
    batches = ref.read_st(f"{d}/batches.safetensors")
    toks, tgts = batches["tokens"].long(), batches["targets"].long()
    out = ref.read_st(f"{d}/outputs.safetensors")
    grads = ref.read_st(f"{d}/grads.safetensors")
    assert cfg["model_type"] == "qwen3" and any(".q_norm." in n for n in sd), "not a qwen3 directory"
    model = ref.Model(cfg, sd)
    model.drop_q_norm = drop_q_norm
    V = cfg["vocab_size"]
    logits = model(toks[0])
    worst = {"logits": ref.compare("logits", out["logits"], logits, TOL)}
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, V), tgts[0].reshape(-1))
    worst["loss"] = ref.compare("loss", out["loss"], loss, TOL)
    loss.backward()
    worst["grads"] = ref.grad_error(model, sd, grads, TOL)
    # (grad_error covered them; shown apart: a reference without q_norm gives its weights no gradient)
    worst["q/k norm grads"] = max(
        ref.compare(f"grad {n}", grads[n], model.w(n).grad if model.w(n).grad is not None else torch.zeros(grads[n].shape), TOL)
        for n in sd if "_norm." in n and "self_attn" in n)
    print(f"qwen3{' (reference without q_norm)' if drop_q_norm else ''}: "
          + ", ".join(f"{k} {v:.2e}" for k, v in worst.items()) + f" (tolerance {TOL})")
    return ref.finish()


def write_st(path, tensors):
    """safetensors from the spec: 8-byte header length, JSON header, raw little-endian data."""
    header, blobs, off = {}, [], 0
    for name, t in tensors.items():
        b = t.detach().to(torch.float32).contiguous().numpy().astype("<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def write(d):
    """A Qwen3 checkpoint as transformers >= 4.51 saves Qwen3ForCausalLM: hidden 48, 4 heads of 16
    (q/o 64 wide), 2 KV heads, tied embeddings."""
    os.makedirs(d, exist_ok=True)
    L, C, H, KV, D, F, V = 2, 48, 4, 2, 16, 96, 128
    cfg = {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False,
        "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2, "head_dim": D, "hidden_act": "silu",
        "hidden_size": C, "initializer_range": 0.02, "intermediate_size": F, "max_position_embeddings": 256,
        "max_window_layers": L, "num_attention_heads": H, "num_hidden_layers": L, "num_key_value_heads": KV,
        "rms_norm_eps": 1e-6, "rope_scaling": None, "rope_theta": 1000000.0, "sliding_window": None,
        "tie_word_embeddings": True, "torch_dtype": "float32", "transformers_version": "4.51.0",
        "use_cache": True, "use_sliding_window": False, "vocab_size": V,
    }
    json.dump(cfg, open(f"{d}/config.json", "w"), indent=2)
    g = torch.Generator().manual_seed(31)

    def n(*shape, std=0.3):
        return torch.randn(*shape, generator=g, dtype=torch.float64) * std

    def ones(k):
        return 1.0 + 0.1 * torch.randn(k, generator=g, dtype=torch.float64)

    sd = {"model.embed_tokens.weight": n(V, C), "model.norm.weight": ones(C)}
    for i in range(L):
        p = f"model.layers.{i}."
        sd.update({
            p + "input_layernorm.weight": ones(C), p + "post_attention_layernorm.weight": ones(C),
            p + "self_attn.q_proj.weight": n(H * D, C), p + "self_attn.k_proj.weight": n(KV * D, C),
            p + "self_attn.v_proj.weight": n(KV * D, C), p + "self_attn.o_proj.weight": n(C, H * D),
            p + "self_attn.q_norm.weight": ones(D), p + "self_attn.k_norm.weight": ones(D),
            p + "mlp.gate_proj.weight": n(F, C), p + "mlp.up_proj.weight": n(F, C),
            p + "mlp.down_proj.weight": n(C, F),
        })
    write_st(f"{d}/model.safetensors", sd)
    return 0


def logits(d, out, token_lists):
    cfg = json.load(open(f"{d}/config.json"))
    sd = ref.read_st(f"{d}/model.safetensors")
    model = ref.Model(cfg, sd)
    with torch.no_grad():
        res = [model(torch.tensor([[int(t) for t in s.split(",")]]))[0].numpy() for s in token_lists]
    np.concatenate([r.reshape(-1) for r in res]).astype("<f8").tofile(out)
    return 0


if __name__ == "__main__":
    torch.set_default_dtype(torch.float64)
    cmd = sys.argv[1]
    if cmd == "check":
        sys.exit(check(sys.argv[2], "--drop-q-norm" in sys.argv[3:]))
    if cmd == "write":
        sys.exit(write(sys.argv[2]))
    if cmd == "logits":
        sys.exit(logits(sys.argv[2], sys.argv[3], sys.argv[4:]))
    sys.exit(f"unknown command {cmd}")
