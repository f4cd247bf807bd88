#!/usr/bin/env python3
"""Gemma 2 import/export through the lathe binary, checked against transformers 4.45.2's
Gemma2ForCausalLM (config objects, no downloads).

A tiny model (3 layers: layers 0 and 2 slide with window 4 < the 12-token sequence; 4 heads of 16
over 2 kv heads in hidden 48; query_pre_attn_scalar 20; soft caps 5 / 3) with matrices of std 0.5
and norm weights perturbed, saved by transformers (config.json as it writes it):
  * import: `lathe logits` equals transformers (eager, use_cache=False; fp32, relative 1e-5), and
    the caps bind (transformers without them differs);
  * round trip: `lathe convert --from-hf D --to OUT` writes the same tensors byte for byte and a
    config.json transformers reads as the same Gemma2Config (every field it defines);
  * `convert --verify` PASS;
  * train a step from it (init_from, recompute selective), `lathe export`: transformers loads the
    export and its logits equal lathe's, the step changed them; the gemma2-debug preset in bf16:
    interrupted and resumed == uninterrupted (byte-identical final weights);
  * refused with the reason: GGUF export without a final soft cap, hidden_activation silu, a missing tensor (ONNX export is
    checked against transformers in tests/interop/test_onnx_export.py).
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
from run_harness import INIT_FROM_RECIPE  # noqa: E402
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
failures = []
TOKENS = [[1, 5, 9, 100, 3, 3, 77, 55, 0, 12, 64, 28], [7, 7, 7, 8, 9, 10, 50, 1]]
TOL = 1e-5


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what, flush=True)
    if not cond:
        failures.append(what)


def run(args, ok=True):
    p = subprocess.run([LATHE] + args, capture_output=True, text=True, errors="replace")
    if ok and p.returncode != 0:
        raise RuntimeError(f"lathe {' '.join(args)} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    return p


def config(**kw):
    base = dict(num_hidden_layers=3, hidden_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                intermediate_size=64, vocab_size=101, max_position_embeddings=64, query_pre_attn_scalar=20,
                sliding_window=4, attn_logit_softcapping=5.0, final_logit_softcapping=3.0)
    base.update(kw)
    return transformers.Gemma2Config(**base)


def make(d, seed, **kw):
    torch.manual_seed(seed)
    m = transformers.Gemma2ForCausalLM(config(**kw))
    with torch.no_grad():
        for p_ in m.parameters():
            p_.normal_(0.0, 0.5) if p_.dim() >= 2 else p_.copy_(0.1 * torch.randn_like(p_))
    m.save_pretrained(d, safe_serialization=True)
    return m


def hf_logits(m):
    if isinstance(m, str):
        m = transformers.AutoModelForCausalLM.from_pretrained(m, torch_dtype=torch.float32,
                                                              attn_implementation="eager")
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


BF16 = """
recompute: full
precision:
  compute: bf16
model:
  preset: gemma2-debug
data:
  train: {data}
  valid_fraction: 0.0
optimizer:
  lr: 1.0e-2
training:
  micro_batch_size: 2
  seq_len: 16
  steps: 4
  eval_interval: 0
  peak_gflops: 100
output:
  dir: {out}
  checkpoint_every: 1
