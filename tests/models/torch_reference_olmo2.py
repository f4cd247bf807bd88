#!/usr/bin/env python3
"""PyTorch oracle for OLMo 2 (tests/models/test_olmo2.cpp, tests/interop/test_olmo2_hf.py).

transformers 4.45.2 (pinned) has no Olmo2 (it arrived in 4.47), so the reference is the module
below, written after transformers' modeling_olmo2.py (Olmo2RMSNorm, Olmo2Attention, Olmo2MLP,
Olmo2DecoderLayer, Olmo2ForCausalLM; eager attention), loading the same state-dict names:
  * no pre-norms: h = x + post_attention_layernorm(self_attn(x)); out = h + post_feedforward_layernorm(mlp(h));
  * q_norm / k_norm: RMSNorm over the whole q_proj (H*D) / k_proj (KV*D) output, before the heads
    are split and before RoPE (rotate_half);
  * RMSNorm: x in fp32, x * rsqrt(mean(x^2) + eps), times weight, cast back; no biases; lm_head
    untied unless tie_word_embeddings.

  check DIR [--break KIND]  DIR as test_olmo2.cpp writes it (model/ HF dir, batches, outputs, grads):
                            logits, loss and every gradient of lathe (fp32) against the float64
                            reference, relative error <= 1e-5. --break: a broken reference the test
                            expects to FAIL: per-head-qk-norm (Qwen3's per-head q/k norm),
                            pre-norm (the two norms applied to the block inputs), no-rope.
  write DIR [SEED]          a random Olmo2 HF directory as transformers' Olmo2ForCausalLM saves it
                            (config.json + model.safetensors): matrices std 0.5, norm weights 1 + 0.1 N(0, 1).
  logits DIR OUT TOKENS...  float64 reference logits of DIR for each comma-separated token list,
                            written as float64 to OUT (concatenated).
Exit code 1 on a mismatch.
"""
import json
import os
import struct
import sys

import numpy as np
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_reference as ref  # noqa: E402

TOL = 1e-5


class Olmo2RMSNorm(nn.Module):
    def __init__(self, n, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        dt = x.dtype
        x = x.to(torch.float32) if dt != torch.float64 else x
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x).to(dt)


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


class Olmo2Attention(nn.Module):
    def __init__(self, cfg, brk):
        super().__init__()
        C, H = cfg["hidden_size"], cfg["num_attention_heads"]
        self.H, self.KV = H, cfg.get("num_key_value_heads") or H
        self.D = cfg.get("head_dim") or C // H
        self.brk = brk
        eps = cfg.get("rms_norm_eps", 1e-5)
        self.q_proj = nn.Linear(C, self.H * self.D, bias=False)
        self.k_proj = nn.Linear(C, self.KV * self.D, bias=False)
        self.v_proj = nn.Linear(C, self.KV * self.D, bias=False)
        self.o_proj = nn.Linear(self.H * self.D, C, bias=False)
        self.q_norm = Olmo2RMSNorm(self.H * self.D, eps)
        self.k_norm = Olmo2RMSNorm(self.KV * self.D, eps)

    def norm(self, n, x, heads):
        if self.brk != "per-head-qk-norm":
            return n(x)
        # The broken variant: each head normalised on its own (the weight's slice per head).
        B, T, _ = x.shape
        xh = x.view(B, T, heads, self.D)
        xh = xh * torch.rsqrt(xh.pow(2).mean(-1, keepdim=True) + n.eps)
        return n.weight * xh.reshape(B, T, heads * self.D)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q = self.norm(self.q_norm, self.q_proj(x), self.H).view(B, T, -1, self.D).transpose(1, 2)
        k = self.norm(self.k_norm, self.k_proj(x), self.KV).view(B, T, -1, self.D).transpose(1, 2)
        v = self.v_proj(x).view(B, T, -1, self.D).transpose(1, 2)
        if self.brk != "no-rope":
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
        k = k.repeat_interleave(self.H // self.KV, dim=1)
        v = v.repeat_interleave(self.H // self.KV, dim=1)
        s = (q @ k.transpose(2, 3)) * self.D**-0.5
        s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
        p = torch.softmax(s, dim=-1, dtype=torch.float32 if s.dtype != torch.float64 else s.dtype).to(q.dtype)
        return self.o_proj((p @ v).transpose(1, 2).reshape(B, T, -1))


class Olmo2MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        C, F = cfg["hidden_size"], cfg["intermediate_size"]
        self.gate_proj = nn.Linear(C, F, bias=False)
        self.up_proj = nn.Linear(C, F, bias=False)
        self.down_proj = nn.Linear(F, C, bias=False)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class Olmo2DecoderLayer(nn.Module):
    def __init__(self, cfg, brk):
        super().__init__()
        eps = cfg.get("rms_norm_eps", 1e-5)
        self.self_attn = Olmo2Attention(cfg, brk)
        self.mlp = Olmo2MLP(cfg)
        self.post_attention_layernorm = Olmo2RMSNorm(cfg["hidden_size"], eps)
        self.post_feedforward_layernorm = Olmo2RMSNorm(cfg["hidden_size"], eps)
        self.brk = brk

    def forward(self, x, cos, sin):
        if self.brk == "pre-norm":  # the broken variant: the norms on the block inputs
            h = x + self.self_attn(self.post_attention_layernorm(x), cos, sin)
            return h + self.mlp(self.post_feedforward_layernorm(h))
        h = x + self.post_attention_layernorm(self.self_attn(x, cos, sin))
        return h + self.post_feedforward_layernorm(self.mlp(h))


class Olmo2Model(nn.Module):
    def __init__(self, cfg, brk=None):
        super().__init__()
        C, V = cfg["hidden_size"], cfg["vocab_size"]
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(V, C)
        self.layers = nn.ModuleList(Olmo2DecoderLayer(cfg, brk) for _ in range(cfg["num_hidden_layers"]))
        self.norm = Olmo2RMSNorm(C, cfg.get("rms_norm_eps", 1e-5))


class Olmo2ForCausalLM(nn.Module):
    def __init__(self, cfg, brk=None):
        super().__init__()
        self.cfg = cfg
        self.model = Olmo2Model(cfg, brk)
        self.tied = cfg.get("tie_word_embeddings", False)
        if not self.tied:
            self.lm_head = nn.Linear(cfg["hidden_size"], cfg["vocab_size"], bias=False)

    def forward(self, idx):
        cfg = self.cfg
        B, T = idx.shape
        D = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        theta = cfg.get("rope_theta", 10000.0)
        inv = 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.int64).to(torch.float32) / D))
        fr = torch.outer(torch.arange(T, dtype=torch.float32), inv)
        emb = torch.cat([fr, fr], -1)
        dt = self.model.embed_tokens.weight.dtype
        cos, sin = emb.cos().to(dt), emb.sin().to(dt)
        x = self.model.embed_tokens(idx)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        x = self.model.norm(x)
        head = self.model.embed_tokens.weight if self.tied else self.lm_head.weight
        return x @ head.T


