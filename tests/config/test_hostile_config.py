"""Hostile recipes, --set values and Hugging Face config.json / model directories (issue 14, config
part). Each case failed on the code before the fix: a crash (std::regex stack overflow on a long
scalar, infinite recursion on a YAML alias cycle, a deep config.json field copied recursively into
an error message), a hang or unbounded memory (billion laughs, n_layer 2^31), silent acceptance
(duplicate keys, a second document, tags, infinite epsilons, huge integers that wrap), or an error
that did not name the file / field."""
import json
import os
import shutil
import sys

SRC = os.environ.get("LATHE_SOURCE_DIR", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(SRC, "tests"))
sys.path.insert(0, os.path.join(SRC, "tests", "train"))
from hostile import Cases, run_lathe  # noqa: E402

import megatron_writer  # noqa: E402
import numpy as np  # noqa: E402

cases = Cases()
data = cases.path("data", "d")
megatron_writer.write(data, [np.arange(600) % 90 for _ in range(4)])
BASE = (f"model: {{preset: gpt2-debug}}\n"
        f"data: {{train: {data}, valid_fraction: 0.1}}\n"
        f"optimizer: {{lr: 1.0e-3}}\n"
        f"training: {{micro_batch_size: 2, seq_len: 16, steps: 2, eval_interval: 0, peak_gflops: 1.0}}\n"
        f"output: {{dir: {cases.path('out')}}}\n")
base = cases.write("base.yaml", BASE)


def recipe(name, text):
    return cases.write(name, text)


def check(args, must, rc=1, **kw):
    return run_lathe(["check"] + args, rc=rc, must=must, timeout=kw.pop("timeout", 30), **kw)


# ---------------------------------------------------------------------------------- YAML parsing
with cases.case("100,000-digit integer scalar (std::regex stack overflow)"):
    r = recipe("long_int.yaml", BASE + "schedule: {warmup_steps: " + "1" * 100000 + "}\n")
    check([r], ["long_int.yaml", "schedule.warmup_steps", "does not fit a 64-bit integer"])

with cases.case("100,000-digit float scalar"):
    r = recipe("long_float.yaml", BASE.replace("lr: 1.0e-3", "lr: 0." + "0" * 100000 + "1"))
    check([r], ["long_float.yaml", "optimizer.lr", "must be > 0"])

with cases.case("100,000-digit scalar through --set"):
    check([base, "--set", "training.steps=" + "9" * 100000], ["--set training.steps=", "does not fit"])

with cases.case("YAML alias cycle x: &a [*a]"):
    check([recipe("cycle.yaml", "x: &a [*a]\n")], ["cycle.yaml", "cycle"])

with cases.case("YAML alias cycle through --set"):
    check([base, "--set", "model.n_layer=&a [*a]"], ["--set model.n_layer", "cycle"])

with cases.case("YAML billion laughs"):
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 10)]
    check([recipe("laughs.yaml", "\n".join(lines) + "\n")], ["laughs.yaml", "more than 100000 values"],
          timeout=20, mem_mb=1024)

with cases.case("YAML nested 100,000 levels (yaml-cpp's depth error names the file)"):
    r = recipe("deep.yaml", "model: " + "[" * 100000 + "]" * 100000 + "\n")
    check([r], ["deep.yaml", "nests too deeply", "line 1"], must_not=["bad file"])

with cases.case("YAML nested 100 levels"):
    check([recipe("deep100.yaml", "model: " + "[" * 100 + "]" * 100 + "\n")], ["deep100.yaml", "nests deeper than 32"])

with cases.case("duplicate section"):
    check([recipe("dup_sec.yaml", BASE + "training: {steps: 5}\n")],
          ["dup_sec.yaml", "duplicate section 'training'", "lines 4 and 6"])

with cases.case("duplicate key"):
    r = recipe("dup_key.yaml", BASE.replace("steps: 2,", "steps: 2, steps: 3,"))
    check([r], ["dup_key.yaml", "duplicate key 'training.steps'"])

with cases.case("second YAML document"):
    check([recipe("two_docs.yaml", BASE + "---\nmodel: {preset: llama-debug}\n")],
          ["two_docs.yaml", "more than one YAML document", "line 6"])

