#!/usr/bin/env python3
"""GPT-NeoX (Pythia) import/export through the lathe binary, checked against transformers 4.45.2's
GPTNeoXForCausalLM (config objects, no downloads).

Tiny models (3 heads of 16, rotary_pct 0.25: 4 rotated dims, MLP 100 wide) with weights of std 0.2
so that attention and RoPE matter, norms and biases perturbed:
  * import: `lathe logits` equals transformers (fp32, relative 1e-5), with use_parallel_residual
    true and false, hidden_act gelu (exact) and gelu_new (tanh); the file's query_key_value rows
    are interleaved per head and the old checkpoints' buffers (attention.bias, masked_bias,
    rotary_emb.inv_freq) are in the file and ignored (reported)
  * train one step (init_from, recompute full, checkpoint), `lathe export`: transformers loads the
    directory and its logits equal lathe's; the step changed them
  * `convert --verify`: import and export PASS
  * the gpt-neox-debug preset in bf16 with selective recompute: resumed == uninterrupted
  * GGUF (llama.cpp gptneox) of tanh-GELU models, both residual forms, run by llama.cpp itself:
    equal to transformers with llama.cpp's fp16 GELU table emulated (1e-4)
  * ONNX export (exact GELU + parallel residual, tanh GELU + sequential) run by onnxruntime
  * refused with the reason: GGUF of an exact-GELU model (llama.cpp computes the tanh GELU),
    hidden_act relu, a missing tensor; rope_scaling types equal transformers
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
TOKENS = [[1, 5, 9, 200, 3, 3, 77, 255, 0, 12, 64, 128], [7, 7, 7, 8, 9, 10, 250, 1]]
TOL = 1e-5  # relative to the largest logit: fp32 against fp32


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what, flush=True)
    if not cond:
        failures.append(what)


def run(args, ok=True):
    p = subprocess.run([LATHE] + args, capture_output=True, text=True, errors="replace")
    if ok and p.returncode != 0:
        raise RuntimeError(f"lathe {' '.join(args)} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    return p


def make(d, seed, parallel=True, act="gelu", buffers=True):
    torch.manual_seed(seed)
    cfg = transformers.GPTNeoXConfig(num_hidden_layers=2, hidden_size=48, num_attention_heads=3,
                                     intermediate_size=100, vocab_size=256, max_position_embeddings=64,
                                     rotary_pct=0.25, rotary_emb_base=10000, use_parallel_residual=parallel,
                                     hidden_act=act)
    m = transformers.GPTNeoXForCausalLM(cfg)
    with torch.no_grad():
        for p_ in m.parameters():
            p_.normal_(0.0, 0.2) if p_.dim() >= 2 else p_.copy_((1.0 if p_.abs().max() > 0 else 0.0)
                                                              + 0.1 * torch.randn_like(p_))
    m.save_pretrained(d, safe_serialization=True)
    if buffers:  # what Pythia's files on the Hub also carry (non-persistent buffers today)
        f = os.path.join(d, "model.safetensors")
        sd = load_file(f)
        for i in range(2):
            p = f"gpt_neox.layers.{i}.attention."
            sd[p + "bias"] = torch.tril(torch.ones(1, 1, 64, 64, dtype=torch.bool))
            sd[p + "masked_bias"] = torch.tensor(-1e9)
            sd[p + "rotary_emb.inv_freq"] = 1.0 / 10000 ** (torch.arange(0, 4, 2).float() / 4)
        save_file(sd, f, metadata={"format": "pt"})
    return m


def hf_logits(m):
    if isinstance(m, str):
        m = transformers.AutoModelForCausalLM.from_pretrained(m, torch_dtype=torch.float32,
                                                              attn_implementation="eager")
    m.eval()
    with torch.no_grad():
        return [m(torch.tensor([t])).logits[0].numpy() for t in TOKENS]


def hf_logits_of(d, tokens):
    m = transformers.AutoModelForCausalLM.from_pretrained(d, torch_dtype=torch.float32, attn_implementation="eager")
    m.eval()
    with torch.no_grad():
        return m(torch.tensor([tokens])).logits[0].numpy()


def lathe_logits(d, tmp):
    out = os.path.join(tmp, "logits.f32")
    args = ["logits", "--model", d, "--out", out]
    for t in TOKENS:
        args += ["--tokens", ",".join(map(str, t))]
    p = run(args)
    rep = p.stdout + p.stderr
    flat = np.fromfile(out, dtype="<f4")
    res, off = [], 0
    V = json.load(open(os.path.join(d, "config.json")))["vocab_size"]
    for t in TOKENS:
        n = len(t) * V
        res.append(flat[off:off + n].reshape(len(t), V))
        off += n
    return res, rep


def reldiff(a, b):
    scale = max(float(np.abs(y).max()) for y in b)
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b)) / scale


RECIPE = "\nrecompute: full" + INIT_FROM_RECIPE


BF16 = """
recompute: selective
precision:
  compute: bf16
