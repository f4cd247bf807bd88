"""Independent oracle for tests/optim/test_optim.cpp.

Reads DIR/manifest.json and the raw float32 files lathe wrote, recomputes:
  * AdamW with torch.optim.AdamW (foreach=False), decay mask as two param groups;
  * LAMB from its formula (You et al. 2019 / apex FusedLAMB, trust ratio per tensor) in float64;
  * clipping with torch.nn.utils.clip_grad_norm_ over the tensors listed in the manifest;
  * LR schedules from their closed forms;
prints the maximum errors and exits 1 if any exceeds its tolerance.
"""
import json
import math
import os
import sys

import numpy as np
import torch

DIR = sys.argv[1]
M = json.load(open(os.path.join(DIR, "manifest.json")))
failures = []


def load(sub, name):
    return np.fromfile(os.path.join(DIR, sub, name), dtype="<f4")


def compare(what, got, ref, rtol, atol, scale_atol=0.0):
    """|got - ref| <= atol + scale_atol * max|ref| + rtol * |ref| elementwise. scale_atol is for
    quantities that are sums of terms of both signs (moments), where cancellation makes the
    elementwise relative error meaningless and the error is relative to the terms' size."""
    got = np.asarray(got, np.float64)
    ref = np.asarray(ref, np.float64)
    if ref.size:
        atol = atol + scale_atol * float(np.abs(ref).max())
    err = np.abs(got - ref)
    bad = err > atol + rtol * np.abs(ref)
    rel = float((err / (np.abs(ref) + atol)).max()) if err.size else 0.0
    print(f"{what}: max abs err {float(err.max()) if err.size else 0:.3e}, max rel err {rel:.3e}")
    if bad.any():
        i = int(np.argmax(bad))
        failures.append(f"{what}: element {i}: lathe {got.flat[i]!r} reference {ref.flat[i]!r}")


def covered_mask(P, ranges):
    m = np.zeros(P, bool)
    for off, size, _ in ranges:
        m[off:off + size] = True
    return m


def check_adamw(o):
    sub = o["dir"]
    p0 = torch.from_numpy(load(sub, "params0.f32").copy())
    tensors = [torch.nn.Parameter(p0[off:off + size].clone()) for off, size, _ in o["ranges"]]
    decay = [t for t, r in zip(tensors, o["ranges"]) if r[2]]
    nodecay = [t for t, r in zip(tensors, o["ranges"]) if not r[2]]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": o["weight_decay"]},
                             {"params": nodecay, "weight_decay": 0.0}],
                            lr=1.0, betas=(o["beta1"], o["beta2"]), eps=o["eps"], foreach=False)
    for st in o["steps"]:
        g = torch.from_numpy(load(sub, st["grad"]).copy())
        for t, (off, size, _) in zip(tensors, o["ranges"]):
            t.grad = g[off:off + size].clone()
        for group in opt.param_groups:
            group["lr"] = st["lr"]
        opt.step()
    out = load(sub, "out_params.f32")
    m = load(sub, o["state"]["exp_avg"])
    v = load(sub, o["state"]["exp_avg_sq"])
    for i, (t, (off, size, _)) in enumerate(zip(tensors, o["ranges"])):
        compare(f"adamw param tensor {i}", out[off:off + size], t.detach().numpy(), 1e-6, 1e-7)
        compare(f"adamw exp_avg tensor {i}", m[off:off + size], opt.state[t]["exp_avg"].numpy(), 1e-6, 0, 1e-6)
        compare(f"adamw exp_avg_sq tensor {i}", v[off:off + size], opt.state[t]["exp_avg_sq"].numpy(), 1e-6, 0, 1e-6)
    gap = ~covered_mask(o["P"], o["ranges"])
    compare("adamw untouched gap", out[gap], load(sub, "params0.f32")[gap], 0, 0)


