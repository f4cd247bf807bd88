"""What the mpirun training tests share (test_dp_train.py, test_tp_train.py, test_pp_train.py, ...):
on top of tests/common/run_harness.py (the binary, the rank environment, running lathe under mpirun,
the check/failure bookkeeping), a small structured dataset, recipe files, comparisons of runs, and
the six-layer GPT-2 / Llama models of the pipeline tests."""
import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "train"))
sys.path.insert(0, os.path.join(HERE, "..", "common"))
import megatron_writer  # noqa: E402
from run_harness import ENV, LATHE, MPIRUN, check, failures, metrics, run  # noqa: E402,F401 (re-exported)


def make_data(tmp):
    rng = np.random.default_rng(7)
    # Structured tokens (a noisy repeating pattern) so that the loss moves in 10 steps.
    docs = [(np.arange(400) * (d % 7 + 1) + rng.integers(0, 3, 400)) % 96 for d in range(60)]
    prefix = os.path.join(tmp, "data")
    megatron_writer.write(prefix, docs)
    return prefix


def write_recipe(data, preset, out, training, **kw):
    """OUT.yaml for `preset` on `data` with the `training` section; kw `section__key=value` overrides."""
    r = {
        "model": {"preset": preset},
        "data": {"train": data, "valid_fraction": 0.1},
        "optimizer": {"name": "adamw", "lr": 3e-3, "grad_clip": 1.0},
        "schedule": {"name": "cosine", "warmup_steps": 2},
        "training": dict(training),
        "output": {"dir": out},
    }
    for k, v in kw.items():
        sec, key = k.split("__")
        r.setdefault(sec, {})[key] = v
    path = out + ".yaml"
    with open(path, "w") as f:
        json.dump(r, f)  # JSON is YAML
    return path


def weights(out):
    from safetensors.numpy import load_file
    return load_file(os.path.join(out, "model", "model.safetensors"))


def series(out, key):
    return [r[key] for r in metrics(out) if key in r and "loss" in r]


def val_losses(out):
    return [r["val_loss"] for r in metrics(out) if "val_loss" in r]


def rel(a, b):
    """Largest relative difference of two equally long series (inf when the lengths differ)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-30))) if len(a) and len(a) == len(b) else float("inf")


def without_k_bias(name, w):
    # The gradient of the key bias is exactly zero in exact arithmetic (softmax ignores the constant
    # q.b_k it adds to a row of scores), so AdamW turns its rounding noise into +-lr steps in any
    # two runs that sum in different orders: compare q and v biases only.
    if name.endswith("attn.c_attn.bias"):
        n = w.shape[0] // 3
        return np.concatenate([w[:n], w[2 * n:]])
    return w


def weights_close(a, b, tol):
    """Whether the HF weights of runs a and b agree within tol (relative to each tensor's largest
    magnitude), and the worst such difference."""
    wa, wb = weights(a), weights(b)
    worst = 0.0
    for k in wb:
        if k not in wa:
            return False, float("inf")
        x, y = without_k_bias(k, wa[k]), without_k_bias(k, wb[k])
        worst = max(worst, float(np.max(np.abs(x - y)) / (np.max(np.abs(y)) + 1e-30)))
    return set(wa) == set(wb) and worst <= tol, worst


def model_recipe(data, model, out, training, **kw):
    """OUT.yaml as write_recipe, with the model section `model` (a dict); kw `training__key` overrides
    one training key, `recompute` sets the recipe's recompute, the rest as write_recipe."""
    training = dict(training)
    for k in [k for k in kw if k.startswith("training__")]:
        training[k.split("__")[1]] = kw.pop(k)
    recompute = kw.pop("recompute", None)
    path = write_recipe(data, "unused", out, training, **kw)
    r = json.load(open(path))
    r["model"] = model
    if recompute:
        r["recompute"] = recompute
    json.dump(r, open(path, "w"))
    return path