model:
  preset: gpt-neox-debug
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


def bf16_resume(tmp):
    """The gpt-neox-debug preset trained in bf16 with selective recompute: interrupted after 2
    steps and resumed from its checkpoint == uninterrupted (byte-identical final weights)."""
    data = os.path.join(tmp, "small_vocab")
    rng = np.random.default_rng(1)
    megatron_writer.write(data, [rng.integers(0, 101, 600) for _ in range(4)])
    outs = []
    for name, stop in (("bf16_whole", None), ("bf16_resumed", 2)):
        out, recipe = os.path.join(tmp, name), os.path.join(tmp, name + ".yaml")
        open(recipe, "w").write(BF16.format(data=data, out=out))
        if stop:
            run(["train", recipe, "--stop-after", str(stop)])
            run(["train", recipe, "--resume", "auto"])
        else:
            run(["train", recipe])
        outs.append(open(os.path.join(out, "model", "model.safetensors"), "rb").read())
        losses = [json.loads(line)["loss"] for line in open(os.path.join(out, "metrics.jsonl"))
                  if '"loss"' in line]
        check(len(losses) >= 2 and all(np.isfinite(losses)), f"{name}: bf16 losses finite ({losses})")
    check(outs[0] == outs[1], "bf16 + selective recompute: resumed run's weights equal the uninterrupted run's")


def gelu_fp16_table(kind):
    """llama.cpp's GELU (ggml-cpu GGML_GELU_FP16): the tanh formula looked up at fp16(x), stored as
    fp16; 0 below -10, x above 10."""
    class Act(torch.nn.Module):
        def forward(self, x):
            y = torch.nn.functional.gelu(x.half().float(), approximate=kind).half().float()
            return torch.where(x <= -10, torch.zeros_like(x), torch.where(x >= 10, x, y))
    return Act()


def gguf_llama_cpp(tmp):
    """GGUF (llama.cpp's gptneox) of the tanh-GELU models, run by llama.cpp itself (f32 KV cache):
    its logits equal transformers' with llama.cpp's fp16-table GELU emulated (the export is exact),
    and lathe's within the table's effect."""
    try:
        import llama_cpp
    except ImportError:
        print("NOT RUN gguf: llama_cpp (llama-cpp-python) is not importable")
        return
    ids = [1, 5, 9, 200, 3, 3, 77, 255, 0, 12, 64, 128, 7, 7, 8, 90]
    for name in ("tanh", "tanh_sequential"):
        d, g = os.path.join(tmp, name), os.path.join(tmp, name + ".gguf")
        p = run(["convert", "--from-hf", d, "--to-gguf", g])
        check("architecture gptneox" in p.stdout, f"{name}: GGUF written as gptneox ({p.stdout.strip()[-160:]})")
        llm = llama_cpp.Llama(model_path=g, n_ctx=64, n_threads=2, logits_all=True, verbose=False, type_k=0, type_v=0)
        llm.eval(ids)
        got = np.array(llm.scores[:len(ids)], dtype=np.float32)
        m = transformers.AutoModelForCausalLM.from_pretrained(d, torch_dtype=torch.float32, attn_implementation="eager")
        for layer in m.gpt_neox.layers:
            layer.mlp.act = gelu_fp16_table("tanh")
        with torch.no_grad():
            ref = m(torch.tensor([ids])).logits[0].numpy()
        e = float(np.abs(got - ref).max())
        check(e < 1e-4, f"{name}: llama.cpp {llama_cpp.__version__} equals transformers with its fp16 GELU table "
                        f"(max abs diff {e:.2e})")
        out = os.path.join(tmp, "gg.f32")
        run(["logits", "--model", d, "--tokens", ",".join(map(str, ids)), "--out", out])
        ours = np.fromfile(out, dtype="<f4").reshape(len(ids), -1)
        e = float(np.abs(got - ours).max())
        check(e < 5e-3, f"{name}: llama.cpp within 5e-3 of lathe (the fp16 GELU table's effect: {e:.2e})")


