#!/usr/bin/env python3
"""PyTorch oracle for tests/models/test_model_parity.cpp.

Reads the directory the C++ test wrote (HF model dir with config.json + model.safetensors, the
token batches, lathe's logits/loss/gradients/parameters), rebuilds the model in plain PyTorch in
float64 following HF's GPT-2 / Llama / Qwen2 / Mistral / Qwen3 definitions, and compares. The safetensors
files are parsed here from the spec (8-byte header length + JSON + raw data), independently of
lathe's reader. Exit code 1 on any mismatch above the tolerance. With --transformers the
directory is also loaded by transformers in float32 and its logits, loss and gradients compared at
1e-5 (the explicit head_dim case of test_model_parity.cpp).
"""
import json
import math
import struct
import sys

import numpy as np
import torch

TOL = 1e-4
# Parameters after 3 AdamW steps: Adam divides by sqrt(v), so an element whose gradient is near
# zero turns fp32 summation noise into a visible step. Which OpenBLAS kernel runs decides that
# noise: 1.4e-5 with the SkylakeX/default kernels, 1.53e-4 for llama untied+bias (v_proj) with
# OPENBLAS_CORETYPE=Haswell or Zen (measured 2026-11-30, gradients themselves within 4.2e-6).
TOL_AFTER_STEPS = 3e-4
DTYPES = {"F32": np.float32, "I32": np.int32, "F64": np.float64, "BF16": None, "F16": np.float16}