with cases.case("second YAML document in --set"):
    check([base, "--set", "training.steps=3\n---\n4"], ["--set training.steps", "more than one YAML document"])

for tag in ("!!str", "!!python/object:os.system", "!custom"):
    with cases.case(f"explicit tag {tag}"):
        r = recipe("tag.yaml", BASE.replace("steps: 2,", f"steps: {tag} 2,"))
        check([r], ["tag.yaml", "explicit YAML tag", "training.steps"])

with cases.case("explicit tag on a key"):
    check([recipe("tagkey.yaml", BASE + "!!str output: {dir: x}\n")], ["tagkey.yaml", "explicit YAML tag"])

with cases.case("mapping as a key"):
    check([recipe("mapkey.yaml", BASE + "? [a, b]\n: 1\n")], ["mapkey.yaml", "keys must be plain names"])

with cases.case("invalid UTF-8 in output.dir (train wrote recipe.yaml through a JSON type error)"):
    r = cases.write("utf8.yaml", BASE.encode().replace(b"output: {dir: ", b"output: {dir: \xff\xfe"))
    run_lathe(["train", r], rc=1, must=["utf8.yaml", "output.dir", "not valid UTF-8"], timeout=60, cwd=cases.tmp)

# ---------------------------------------------------------------------------------- float fields
for key, model in (("model.layer_norm_epsilon", "gpt2-debug"), ("model.initializer_range", "gpt2-debug"),
                   ("model.rms_norm_eps", "llama-debug"), ("model.rope_theta", "llama-debug"),
                   ("model.rope_parameters.rope_theta", "llama-debug"), ("optimizer.eps", "gpt2-debug"),
                   ("optimizer.weight_decay", "gpt2-debug"), ("optimizer.grad_clip", "gpt2-debug")):
    with cases.case(f"{key} = 1e999 (+inf)"):
        check([base, "--set", f"model.preset={model}", "--set", f"{key}=1e999"], [key.split(".")[-1], "finite"])

# ------------------------------------------------- numeric bounds that passed check (issue 23 S1, S2, S8)
with cases.case("loss scale below float range (1 / scale = inf: NaN weights, exit 0)"):
    ls = ["--set", "precision.loss_scale.enabled=true"]
    check([base] + ls + ["--set", "precision.loss_scale.initial=1e-39", "--set", "precision.loss_scale.min=1e-40"],
          ["precision.loss_scale.initial", "1e-39", "2^-100"])
    check([base] + ls + ["--set", "precision.loss_scale.min=1e-40"], ["precision.loss_scale.min", "1e-40", "2^-100"])
    check([base, "--set", "precision.compute=fp16", "--set", "precision.loss_scale.initial=1e-300",
           "--set", "precision.loss_scale.min=1e-320"], ["precision.loss_scale.initial", "2^-100"])
    check([base] + ls + ["--set", "precision.loss_scale.initial=7.9e-31", "--set", "precision.loss_scale.min=7.9e-31"],
          ["lathe train", "can start"], rc=0, stream="stdout")  # 2^-100 itself is allowed

with cases.case("anomaly warmup_steps 0 and min_rel_std 0 (z ~ 1e12: every step skipped)"):
    an = ["--set", "training.anomaly.enabled=true"]
    check([base] + an + ["--set", "training.anomaly.warmup_steps=0"], ["training.anomaly.warmup_steps", "0 must be >= 1"])
    check([base] + an + ["--set", "training.anomaly.min_rel_std=0"], ["training.anomaly.min_rel_std", "0 must be in"])

with cases.case("parallel.timeout_s 1e-300 (the watchdog aborts the first all-reduce)"):
    check([base, "--set", "parallel.timeout_s=1e-300"], ["parallel.timeout_s", "1e-300", "must be 0 (no watchdog) or in"])
    check([base, "--set", "parallel.timeout_s=0.5"], ["parallel.timeout_s", "0.5"])
    check([base, "--set", "parallel.timeout_s=1e300"], ["parallel.timeout_s", "1e+300"])
    check([base, "--set", "parallel.timeout_s=0"], ["can start"], rc=0, stream="stdout")