def check_lamb(o):
    sub = o["dir"]
    b1, b2, eps, wd = o["beta1"], o["beta2"], o["eps"], o["weight_decay"]
    p = load(sub, "params0.f32").astype(np.float64)
    m = np.zeros_like(p)
    v = np.zeros_like(p)
    trusts = []
    for k, st in enumerate(o["steps"], start=1):
        g = load(sub, st["grad"]).astype(np.float64)
        for off, size, decay in o["ranges"]:
            s = slice(off, off + size)
            m[s] = b1 * m[s] + (1 - b1) * g[s]
            v[s] = b2 * v[s] + (1 - b2) * g[s] ** 2
            u = (m[s] / (1 - b1 ** k)) / (np.sqrt(v[s] / (1 - b2 ** k)) + eps)
            if decay:
                u = u + wd * p[s]
            pn, un = np.linalg.norm(p[s]), np.linalg.norm(u)
            trust = pn / un if pn > 0 and un > 0 else 1.0
            trusts.append(trust)
            p[s] = p[s] - st["lr"] * trust * u
    assert any(t == 1.0 for t in trusts) and any(t != 1.0 for t in trusts)
    out = load(sub, "out_params.f32")
    for i, (off, size, _) in enumerate(o["ranges"]):
        compare(f"lamb param tensor {i}", out[off:off + size], p[off:off + size], 2e-6, 1e-6)
    compare("lamb exp_avg", load(sub, o["state"]["exp_avg"]), m, 1e-5, 0, 1e-6)
    compare("lamb exp_avg_sq", load(sub, o["state"]["exp_avg_sq"]), v, 1e-5, 0, 1e-6)
    gap = ~covered_mask(o["P"], o["ranges"])
    compare("lamb untouched gap", out[gap], load(sub, "params0.f32")[gap], 0, 0)


def check_clip(c):
    sub = c["dir"]
    grads = load(sub, c["grads"])
    for case in c["cases"]:
        ts, off = [], 0
        for n in c["sizes"]:
            t = torch.nn.Parameter(torch.zeros(n))
            t.grad = torch.from_numpy(grads[off:off + n].copy())
            ts.append(t)
            off += n
        ref_norm = float(torch.nn.utils.clip_grad_norm_(ts, case["max_norm"] if case["max_norm"] > 0 else float("inf")))
        exact = math.sqrt(float(np.sum(grads.astype(np.float64) ** 2)))
        compare(f"clip norm (max_norm {case['max_norm']:.4g}) vs torch", [case["norm"]], [ref_norm], 1e-5, 0)
        compare(f"clip norm (max_norm {case['max_norm']:.4g}) vs float64", [case["norm"]], [exact], 1e-12, 0)
        ref = torch.cat([t.grad for t in ts]).numpy()
        compare(f"clipped grads (max_norm {case['max_norm']:.4g})", load(sub, case["out"]), ref, 1e-6, 1e-12)


def schedule_ref(c, step):
    lr, mn, w, T = c["lr"], c["min_lr"], c["warmup_steps"], c["total_steps"]
    if step < w:
        return lr * (step + 1) / w
    name = c["name"]
    if name == "constant":
        return lr
    if name in ("linear", "cosine"):
        p = min(max((step - w) / (T - w), 0.0), 1.0) if T > w else 1.0
        return lr + (mn - lr) * p if name == "linear" else mn + 0.5 * (lr - mn) * (1 + math.cos(math.pi * p))
    d = round(c["decay_fraction"] * T)
    start = T - d
    if step < start:
        return lr
    p = min((step - start) / d, 1.0) if d > 0 else 1.0
    f = {"linear": 1 - p, "cosine": 0.5 * (1 + math.cos(math.pi * p)), "1-sqrt": 1 - math.sqrt(p)}[c["decay_shape"]]
    return mn + (lr - mn) * f


def check_schedules(cs):
    worst = 0.0
    for c in cs:
        ref = [schedule_ref(c, s) for s in range(len(c["lrs"]))]
        for s, (a, b) in enumerate(zip(c["lrs"], ref)):
            err = abs(a - b) / max(abs(b), 1e-30)
            worst = max(worst, err)
            if err > 1e-12:
                failures.append(f"schedule {c['name']}/{c['decay_shape']} step {s}: lathe {a} ref {b}")
        # Shape checks that do not depend on the formula above.
        T, w = c["total_steps"], c["warmup_steps"]
        if w > 0:
            assert abs(c["lrs"][w - 1] - c["lr"]) < 1e-15, "warmup must end at lr"
        if c["name"] != "constant" and not (c["name"] == "wsd" and round(c["decay_fraction"] * T) == 0):
            assert abs(c["lrs"][T] - c["min_lr"]) < 1e-15, f"{c['name']} must reach min_lr at total_steps"
    print(f"schedules: {len(cs)} configs, max rel err {worst:.3e}")


for o in M["optimizers"]:
    check_adamw(o) if o["name"] == "adamw" else check_lamb(o)
check_clip(M["clip"])
check_schedules(M["schedules"])
if failures:
    print("FAILURES:\n  " + "\n  ".join(failures))
    sys.exit(1)
print("optim oracle: all OK")
