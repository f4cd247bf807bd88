#!/usr/bin/env python3
"""Hugging Face import/export through the lathe binary, checked against the real `transformers`.

For random tiny GPT-2, Llama (GQA, untied) and Qwen2 (q/k/v biases, tied) models made with
transformers (config objects, no downloads), with every weight perturbed so biases and norms are
not at their trivial init:
  * `lathe logits` on the imported directory equals transformers' logits (max abs diff < 1e-4)
  * `lathe convert --verify` passes for import and export and says which version it compared with
  * `lathe train` (init_from, one step, checkpoint) then `lathe export RUN --to DIR`: transformers
    loads DIR and its logits equal lathe's on the trained weights; the weights did change
Import errors: a renamed, a missing and an extra tensor each fail naming the tensor; a tied
model's lm_head that differs from the embedding fails; pytorch_model.bin is refused with the
conversion hint; a sharded index pointing at the wrong shard fails naming the tensor.
Also: bf16 files are converted (reported), GPT-2 without the "transformer." prefix and with mask
buffers imports, sharded import and export (index) work with transformers, --resize-vocab fills
new rows with the mean embedding, a missing transformers is reported as NOT RUN.
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
    from safetensors.numpy import load_file, save_file
except ImportError as e:  # the pins are in scripts/requirements-test.txt
    print(f"FAIL transformers/safetensors not importable ({e}); run scripts/setup.sh")
    sys.exit(1)

transformers.logging.set_verbosity_error()
transformers.logging.disable_progress_bar()
LATHE = os.environ.get("LATHE_BIN", "build/lathe")
failures = []
TOKENS = [[1, 5, 9, 200, 3, 3, 77, 255, 0, 12, 64, 128], [7, 7, 7, 8, 9, 10, 250, 1]]


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what, flush=True)
    if not cond:
        failures.append(what)


def run(args, ok=True, env=None):
    p = subprocess.run([LATHE] + args, capture_output=True, text=True, errors="replace", env=env)
    if ok and p.returncode != 0:
        raise RuntimeError(f"lathe {' '.join(args)} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    return p


def make(kind, d, tied=None):
    torch.manual_seed({"gpt2": 1, "llama": 2, "qwen2": 3, "phi3": 6}[kind])
    if kind == "gpt2":
        cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=256, n_positions=64,
                                      resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)
        m = transformers.GPT2LMHeadModel(cfg)
    elif kind == "llama":
        cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                       num_key_value_heads=2, intermediate_size=64, vocab_size=256,
                                       max_position_embeddings=64, tie_word_embeddings=False,
                                       rope_theta=10000.0)
        m = transformers.LlamaForCausalLM(cfg)
    elif kind == "phi3":
        # Phi3ForCausalLM: fused qkv_proj / gate_up_proj; longrope (old name "su") with original 8 < the
        # 12-token sample (long factors) and = the 8-token one (short); sliding_window 11 = 12 keys
        # (flash-attn's (11, 11)), no narrower than the samples (transformers' eager Phi3 ignores the
        # window), narrower than training's seq_len 16.
        cfg = transformers.Phi3Config(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=64, vocab_size=256,
                                      max_position_embeddings=64, original_max_position_embeddings=8,
                                      rope_scaling={"type": "su", "short_factor": [1.0, 1.5, 2.0, 3.0],
                                                    "long_factor": [2.0, 4.0, 8.0, 16.0]},
                                      sliding_window=11, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                                      tie_word_embeddings=False)
        m = transformers.Phi3ForCausalLM(cfg)
    else:
        cfg = transformers.Qwen2Config(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                       num_key_value_heads=2, intermediate_size=64, vocab_size=256,
                                       max_position_embeddings=64, tie_word_embeddings=True,
                                       rope_theta=1e6)
        m = transformers.Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.05 * torch.randn_like(p))
    m.save_pretrained(d, safe_serialization=True)
    return m


def hf_logits(d_or_model):
    m = d_or_model
    if isinstance(m, str):
        m = transformers.AutoModelForCausalLM.from_pretrained(m, torch_dtype=torch.float32,
                                                              attn_implementation="eager")
    m.eval()
    with torch.no_grad():
        return [m(torch.tensor([t])).logits[0].numpy() for t in TOKENS]


def lathe_logits(d, tmp):
    out = os.path.join(tmp, "logits.f32")
    args = ["logits", "--model", d, "--out", out]
    for t in TOKENS:
        args += ["--tokens", ",".join(map(str, t))]
    rep = run(args).stdout
    flat = np.fromfile(out, dtype="<f4")
    res, off = [], 0
    V = json.load(open(os.path.join(d, "config.json")))["vocab_size"]
    for t in TOKENS:
        n = len(t) * V
        res.append(flat[off:off + n].reshape(len(t), V))
        off += n
    return res, rep


def maxdiff(a, b):
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b))


RECIPE = INIT_FROM_RECIPE


def roundtrip(kind, tmp, data):
    d = os.path.join(tmp, kind)
    m = make(kind, d)
    ref = hf_logits(m)
    ours, rep = lathe_logits(d, tmp)
    diff = maxdiff(ours, ref)
    check(diff < 1e-4, f"{kind}: imported logits equal transformers (max abs diff {diff:.2e})")
    # training one step from the import, then export from the run directory (its checkpoint)
    run_dir = os.path.join(tmp, kind + "_run")
    recipe = os.path.join(tmp, kind + ".yaml")
    open(recipe, "w").write(RECIPE.format(init=d, data=data, out=run_dir))
    p = run(["train", recipe])
    check("init_from" in p.stdout and "loaded" in p.stdout, f"{kind}: train logs the load report")
    exp = os.path.join(tmp, kind + "_export")
    p = run(["export", run_dir, "--to", exp])
    check("checkpoint" in p.stdout, f"{kind}: export took the run's checkpoint ({p.stdout.splitlines()[0]})")
    for f in ("config.json", "model.safetensors", "generation_config.json"):
        check(os.path.exists(os.path.join(exp, f)), f"{kind}: export wrote {f}")
    trained_hf = hf_logits(exp)
    trained_ours, _ = lathe_logits(exp, tmp)
    diff = maxdiff(trained_ours, trained_hf)
    check(diff < 1e-4, f"{kind}: exported trained model: transformers equals lathe (max abs diff {diff:.2e})")
    moved = maxdiff(trained_hf, ref)
    check(moved > 1e-4, f"{kind}: the training step changed the logits (by {moved:.3g})")
    # lathe's final HF dir of the run agrees with the exported checkpoint (same weights)
    diff = maxdiff(lathe_logits(os.path.join(run_dir, "model"), tmp)[0], trained_ours)
    check(diff == 0, f"{kind}: export of the checkpoint equals the run's final model dir")
    return d


def expect_fail(args, needles, what):
    p = run(args, ok=False)
    msg = p.stdout + p.stderr
    ok = p.returncode != 0 and all(n in msg for n in needles)
    check(ok, what + ("" if ok else f" (rc {p.returncode}: {msg.strip()[-400:]})"))


def edited_copy(src, dst, edit):
    shutil.copytree(src, dst)
    f = os.path.join(dst, "model.safetensors")
    t = load_file(f)
    edit(t)
    save_file(t, f, metadata={"format": "pt"})
    return dst


def first_loss(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return next(json.loads(l)["loss"] for l in f if '"loss"' in l)


def init_from_overrides(llama, tmp, data):
    """model: {init_from: DIR, rope_theta: X} trains, checkpoints and exports with X (the long-context
    continuation recipe); a key that changes a weight's shape is refused naming it."""
    base_theta = json.load(open(os.path.join(llama, "config.json")))["rope_theta"]
    run_dir = os.path.join(tmp, "theta_run")
    recipe = os.path.join(tmp, "theta.yaml")
    open(recipe, "w").write(RECIPE.format(init=llama, data=data, out=run_dir).replace(
        "  init_from: " + llama, "  init_from: " + llama + "\n  rope_theta: 500000.0"))
    p = run(["train", recipe])
    check(f"the recipe overrides rope_theta: {base_theta} -> 500000.0" in p.stdout,
          "init_from + rope_theta: the startup report names the override")
    cfg = json.load(open(os.path.join(run_dir, "model", "config.json")))
    check(cfg["rope_theta"] == 500000.0, f"init_from + rope_theta: the exported config.json says {cfg['rope_theta']}")
    # The same step without the override (the roundtrip's run) has another loss: the override trains.
    plain, theta = first_loss(os.path.join(tmp, "llama_run")), first_loss(run_dir)
    check(plain != theta, f"init_from + rope_theta: the first loss differs from the run without it ({plain} vs {theta})")
    # The exported model is the trained one with the new rope_theta: transformers agrees with lathe.
    diff = maxdiff(lathe_logits(os.path.join(run_dir, "model"), tmp)[0], hf_logits(os.path.join(run_dir, "model")))
    check(diff < 1e-4, f"init_from + rope_theta: exported model, transformers equals lathe ({diff:.2e})")
    bad = os.path.join(tmp, "ffn.yaml")
    open(bad, "w").write(RECIPE.format(init=llama, data=data, out=os.path.join(tmp, "ffn_run")).replace(
        "  init_from: " + llama, "  init_from: " + llama + "\n  intermediate_size: 96"))
    expect_fail(["train", bad], ["model.intermediate_size: 96 differs from 64", "init_from", "drop model.intermediate_size"],
                "init_from + intermediate_size: refused naming the key")