def train_checked(np_, path, out, name, extra=()):
    """Trains recipe `path` (output `out`) on np_ ranks, checks that it succeeded, returns `out`."""
    p, dt = run(np_, ["train", path, "--quiet", *extra], 300, ENV)
    if p.returncode != 0:
        print(p.stdout[-2000:], p.stderr[-3000:])
    check(p.returncode == 0, f"{name}: {np_} process(es) train ({dt:.1f} s)")
    return out


# How far runs whose only difference is float summation order may drift apart, as a multiple of the
# drift that summation order alone gives on this machine (order_tolerance).
NOISE_FACTOR = 10


def order_tolerance(one, controls, series_floor=1e-5, weights_floor=1e-4):
    """Tolerances (series, weights) for comparing another layout's run with the one-process run `one`.

    A layout (TP, PP, DP) changes only the order in which floats are summed; AdamW then turns the
    rounding noise of near-zero gradients into whole steps, so the runs drift apart by an amount set
    by this model, these steps and this machine's kernels (OpenBLAS's and oneDNN's blocking), not by
    a constant. `controls` are one-process runs of the same global batch split into other
    micro-batches (the same sequences and the same mean, summed in another order): equally valid
    arithmetic, so their drift from `one` is the summation-order noise of this training here.
    Returns NOISE_FACTOR x the largest such drift (losses and gradient norms; final weights relative
    to each tensor's largest magnitude), never below the floors. Validation losses are not compared:
    the evaluation reads eval_batches micro-batches, so another micro-batch size evaluates other
    sequences. A wrong layout
    (a missing all-reduce, a shard off by one) moves losses by 1e-3 or more from the first step."""
    s = w = 0.0
    for c in controls:
        for key in ("loss", "grad_norm"):
            s = max(s, rel(series(c, key), series(one, key)))
        w = max(w, weights_close(c, one, float("inf"))[1])
    return max(series_floor, NOISE_FACTOR * s), max(weights_floor, NOISE_FACTOR * w)


def same_run(a, ref, what, steps=slice(None), tol=1e-5, ref_name="one process"):
    """Checks that run a's losses and gradient norms match run ref's within tol (relative)."""
    if not os.path.exists(os.path.join(a, "metrics.jsonl")):
        check(False, f"{what}: no metrics")
        return
    e = rel(series(a, "loss")[steps], series(ref, "loss")[steps])
    check(e <= tol, f"{what}: losses match {ref_name} (max rel {e:.2e} <= {tol})")
    e = rel(series(a, "grad_norm")[steps], series(ref, "grad_norm")[steps])
    check(e <= tol, f"{what}: gradient norms match (max rel {e:.2e} <= {tol})")



# The pipeline tests' runs (test_pp_train.py, test_tp_pp_train.py): 5 steps of 4 micro-batches of
# 2x32 and 6-layer models, so that 2, 3 and 6 (virtual) stages divide them; 4 heads (2 KV heads for
# Llama) and vocabulary 96 split over 2 tensor ranks.
PIPELINE_TRAINING = {"micro_batch_size": 2, "seq_len": 32, "grad_accum_steps": 4, "steps": 5, "eval_interval": 5,
                     "eval_batches": 2, "log_interval": 1, "threads": 1, "peak_gflops": 100, "seed": 5}
PIPELINE_MODELS = {"gpt2": {"preset": "gpt2-debug", "n_layer": 6},
                   "llama": {"preset": "llama-debug", "num_hidden_layers": 6}}


def pipeline_recipe(data, family, out, **kw):
    """OUT.yaml: PIPELINE_TRAINING with PIPELINE_MODELS[family] ("gpt2" or "llama"); kw as model_recipe."""
    return model_recipe(data, PIPELINE_MODELS[family], out, PIPELINE_TRAINING, **kw)


def pipeline_train(tmp, np_, data, family, name, extra=(), **kw):
    """Trains pipeline_recipe into TMP/NAME on np_ ranks, checks that it succeeded, returns TMP/NAME."""
    out = os.path.join(tmp, name)
    return train_checked(np_, pipeline_recipe(data, family, out, **kw), out, name, extra)
