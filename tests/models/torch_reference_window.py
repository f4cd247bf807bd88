#!/usr/bin/env python3
"""transformers 4.45.2 oracle for tests/models/test_sliding_window.cpp (sliding-window attention,
issue 25 item 5).

Reads what the C++ test wrote (HF model dir, run.safetensors with tokens, targets, lathe's logits
and loss; grads.safetensors) and runs MistralForCausalLM / Qwen2ForCausalLM from that directory in
float64 with eager attention and use_cache=False. The loss is the mean cross-entropy of the logits
at every position against lathe's explicit targets (lathe's targets are not shifted).

Masks: transformers 4.45.2 MistralModel._update_causal_mask excludes key j from query i when
j > i or `arange(target_length) <= cache_position - sliding_window`, i.e. query i sees keys
i - sliding_window < j <= i. A Mistral config whose layers all slide runs with HF's own mask.
When only some layers slide (a layer_types list; Qwen2's max_window_layers: layers >= it, as
4.45.2's Qwen2FlashAttention2 decides, while its eager attention ignores the window) every
layer's attention gets that same formula with its own window, through a wrapper of its forward.

Checks (exit code 1 on any failure): logits, loss, every gradient within 1e-5 relative; HF with
the window one key narrower or wider, and with full attention, differs from lathe's logits by more
than 100x that (so the comparison above would fail for a window off by one).
"""
import json
import os
import sys

import torch
import transformers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_reference import compare, failures, finish, read_st  # noqa: E402

TOL = 1e-5


def layer_windows(cfg):
    """Each layer's window (0: full attention) as lathe's config.json states it."""
    L = cfg["num_hidden_layers"]
    w = cfg.get("sliding_window") or 0
    if cfg["model_type"] == "qwen2" and not cfg.get("use_sliding_window", False):
        w = 0
    if "layer_types" in cfg:
        return [w if t == "sliding_attention" else 0 for t in cfg["layer_types"]], False
    if cfg["model_type"] == "qwen2":
        return [w if i >= cfg.get("max_window_layers", 28) else 0 for i in range(L)], False
    return [w] * L, True  # mistral, every layer: HF's own mask


def hf_mask(T, window):
    """[1, 1, T, T] additive float64 mask, transformers 4.45.2 Mistral's formula."""
    i = torch.arange(T).reshape(-1, 1)
    j = torch.arange(T)
    exclude = j > i
    if window:
        exclude |= j <= (i - window)
    m = torch.zeros(T, T, dtype=torch.float64)
    m[exclude] = torch.finfo(torch.float64).min
    return m[None, None]


def patch(model, windows, T):
    """Every layer's attention runs with its own window's mask (replacing the model's)."""
    for layer, w in zip(model.model.layers, windows):
        attn = layer.self_attn
        if not hasattr(attn, "_lathe_orig"):
            attn._lathe_orig = attn.forward
        mask = hf_mask(T, w)

        def fwd(*a, _o=attn._lathe_orig, _m=mask, **kw):
            kw["attention_mask"] = _m.expand(a[0].shape[0] if a else kw["hidden_states"].shape[0], 1, T, T)
            return _o(*a, **kw)

        attn.forward = fwd


def main(d):
    cfg = json.load(open(f"{d}/model/config.json"))
    run = read_st(f"{d}/run.safetensors")
    grads = read_st(f"{d}/grads.safetensors")
    toks, tgts = run["tokens"].long(), run["targets"].long()
    B, T = toks.shape
    V = cfg["vocab_size"]
    cls = {"mistral": transformers.MistralForCausalLM, "qwen2": transformers.Qwen2ForCausalLM}[cfg["model_type"]]
    model = cls.from_pretrained(f"{d}/model", torch_dtype=torch.float64, attn_implementation="eager")
    model.train(False)
    windows, native = layer_windows(cfg)
    if not native:
        patch(model, windows, T)
    print(f"{cfg['model_type']}: layer windows {windows} ({'HF mask' if native else 'per-layer HF-formula masks'}),"
          f" T={T}")

    out = model(input_ids=toks, use_cache=False)
    logits = out.logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, V), tgts.reshape(-1))
    loss.backward()
    e_logits = compare("logits", run["logits"], logits, TOL)
    e_loss = compare("loss", run["loss"].reshape(()), loss, TOL)
    e_grad = 0.0
    params = dict(model.named_parameters())
    for name, g in grads.items():
        p = params[name]
        e_grad = max(e_grad, compare(f"grad {name}", g, p.grad if p.grad is not None else torch.zeros_like(p), TOL))
    print(f"  vs transformers: logits {e_logits:.2e}, loss {e_loss:.2e}, worst gradient {e_grad:.2e} (tol {TOL})")

    # A window off by one (and no window) is a different model: far outside the tolerance.
    with torch.no_grad():
        for delta in (-1, 1, None):
            ws = [0 if delta is None else (w + delta if w else 0) for w in windows]
            if native:
                model.config.sliding_window = None if delta is None else windows[0] + delta
            else:
                patch(model, ws, T)
            other = model(input_ids=toks, use_cache=False).logits
            scale = other.abs().max().item()
            err = (run["logits"].double() - other).abs().max().item() / scale
            what = "full attention" if delta is None else f"window {'+' if delta > 0 else ''}{delta}"
            print(f"  lathe vs HF with {what}: {err:.2e}")
            if not err > 100 * TOL:
                failures.append(f"{what}: lathe's logits are within {err:.2e} of it (the window does not show)")
    return finish()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
