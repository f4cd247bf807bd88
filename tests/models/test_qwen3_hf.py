#!/usr/bin/env python3
"""Qwen3 Hugging Face directories through the lathe binary, against torch_reference_qwen3.py.

transformers 4.45.2 (pinned) has no Qwen3, so the directory is written by the reference itself
(config.json as Qwen3ForCausalLM saves it, model.safetensors with HF names; hidden 48, 4 heads of
16, 2 KV heads, tied, weights std 0.3) and the reference is its float64 model:
  * `lathe logits` on the directory equals the reference (max |diff| <= 1e-5 x max |logit|)
  * `lathe convert --from-hf DIR --to OUT`: config.json (qwen3, Qwen3ForCausalLM, head_dim 16) and
    every tensor back bit for bit
  * `lathe train` (init_from, one step) then `lathe export`: the reference on the exported weights
    equals lathe's logits of them, and the step moved them
  * import stays strict: a missing k_norm, and q_norm tensors in a llama directory, fail naming the
    tensor
  * `--to-gguf`: llama.cpp (the pinned llama-cpp-python, architecture qwen3) gives lathe's f32
    logits within 1e-4; with attention_bias true it is refused
  * `--to-onnx`: onnxruntime's logits (prompt + cached steps) equal the reference
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "common"))
sys.path.insert(0, os.path.join(HERE, "..", "train"))
from run_harness import INIT_FROM_RECIPE  # noqa: E402
import megatron_writer  # noqa: E402
import torch_reference_qwen3 as q3  # noqa: E402
from safetensors.numpy import load_file, save_file  # noqa: E402

LATHE = os.environ.get("LATHE_BIN", "build/lathe")
TOKENS = [[1, 5, 9, 100, 3, 3, 77, 120, 0, 12, 64, 127], [7, 7, 7, 8, 9, 10, 90, 1]]
failures = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what, flush=True)
    if not cond:
        failures.append(what)


def run(args, ok=True):
    p = subprocess.run([LATHE] + args, capture_output=True, text=True, errors="replace")
    if ok and p.returncode != 0:
        raise RuntimeError(f"lathe {' '.join(args)} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    return p


def ref_logits(d, tmp):
    out = os.path.join(tmp, "ref.f64")
    q3.torch.set_default_dtype(q3.torch.float64)
    q3.logits(d, out, [",".join(map(str, t)) for t in TOKENS])
    return split(np.fromfile(out, dtype="<f8"), d)


def lathe_logits(d, tmp):
    out = os.path.join(tmp, "logits.f32")
    args = ["logits", "--model", d, "--out", out]
    for t in TOKENS:
        args += ["--tokens", ",".join(map(str, t))]
    run(args)
    return split(np.fromfile(out, dtype="<f4").astype(np.float64), d)


def split(flat, d):
    V = json.load(open(os.path.join(d, "config.json")))["vocab_size"]
    res, off = [], 0
    for t in TOKENS:
        res.append(flat[off:off + len(t) * V].reshape(len(t), V))
        off += len(t) * V
    return res


def rel_diff(a, b):
    scale = max(float(np.abs(y).max()) for y in b)
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b)) / scale


RECIPE = INIT_FROM_RECIPE


def edited(src, dst, cfg_edit=None, tensors_edit=None):
    shutil.copytree(src, dst)
    if cfg_edit:
        cfg = json.load(open(os.path.join(dst, "config.json")))
        cfg_edit(cfg)
        json.dump(cfg, open(os.path.join(dst, "config.json"), "w"))
    if tensors_edit:
        st = os.path.join(dst, "model.safetensors")
        save_file(tensors_edit(dict(load_file(st))), st)
    return dst


def gguf(d, tmp):
    try:
        import llama_cpp
    except ImportError as e:
        check(False, f"llama_cpp importable ({e}); run scripts/setup.sh")
        return
    g = os.path.join(tmp, "qwen3.gguf")
    p = run(["convert", "--from-hf", d, "--to-gguf", g])
    check("architecture qwen3" in p.stdout, f"--to-gguf writes architecture qwen3 ({p.stdout.strip()[-160:]})")
    llm = llama_cpp.Llama(model_path=g, n_ctx=64, n_threads=2, logits_all=True, verbose=False, type_k=0, type_v=0)
    ids = TOKENS[0]
    out = os.path.join(tmp, "gguf_ref.f32")
    run(["logits", "--model", d, "--tokens", ",".join(map(str, ids)), "--out", out])
    want = np.fromfile(out, dtype="<f4").reshape(len(ids), -1)
    llm.eval(ids)
    got = np.array(llm.scores[:len(ids)], dtype=np.float32)
    diff = float(np.abs(got - want).max())
    check(diff <= 1e-4, f"llama.cpp {llama_cpp.__version__} qwen3 f32 logits vs lathe: max |diff| {diff:.2e} <= 1e-4 "
                        f"(max |logit| {float(np.abs(want).max()):.1f})")
    del llm
    b = edited(d, os.path.join(tmp, "qwen3_bias"), lambda c: c.update(attention_bias=True),
               lambda t: {**t, **{n.replace(".weight", ".bias"): np.zeros(t[n].shape[0], np.float32)
                                  for n in t if any(s in n for s in ("q_proj", "k_proj", "v_proj"))},
                          **{n.replace(".weight", ".bias"): np.zeros(48, np.float32) for n in t if "o_proj" in n}})
    p = run(["convert", "--from-hf", b, "--to-gguf", b + ".gguf"], ok=False)
    check(p.returncode == 1 and "no q/k/v/o biases" in p.stderr and not os.path.exists(b + ".gguf"),
          f"--to-gguf with attention_bias refused ({p.stderr.strip()[-160:]})")


def onnx_check(d, tmp, ref):
    """onnxruntime on the exported graph (past key/values: prompt of 5, then one token at a time)
    against the float64 reference: the per-head norms are in the graph."""
    try:
        import onnxruntime as ort
    except ImportError as e:
        check(False, f"onnxruntime importable ({e}); run scripts/setup.sh")
        return
    path = os.path.join(tmp, "qwen3.onnx")
    run(["export", d, "--to-onnx", path])
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    L, KV, D = 2, 2, 16
    past = [np.zeros((1, KV, 0, D), np.float32) for _ in range(2 * L)]
    ids, got = TOKENS[0], []
    for s, e in ((0, 5),) + tuple((t, t + 1) for t in range(5, len(ids))):
        feed = {"input_ids": np.array([ids[s:e]], np.int64), "attention_mask": np.ones((1, e), np.int64),
                "position_ids": np.arange(s, e, dtype=np.int64)[None]}
        for i in range(L):
            feed[f"past_key_values.{i}.key"], feed[f"past_key_values.{i}.value"] = past[2 * i], past[2 * i + 1]
        outs = sess.run(None, feed)
        got.append(outs[0][0])
        past = outs[1:]
    diff = rel_diff([np.concatenate(got).astype(np.float64)], [ref[0]])
    check(diff <= 1e-5, f"ONNX (onnxruntime, prompt 5 + 7 cached steps) equals the reference: max rel diff {diff:.2e}")


def main():
    tmp = tempfile.mkdtemp(prefix="lathe_qwen3_hf_")
    d = os.path.join(tmp, "qwen3")
    q3.write(d)
    ref = ref_logits(d, tmp)
    diff = rel_diff(lathe_logits(d, tmp), ref)
    check(diff <= 1e-5, f"imported qwen3: lathe logits equal the float64 reference (max rel diff {diff:.2e})")

    out = os.path.join(tmp, "converted")
    run(["convert", "--from-hf", d, "--to", out])
    cfg = json.load(open(os.path.join(out, "config.json")))
    check(cfg.get("model_type") == "qwen3" and cfg.get("architectures") == ["Qwen3ForCausalLM"]
          and cfg.get("head_dim") == 16 and cfg.get("attention_bias") is False and cfg.get("tie_word_embeddings"),
          f"convert: config.json qwen3 / Qwen3ForCausalLM / head_dim 16 ({cfg})")
    a, b = load_file(os.path.join(d, "model.safetensors")), load_file(os.path.join(out, "model.safetensors"))
    check(sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a),
          f"convert: every tensor back bit for bit ({len(a)} tensors, q/k norms included)")

    data = os.path.join(tmp, "tokens")
    rng = np.random.default_rng(0)
    megatron_writer.write(data, [rng.integers(0, 128, 600) for _ in range(4)])
    run_dir = os.path.join(tmp, "run")
    recipe = os.path.join(tmp, "qwen3.yaml")
    open(recipe, "w").write(RECIPE.format(init=d, data=data, out=run_dir))
    run(["train", recipe])
    exp = os.path.join(tmp, "exported")
    run(["export", run_dir, "--to", exp])
    trained = lathe_logits(exp, tmp)
    diff = rel_diff(trained, ref_logits(exp, tmp))
    check(diff <= 1e-5, f"trained and exported qwen3: lathe logits equal the reference (max rel diff {diff:.2e})")
    moved = rel_diff(trained, ref)
    check(moved > 1e-4, f"the training step moved the logits (by {moved:.3g} relative)")

    miss = edited(d, os.path.join(tmp, "missing"),
                  tensors_edit=lambda t: {k: v for k, v in t.items() if k != "model.layers.1.self_attn.k_norm.weight"})
    p = run(["convert", "--from-hf", miss, "--to", miss + "_out"], ok=False)
    check(p.returncode != 0 and "model.layers.1.self_attn.k_norm.weight" in p.stderr,
          f"missing k_norm refused naming it ({p.stderr.strip()[-200:]})")
    llama = edited(d, os.path.join(tmp, "as_llama"),
                   lambda c: c.update(model_type="llama", architectures=["LlamaForCausalLM"]))
    p = run(["convert", "--from-hf", llama, "--to", llama + "_out"], ok=False)
    check(p.returncode != 0 and "q_norm.weight" in p.stderr,
          f"q/k norms in a llama directory refused naming them ({p.stderr.strip()[-200:]})")

    gguf(d, tmp)
    onnx_check(d, tmp, ref)

    if failures:
        print(f"{len(failures)} FAILED (files kept in {tmp})")
        return 1
    shutil.rmtree(tmp)
    print("all passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
