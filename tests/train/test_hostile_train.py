#!/usr/bin/env python3
"""One validation path (issue 14): `lathe check` runs exactly the checks `lathe train` runs before
its first step. For each thing check must catch, BOTH commands exit 1 with the same message (the
text after "lathe CMD: error: "), in bounded time and memory: bad datasets (missing, wrong dtype,
token ids beyond the vocabulary), model dimensions beyond the machine, init_from weights that do not
fit the model, an output directory that cannot be created or written, a bad resume checkpoint. A
good recipe passes check, leaves no files behind, and train then starts. CLI usage errors of train,
check, export and generate exit 2.
"""
import json
import os
import shutil
import struct
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.environ.get("LATHE_SOURCE_DIR", os.path.join(HERE, "..", "..")), "tests"))
sys.path.insert(0, HERE)
import megatron_writer  # noqa: E402
from hostile import Cases, Failure, error_text, run_lathe  # noqa: E402
from kill_test_lib import HOSTILE_RECIPE as RECIPE, make_data, xxh64  # noqa: E402


cases = Cases()
tmp = cases.tmp
data = make_data(tmp, "shake", 20000)


def recipe(name, body=None, **fmt):
    p = os.path.join(tmp, name + ".yaml")
    args = dict(data=data, out=os.path.join(tmp, "out_" + name))
    args.update(fmt)
    open(p, "w").write((body or RECIPE).format(**args))
    return p


def both_fail(rec, must, extra=(), mem_mb=3072):
    """lathe check and lathe train on the same recipe: exit 1, the same error, naming `must`."""
    pc = run_lathe(["check", rec, *extra], rc=1, must=["lathe check: error:"] + must, timeout=60, mem_mb=mem_mb)
    pt = run_lathe(["train", rec, "--quiet", *extra], rc=1, must=["lathe train: error:"] + must, timeout=60,
                   mem_mb=mem_mb)
    if error_text(pc) != error_text(pt):
        raise Failure(f"check and train differ:\n  check: {error_text(pc)}\n  train: {error_text(pt)}")


# ---- a good recipe: check passes without side effects, then train starts ----
with cases.case("a good recipe: check passes, leaves nothing behind, train runs"):
    rec = recipe("good")
    out = os.path.join(tmp, "out_good")
    p = run_lathe(["check", rec], rc=0, stream="stdout",
                  must=["ok   data.train", "ok   output.dir", "ok   model gpt2", "can start"], timeout=60)
    if os.path.exists(out):
        raise Failure(f"check left {out} behind")
    run_lathe(["train", rec, "--quiet"], rc=0, timeout=120)

# ---- datasets ----
with cases.case("data.train missing"):
    both_fail(recipe("nodata", data=os.path.join(tmp, "nothere")), ["nothere"])

with cases.case("data.train with a float dtype code"):
    prefix = os.path.join(tmp, "floaty")
    megatron_writer.write(prefix, [list(range(200))] * 4)
    blob = bytearray(open(prefix + ".idx", "rb").read())
    blob[17] = 6  # dtype code: float64
    open(prefix + ".idx", "wb").write(blob)
    both_fail(recipe("floaty", data=prefix), ["floaty.idx"])

with cases.case("data.train with token ids beyond model.vocab_size"):
    prefix = os.path.join(tmp, "big_ids")
    megatron_writer.write(prefix, [list(range(300)) * 3] * 4)
    both_fail(recipe("big_ids", data=prefix), ["big_ids", "299", "vocab_size"])

with cases.case("data.train too small for one micro-batch"):
    prefix = os.path.join(tmp, "tiny")
    megatron_writer.write(prefix, [list(range(20))])
    both_fail(recipe("tiny", data=prefix), ["data.train", "micro_batch_size"], extra=["--set", "data.valid_fraction=0"])

# ---- model dimensions and memory ----
with cases.case("model dimensions beyond the machine's memory"):
    both_fail(recipe("huge"), ["huge.yaml", "n_layer = 96", "needs"], extra=["--set", "model.n_embd=16384", "--set", "model.n_layer=96",
                                                 "--set", "model.n_head=128"], mem_mb=2048)

# ---- init_from weights that do not fit the model ----
with cases.case("init_from whose weights have other shapes than its config.json"):
    hf = os.path.join(tmp, "hf_model")
    run_lathe(["train", recipe("for_hf"), "--quiet", "--set", "training.steps=1"], rc=0, timeout=120)
    shutil.copytree(os.path.join(tmp, "out_for_hf", "model"), hf)
    cfg = json.load(open(os.path.join(hf, "config.json")))
    cfg["n_inner"] = 4 * cfg["n_embd"] + 8  # the MLP weights in the file are 4 x n_embd wide
    json.dump(cfg, open(os.path.join(hf, "config.json"), "w"))
    body = RECIPE.replace("{{preset: gpt2-debug, vocab_size: 256}}", "{{init_from: {hf}}}")
    both_fail(recipe("init_bad", body, hf=hf), ["hf_model", "c_fc"])

# ---- output directory ----
with cases.case("output.dir under a regular file"):
    blocker = os.path.join(tmp, "a_file")
    open(blocker, "w").write("x")
    both_fail(recipe("out_file", out=os.path.join(blocker, "run")), ["output.dir", "a_file"])

with cases.case("output.dir is a regular file"):
    both_fail(recipe("out_is_file", out=os.path.join(tmp, "a_file")), ["output.dir", "a_file"])

with cases.case("output.dir/checkpoints is a symlink loop (resume auto)"):
    out = os.path.join(tmp, "out_loop")
    os.makedirs(out)
    os.symlink("checkpoints", os.path.join(out, "checkpoints"))
    both_fail(recipe("loop", out=out), ["checkpoints", "symbolic links"], extra=["--resume", "auto"])

