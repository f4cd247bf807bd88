#!/usr/bin/env python3
"""transformers 4.45.2 oracle for tests/models/test_rope_scaling.cpp.

  hf_rope_reference.py freqs FILE  - FILE is a JSON list of {config, seq_len, inv_freq,
      attention_factor} computed by lathe (config/rope_scaling.cpp); each is compared with
      transformers' ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", seq_len) (dynamic gets seq_len as
      the 0-dim int64 tensor LlamaRotaryEmbedding passes, when it exceeds max_position_embeddings).
      Plain RoPE must agree bit for bit, the others within 4 fp32 ulp (relative 5e-7).
  hf_rope_reference.py model DIR   - DIR/model is lathe's HF export (config.json with rope_scaling
      / partial_rotary_factor, model.safetensors); DIR/outputs.safetensors holds tokens, targets,
      lathe's logits and loss, DIR/grads.safetensors lathe's gradients. transformers' own
      LlamaForCausalLM / Qwen2ForCausalLM (fp32, eager attention) loads the directory and computes
      them; every tensor must agree within TOL of max|torch|. Phi3ForCausalLM too (phi3_window_mask).
      partial_rotary_factor: transformers 4.45's llama computes cos/sin of the rotated width but
      apply_rotary_pos_emb multiplies the whole head by them (a shape error), so the oracle swaps in
      GPT-NeoX's partial rotation (modeling_gpt_neox: rotate q[..., :rot], pass q[..., rot:]).
Exit code 1 on any mismatch.
"""
import json
import os
import sys

import numpy as np
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from safetensors.torch import load_file

TOL = 1e-5


def config_of(d):
    cls = transformers.Qwen2Config if d["model_type"] == "qwen2" else transformers.LlamaConfig
    return cls(**{k: v for k, v in d.items() if k not in ("model_type", "architectures")})


def freqs(path):
    cases = json.load(open(path))
    bad = 0
    worst = {}
    for c in cases:
        cfg = config_of(c["config"])
        rs = cfg.rope_scaling
        kind = "default" if rs is None else rs.get("rope_type", rs.get("type"))
        seq = c["seq_len"]
        arg = torch.tensor(seq) if (kind == "dynamic" and seq > cfg.max_position_embeddings) else None
        inv, af = ROPE_INIT_FUNCTIONS[kind](cfg, "cpu", seq_len=arg)
        want = inv.float().numpy()
        got = np.array(c["inv_freq"], dtype=np.float32)
        tag = f"{kind} head_dim {cfg.hidden_size // cfg.num_attention_heads} theta {cfg.rope_theta} seq {seq}"
        if got.shape != want.shape:
            print(f"MISMATCH {tag}: {got.shape} vs {want.shape}")
            bad += 1
            continue
        rel = float(np.max(np.abs(got.astype(np.float64) - want) / np.abs(want)))
        afd = abs(float(np.float32(af)) - c["attention_factor"])
        worst[kind] = max(worst.get(kind, 0.0), rel)
        ok = (rel == 0.0) if kind == "default" else rel <= 5e-7
        if not ok or afd > 0:
            print(f"MISMATCH {tag}: inv_freq rel {rel:.3g}, attention factor {c['attention_factor']} vs {af}")
            bad += 1
    print(f"{len(cases)} cases; worst relative inv_freq error per type: " +
          ", ".join(f"{k} {v:.2e}" for k, v in sorted(worst.items())))
    return 1 if bad else 0