# ------------------------------------------------------------------------- integer bounds, overflow
with cases.case("grad_accum_steps 10^12 (a step that never finishes)"):
    check([base, "--set", "training.grad_accum_steps=1000000000000"],
          ["training.grad_accum_steps", "exceeds the maximum 65536"])

with cases.case("steps x micro_batch x accum x seq_len overflows 64 bits"):
    check([base, "--set", "training.steps=1000000000000", "--set", "training.micro_batch_size=65536",
           "--set", "training.grad_accum_steps=65536"], ["training.steps x micro_batch_size", "overflows"])

with cases.case("threads 10^6"):
    check([base, "--set", "training.threads=1000000"], ["training.threads", "exceeds the maximum"])

with cases.case("vocab_size 2^62 wraps V x C to 0: train must refuse, not train"):
    run_lathe(["train", base, "--set", "model.vocab_size=4611686018427387904"], rc=1,
              must=["model.vocab_size", "exceeds lathe's maximum"], timeout=60, mem_mb=2048)

with cases.case("n_layer 2^31 in a recipe"):
    check([base, "--set", "model.n_layer=2147483648"], ["model.n_layer", "exceeds"], timeout=20, mem_mb=1024)

with cases.case("n_embd 2^31 in a recipe"):
    check([base, "--set", "model.n_embd=2147483648", "--set", "model.n_head=1"], ["model.n_embd", "exceeds"],
          timeout=20, mem_mb=1024)

# -------------------------------------------------------------------- config.json / HF directories
hf = cases.path("hf")
run_lathe(["train", base, "--set", f"output.dir={hf}"], rc=0, timeout=120)
model_dir = os.path.join(hf, "model")
assert os.path.exists(os.path.join(model_dir, "config.json")), os.listdir(hf)
good_cfg = json.load(open(os.path.join(model_dir, "config.json")))


def hf_dir(name, edit=None, raw=None):
    d = cases.path(name)
    shutil.rmtree(d, ignore_errors=True)
    shutil.copytree(model_dir, d)
    if raw is not None:
        with open(os.path.join(d, "config.json"), "w") as f:
            f.write(raw)
    elif edit:
        c = dict(good_cfg)
        edit(c)
        json.dump(c, open(os.path.join(d, "config.json"), "w"))
    return d


def eval_(d, must, **kw):
    return run_lathe(["eval", "--model", d, "--data", data, "--seq-len", "16"], rc=1, must=must,
                     timeout=kw.pop("timeout", 30), **kw)


with cases.case("config.json n_layer 2^31 (unbounded allocation before the weights are compared)"):
    eval_(hf_dir("hf_layers", lambda c: c.update(n_layer=2**31)), ["config.json", "n_layer = 2147483648", "exceeds"],
          timeout=20, mem_mb=1024)

with cases.case("config.json vocab_size 2^40"):
    eval_(hf_dir("hf_vocab", lambda c: c.update(vocab_size=2**40)), ["config.json", "vocab_size", "exceeds"],
          timeout=20, mem_mb=1024)

with cases.case("config.json hidden 2^31"):
    eval_(hf_dir("hf_hidden", lambda c: c.update(n_embd=2**31, n_head=1)), ["config.json", "n_embd", "exceeds"],
          timeout=20, mem_mb=1024)

with cases.case("config.json within bounds but far beyond the machine: memory estimate names fields"):
    d = hf_dir("hf_big", lambda c: c.update(n_layer=60000, n_embd=4096, n_head=32, n_inner=16384))
    eval_(d, ["config.json", "n_layer = 60000", "n_embd = 4096", "needs", "TB"], timeout=20, mem_mb=1024)

with cases.case("config.json 2^64-1 integer"):
    eval_(hf_dir("hf_u64", raw=json.dumps(good_cfg)[:-1] + ', "n_positions": 18446744073709551615}'),
          ["config.json", "n_positions", "does not fit"])

with cases.case("config.json field nested 100,000 levels (recursive dump in the error)"):
    raw = json.dumps(good_cfg)[:-1] + ', "n_layer_x": 1}'
    raw = raw.replace('"n_layer": 2', '"n_layer": ' + "[" * 100000 + "]" * 100000)
    eval_(hf_dir("hf_deep", raw=raw), ["config.json", "nests deeper"])

