#!/usr/bin/env python3
"""PyTorch oracle for lathe's bf16 / fp16 compute path (tests/models/test_model_bf16.cpp, TorchOracle).

Reads the directory the C++ test wrote (HF model dir with the fp32 master weights, tokens and
targets, lathe's logits, loss and gradients computed in DTYPE) and runs the same model in PyTorch
twice: in float64 (the truth) and with weights and activations in DTYPE (torch_reference.Model with
dtype=bfloat16/float16: as HF runs a model loaded in that dtype; CPU matmuls accumulate in fp32).

Tolerance: lathe and torch each round every activation to DTYPE, independently, so each is within
K * u of the float64 result (u = 2^-8 for bf16, 2^-11 for fp16; K = 12 for logits and loss, 16 for
gradients: the bounds of test_model_bf16.cpp, derived there) and they are within 2 * K * u of each
other. Errors are max|a - b| / max|b| per tensor, the scale of a fused GEMM's tensors (q|k|v,
gate|up) taken over the group (the k bias gradient is analytically zero). lathe must also be at
least as close to float64 as K * u. Exit code 1 on a violation.

usage: torch_reference_bf16.py DIR bf16|fp16
"""
import json
import os
import re
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_reference import Model, read_st  # noqa: E402

K_LOGITS, K_GRAD = 12, 16


def group_of(name):
    """Names of the tensors produced by the same fused GEMM as `name` (itself if none)."""
    for parts in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
        for p in parts:
            if f".{p}." in name:
                return [name.replace(f".{p}.", f".{q}.") for q in parts]
    return [name]


def main(d, dt_name):
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[dt_name]
    u = 2.0 ** (-8 if dt == torch.bfloat16 else -11)
    cfg = json.load(open(f"{d}/model/config.json"))
    sd = read_st(f"{d}/model/model.safetensors")
    batches = read_st(f"{d}/batches.safetensors")
    toks, tgts = batches["tokens"].long()[0], batches["targets"].long()[0]
    out = read_st(f"{d}/outputs.safetensors")
    grads = read_st(f"{d}/grads.safetensors")
    V = cfg["vocab_size"]

    res = {}
    for label, dtype in (("f64", torch.float64), ("half", dt)):
        m = Model(cfg, sd, dtype)
        logits = m(toks)
        loss = torch.nn.functional.cross_entropy(logits.float().double().reshape(-1, V), tgts.reshape(-1))
        loss.backward()
        g = {n: (m.w(n).grad if m.w(n).grad is not None else torch.zeros_like(m.w(n))).double() for n in sd}
        res[label] = (logits.detach().double(), loss.detach().double(), g)

    failures, report = [], {}

    def err(a, b, scale=None):
        a, b = a.double(), b.double()
        s = b.abs().max().item() if scale is None else scale
        return (a - b).abs().max().item() / (s if s > 0 else 1.0)

    def check(what, lathe_t, k, scale_of=None):
        t64, th = scale_of("f64"), scale_of("half")
        e_torch = err(lathe_t, th[0], th[1])
        e_truth = err(lathe_t, t64[0], t64[1])
        e_torch_truth = err(th[0], t64[0], t64[1])
        report[what] = (e_torch, e_truth, e_torch_truth)
        if not e_torch <= 2 * k * u:
            failures.append(f"{what}: lathe {dt_name} vs torch {dt_name} {e_torch:.3e} > {2 * k * u:.3e}")
        if not e_truth <= k * u:
            failures.append(f"{what}: lathe {dt_name} vs float64 {e_truth:.3e} > {k * u:.3e}")

    check("logits", out["logits"], K_LOGITS, lambda l: (res[l][0], None))
    check("loss", out["loss"], K_LOGITS, lambda l: (res[l][1], None))
    for name in sd:
        grp = [n for n in group_of(name) if n in sd]
        check(f"grad {name}", grads[name], K_GRAD,
              lambda l, name=name, grp=grp: (res[l][2][name], max(res[l][2][n].abs().max().item() for n in grp)))

    worst = lambda keys, i: max(report[k][i] for k in keys)
    gk = [k for k in report if k.startswith("grad ")]
    print(f"{cfg['model_type']} {dt_name} (u = {u:.2e}): lathe vs torch {dt_name}: logits {report['logits'][0]:.2e}, "
          f"loss {report['loss'][0]:.2e}, grads {worst(gk, 0):.2e}; vs float64: lathe logits {report['logits'][1]:.2e} "
          f"grads {worst(gk, 1):.2e}, torch {dt_name} logits {report['logits'][2]:.2e} grads {worst(gk, 2):.2e}")
    if failures:
        print("MISMATCH:\n  " + "\n  ".join(failures[:30]))
        return 1
    return 0


if __name__ == "__main__":
    torch.set_default_dtype(torch.float64)
    sys.exit(main(sys.argv[1], sys.argv[2]))
