#!/usr/bin/env python3
"""transformers 4.45.2 oracle for tests/models/test_gemma2.cpp.

`check DIR [--break-softcap | --break-final | --break-window | --break-scale]`: DIR holds what the C++ test wrote
(model/ = lathe's HF export: config.json + model.safetensors; batches, outputs = lathe's logits and
loss, grads = lathe's gradient of every tensor). transformers' Gemma2ForCausalLM loads model/ in
float32 with eager attention (use_cache=False: Debian's torch 1.13), and its logits, loss and every
gradient must be within 1e-5 of lathe's (max |lathe - hf| / max |hf| per tensor). The --break-*
flags load a deliberately different model (no attention soft cap, no final soft cap, no sliding
window, the score scale 1/sqrt(head_dim)): the comparison must then fail, which shows each feature
is seen.
Exit code 1 on a mismatch.
"""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_reference as ref  # noqa: E402

TOL = 1e-5


def check(d, flags):
    import transformers

    transformers.logging.set_verbosity_error()
    cfg = json.load(open(f"{d}/model/config.json"))
    hf_cfg = transformers.Gemma2Config.from_pretrained(f"{d}/model")
    if "--break-softcap" in flags:
        hf_cfg.attn_logit_softcapping = None
    if "--break-final" in flags:
        hf_cfg.final_logit_softcapping = None
    if "--break-window" in flags:
        hf_cfg.sliding_window = 10**6
    if "--break-scale" in flags:
        hf_cfg.query_pre_attn_scalar = hf_cfg.head_dim
    hf_cfg._attn_implementation = "eager"
    m = transformers.Gemma2ForCausalLM.from_pretrained(f"{d}/model", config=hf_cfg, torch_dtype=torch.float32,
                                                       attn_implementation="eager")
    batches = ref.read_st(f"{d}/batches.safetensors")
    toks, tgts = batches["tokens"].long(), batches["targets"].long()
    out = ref.read_st(f"{d}/outputs.safetensors")
    grads = ref.read_st(f"{d}/grads.safetensors")
    V = cfg["vocab_size"]
    logits = m(toks[0], use_cache=False).logits
    worst = {"logits": ref.compare("transformers logits", out["logits"], logits, TOL)}
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, V).float(), tgts[0].reshape(-1))
    worst["loss"] = ref.compare("transformers loss", out["loss"], loss, TOL)
    loss.backward()
    params = dict(m.named_parameters())
    gmax, gworst = 0.0, ""
    for name in grads:
        g = params[name].grad
        e = ref.compare(f"grad {name}", grads[name], g if g is not None else torch.zeros_like(grads[name]), TOL)
        if e >= gmax:
            gmax, gworst = e, name
    worst[f"grads (worst {gworst})"] = gmax
    missing = sorted(set(params) - set(grads))
    if missing:
        ref.failures.append(f"parameters lathe wrote no gradient for: {missing}")
    # How much the caps and the window matter in this case (printed: the test's inputs must make them bind).
    print(f"gemma2 vs transformers {transformers.__version__} (fp32{' ' + ' '.join(flags) if flags else ''}): "
          + ", ".join(f"{k} {v:.2e}" for k, v in worst.items()) + f" (tolerance {TOL}); "
          + f"max |logit| {logits.abs().max().item():.3f} (final cap {cfg.get('final_logit_softcapping')})")
    return ref.finish()


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] != "check":
        print(__doc__)
        sys.exit(2)
    sys.exit(check(sys.argv[2], sys.argv[3:]))