# ---- the resume checkpoint ----
run_dir = os.path.join(tmp, "out_base")
base = recipe("base")
run_lathe(["train", base, "--quiet", "--stop-after", "2"], rc=0, timeout=120)
ckpt0 = os.path.join(run_dir, "checkpoints", "step_00000002")
# The forged checkpoints below are resumed into a fresh output.dir: out_base holds a run, which a
# resume from elsewhere may not reuse (issue 23 D1).
into = recipe("resume_into")


def forged_checkpoint(name, edit, prepare=None):
    """A copy of the base checkpoint; prepare(dir) may change its files, edit(body) its state; the
    state.json is then resealed (checksum recomputed, as kill_test_lib's independent XXH64 does)."""
    d = os.path.join(tmp, "ck_" + name)
    shutil.copytree(ckpt0, d)
    if prepare:
        prepare(d)
    text = open(os.path.join(d, "state.json")).read()
    body = json.loads(text[len('{"body":'):text.rindex(',"body_xxh64":')])
    edit(body)
    bt = json.dumps(body, separators=(",", ":"), sort_keys=True, ensure_ascii=False)
    open(os.path.join(d, "state.json"), "w").write('{"body":' + bt + ',"body_xxh64":"' +
                                                   format(xxh64(bt.encode()), "016x") + '"}\n')
    return d


with cases.case("resume checkpoint with another optimizer (--resume)"):
    d = forged_checkpoint("lamb", lambda b: b.__setitem__("optimizer", "lamb"))
    both_fail(into, ["state.json", "'optimizer'"], extra=["--resume", d])

with cases.case("resume checkpoint with inconsistent consumed_samples (training.resume)"):
    d = forged_checkpoint("consumed", lambda b: b.__setitem__("consumed_samples", 3))
    both_fail(into, ["state.json", "consumed_samples"], extra=["--set", f"training.resume={d}"])

with cases.case("resume checkpoint with a corrupt model file"):
    d = os.path.join(tmp, "ck_flip")
    shutil.copytree(ckpt0, d)
    with open(os.path.join(d, "model.safetensors"), "r+b") as f:
        f.seek(5000)
        c = f.read(1)
        f.seek(5000)
        f.write(bytes([c[0] ^ 1]))
    both_fail(into, ["model.safetensors", "checksum"], extra=["--resume", d])

def nan_moment(d):
    path = os.path.join(d, "optimizer.safetensors")
    blob = bytearray(open(path, "rb").read())
    n = struct.unpack("<Q", blob[:8])[0]
    off = json.loads(blob[8:8 + n])["exp_avg/transformer.wpe.weight"]["data_offsets"][0]
    blob[8 + n + off:8 + n + off + 4] = struct.pack("<f", float("nan"))
    open(path, "wb").write(blob)
    open(os.path.join(d, "digest"), "w").write(format(xxh64(bytes(blob)), "016x"))


with cases.case("resume checkpoint with a NaN moment (data, resealed)"):
    d = forged_checkpoint("nan", lambda b: b["files"]["optimizer.safetensors"].__setitem__(
        "xxh64", open(os.path.join(tmp, "ck_nan", "digest")).read()), prepare=nan_moment)
    both_fail(into, ["optimizer.safetensors", "exp_avg/transformer.wpe.weight", "nan"], extra=["--resume", d])

with cases.case("resume checkpoint with more skipped steps than steps (resealed)"):
    d = forged_checkpoint("skipped", lambda b: b.__setitem__("skipped_steps", 3))
    both_fail(into, ["state.json", "'skipped_steps' is 3"], extra=["--resume", d])

with cases.case("resume checkpoint with a non-boolean loss_scale_dynamic (resealed)"):
    d = forged_checkpoint("dynamic", lambda b: b.__setitem__("loss_scale_dynamic", "yes"))
    both_fail(into, ["state.json", "'loss_scale_dynamic' must be true or false"], extra=["--resume", d])

with cases.case("unknown precision.compute"):
    both_fail(base, ["precision.compute", "'fp8' is not supported", "fp32, bf16, fp16"],
              extra=["--set", "precision.compute=fp8"])

with cases.case("resume checkpoint beyond training.steps"):
    both_fail(base, ["state.json", "'step'", "training.steps"], extra=["--resume", ckpt0, "--set",
                                                                      "training.steps=1"])

# ---- CLI usage errors exit 2 (never 104, never 1) ----
for name, args, must in [
    ("train --stop-after 12abc", ["train", base, "--stop-after", "12abc"], "12abc"),
    ("train --checkpoint-every x", ["train", base, "--checkpoint-every", "x"], "--checkpoint-every"),
    ("train without a recipe", ["train"], "recipe"),
    ("check --resume without a value", ["check", base, "--resume"], "--resume"),
    ("check with two recipes", ["check", base, base], base),
    ("export --max-shard-size without a value", ["export", run_dir, "--to"], "--to"),
    ("export --bogus", ["export", run_dir, "--bogus"], "--bogus"),
    ("generate --max-new-tokens 12abc", ["generate", "--model", run_dir, "--prompt", "x", "--max-new-tokens", "12abc"],
     "12abc"),
    ("generate --temperature abc", ["generate", "--model", run_dir, "--prompt", "x", "--temperature", "abc"], "abc"),
    ("generate without --prompt", ["generate", "--model", run_dir], "--prompt"),
]:
    with cases.case(f"usage error exits 2: {name}"):
        run_lathe(args, rc=2, must=["usage error", must], timeout=30)

cases.finish()
