#!/usr/bin/env python3
"""OLMo 2 import/export through the lathe binary, checked against the PyTorch reference module
tests/models/torch_reference_olmo2.py (written after transformers' modeling_olmo2.py: the pinned
transformers 4.45.2 has no Olmo2, it arrived in 4.47).

A tiny random Olmo2 directory (3 layers, 6 heads of 10 over 2 kv heads in hidden 60, q_norm 60 and
k_norm 20 wide, untied, rope_theta 5e5) with matrices of std 0.5 and norm weights 1 + 0.1 N(0, 1):
  * import: `lathe logits` equals the float64 reference (relative 1e-5); the broken references
    (per-head q/k norms, pre-norms, no RoPE) differ by far more (attention, RoPE and the norms matter);
  * round trip: `lathe convert --from-hf D --to OUT` writes the same tensors byte for byte and a
    config.json with every key of the source and the same values;
  * `convert --verify` cannot run (transformers 4.45.2 has no olmo2) and says so, failing;
  * train a step from it (init_from), `lathe export`: the reference's logits of the export equal
    lathe's, and the step changed them;
  * GGUF export writes llama.cpp's olmo2; refused with the reason: ONNX export, attention_bias true, a missing k_norm tensor.
(Gradients against the same reference: tests/models/test_olmo2.cpp.)
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "models"))
sys.path.insert(0, os.path.join(HERE, "..", "common"))
sys.path.insert(0, os.path.join(HERE, "..", "train"))
from run_harness import INIT_FROM_RECIPE, check, failures  # noqa: E402
import megatron_writer  # noqa: E402
import torch  # noqa: E402
import torch_reference_olmo2 as o2  # noqa: E402
from safetensors.numpy import load_file, save_file  # noqa: E402

LATHE = os.environ.get("LATHE_BIN", "build/lathe")
TOKENS = [[1, 5, 9, 90, 3, 3, 77, 55, 0, 12, 64, 28], [7, 7, 7, 8, 9, 10, 50, 1]]
TOL = 1e-5


def run(args, ok=True):
    p = subprocess.run([LATHE] + args, capture_output=True, text=True, errors="replace")
    if ok and p.returncode != 0:
        raise RuntimeError(f"lathe {' '.join(args)} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    return p


def ref_logits(d, brk=None):
    _, _, m = o2.load(d, brk)
    with torch.no_grad():
        return [m(torch.tensor([t]))[0].numpy() for t in TOKENS]


def lathe_logits(d, tmp):
    out = os.path.join(tmp, "logits.f32")
    args = ["logits", "--model", d, "--out", out]
    for t in TOKENS:
        args += ["--tokens", ",".join(map(str, t))]
    run(args)
    flat = np.fromfile(out, dtype="<f4")
    V = json.load(open(os.path.join(d, "config.json")))["vocab_size"]
    res, off = [], 0
    for t in TOKENS:
        res.append(flat[off:off + len(t) * V].reshape(len(t), V))
        off += len(t) * V
    return res


def reldiff(a, b):
    scale = max(float(np.abs(y).max()) for y in b)
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b)) / scale


def train_export(tmp, d, want):
    data = os.path.join(tmp, "data")
    rng = np.random.default_rng(1)
    megatron_writer.write(data, [rng.integers(0, 97, 600) for _ in range(4)])
    run_dir, recipe = os.path.join(tmp, "run"), os.path.join(tmp, "o.yaml")
    open(recipe, "w").write(INIT_FROM_RECIPE.format(init=d, data=data, out=run_dir))
    run(["train", recipe])
    exp = os.path.join(tmp, "export")
    run(["export", run_dir, "--to", exp])
    trained_ref = ref_logits(exp)
    e = reldiff(lathe_logits(exp, tmp), trained_ref)
    check(e < TOL, f"exported trained model: the reference equals lathe (relative {e:.2e})")
    moved = reldiff(trained_ref, want)
    check(moved > 1e-4, f"the training step changed the logits (by {moved:.3g} relative)")


def main():
    torch.set_default_dtype(torch.float64)
    tmp = tempfile.mkdtemp(prefix="lathe_olmo2_hf_")
    try:
        d = os.path.join(tmp, "hf")
        o2.write(d, 5)
        want = ref_logits(d)
        got = lathe_logits(d, tmp)
        e = reldiff(got, want)
        check(e <= TOL, f"import: lathe logits == the reference (relative {e:.2e} <= {TOL})")
        for brk in ("per-head-qk-norm", "pre-norm", "no-rope"):
            eb = reldiff(got, ref_logits(d, brk))
            check(eb > 1e-3, f"the {brk} reference differs from lathe (by {eb:.2e} relative)")

        # Round trip: the same tensors byte for byte, every config.json key with the same value.
        out = os.path.join(tmp, "out")
        run(["convert", "--from-hf", d, "--to", out])
        a, b = load_file(os.path.join(d, "model.safetensors")), load_file(os.path.join(out, "model.safetensors"))
        check(sorted(a) == sorted(b), f"round trip: the same tensor names ({len(a)})")
        check(all(a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]) for k in a if k in b),
              "round trip: every tensor byte-identical")
        ca, cb = json.load(open(os.path.join(d, "config.json"))), json.load(open(os.path.join(out, "config.json")))
        diff = {k: (ca.get(k), cb.get(k)) for k in ca
                if k != "transformers_version" and ca.get(k) != cb.get(k)}
        check(not diff, f"round trip: config.json keeps every key and value ({diff})")
        e4 = reldiff(lathe_logits(out, tmp), got)
        check(e4 == 0.0, f"round trip: lathe's logits of the export equal the original's ({e4:.2e})")
        p = run(["convert", "--from-hf", d, "--verify"], ok=False)
        msg = p.stdout + p.stderr
        check(p.returncode != 0 and "model type `olmo2`" in msg and "-> PASS" not in msg,
              f"convert --verify cannot run on transformers 4.45.2 and fails saying so ({msg.strip()[-200:]})")

        train_export(tmp, d, want)

        # Refusals, each naming the reason.
        # (GGUF export is run by llama.cpp itself in tests/interop/test_gguf_llama_cpp.py.)
        p = run(["convert", "--from-hf", d, "--to-gguf", os.path.join(tmp, "g.gguf")], ok=False)
        check(p.returncode == 0 and "architecture olmo2" in p.stdout,
              f"GGUF export writes llama.cpp's olmo2 architecture ({(p.stdout + p.stderr).strip()[-200:]})")
        p = run(["export", d, "--to-onnx", os.path.join(tmp, "m.onnx")], ok=False)
        check(p.returncode != 0 and "olmo2" in p.stderr, f"ONNX export refused ({p.stderr.strip()[-200:]})")
        bad = os.path.join(tmp, "bad")
        shutil.copytree(d, bad)
        cfg = json.load(open(os.path.join(bad, "config.json")))
        cfg["attention_bias"] = True
        json.dump(cfg, open(os.path.join(bad, "config.json"), "w"))
        p = run(["logits", "--model", bad, "--out", os.path.join(tmp, "x"), "--tokens", "1,2"], ok=False)
        check(p.returncode != 0 and "attention_bias" in p.stderr,
              f"attention_bias true refused ({p.stderr.strip()[-200:]})")
        shutil.rmtree(bad)
        shutil.copytree(d, bad)
        sd = load_file(os.path.join(bad, "model.safetensors"))
        del sd["model.layers.1.self_attn.k_norm.weight"]
        save_file(sd, os.path.join(bad, "model.safetensors"), metadata={"format": "pt"})
        p = run(["logits", "--model", bad, "--out", os.path.join(tmp, "x"), "--tokens", "1,2"], ok=False)
        check(p.returncode != 0 and "k_norm" in p.stderr, f"a missing tensor is named ({p.stderr.strip()[-200:]})")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if failures:
        print(f"FAILED {len(failures)}: " + "; ".join(failures))
        sys.exit(1)
    print("PASS")


if __name__ == "__main__":
    main()