def unused_keys_and_stop_ids(llama, tmp, data):
    """Nothing silent: config.json keys lathe does not use are listed once with the reason; an
    eos_token_id list and the source's generation_config.json survive convert and training."""
    src = os.path.join(tmp, "llama_extra")
    shutil.copytree(llama, src)
    cfg = json.load(open(os.path.join(src, "config.json")))
    cfg.update({"use_mrope": False, "attention_dropout": 0.1, "eos_token_id": [2, 5, 7]})
    json.dump(cfg, open(os.path.join(src, "config.json"), "w"))
    gen = {"bos_token_id": 1, "eos_token_id": [2, 5, 7], "do_sample": True, "temperature": 0.6, "top_p": 0.9}
    json.dump(gen, open(os.path.join(src, "generation_config.json"), "w"))
    out = os.path.join(tmp, "llama_extra_out")
    p = run(["convert", "--from-hf", src, "--to", out])
    check("use_mrope (not a field lathe's llama config reads)" in p.stdout,
          "convert lists an unknown config.json key with the reason")
    check("attention_dropout (0.1: lathe trains without dropout)" in p.stdout,
          "convert lists a non-zero config.json dropout as not used")
    check(json.load(open(os.path.join(out, "config.json")))["eos_token_id"] == [2, 5, 7],
          "convert keeps the whole eos_token_id list in config.json")
    check(json.load(open(os.path.join(out, "generation_config.json"))) == gen,
          "convert copies the source's generation_config.json")
    hf_gen = transformers.GenerationConfig.from_pretrained(out)
    check(hf_gen.eos_token_id == [2, 5, 7], f"transformers reads the stop ids back ({hf_gen.eos_token_id})")
    run_dir = os.path.join(tmp, "extra_run")
    recipe = os.path.join(tmp, "extra.yaml")
    open(recipe, "w").write(RECIPE.format(init=src, data=data, out=run_dir))
    p = run(["train", recipe])
    check("use_mrope (not a field" in p.stdout, "train init_from lists the unused keys")
    check(json.load(open(os.path.join(run_dir, "model", "generation_config.json"))) == gen,
          "train: the run's model directory keeps init_from's generation_config.json")
    check(json.load(open(os.path.join(run_dir, "model", "config.json")))["eos_token_id"] == [2, 5, 7],
          "train: the run's config.json keeps the eos_token_id list")


