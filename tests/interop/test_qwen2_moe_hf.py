#!/usr/bin/env python3
"""Qwen2-MoE (mixture of experts with a gated shared expert, issue 28) import/export through the
lathe binary, checked against transformers 4.45.2's Qwen2MoeForCausalLM (config objects, no
downloads).

A tiny model (2 layers, 4 heads over 2 kv heads in hidden 48, 6 experts of width 24, top-3 without
renormalisation, a shared expert of width 56, output_router_logits with router_aux_loss_coef 0.02)
with matrices of std 0.5 (routing far from uniform, the shared gate's sigmoid spread) and 1-D
weights (norms, q/k/v biases) perturbed around 1, saved by transformers:
  * import: `lathe logits` equals transformers (eager, use_cache=False; fp32, relative 1e-5), and
    routing binds (transformers with top-1 differs), the shared expert binds (its gate weights
    zeroed differ);
  * round trip: `lathe convert --from-hf D --to OUT` writes the same tensors byte for byte and a
    config.json transformers reads as the same Qwen2MoeConfig;
  * `convert --verify` PASS;
  * train a step from it (init_from), `lathe export`: transformers loads the export, its logits
    equal lathe's and the step changed them; the run's metrics carry moe_aux_loss (the loss and every
    gradient against transformers: tests/models/test_qwen2_moe.cpp);
  * refused with the reason: GGUF and ONNX export, decoder_sparse_step 2, mlp_only_layers [0], a
    missing shared-expert tensor.
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "common"))
sys.path.insert(0, os.path.join(HERE, "..", "train"))
from run_harness import INIT_FROM_RECIPE, check, failures  # noqa: E402
import megatron_writer  # noqa: E402

try:
    import transformers
    from safetensors.torch import load_file, save_file
except ImportError as e:
    print(f"FAIL transformers/safetensors not importable ({e}); run scripts/setup.sh")
    sys.exit(1)

transformers.logging.set_verbosity_error()
transformers.logging.disable_progress_bar()
LATHE = os.environ.get("LATHE_BIN", "build/lathe")
TOKENS = [[1, 5, 9, 90, 3, 3, 77, 55, 0, 12, 64, 28], [7, 7, 7, 8, 9, 10, 50, 1]]
TOL = 1e-5


def run(args, ok=True):
    p = subprocess.run([LATHE] + args, capture_output=True, text=True, errors="replace")
    if ok and p.returncode != 0:
        raise RuntimeError(f"lathe {' '.join(args)} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    return p


def config(**kw):
    base = dict(num_hidden_layers=2, hidden_size=48, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=64, moe_intermediate_size=24, shared_expert_intermediate_size=56, vocab_size=96,
                max_position_embeddings=64, num_experts=6, num_experts_per_tok=3, output_router_logits=True,
                router_aux_loss_coef=0.02, rope_theta=1e4)
    base.update(kw)
    return transformers.Qwen2MoeConfig(**base)


def make(d, seed, **kw):
    torch.manual_seed(seed)
    m = transformers.Qwen2MoeForCausalLM(config(**kw))
    with torch.no_grad():
        for p_ in m.parameters():
            p_.normal_(0.0, 0.5) if p_.dim() >= 2 else p_.copy_(1.0 + 0.1 * torch.randn_like(p_))
    m.save_pretrained(d, safe_serialization=True)
    return m


def load(d, **kw):
    return transformers.Qwen2MoeForCausalLM.from_pretrained(d, torch_dtype=torch.float32, attn_implementation="eager",
                                                           **kw)


def hf_logits(m):
    if isinstance(m, str):
        m = load(m)
    m.eval()
    with torch.no_grad():
        return [m(torch.tensor([t]), use_cache=False).logits[0].numpy() for t in TOKENS]


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


def metrics(run_dir):
    return [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl")) if line.strip()]


def train_export(tmp, d):
    data = os.path.join(tmp, "data")
    rng = np.random.default_rng(1)
    docs = [rng.integers(0, 96, 600) for _ in range(4)]
    megatron_writer.write(data, docs)
    run_dir, recipe = os.path.join(tmp, "run"), os.path.join(tmp, "m.yaml")
    open(recipe, "w").write(INIT_FROM_RECIPE.format(init=d, data=data, out=run_dir))
    run(["train", recipe])
    rec = [r for r in metrics(run_dir) if "loss" in r and "moe_aux_loss" in r]
    check(len(rec) == 1 and rec[0]["moe_aux_loss"] >= 1.0, f"metrics carry moe_aux_loss ({rec[:1]})")
    exp = os.path.join(tmp, "export")
    run(["export", run_dir, "--to", exp])
    trained_hf = hf_logits(exp)
    e = reldiff(lathe_logits(exp, tmp), trained_hf)
    check(e < TOL, f"exported trained model: transformers equals lathe (relative {e:.2e})")
    moved = reldiff(trained_hf, hf_logits(d))
    check(moved > 1e-4, f"the training step changed the logits (by {moved:.3g} relative)")
    return rec


def main():
    tmp = tempfile.mkdtemp(prefix="lathe_qwen2_moe_hf_")
    try:
        d = os.path.join(tmp, "hf")
        m = make(d, 1)
        want = hf_logits(m)
        got = lathe_logits(d, tmp)
        e = reldiff(got, want)
        check(e <= TOL, f"import: lathe logits == transformers (relative {e:.2e} <= {TOL})")
        e2 = reldiff(got, hf_logits(load(d, config=config(num_experts_per_tok=1))))
        check(e2 > 1e-3, f"routing binds (transformers with top-1 differs by {e2:.2e})")
        ms = load(d)
        with torch.no_grad():
            for layer in ms.model.layers:
                layer.mlp.shared_expert_gate.weight.zero_()  # sigmoid 0.5 everywhere
        e3 = reldiff(got, hf_logits(ms))
        check(e3 > 1e-3, f"the shared expert's gate binds (zeroed, transformers differs by {e3:.2e})")

        out = os.path.join(tmp, "out")
        run(["convert", "--from-hf", d, "--to", out])
        a, b = load_file(os.path.join(d, "model.safetensors")), load_file(os.path.join(out, "model.safetensors"))
        check(sorted(a) == sorted(b) and "model.layers.1.mlp.experts.5.down_proj.weight" in b
              and "model.layers.1.mlp.shared_expert_gate.weight" in b and "model.layers.0.self_attn.k_proj.bias" in b,
              f"round trip: the same tensor names ({len(a)}: experts, shared expert, q/k/v biases)")
        check(all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a if k in b),
              "round trip: every tensor byte-identical")
        ca = transformers.Qwen2MoeConfig.from_pretrained(d).to_dict()
        cb = transformers.Qwen2MoeConfig.from_pretrained(out).to_dict()
        diff = {k: (ca.get(k), cb.get(k)) for k in set(ca) | set(cb)
                if k not in ("transformers_version", "_name_or_path", "torch_dtype", "architectures")
                and ca.get(k) != cb.get(k)}
        check(not diff, f"round trip: transformers reads the same Qwen2MoeConfig ({diff})")
        p = run(["convert", "--from-hf", d, "--verify"], ok=False)
        check(p.returncode == 0 and "PASS" in p.stdout + p.stderr,
              f"convert --verify passes ({(p.stdout + p.stderr).strip()[-300:]})")

        train_export(tmp, d)

        p = run(["convert", "--from-hf", d, "--to-gguf", os.path.join(tmp, "g.gguf")], ok=False)
        check(p.returncode != 0 and "mixture of experts" in p.stderr, f"GGUF export refused ({p.stderr.strip()[-200:]})")
        p = run(["export", d, "--to-onnx", os.path.join(tmp, "m.onnx")], ok=False)
        check(p.returncode != 0 and "mixture of experts" in p.stderr, f"ONNX export refused ({p.stderr.strip()[-200:]})")
        bad = os.path.join(tmp, "bad")
        shutil.copytree(d, bad)
        cfg = json.load(open(os.path.join(bad, "config.json")))
        for key, val in (("decoder_sparse_step", 2), ("mlp_only_layers", [0])):
            c2 = dict(cfg, **{key: val})
            json.dump(c2, open(os.path.join(bad, "config.json"), "w"))
            p = run(["logits", "--model", bad, "--out", os.path.join(tmp, "x"), "--tokens", "1,2"], ok=False)
            check(p.returncode != 0 and key in p.stderr, f"{key} {val} refused ({p.stderr.strip()[-200:]})")
        shutil.rmtree(bad)
        shutil.copytree(d, bad)
        sd = load_file(os.path.join(bad, "model.safetensors"))
        del sd["model.layers.1.mlp.shared_expert.up_proj.weight"]
        save_file(sd, os.path.join(bad, "model.safetensors"), metadata={"format": "pt"})
        p = run(["logits", "--model", bad, "--out", os.path.join(tmp, "x"), "--tokens", "1,2"], ok=False)
        check(p.returncode != 0 and "shared_expert.up_proj" in p.stderr, f"a missing shared-expert tensor is named ({p.stderr.strip()[-200:]})")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if failures:
        print(f"FAILED {len(failures)}: " + "; ".join(failures))
        sys.exit(1)
    print("PASS")


if __name__ == "__main__":
    main()