"""


def train_export_resume(tmp, d):
    data = os.path.join(tmp, "data")
    rng = np.random.default_rng(1)
    megatron_writer.write(data, [rng.integers(0, 101, 600) for _ in range(4)])
    run_dir, recipe = os.path.join(tmp, "run"), os.path.join(tmp, "g.yaml")
    open(recipe, "w").write("\nrecompute: selective" + INIT_FROM_RECIPE.format(init=d, data=data, out=run_dir))
    run(["train", recipe])
    exp = os.path.join(tmp, "export")
    run(["export", run_dir, "--to", exp])
    trained_hf = hf_logits(exp)
    e = reldiff(lathe_logits(exp, tmp), trained_hf)
    check(e < TOL, f"exported trained model: transformers equals lathe (relative {e:.2e})")
    moved = reldiff(trained_hf, hf_logits(d))
    check(moved > 1e-4, f"the training step changed the logits (by {moved:.3g} relative)")
    outs = []
    for name, stop in (("bf16_whole", None), ("bf16_resumed", 2)):
        out, rec = os.path.join(tmp, name), os.path.join(tmp, name + ".yaml")
        open(rec, "w").write(BF16.format(data=data, out=out))
        if stop:
            run(["train", rec, "--stop-after", str(stop)])
            run(["train", rec, "--resume", "auto"])
        else:
            run(["train", rec])
        outs.append(open(os.path.join(out, "model", "model.safetensors"), "rb").read())
    check(outs[0] == outs[1], "bf16 + full recompute: resumed run's weights equal the uninterrupted run's")


def reldiff(a, b):
    scale = max(float(np.abs(y).max()) for y in b)
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b)) / scale


def main():
    tmp = tempfile.mkdtemp(prefix="lathe_gemma2_hf_")
    try:
        d = os.path.join(tmp, "hf")
        m = make(d, 1)
        want = hf_logits(m)
        got = lathe_logits(d, tmp)
        e = reldiff(got, want)
        check(e <= TOL, f"import: lathe logits == transformers (relative {e:.2e} <= {TOL})")
        m_nocap = transformers.Gemma2ForCausalLM.from_pretrained(
            d, config=config(attn_logit_softcapping=None), torch_dtype=torch.float32, attn_implementation="eager")
        e2 = reldiff(got, hf_logits(m_nocap))
        check(e2 > 1e-3, f"the attention soft cap binds (transformers without it differs by {e2:.2e})")
        m_nowin = transformers.Gemma2ForCausalLM.from_pretrained(
            d, config=config(sliding_window=1000), torch_dtype=torch.float32, attn_implementation="eager")
        e3 = reldiff(got, hf_logits(m_nowin))
        check(e3 > 1e-3, f"the sliding window binds (transformers without it differs by {e3:.2e})")

        # Round trip: the same tensors byte for byte, the same Gemma2Config.
        out = os.path.join(tmp, "out")
        run(["convert", "--from-hf", d, "--to", out])
        a, b = load_file(os.path.join(d, "model.safetensors")), load_file(os.path.join(out, "model.safetensors"))
        check(sorted(a) == sorted(b), f"round trip: the same tensor names ({len(a)})")
        check(all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a if k in b),
              "round trip: every tensor byte-identical")
        ca = transformers.Gemma2Config.from_pretrained(d).to_dict()
        cb = transformers.Gemma2Config.from_pretrained(out).to_dict()
        diff = {k: (ca.get(k), cb.get(k)) for k in set(ca) | set(cb)
                if k not in ("transformers_version", "_name_or_path", "torch_dtype", "architectures")
                and ca.get(k) != cb.get(k)}
        check(not diff, f"round trip: transformers reads the same Gemma2Config ({diff})")
        e4 = reldiff(hf_logits(out), want)
        check(e4 == 0.0, f"round trip: transformers' logits of the export equal the original's ({e4:.2e})")
        p = run(["convert", "--from-hf", d, "--verify"], ok=False)
        check(p.returncode == 0 and "PASS" in p.stdout + p.stderr,
              f"convert --verify passes ({(p.stdout + p.stderr).strip()[-300:]})")

        train_export_resume(tmp, d)

        # Refusals, each naming the reason.
        # (GGUF export is run by llama.cpp itself in tests/interop/test_gguf_llama_cpp.py; here only
        # the refusal of what llama.cpp's gemma2 cannot do: no final cap.)
        nocap = os.path.join(tmp, "nocap")
        shutil.copytree(d, nocap)
        cfg = json.load(open(os.path.join(nocap, "config.json")))
        cfg["final_logit_softcapping"] = None
        json.dump(cfg, open(os.path.join(nocap, "config.json"), "w"))
        p = run(["convert", "--from-hf", nocap, "--to-gguf", os.path.join(tmp, "g.gguf")], ok=False)
        check(p.returncode != 0 and "always soft-caps" in p.stderr,
              f"GGUF export without a final cap refused with the reason ({p.stderr.strip()[-200:]})")
        bad = os.path.join(tmp, "bad")
        shutil.copytree(d, bad)
        cfg = json.load(open(os.path.join(bad, "config.json")))
        cfg["hidden_activation"] = "silu"
        json.dump(cfg, open(os.path.join(bad, "config.json"), "w"))
        p = run(["logits", "--model", bad, "--out", os.path.join(tmp, "x"), "--tokens", "1,2"], ok=False)
        check(p.returncode != 0 and "hidden_activation" in p.stderr, f"hidden_activation silu refused ({p.stderr.strip()[-200:]})")
        shutil.rmtree(bad)
        shutil.copytree(d, bad)
        sd = load_file(os.path.join(bad, "model.safetensors"))
        del sd["model.layers.1.post_feedforward_layernorm.weight"]
        save_file(sd, os.path.join(bad, "model.safetensors"), metadata={"format": "pt"})
        p = run(["logits", "--model", bad, "--out", os.path.join(tmp, "x"), "--tokens", "1,2"], ok=False)
        check(p.returncode != 0 and "post_feedforward_layernorm" in p.stderr,
              f"a missing tensor is named ({p.stderr.strip()[-200:]})")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if failures:
        print(f"FAILED {len(failures)}: " + "; ".join(failures))
        sys.exit(1)
    print("PASS")


if __name__ == "__main__":
    main()
