#!/usr/bin/env python3
"""transformers 4.45.2 oracle for tests/models/test_qwen2_moe.cpp (issue 28).

`check DIR [--break-aux | --break-renorm | --break-shared-gate | --break-shared | --break-bias]`:
DIR holds what the C++ test wrote (model/ = lathe's HF export: config.json + model.safetensors;
batches, outputs = lathe's logits and training loss, grads = lathe's gradient of every tensor).
transformers' Qwen2MoeForCausalLM loads model/ in float32 with eager attention and
output_router_logits, and its logits, its loss (cross entropy + router_aux_loss_coef x
load-balancing loss, as Qwen2MoeForCausalLM returns it with labels) and every gradient must be
within 1e-5 of lathe's (max |lathe - hf| / max |hf| per tensor). Labels are passed already shifted
(lathe's targets) by computing the loss here from the logits and aux_loss transformers returns.

The --break-* flags compute a deliberately different model: without the aux loss, with the top-k
weights renormalised (norm_topk_prob flipped), the shared expert without its sigmoid gate, without
the shared expert, or with q/k/v biases zeroed: the comparison must then fail, which shows each is
seen. Exit code 1 on a mismatch.
"""
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_reference as ref  # noqa: E402

TOL = 1e-5


def patched_forward(gate_shared, use_shared):
    """Qwen2MoeSparseMoeBlock.forward of 4.45.2 with the shared expert's gate (or the expert) off."""

    def forward(self, hidden_states):
        b, t, c = hidden_states.shape
        x = hidden_states.view(-1, c)
        router_logits = self.gate(x)
        w = F.softmax(router_logits, dim=1, dtype=torch.float)
        w, sel = torch.topk(w, self.top_k, dim=-1)
        if self.norm_topk_prob:
            w /= w.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(x)
        mask = F.one_hot(sel, num_classes=self.num_experts).permute(2, 1, 0)
        for e in range(self.num_experts):
            idx, top_x = torch.where(mask[e])
            out.index_add_(0, top_x, self.experts[e](x[top_x]) * w[top_x, idx, None])
        if use_shared:
            s = self.shared_expert(x)
            out = out + (torch.sigmoid(self.shared_expert_gate(x)) * s if gate_shared else s)
        return out.reshape(b, t, c), router_logits

    return forward


def check(d, flags):
    import transformers
    from transformers.models.qwen2_moe import modeling_qwen2_moe

    transformers.logging.set_verbosity_error()
    cfg = json.load(open(f"{d}/model/config.json"))
    hf_cfg = transformers.Qwen2MoeConfig.from_pretrained(f"{d}/model")
    if "--break-aux" in flags:
        hf_cfg.router_aux_loss_coef = 0.0
    if "--break-renorm" in flags:
        hf_cfg.norm_topk_prob = not hf_cfg.norm_topk_prob
    if "--break-shared-gate" in flags:
        modeling_qwen2_moe.Qwen2MoeSparseMoeBlock.forward = patched_forward(False, True)
    if "--break-shared" in flags:
        modeling_qwen2_moe.Qwen2MoeSparseMoeBlock.forward = patched_forward(True, False)
    m = transformers.Qwen2MoeForCausalLM.from_pretrained(f"{d}/model", config=hf_cfg, torch_dtype=torch.float32,
                                                         attn_implementation="eager")
    if "--break-bias" in flags:
        with torch.no_grad():
            for name, p in m.named_parameters():
                if name.endswith("_proj.bias"):
                    p.zero_()
    batches = ref.read_st(f"{d}/batches.safetensors")
    toks, tgts = batches["tokens"].long(), batches["targets"].long()
    out = ref.read_st(f"{d}/outputs.safetensors")
    grads = ref.read_st(f"{d}/grads.safetensors")
    V = cfg["vocab_size"]
    res = m(toks[0], use_cache=False, output_router_logits=True)
    logits = res.logits
    worst = {"logits": ref.compare("transformers logits", out["logits"], logits, TOL)}
    # Qwen2MoeForCausalLM: loss = CE + router_aux_loss_coef * aux_loss (labels given; here already shifted).
    ce = F.cross_entropy(logits.reshape(-1, V).float(), tgts[0].reshape(-1))
    loss = ce + hf_cfg.router_aux_loss_coef * res.aux_loss
    worst["loss"] = ref.compare("transformers loss", out["loss"], loss, TOL)
    worst["aux_loss"] = ref.compare("transformers aux_loss", out["aux_loss"], res.aux_loss, TOL)
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
    # How uneven the routing is and how much the shared gate varies (both must matter).
    probs = torch.softmax(res.router_logits[0], dim=-1)
    x0 = m.model.layers[0].post_attention_layernorm(m.model.embed_tokens(toks[0]))  # not the real ln2: a scale hint
    sg = torch.sigmoid(m.model.layers[0].mlp.shared_expert_gate(x0))
    print(f"qwen2_moe vs transformers {transformers.__version__} (fp32{' ' + ' '.join(flags) if flags else ''}): "
          + ", ".join(f"{k} {v:.2e}" for k, v in worst.items()) + f" (tolerance {TOL}); aux_loss "
          + f"{res.aux_loss.item():.4f}, layer-0 max router prob {probs.max().item():.3f}, shared gate range "
          + f"[{sg.min().item():.2f}, {sg.max().item():.2f}]")
    return ref.finish()


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] != "check":
        print(__doc__)
        sys.exit(2)
    sys.exit(check(sys.argv[2], sys.argv[3:]))