def neox_partial_apply(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """GPT-NeoX's partial rotary (transformers 4.45 modeling_gpt_neox): rotate the first
    cos.shape[-1] dims with rotate_half, pass the rest."""
    rot = cos.shape[-1]
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    rh = transformers.models.llama.modeling_llama.rotate_half

    def one(x):
        xr, xp = x[..., :rot], x[..., rot:]
        return torch.cat((xr * cos + rh(xr) * sin, xp), dim=-1)

    return one(q), one(k)


def phi3_window_mask(cfgd, toks):
    """phi3 with a sliding_window S shorter than the pass: transformers 4.45.2 applies the window
    only in Phi3FlashAttention2, as flash-attn's window_size=(S, S): query t sees keys
    t - S .. t (S + 1 keys); its eager mask ignores the window. The oracle is the eager model with
    that mask given as a 4D additive mask (_prepare_4d_causal_attention_mask_with_cache_position
    uses a 4D mask as it is). PHI3_WINDOW_DELTA (tests only) widens it to show an off-by-one fails."""
    S = cfgd.get("sliding_window")
    if cfgd["model_type"] != "phi3" or S is None:
        return None
    S += int(os.environ.get("PHI3_WINDOW_DELTA", "0"))
    B, T = toks.shape
    i = torch.arange(T).reshape(-1, 1)
    j = torch.arange(T).reshape(1, -1)
    allowed = (j <= i) & (i - j <= S)
    mask = torch.zeros(T, T).masked_fill(~allowed, torch.finfo(torch.float32).min)
    return mask[None, None].expand(B, 1, T, T)


def phi3_partial_rotary(m):
    """Phi-4-mini's partial_rotary_factor as later transformers' Phi3 computes it (4.45.2 rotates
    the whole head): the rotary classes built over rot = int(head_dim x factor) dims (longrope's
    factors one per rotated pair, its attention factor unchanged), applied by neox_partial_apply."""
    ph = transformers.models.phi3.modeling_phi3
    c = m.config
    rot = int(c.hidden_size // c.num_attention_heads * c.partial_rotary_factor)
    for layer in m.model.layers:
        a = layer.self_attn
        if c.rope_scaling is None:
            a.rotary_emb = ph.Phi3RotaryEmbedding(rot, max_position_embeddings=c.max_position_embeddings,
                                                  base=c.rope_theta)
        else:
            a.rotary_emb = ph.Phi3LongRoPEScaledRotaryEmbedding(rot, c)


def model(d):
    cfgd = json.load(open(f"{d}/model/config.json"))
    if cfgd.get("partial_rotary_factor", 1.0) != 1.0:
        transformers.models.llama.modeling_llama.apply_rotary_pos_emb = neox_partial_apply
        transformers.models.qwen2.modeling_qwen2.apply_rotary_pos_emb = neox_partial_apply
        transformers.models.phi3.modeling_phi3.apply_rotary_pos_emb = neox_partial_apply
        # 4.45's Phi3Config wants head_dim / 2 longrope factors; later releases count the rotated
        # pairs (lathe's validate_rope checks that count).
        transformers.models.phi3.configuration_phi3.Phi3Config._rope_scaling_validation = lambda self: None
    m = transformers.AutoModelForCausalLM.from_pretrained(f"{d}/model", torch_dtype=torch.float32,
                                                         attn_implementation="eager")
    if cfgd["model_type"] == "phi3" and cfgd.get("partial_rotary_factor", 1.0) != 1.0:
        phi3_partial_rotary(m)
    out = load_file(f"{d}/outputs.safetensors")
    grads = load_file(f"{d}/grads.safetensors")
    toks, tgts = out["tokens"].long(), out["targets"].long()
    logits = m(input_ids=toks, attention_mask=phi3_window_mask(cfgd, toks), use_cache=False).logits
    V = logits.shape[-1]
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, V), tgts.reshape(-1))
    loss.backward()
    bad = 0
    worst = {}

    def cmp(what, lathe_t, torch_t):
        nonlocal bad
        t = torch_t.detach().double()
        err = float((lathe_t.double() - t).abs().max() / max(float(t.abs().max()), 1e-30))
        key = what.split(" ")[0]
        worst[key] = max(worst.get(key, 0.0), err)
        if err > TOL:
            print(f"MISMATCH {what}: relative error {err:.3g} > {TOL}")
            bad += 1

    cmp("logits", out["logits"], logits)
    cmp("loss", out["loss"].reshape(()), loss)
    params = dict(m.named_parameters())
    for name, g in grads.items():
        p = params[name]
        cmp(f"grad {name}", g, p.grad if p.grad is not None else torch.zeros_like(p))
    rs = cfgd.get("rope_scaling")
    print(f"{cfgd['model_type']} rope_scaling {json.dumps(rs)[:80]} partial {cfgd.get('partial_rotary_factor', 1.0)}: "
          + ", ".join(f"{k} {v:.2e}" for k, v in worst.items()) + f" (tolerance {TOL})")
    return 1 if bad else 0


if __name__ == "__main__":
    torch.manual_seed(0)
    sys.exit(freqs(sys.argv[2]) if sys.argv[1] == "freqs" else model(sys.argv[2]))
