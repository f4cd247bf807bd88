#!/usr/bin/env python3
"""transformers oracle for the MoE CPU kernels (tests/kernels/test_moe.cpp, issue 28).

  check DIR FAMILY N C F E K     DIR holds raw little-endian float32 files written by test_moe.cpp:
                                 inputs x[N,C], wr[E,C], w1[E,F,C], w3[E,F,C], w2[E,C,F], g[N,C];
                                 lathe's out[N,C], aux[1], z[1] and gradients dx, dwr, dw1, dw3, dw2
                                 of  <out, g> + 0.3 * aux + 0.05 * z.
FAMILY mixtral: transformers 4.45.2's MixtralSparseMoeBlock (softmax, top-k, renormalised);
FAMILY qwen2_moe: Qwen2MoeSparseMoeBlock with norm_topk_prob false and its shared expert zeroed
(down_proj = 0, so it adds nothing). aux = transformers' load_balancing_loss_func of the block's
router logits, z = switch_transformers' router_z_loss_func (mean of logsumexp^2). Float64 modules
(the blocks compute the routing softmax in fp32 as transformers does). Every tensor must match with
max |lathe - ref| <= 1e-5 * (1 + max |ref|). Exit code 1 on a mismatch, 2 on bad arguments.
"""
import sys

import numpy as np
import torch
from transformers import MixtralConfig, Qwen2MoeConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock, load_balancing_loss_func
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
from transformers.models.switch_transformers.modeling_switch_transformers import router_z_loss_func

AUX_COEF, Z_COEF, TOL = 0.3, 0.05, 1e-5


def load(d, name, shape):
    a = np.fromfile(f"{d}/{name}.bin", dtype="<f4")
    assert a.size == int(np.prod(shape)), f"{d}/{name}.bin holds {a.size} floats, expected shape {shape}"
    return torch.from_numpy(a.astype(np.float64)).reshape(shape)


def build(family, C, F, E, K, wr, w1, w3, w2):
    if family == "mixtral":
        cfg = MixtralConfig(hidden_size=C, intermediate_size=F, num_local_experts=E, num_experts_per_tok=K,
                            router_jitter_noise=0.0)
        block = MixtralSparseMoeBlock(cfg).double().eval()
        names = ("w1", "w3", "w2")
    elif family == "qwen2_moe":
        cfg = Qwen2MoeConfig(hidden_size=C, moe_intermediate_size=F, shared_expert_intermediate_size=F,
                             num_experts=E, num_experts_per_tok=K, norm_topk_prob=False)
        block = Qwen2MoeSparseMoeBlock(cfg).double().eval()
        names = ("gate_proj", "up_proj", "down_proj")
    else:
        print(f"unknown family {family!r}: mixtral or qwen2_moe")
        sys.exit(2)
    with torch.no_grad():
        block.gate.weight.copy_(wr)
        for e, expert in enumerate(block.experts):
            getattr(expert, names[0]).weight.copy_(w1[e])
            getattr(expert, names[1]).weight.copy_(w3[e])
            getattr(expert, names[2]).weight.copy_(w2[e])
        if family == "qwen2_moe":
            block.shared_expert.down_proj.weight.zero_()
    return block


def main():
    if len(sys.argv) != 9 or sys.argv[1] != "check":
        print(__doc__)
        sys.exit(2)
    d, family = sys.argv[2], sys.argv[3]
    N, C, F, E, K = (int(v) for v in sys.argv[4:])
    x = load(d, "x", (N, C)).requires_grad_(True)
    wr, w1, w3, w2 = load(d, "wr", (E, C)), load(d, "w1", (E, F, C)), load(d, "w3", (E, F, C)), load(d, "w2", (E, C, F))
    g = load(d, "g", (N, C))
    block = build(family, C, F, E, K, wr, w1, w3, w2)
    out, logits = block(x.view(1, N, C))
    aux = load_balancing_loss_func((logits,), E, K)
    z = router_z_loss_func(logits.view(1, N, E))
    (torch.sum(out.view(N, C) * g) + AUX_COEF * aux + Z_COEF * z).backward()

    pairs = [("out", out.view(N, C)), ("aux", aux.view(1)), ("z", z.view(1)), ("dx", x.grad),
             ("dwr", block.gate.weight.grad)]
    names = ("w1", "w3", "w2") if family == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    for lname, hname in zip(("dw1", "dw3", "dw2"), names):
        grads = []
        for expert in block.experts:
            w = getattr(expert, hname).weight
            grads.append(w.grad if w.grad is not None else torch.zeros_like(w))
        pairs.append((lname, torch.stack(grads)))
    bad = 0
    for name, want in pairs:
        got = load(d, name, tuple(want.shape))
        want = want.detach()
        err = (got - want).abs().max().item()
        lim = TOL * (1.0 + want.abs().max().item())
        ok = err <= lim
        bad += not ok
        print(f"{family} {name}: max abs err {err:.3g} (limit {lim:.3g}) {'ok' if ok else 'MISMATCH'}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