def phi3_checks(d, tmp):
    """phi3 beyond the round trip: the exported config.json is Phi3Config's (architectures, the
    3-key rope_scaling, original_max_position_embeddings, sliding_window); convert --verify; GGUF of
    a phi3 with a sliding window refused naming the reason (plain and longrope phi3: tests/interop/test_gguf_llama_cpp.py); the oracle tells a gate|up swap apart (lathe logits on a copy whose
    gate_up_proj halves are swapped differ from transformers on the original)."""
    out = os.path.join(tmp, "phi3_conv")
    p = run(["convert", "--from-hf", d, "--to", out, "--verify"], ok=False)
    check(p.returncode == 0 and "PASS" in p.stdout, f"phi3: convert --verify passes ({p.stdout[-300:]}{p.stderr[-300:]})")
    cfg = json.load(open(os.path.join(out, "config.json")))
    check(cfg["architectures"] == ["Phi3ForCausalLM"] and cfg["rope_scaling"]["type"] == "longrope"
          and len(cfg["rope_scaling"]) == 3 and cfg["original_max_position_embeddings"] == 8
          and cfg["sliding_window"] == 11, f"phi3: exported config.json {json.dumps(cfg)[:300]}")
    expect_fail(["convert", "--from-hf", d, "--to-gguf", os.path.join(tmp, "phi3.gguf")],
                ["sliding_window 11 < context"], "phi3 with a sliding window: GGUF export refused naming the reason")
    sw = os.path.join(tmp, "phi3_swapped")

    def swap(t):
        for k in t:
            if k.endswith("gate_up_proj.weight"):
                g, u = np.split(t[k], 2, axis=0)
                t[k] = np.concatenate([u, g], axis=0)
    edited_copy(d, sw, swap)
    diff = maxdiff(lathe_logits(sw, tmp)[0], hf_logits(d))
    check(diff > 1e-2, f"phi3: gate|up swapped differs from transformers (max abs diff {diff:.3g})")