def onnx_runtime(tmp, cases):
    """`lathe export --to-onnx` run by onnxruntime (CPU): the whole sequence and then one token with
    the past key/values equal lathe's logits (1e-4 relative). Cases: (source, its HF directory)."""
    try:
        import onnxruntime as ort
    except ImportError:
        print("NOT RUN onnx: onnxruntime is not importable")
        return
    ids = TOKENS[0]
    for src, hf in cases:
        f = os.path.join(tmp, os.path.basename(src) + ".onnx")
        run(["export", src, "--to-onnx", f])
        cfg = json.load(open(os.path.join(hf, "config.json")))
        L, H = cfg["num_hidden_layers"], cfg["num_attention_heads"]
        D = cfg["hidden_size"] // H
        sess = ort.InferenceSession(f, providers=["CPUExecutionProvider"])

        def step(tok, past, start):
            n = len(tok)
            feed = {"input_ids": np.array([tok], np.int64), "attention_mask": np.ones((1, start + n), np.int64),
                    "position_ids": np.arange(start, start + n, dtype=np.int64)[None]}
            for i in range(L):
                feed[f"past_key_values.{i}.key"], feed[f"past_key_values.{i}.value"] = past[2 * i], past[2 * i + 1]
            outs = sess.run(None, feed)
            return outs[0][0], outs[1:]

        empty = [np.zeros((1, H, 0, D), np.float32) for _ in range(2 * L)]
        whole, _ = step(ids, empty, 0)
        _, past = step(ids[:-1], empty, 0)
        last, _ = step(ids[-1:], past, len(ids) - 1)
        ours = lathe_logits(hf, tmp)[0][0]
        e = reldiff([whole, last], [ours, ours[-1:]])
        check(e < 1e-4, f"{os.path.basename(src)} ({cfg['hidden_act']}, parallel residual "
                        f"{cfg['use_parallel_residual']}): onnxruntime {ort.__version__} equals lathe, whole sequence "
                        f"and one step with past key/values (relative {e:.2e})")


def rope_scaled(tmp, d, edited):
    """transformers 4.45's GPT-NeoX rotary class is Llama's: each rope_scaling type over the rotary_pct
    dims, equal to transformers (and moved from the plain model, so the check is not vacuous).
    dynamic at max_position_embeddings 8 < T = 12 recomputes the frequencies from the length."""
    plain = hf_logits(d)
    for name, scaling, max_pos in (("linear", {"type": "linear", "factor": 2.0}, None),
                                   ("dynamic", {"rope_type": "dynamic", "factor": 2.0}, 8),
                                   ("yarn", {"rope_type": "yarn", "factor": 4.0}, None),
                                   ("llama3", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                               "high_freq_factor": 4.0,
                                               "original_max_position_embeddings": 16}, None)):
        def edit(c, scaling=scaling, max_pos=max_pos):
            c["rope_scaling"] = scaling
            if max_pos:
                c["max_position_embeddings"] = max_pos
        p = edited("rope_" + name, edit_cfg=edit)
        check(p.returncode == 0, f"rope_scaling {name} accepted: {p.stderr.strip()[:300]}")
        dst = os.path.join(tmp, "rope_" + name)
        ours, _ = lathe_logits(dst, tmp)
        # transformers' dynamic class keeps the frequencies of the longest pass so far (a later
        # shorter pass above max_position_embeddings reuses them): a fresh model per sequence.
        theirs = hf_logits(dst) if name != "dynamic" else [hf_logits_of(dst, t) for t in TOKENS]
        e, moved = reldiff(ours, theirs), reldiff(theirs, plain)
        check(e < TOL and moved > 1e-4,
              f"gpt_neox rope_scaling {name}: lathe equals transformers (relative {e:.2e}; "
              f"{moved:.2e} from plain RoPE)")
    p = run(["convert", "--from-hf", os.path.join(tmp, "rope_linear"), "--to-gguf", os.path.join(tmp, "r.gguf")],
            ok=False)
    check(p.returncode != 0 and "rope_scaling 'linear'" in p.stderr and "gptneox" in p.stderr,
          f"GGUF of a scaled gpt_neox refused with the reason: {p.stderr.strip()[-300:]}")
    conv = os.path.join(tmp, "rope_yarn_conv")
    run(["convert", "--from-hf", os.path.join(tmp, "rope_yarn"), "--to", conv])
    cfg = json.load(open(os.path.join(conv, "config.json")))
    check(cfg.get("rope_scaling", {}).get("factor") == 4.0, f"rope_scaling written back ({cfg.get('rope_scaling')})")