def load(d, brk=None, dtype=torch.float64):
    cfg = json.load(open(f"{d}/config.json"))
    assert cfg["model_type"] == "olmo2", "not an olmo2 directory"
    sd = ref.read_st(f"{d}/model.safetensors")
    m = Olmo2ForCausalLM(cfg, brk).to(dtype)
    missing, unexpected = m.load_state_dict({k: v.to(dtype) for k, v in sd.items()}, strict=False)
    assert not unexpected, f"unexpected tensors {unexpected}"
    assert all(k == "lm_head.weight" and m.tied for k in missing) or not missing, f"missing tensors {missing}"
    return cfg, sd, m


def check(d, brk):
    cfg, sd, model = load(f"{d}/model", brk)
    batches = ref.read_st(f"{d}/batches.safetensors")
    toks, tgts = batches["tokens"].long(), batches["targets"].long()
    out = ref.read_st(f"{d}/outputs.safetensors")
    grads = ref.read_st(f"{d}/grads.safetensors")
    V = cfg["vocab_size"]
    logits = model(toks[0])
    worst = {"logits": ref.compare("logits", out["logits"], logits, TOL)}
    loss = nn.functional.cross_entropy(logits.reshape(-1, V), tgts[0].reshape(-1))
    worst["loss"] = ref.compare("loss", out["loss"], loss, TOL)
    loss.backward()
    params = dict(model.named_parameters())
    gmax = 0.0
    for name in sd:
        g = params[name].grad
        gmax = max(gmax, ref.compare(f"grad {name}", grads[name], g if g is not None else torch.zeros(grads[name].shape),
                                     TOL))
    worst["grads"] = gmax
    worst["q/k norm grads"] = max(ref.compare(f"grad {n}", grads[n], params[n].grad, TOL)
                                  for n in sd if "_norm." in n and "self_attn" in n)
    print(f"olmo2{f' (broken reference: {brk})' if brk else ''}: "
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


def write(d, seed=31):
    """An Olmo2 checkpoint as transformers (>= 4.47) saves Olmo2ForCausalLM: 3 layers, hidden 60,
    6 heads of 10 over 2 KV heads (q_norm 60 wide, k_norm 20), MLP 72, vocab 97, untied, rope_theta
    5e5, every key Olmo2Config.to_dict() writes."""
    os.makedirs(d, exist_ok=True)
    L, C, H, KV, F, V = 3, 60, 6, 2, 72, 97
    cfg = {
        "architectures": ["Olmo2ForCausalLM"], "model_type": "olmo2", "attention_bias": False,
        "attention_dropout": 0.0, "bos_token_id": None, "eos_token_id": 96, "pad_token_id": 1,
        "hidden_act": "silu", "hidden_size": C, "initializer_range": 0.02, "intermediate_size": F,
        "max_position_embeddings": 64, "num_attention_heads": H, "num_hidden_layers": L,
        "num_key_value_heads": KV, "rms_norm_eps": 1e-6, "rope_scaling": None, "rope_theta": 500000.0,
        "tie_word_embeddings": False, "torch_dtype": "float32", "transformers_version": "4.47.0",
        "use_cache": True, "vocab_size": V,
    }
    json.dump(cfg, open(f"{d}/config.json", "w"), indent=2)
    g = torch.Generator().manual_seed(seed)
    m = Olmo2ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            else:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
    write_st(f"{d}/model.safetensors", dict(m.named_parameters()))
    return 0


def logits(d, out, token_lists):
    _, _, model = load(d)
    with torch.no_grad():
        res = [model(torch.tensor([[int(t) for t in s.split(",")]]))[0].numpy() for s in token_lists]
    np.concatenate([r.reshape(-1) for r in res]).astype("<f8").tofile(out)
    return 0


if __name__ == "__main__":
    torch.set_default_dtype(torch.float64)
    cmd = sys.argv[1]
    if cmd == "check":
        args = sys.argv[3:]
        sys.exit(check(sys.argv[2], args[args.index("--break") + 1] if "--break" in args else None))
    if cmd == "write":
        sys.exit(write(sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 31))
    if cmd == "logits":
        sys.exit(logits(sys.argv[2], sys.argv[3], sys.argv[4:]))
    sys.exit(f"unknown command {cmd}")