def main():
    tmp = tempfile.mkdtemp(prefix="lathe_hf_test_")
    data = os.path.join(tmp, "bytes")
    rng = np.random.default_rng(0)
    megatron_writer.write(data, [rng.integers(0, 256, 600) for _ in range(4)])
    dirs = {k: roundtrip(k, tmp, data) for k in ("gpt2", "llama", "qwen2", "phi3")}
    phi3_checks(dirs["phi3"], tmp)
    llama = dirs["llama"]
    init_from_overrides(llama, tmp, data)
    unused_keys_and_stop_ids(llama, tmp, data)

    # mistral (llama math, its own config class and default sliding window): import only
    torch.manual_seed(4)
    mi = transformers.MistralForCausalLM(transformers.MistralConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
        vocab_size=256, max_position_embeddings=64, sliding_window=32))
    with torch.no_grad():
        for p_ in mi.parameters():
            p_.add_(0.05 * torch.randn_like(p_))
    md = os.path.join(tmp, "mistral")
    mi.save_pretrained(md)
    diff = maxdiff(lathe_logits(md, tmp)[0], hf_logits(mi))
    check(diff < 1e-4, f"mistral: imported logits equal transformers (max abs diff {diff:.2e})")

    # mistral with an explicit head_dim (Mistral-Nemo's shape scaled down: 4 heads of 32, q/o 128
    # wide with hidden 96); weights of std 0.25 so that attention and RoPE matter. Import: logits;
    # convert --verify: import and export (config.json head_dim 32 read back by transformers) PASS.
    torch.manual_seed(5)
    mh = transformers.MistralForCausalLM(transformers.MistralConfig(
        num_hidden_layers=2, hidden_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        intermediate_size=192, vocab_size=256, max_position_embeddings=64, sliding_window=None))
    with torch.no_grad():
        for name, p_ in mh.named_parameters():
            p_.normal_(0.0, 0.25) if p_.dim() >= 2 else p_.copy_(1.0 + 0.1 * torch.randn_like(p_))
    mhd = os.path.join(tmp, "mistral_hd")
    mh.save_pretrained(mhd)
    ref = hf_logits(mh)
    scale = max(float(np.abs(r).max()) for r in ref)
    diff = maxdiff(lathe_logits(mhd, tmp)[0], ref)
    check(diff < 1e-5 * scale, f"mistral head_dim 32 x 4 != hidden 96: imported logits equal transformers "
                               f"(max abs diff {diff:.2e}, logits up to {scale:.1f})")
    p = run(["convert", "--from-hf", mhd, "--to", os.path.join(tmp, "mistral_hd_out"), "--verify"], ok=False)
    exported = json.load(open(os.path.join(tmp, "mistral_hd_out", "config.json")))
    check(p.returncode == 0 and p.stdout.count("-> PASS") == 2 and exported.get("head_dim") == 32,
          f"mistral head_dim: convert --verify import and export PASS, config.json head_dim "
          f"{exported.get('head_dim')}\n{p.stdout}")

    # built-in parity check, import and export
    out = os.path.join(tmp, "conv")
    p = run(["convert", "--from-hf", llama, "--to", out, "--verify"], ok=False)
    check(p.returncode == 0 and p.stdout.count("-> PASS") == 2 and "transformers " + transformers.__version__ in p.stdout,
          "convert --verify: import and export PASS against transformers " + transformers.__version__)
    # a reference that differs by 1e-3 in one logit: the check fails (exit 1) and says where
    wrap = os.path.join(tmp, "perturbing_python.py")
    open(wrap, "w").write(
        "#!/usr/bin/python3\nimport json, subprocess, sys\nimport numpy as np\n"
        "if sys.argv[1:2] == ['-c']:\n    sys.exit(subprocess.call(['/usr/bin/python3'] + sys.argv[1:]))\n"
        "rc = subprocess.call(['/usr/bin/python3'] + sys.argv[1:])\n"
        "out = json.load(open(sys.argv[2]))['out']\n"
        "a = np.fromfile(out, dtype='<f4'); a[1000] += 1e-3; a.tofile(out)\nsys.exit(rc)\n")
    os.chmod(wrap, 0o755)
    p = run(["convert", "--from-hf", llama, "--verify"], ok=False, env=dict(os.environ, LATHE_PYTHON=wrap))
    check(p.returncode == 1 and "-> FAIL" in p.stdout and "position" in p.stdout,
          "convert --verify fails (exit 1) on a 1e-3 logit difference and locates it")
    # without transformers: said, not passed
    env = dict(os.environ, LATHE_PYTHON="/bin/false")
    p = run(["convert", "--from-hf", llama, "--verify"], ok=False, env=env)
    check(p.returncode == 0 and "NOT RUN" in p.stdout and "PASS" not in p.stdout,
          "convert --verify without transformers says NOT RUN")

    # strictness: renamed, missing, extra
    def rename(t):
        t["model.layers.0.mlp.upp_proj.weight"] = t.pop("model.layers.0.mlp.up_proj.weight")
    expect_fail(["convert", "--from-hf", edited_copy(llama, os.path.join(tmp, "ren"), rename), "--verify"],
                ["model.layers.0.mlp.upp_proj.weight", "model.layers.0.mlp.up_proj.weight"],
                "renamed tensor: both names in the error")
    expect_fail(["convert", "--from-hf", edited_copy(llama, os.path.join(tmp, "mis"),
                                                   lambda t: t.pop("model.layers.1.self_attn.k_proj.weight")),
                 "--verify"], ["missing", "model.layers.1.self_attn.k_proj.weight"], "missing tensor named")
    expect_fail(["convert", "--from-hf", edited_copy(llama, os.path.join(tmp, "ext"),
                                                   lambda t: t.update({"model.layers.0.extra.weight": np.ones(4, np.float32)})),
                 "--verify"], ["unexpected", "model.layers.0.extra.weight"], "extra tensor named")

    def bad_shape(t):
        t["model.norm.weight"] = np.ones(31, np.float32)
    expect_fail(["convert", "--from-hf", edited_copy(llama, os.path.join(tmp, "shp"), bad_shape), "--verify"],
                ["model.norm.weight", "[31]", "[32]"], "mis-shaped tensor named with both shapes")
    # init_from goes through the same strict loader
    bad = os.path.join(tmp, "mis")
    recipe = os.path.join(tmp, "bad.yaml")
    open(recipe, "w").write(RECIPE.format(init=bad, data=data, out=os.path.join(tmp, "bad_run")))
    expect_fail(["train", recipe], ["model.layers.1.self_attn.k_proj.weight"], "init_from with a missing tensor fails")

    # tied embeddings: an lm_head copy is accepted only when equal
    qwen = dirs["qwen2"]
    def tied_equal(t):
        t["lm_head.weight"] = t["model.embed_tokens.weight"].copy()
    p = run(["convert", "--from-hf", edited_copy(qwen, os.path.join(tmp, "tied_eq"), tied_equal), "--to",
             os.path.join(tmp, "tied_eq_out")])
    check("equal to model.embed_tokens.weight" in p.stdout, "tied model: equal lm_head copy accepted and reported")
    def tied_diff(t):
        t["lm_head.weight"] = t["model.embed_tokens.weight"] + 1e-3
    expect_fail(["convert", "--from-hf", edited_copy(qwen, os.path.join(tmp, "tied_ne"), tied_diff), "--to",
                 os.path.join(tmp, "tied_ne_out")], ["lm_head.weight", "tie_word_embeddings"],
                "tied model: differing lm_head refused")

    # GPT-2 base-model names (no "transformer.") plus the causal-mask buffers of old checkpoints
    g = os.path.join(tmp, "gpt2_noprefix")
    def strip(t):
        for k in list(t):
            t[k[len("transformer."):]] = t.pop(k)
        t["h.0.attn.bias"] = np.tril(np.ones((1, 1, 64, 64), np.float32))
    edited_copy(dirs["gpt2"], g, strip)
    ours, rep = lathe_logits(g, tmp)
    diff = maxdiff(ours, hf_logits(dirs["gpt2"]))
    check(diff < 1e-4 and "ignored 1 non-parameter" in rep,
          f"gpt2 without prefix + mask buffer: same logits ({diff:.2e}), buffer reported ({rep.strip()})")

    # bf16 file: converted and reported; logits equal transformers loading the same file in fp32
    bf = os.path.join(tmp, "llama_bf16")
    transformers.AutoModelForCausalLM.from_pretrained(llama).to(torch.bfloat16).save_pretrained(bf)
    ours, rep = lathe_logits(bf, tmp)
    diff = maxdiff(ours, hf_logits(bf))
    check("BF16->F32" in rep and diff < 1e-4, f"bf16 import: conversion reported ({rep.strip()}), diff {diff:.2e}")

    # sharded import (transformers' index) and sharded export readable by transformers
    sh = os.path.join(tmp, "llama_sharded")
    transformers.AutoModelForCausalLM.from_pretrained(llama).save_pretrained(sh, max_shard_size="40KB")
    check(os.path.exists(os.path.join(sh, "model.safetensors.index.json")), "transformers wrote a sharded model")
    ours, rep = lathe_logits(sh, tmp)
    nfiles = len(set(json.load(open(os.path.join(sh, "model.safetensors.index.json")))["weight_map"].values()))
    check(maxdiff(ours, hf_logits(llama)) < 1e-4 and f"from {nfiles} file(s)" in rep,
          f"sharded import ({nfiles} files): {rep.strip()}")
    shout = os.path.join(tmp, "llama_sharded_out")
    run(["export", llama, "--to", shout, "--max-shard-size", "30KB"])
    idx = json.load(open(os.path.join(shout, "model.safetensors.index.json")))
    nsh = len(set(idx["weight_map"].values()))
    diff = maxdiff(hf_logits(shout), hf_logits(llama))
    check(nsh > 1 and diff < 1e-6 and not os.path.exists(os.path.join(shout, "model.safetensors")),
          f"sharded export: {nsh} shards + index, transformers loads it (diff {diff:.2e})")
    # index pointing a tensor at the wrong shard
    wrong = os.path.join(tmp, "wrong_index")
    shutil.copytree(sh, wrong)
    ij = json.load(open(os.path.join(wrong, "model.safetensors.index.json")))
    names = sorted(ij["weight_map"])
    files = sorted(set(ij["weight_map"].values()))
    victim = next(n for n in names if ij["weight_map"][n] == files[0])
    ij["weight_map"][victim] = files[1]
    json.dump(ij, open(os.path.join(wrong, "model.safetensors.index.json"), "w"))
    expect_fail(["convert", "--from-hf", wrong, "--verify"], [victim, "index"], "index naming the wrong shard refused")

    # pytorch .bin refused with a conversion command
    pb = os.path.join(tmp, "llama_bin")
    transformers.AutoModelForCausalLM.from_pretrained(llama).save_pretrained(pb, safe_serialization=False)
    expect_fail(["convert", "--from-hf", pb, "--verify"], ["pytorch_model.bin", "safe_serialization=True"],
                "pytorch_model.bin refused with a conversion hint")

    # bf16 / fp16 export: transformers reads the dtype; values are the rounded fp32 weights
    for dt, tdt in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        o = os.path.join(tmp, "llama_" + dt)
        run(["convert", "--from-hf", llama, "--to", o, "--dtype", dt])
        m = transformers.AutoModelForCausalLM.from_pretrained(o)
        src = transformers.AutoModelForCausalLM.from_pretrained(llama)
        same = all(torch.equal(a.to(tdt), b) for a, b in zip(src.state_dict().values(), m.state_dict().values()))
        check(json.load(open(os.path.join(o, "config.json")))["torch_dtype"] == str(tdt).split(".")[1] and same,
              f"{dt} export: torch_dtype and every tensor equal to the rounded source")

    # vocabulary resize: only on request; new rows = mean embedding
    rv = os.path.join(tmp, "llama_resized")
    p = run(["convert", "--from-hf", llama, "--to", rv, "--resize-vocab", "300"])
    a, b = load_file(os.path.join(llama, "model.safetensors")), load_file(os.path.join(rv, "model.safetensors"))
    ok = True
    for n in ("model.embed_tokens.weight", "lm_head.weight"):
        ok &= b[n].shape == (300, 32) and np.array_equal(b[n][:256], a[n])
        ok &= np.allclose(b[n][256:], a[n].astype(np.float64).mean(0), atol=1e-6)
    check(ok and "resized 256 -> 300" in p.stdout and json.load(open(os.path.join(rv, "config.json")))["vocab_size"] == 300,
          "--resize-vocab 300: old rows kept, 44 mean rows, reported")
    m = transformers.AutoModelForCausalLM.from_pretrained(rv)
    check(m.config.vocab_size == 300, "resized model loads in transformers")

    shutil.rmtree(tmp)
    print(f"{0 if failures else 1} passed, {1 if failures else 0} failed")
    if failures:
        print("FAILURES:\n  " + "\n  ".join(failures))
        sys.exit(1)


if __name__ == "__main__":
    main()