def read_st(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        arr = np.frombuffer(data[base + a : base + b], dtype=DTYPES[info["dtype"]]).reshape(info["shape"])
        out[name] = torch.from_numpy(arr.copy())
    return out


class Model(torch.nn.Module):
    """HF-equivalent decoder built directly from a state dict (names as in HF)."""

    def __init__(self, cfg, sd, dtype=torch.float64):
        """dtype float64: the parity oracle. bfloat16/float16: weights and activations in that dtype
        as HF runs a model loaded in it (RMSNorm statistics in fp32, RoPE tables cast to it)."""
        super().__init__()
        self.cfg = cfg
        self.gpt2 = cfg["model_type"] == "gpt2"
        self.dtype = dtype
        self.drop_q_norm = False  # a broken model for the oracle tests' negative check (qwen3)
        self.p = torch.nn.ParameterDict({k.replace(".", "/"): torch.nn.Parameter(v.to(dtype)) for k, v in sd.items()})

    def w(self, name):
        return self.p[name.replace(".", "/")]

    def has(self, name):
        return name.replace(".", "/") in self.p

    def forward(self, idx, positions=None):
        """positions: 1-D [T] position ids shared by the rows (default 0..T-1), as HF's position_ids."""
        cfg = self.cfg
        B, T = idx.shape
        if positions is None:
            positions = torch.arange(T)
        if self.gpt2:
            C, H, L = cfg["n_embd"], cfg["n_head"], cfg["n_layer"]
            KV, eps = H, cfg.get("layer_norm_epsilon", 1e-5)
            x = self.w("transformer.wte.weight")[idx] + self.w("transformer.wpe.weight")[positions]
        else:
            C, H, L = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_hidden_layers"]
            KV, eps = cfg.get("num_key_value_heads") or H, cfg["rms_norm_eps"]
            x = self.w("model.embed_tokens.weight")[idx]
        D = (None if self.gpt2 else cfg.get("head_dim")) or C // H  # explicit head_dim: q/o width H*D != C
        if not self.gpt2:
            theta = cfg.get("rope_theta", 10000.0)
            inv = 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
            fr = torch.outer(positions.to(torch.float64), inv)
            emb = torch.cat([fr, fr], -1)
            cos, sin = emb.cos().to(self.dtype), emb.sin().to(self.dtype)

        def rot(t):  # rotate_half
            return torch.cat([-t[..., D // 2 :], t[..., : D // 2]], -1)

        def rms(x, wname):
            if x.dtype == torch.float64:
                return self.w(wname) * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
            xf = x.float()  # HF LlamaRMSNorm: statistics in fp32, normalised x cast back
            return self.w(wname) * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

        def lin(x, wname, bname=None):
            y = x @ self.w(wname).T
            if bname and self.has(bname):
                y = y + self.w(bname)
            return y

        def conv1d(x, pfx):  # HF Conv1D: weight [in, out]
            return x @ self.w(pfx + ".weight") + self.w(pfx + ".bias")

        mask = torch.ones(T, T, dtype=torch.bool).tril()
        for i in range(L):
            if self.gpt2:
                p = f"transformer.h.{i}."
                h = torch.nn.functional.layer_norm(x, (C,), self.w(p + "ln_1.weight"), self.w(p + "ln_1.bias"), eps)
                q, k, v = conv1d(h, p + "attn.c_attn").split(C, -1)
            else:
                p = f"model.layers.{i}."
                h = rms(x, p + "input_layernorm.weight")
                q = lin(h, p + "self_attn.q_proj.weight", p + "self_attn.q_proj.bias")
                k = lin(h, p + "self_attn.k_proj.weight", p + "self_attn.k_proj.bias")
                v = lin(h, p + "self_attn.v_proj.weight", p + "self_attn.v_proj.bias")
            q = q.view(B, T, H, D)
            k = k.view(B, T, KV, D)
            if not self.gpt2 and self.has(p + "self_attn.q_norm.weight"):
                # Qwen3Attention: RMSNorm over each head's D features of q and k, before RoPE.
                if not self.drop_q_norm:
                    q = rms(q, p + "self_attn.q_norm.weight")
                k = rms(k, p + "self_attn.k_norm.weight")
            q = q.transpose(1, 2)
            k = k.transpose(1, 2)
            v = v.view(B, T, KV, D).transpose(1, 2)
            if not self.gpt2:
                q = q * cos + rot(q) * sin
                k = k * cos + rot(k) * sin
            k = k.repeat_interleave(H // KV, dim=1)
            v = v.repeat_interleave(H // KV, dim=1)
            att = (q @ k.transpose(-1, -2)) / math.sqrt(D)
            att = att.masked_fill(~mask, float("-inf")).softmax(-1)
            y = (att @ v).transpose(1, 2).reshape(B, T, H * D)
            if self.gpt2:
                x = x + conv1d(y, p + "attn.c_proj")
                h = torch.nn.functional.layer_norm(x, (C,), self.w(p + "ln_2.weight"), self.w(p + "ln_2.bias"), eps)
                h = torch.nn.functional.gelu(conv1d(h, p + "mlp.c_fc"), approximate="tanh")
                x = x + conv1d(h, p + "mlp.c_proj")
            else:
                x = x + lin(y, p + "self_attn.o_proj.weight", p + "self_attn.o_proj.bias")
                h = rms(x, p + "post_attention_layernorm.weight")
                g = lin(h, p + "mlp.gate_proj.weight")
                u = lin(h, p + "mlp.up_proj.weight")
                x = x + lin(torch.nn.functional.silu(g) * u, p + "mlp.down_proj.weight")
        if self.gpt2:
            x = torch.nn.functional.layer_norm(
                x, (C,), self.w("transformer.ln_f.weight"), self.w("transformer.ln_f.bias"), eps
            )
            return x @ self.w("transformer.wte.weight").T
        x = rms(x, "model.norm.weight")
        head = "lm_head.weight" if self.has("lm_head.weight") else "model.embed_tokens.weight"
        return x @ self.w(head).T


# Shared with torch_reference_docs.py: compare() records every mismatch here, finish() reports them.
failures = []


def compare(what, lathe_t, torch_t, tol=TOL):
    lathe_t = lathe_t.double()
    torch_t = torch_t.detach().double()
    assert lathe_t.shape == torch_t.shape, f"{what}: shape {tuple(lathe_t.shape)} vs {tuple(torch_t.shape)}"
    scale = torch_t.abs().max().item()
    err = (lathe_t - torch_t).abs().max().item() / (scale if scale > 0 else 1.0)
    if not (err <= tol):
        failures.append(f"{what}: relative error {err:.3e} (max |torch| {scale:.3e})")
    return err


def grad_error(model, sd, grads, tol=TOL):
    """Compares lathe's gradient of every parameter with the torch model's (a parameter the loss
    does not reach has gradient 0); returns the worst relative error."""
    gmax = 0.0
    for name in sd:
        g = model.w(name).grad
        gmax = max(gmax, compare(f"grad {name}", grads[name], g if g is not None else torch.zeros_like(grads[name]),
                                 tol))
    return gmax


def finish():
    """Lists the mismatches (the first 30); the exit code: 1 when there was one."""
    if failures:
        print("MISMATCH:\n  " + "\n  ".join(failures[:30]))
        return 1
    return 0


HF_TOL = 1e-5


def check_transformers(d, cfg, toks, tgts, out, grads):
    """The same model loaded by transformers (the pinned 4.45.2) from the written directory, in
    float32: logits, loss and every gradient within HF_TOL of lathe's (fp32 against fp32)."""
    import transformers

    transformers.logging.set_verbosity_error()
    m = transformers.AutoModelForCausalLM.from_pretrained(f"{d}/model", torch_dtype=torch.float32,
                                                         attn_implementation="eager")
    V = cfg["vocab_size"]
    logits = m(toks[0]).logits
    worst = {"hf_logits": compare("transformers logits", out["logits"], logits, HF_TOL)}
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, V).float(), tgts[0].reshape(-1))
    worst["hf_loss"] = compare("transformers loss", out["loss"], loss, HF_TOL)
    loss.backward()
    gmax, gworst = 0.0, ""
    params = dict(m.named_parameters())
    for name in grads:
        g = params[name].grad
        e = compare(f"transformers grad {name}", grads[name], g if g is not None else torch.zeros_like(grads[name]),
                    HF_TOL)
        if e >= gmax:
            gmax, gworst = e, name
    worst[f"hf_grads (worst {gworst})"] = gmax
    print(f"{cfg['model_type']} vs transformers {transformers.__version__} (fp32): "
          + ", ".join(f"{k} {v:.2e}" for k, v in worst.items()) + f" (tolerance {HF_TOL})")


def main(d, with_transformers=False):
    cfg = json.load(open(f"{d}/model/config.json"))
    sd = read_st(f"{d}/model/model.safetensors")
    batches = read_st(f"{d}/batches.safetensors")
    toks, tgts = batches["tokens"].long(), batches["targets"].long()
    out = read_st(f"{d}/outputs.safetensors")
    grads = read_st(f"{d}/grads.safetensors")
    after = read_st(f"{d}/params_after.safetensors")
    norms = read_st(f"{d}/norms.safetensors")["norms"]

    model = Model(cfg, sd)
    V = cfg["vocab_size"]
    logits = model(toks[0])
    worst = {"logits": compare("logits", out["logits"], logits)}
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, V), tgts[0].reshape(-1))
    worst["loss"] = compare("loss", out["loss"], loss)
    loss.backward()
    worst["grads"] = grad_error(model, sd, grads)

    # 3 AdamW steps, accumulation 2 (loss = mean over both micro-batches' tokens), clip 0.5
    model = Model(cfg, sd)
    decay = [p for n, p in model.p.items() if p.dim() >= 2]
    no_decay = [p for n, p in model.p.items() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=1e-3, betas=(0.9, 0.95), eps=1e-8,
    )
    for step in range(3):
        opt.zero_grad()
        for m in range(2):
            i = 1 + 2 * step + m
            lg = model(toks[i])
            l = torch.nn.functional.cross_entropy(lg.reshape(-1, V), tgts[i].reshape(-1), reduction="sum")
            (l / (2 * toks[i].numel())).backward()
        n = torch.nn.utils.clip_grad_norm_(list(model.p.values()), 0.5)
        compare(f"grad norm step {step + 1}", norms[step], n)
        opt.step()
    pmax = 0.0
    for name in sd:
        pmax = max(pmax, compare(f"param after 3 steps {name}", after[name], model.w(name), TOL_AFTER_STEPS))
    worst["params_after_3_steps"] = pmax
    print(f"{cfg['model_type']}: " + ", ".join(f"{k} {v:.2e}" for k, v in worst.items()) + f" (tolerance {TOL}; {TOL_AFTER_STEPS} after steps)")
    if with_transformers:
        check_transformers(d, cfg, toks, tgts, out, grads)
    return finish()


if __name__ == "__main__":
    torch.set_default_dtype(torch.float64)
    # --transformers: also compare against transformers itself (fp32), see check_transformers.
    sys.exit(main(sys.argv[1], "--transformers" in sys.argv[2:]))