def main():
    tmp = tempfile.mkdtemp(prefix="lathe_neox_test_")
    data = os.path.join(tmp, "bytes")
    rng = np.random.default_rng(0)
    megatron_writer.write(data, [rng.integers(0, 256, 600) for _ in range(4)])

    for name, parallel, act, seed in (("parallel", True, "gelu", 1), ("sequential", False, "gelu", 2),
                                      ("tanh", True, "gelu_new", 3), ("tanh_sequential", False, "gelu_new", 4)):
        d = os.path.join(tmp, name)
        m = make(d, seed, parallel, act)
        ours, rep = lathe_logits(d, tmp)
        e = reldiff(ours, hf_logits(m))
        check(e < TOL, f"{name}: imported logits equal transformers (relative {e:.2e})")
    d = os.path.join(tmp, "parallel")
    p = run(["convert", "--from-hf", d, "--to", os.path.join(tmp, "conv_out")])
    check("ignored 6 non-parameter buffers" in p.stdout,
          f"the checkpoint's attention.bias / masked_bias / inv_freq buffers are ignored and reported\n{p.stdout}")

    # train a step (recompute), export, transformers loads the export
    run_dir = os.path.join(tmp, "run")
    recipe = os.path.join(tmp, "neox.yaml")
    open(recipe, "w").write(RECIPE.format(init=d, data=data, out=run_dir))
    run(["train", recipe])
    exp = os.path.join(tmp, "export")
    run(["export", run_dir, "--to", exp])
    trained_hf = hf_logits(exp)
    e = reldiff(lathe_logits(exp, tmp)[0], trained_hf)
    check(e < TOL, f"exported trained model: transformers equals lathe (relative {e:.2e})")
    moved = reldiff(trained_hf, hf_logits(d))
    check(moved > 1e-4, f"the training step changed the logits (by {moved:.3g} relative)")
    cfg = json.load(open(os.path.join(exp, "config.json")))
    check(cfg.get("architectures") == ["GPTNeoXForCausalLM"] and cfg.get("rotary_pct") == 0.25
          and cfg.get("use_parallel_residual") is True and cfg.get("hidden_act") == "gelu",
          f"exported config.json: GPTNeoXForCausalLM, rotary_pct, use_parallel_residual, hidden_act ({cfg})")

    p = run(["convert", "--from-hf", d, "--to", os.path.join(tmp, "verify_out"), "--verify"], ok=False)
    check(p.returncode == 0 and p.stdout.count("-> PASS") == 2, f"convert --verify: import and export PASS\n{p.stdout}")

    bf16_resume(tmp)

    gguf_llama_cpp(tmp)

    # refusals naming the reason
    p = run(["export", run_dir, "--to-gguf", os.path.join(tmp, "m.gguf")], ok=False)
    check(p.returncode != 0 and "gptneox" in p.stderr and "tanh GELU" in p.stderr,
          f"GGUF export of an exact-GELU model refused with the reason: {p.stderr.strip()[:300]}")
    onnx_runtime(tmp, [(run_dir, exp), (os.path.join(tmp, "tanh_sequential"),) * 2])

    def edited(name, edit_cfg=None, edit_sd=None):
        dst = os.path.join(tmp, name)
        shutil.copytree(d, dst)
        if edit_cfg:
            c = json.load(open(os.path.join(dst, "config.json")))
            edit_cfg(c)
            json.dump(c, open(os.path.join(dst, "config.json"), "w"))
        if edit_sd:
            f = os.path.join(dst, "model.safetensors")
            sd = load_file(f)
            edit_sd(sd)
            save_file(sd, f, metadata={"format": "pt"})
        return run(["logits", "--model", dst, "--tokens", "1,2,3", "--out", os.path.join(tmp, "x.f32")], ok=False)

    p = edited("relu", edit_cfg=lambda c: c.update(hidden_act="relu"))
    check(p.returncode != 0 and "hidden_act" in p.stderr and "relu" in p.stderr,
          f"hidden_act relu refused naming the key: {p.stderr.strip()[:300]}")
    rope_scaled(tmp, d, edited)
    p = edited("missing", edit_sd=lambda sd: sd.pop("gpt_neox.layers.1.attention.query_key_value.bias"))
    check(p.returncode != 0 and "gpt_neox.layers.1.attention.query_key_value.bias" in p.stderr,
          f"a missing tensor is named: {p.stderr.strip()[:300]}")

    shutil.rmtree(tmp, ignore_errors=True)
    if failures:
        print(f"{len(failures)} FAILED")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