with cases.case("config.json vocab_size null"):
    eval_(hf_dir("hf_null", lambda c: c.update(vocab_size=None)), ["config.json", "vocab_size", "null"])

with cases.case("config.json rope_scaling a 1 MB string: the message quotes a bounded excerpt"):
    d = hf_dir("hf_rope", raw=json.dumps(dict(good_cfg, model_type="llama", rope_scaling="x" * 1000000)))
    p = eval_(d, ["config.json", "rope_scaling"])
    assert len(p.stderr) < 2000, len(p.stderr)

with cases.case("config.json rope_scaling long_factor of 10^6 numbers and a string: bounded message"):
    lf = [1.0] * 1000000 + ["x"]
    d = hf_dir("hf_rope_lf", raw=json.dumps(dict(good_cfg, model_type="llama", rope_scaling={
        "rope_type": "longrope", "factor": 2.0, "short_factor": [1.0], "long_factor": lf})))
    p = eval_(d, ["config.json", "rope_scaling.long_factor[1000000]", "expected a number"])
    assert len(p.stderr) < 2000, len(p.stderr)

with cases.case("config.json rope_scaling attention_factor 1e300 (inf in fp32 tables)"):
    d = hf_dir("hf_rope_af", raw=json.dumps(dict(good_cfg, model_type="llama", rope_scaling={
        "rope_type": "yarn", "factor": 2.0, "attention_factor": 1e300})))
    eval_(d, ["config.json", "rope_scaling", "not finite in fp32"])

with cases.case("config.json eos_token_id 2^40"):
    eval_(hf_dir("hf_eos", lambda c: c.update(eos_token_id=2**40)), ["config.json", "eos_token_id", "out of range"])

with cases.case("config.json as a symlink loop"):
    d = hf_dir("hf_cfgloop")
    os.remove(os.path.join(d, "config.json"))
    os.symlink("c2", os.path.join(d, "config.json"))
    os.symlink("config.json", os.path.join(d, "c2"))
    eval_(d, ["config.json", "symlink loop"])

with cases.case("model.safetensors as a symlink loop"):
    d = hf_dir("hf_stloop")
    os.remove(os.path.join(d, "model.safetensors"))
    os.symlink("s2", os.path.join(d, "model.safetensors"))
    os.symlink("model.safetensors", os.path.join(d, "s2"))
    eval_(d, ["model.safetensors", "symlink loop"])

with cases.case("init_from directory with a symlink-loop model.safetensors (check)"):
    check([base, "--set", "model.preset=null", "--set", f"model.init_from={cases.path('hf_stloop')}"],
          ["model.safetensors", "symlink loop"])

with cases.case("index.json shard outside the directory"):
    d = hf_dir("hf_idx")
    os.rename(os.path.join(d, "model.safetensors"), os.path.join(d, "model-00001-of-00001.safetensors"))
    json.dump({"weight_map": {"transformer.wte.weight": "../../../../etc/passwd"}},
              open(os.path.join(d, "model.safetensors.index.json"), "w"))
    eval_(d, ["model.safetensors.index.json", "weight_map", "not a file name"])

with cases.case("index.json weight_map entry of the wrong type"):
    json.dump({"weight_map": {"transformer.wte.weight": 5}}, open(os.path.join(d, "model.safetensors.index.json"), "w"))
    eval_(d, ["model.safetensors.index.json", "transformer.wte.weight", "must be a shard file name"])

with cases.case("convert: output directory that cannot be created"):
    run_lathe(["convert", "--from-hf", model_dir, "--to", os.path.join(model_dir, "config.json", "sub")], rc=1,
              must=["config.json/sub", "cannot create the output directory"])

with cases.case("recipe model.config with a 100,000-level field"):
    cfg = cases.write("deep_config.json", '{"model_type": "gpt2", "n_layer": ' + "[" * 100000 + "]" * 100000 + "}")
    check([base, "--set", "model.preset=null", "--set", f"model.config={cfg}"], ["deep_config.json", "nests deeper"])

cases.finish()
