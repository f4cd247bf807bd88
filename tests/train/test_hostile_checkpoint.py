#!/usr/bin/env python3
"""Hostile checkpoints (issue 14): `lathe train --resume` on a damaged or forged checkpoint must
exit 1 with an error naming state.json (or the file) and the field, in bounded time and memory.

"Resealed" cases edit state.json's body and recompute body_xxh64 (independent Python XXH64 of the
compact, key-sorted body text, as lathe writes it), so they pass the checksum and test the
field-by-field validation behind it. One tiny checkpoint (gpt2-debug, 2 steps) is trained once and
copied for every case.
"""
import json
import os
import shutil
import struct
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hostile_ckpt import canonical, reseal_text, train_base  # noqa: E402 (puts tests/ on the path)
from hostile import Cases, run_lathe  # noqa: E402
from kill_test_lib import xxh64  # noqa: E402


cases = Cases()
tmp = cases.tmp
recipe, base_run, BASE = train_base(tmp)
assert os.path.isdir(BASE), os.listdir(os.path.join(base_run, "checkpoints"))
n_case = [0]


def fresh():
    """A copy of the run directory; returns (run_dir, checkpoint_dir)."""
    n_case[0] += 1
    run_dir = os.path.join(tmp, f"run{n_case[0]}")
    shutil.copytree(base_run, run_dir, symlinks=True)
    return run_dir, os.path.join(run_dir, "checkpoints", "step_00000002")


def split_state(ckpt):
    text = open(os.path.join(ckpt, "state.json"), encoding="utf-8").read()
    head, tail = '{"body":', ',"body_xxh64":'
    assert text.startswith(head), text[:40]
    return text[len(head):text.rindex(tail)]


def reseal(ckpt, edit):
    """edit(body) changes the parsed body in place; the result is written with a valid checksum."""
    body_text = split_state(ckpt)
    body = json.loads(body_text)
    assert canonical(body) == body_text, "Python's compact dump no longer matches lathe's: fix canonical()"
    edit(body)
    reseal_text(ckpt, canonical(body))


def resume(run_dir, ckpt, must, rc=1, extra=()):
    return run_lathe(["train", recipe, "--quiet", "--resume", ckpt, "--set", f"output.dir={run_dir}", *extra], rc=rc,
                     must=must, timeout=60, mem_mb=2048)


# The baseline: an untouched copy resumes (so every failure below is caused by its edit).
with cases.case("an intact checkpoint resumes"):
    run_dir, ckpt = fresh()
    resume(run_dir, ckpt, [], rc=0)

with cases.case("a resealed but unchanged state.json resumes (the test's checksum is lathe's)"):
    run_dir, ckpt = fresh()
    reseal(ckpt, lambda b: None)
    resume(run_dir, ckpt, [], rc=0)

# ---- 1. deep nesting: refused by the depth check before anything recurses on it ----
with cases.case("state.json nested 60,000 levels (unsealed)"):
    run_dir, ckpt = fresh()
    body = split_state(ckpt)
    deep = "[" * 60000 + "]" * 60000
    open(os.path.join(ckpt, "state.json"), "w").write('{"body":' + body[:-1] + ',"x":' + deep + '},"body_xxh64":"0"}')
    resume(run_dir, ckpt, ["state.json", "nests deeper"])

with cases.case("state.json nested 60,000 levels (resealed)"):
    run_dir, ckpt = fresh()
    body = split_state(ckpt)
    reseal_text(ckpt, body[:-1] + ',"x":' + "[" * 60000 + "]" * 60000 + "}")
    resume(run_dir, ckpt, ["state.json", "nests deeper"])

with cases.case("resume auto refuses its only checkpoint with a deep state.json, says why, starts nothing"):
    run_dir, ckpt = fresh()
    reseal_text(ckpt, split_state(ckpt)[:-1] + ',"x":' + "[" * 60000 + "]" * 60000 + "}")
    run_lathe(["train", recipe, "--quiet", "--resume", "auto", "--set", f"output.dir={run_dir}",
               "--set", "training.steps=2"], rc=1, must=["nests deeper", "none of the 1 checkpoint can be resumed"],
              must_not=["starting fresh"], timeout=60, mem_mb=2048)


# ---- 2. malformed tensors[*] entries: the field is named, no nlohmann type error ----
def tensor0(f):
    return lambda b: f(b["tensors"]["model.safetensors"][0])


for name, edit, must in [
    ("slice not an array", tensor0(lambda t: t.__setitem__("slice", 5)), ["tensors", "slice"]),
    ("slice entry not a pair", tensor0(lambda t: t.__setitem__("slice", [[0]] * len(t["global_shape"]))),
     ["tensors", "slice"]),
    ("slice bound a string", tensor0(lambda t: t.__setitem__("slice", [["0", "x"]] * len(t["global_shape"]))),
     ["tensors", "slice"]),
    ("name a number", tensor0(lambda t: t.__setitem__("name", 17)), ["tensors", "name"]),
    ("name missing", tensor0(lambda t: t.pop("name")), ["tensors", "name"]),
    ("global_shape missing", tensor0(lambda t: t.pop("global_shape")), ["tensors", "global_shape"]),
    ("global_shape negative", tensor0(lambda t: t.__setitem__("global_shape", [-1, 4])), ["tensors", "global_shape"]),
    ("unknown dtype", tensor0(lambda t: t.__setitem__("dtype", "Q7")), ["tensors", "dtype", "Q7"]),
    ("entry not an object", lambda b: b["tensors"]["model.safetensors"].__setitem__(0, "x"), ["tensors"]),
    ("tensors of a file not an array", lambda b: b["tensors"].__setitem__("model.safetensors", {}), ["tensors"]),
    ("a parameter missing from the table", lambda b: b["tensors"]["model.safetensors"].pop(),
     ["tensors", "model.safetensors"]),
    ("a tensor listed twice", lambda b: b["tensors"]["model.safetensors"].append(b["tensors"]["model.safetensors"][0]),
     ["tensors", "twice"]),
]:
    with cases.case(f"resealed tensors[*]: {name}"):
        run_dir, ckpt = fresh()
        reseal(ckpt, edit)
        resume(run_dir, ckpt, ["state.json"] + must, )

# ---- 3. field by field, against the recipe and the model ----
for name, edit, must in [
    ("optimizer name lamb", lambda b: b.__setitem__("optimizer", "lamb"), ["optimizer", "lamb"]),
    ("optimizer name empty", lambda b: b.__setitem__("optimizer", ""), ["optimizer"]),
    ("world size 0", lambda b: b["world"].__setitem__("world_size", 0), ["world", "world_size"]),
    ("a per-rank shard missing", lambda b: (b["world"].__setitem__("world_size", 2),
                                            b["files"].__setitem__("optimizer-rank00000-of-00002.safetensors",
                                                                   b["files"].pop("optimizer.safetensors")),
                                            b["tensors"].__setitem__("optimizer-rank00000-of-00002.safetensors",
                                                                     b["tensors"].pop("optimizer.safetensors"))),
     ["files", "1 of the 2", "optimizer-rank00001-of-00002.safetensors is missing"]),
    ("a shard of another world size", lambda b: b["files"].__setitem__("optimizer-rank00000-of-00003.safetensors",
                                                                       b["files"]["recipe.yaml"]),
     ["files", "rank 0 of 3", "world_size is 1"]),
    ("a shard file past the last rank", lambda b: b["files"].__setitem__("optimizer-rank00004-of-00002.safetensors",
                                                                         b["files"]["recipe.yaml"]),
     ["files", "not part of a lathe checkpoint"]),
    ("a flat piece beyond its tensor", tensor0(lambda t: t.__setitem__("flat", [0, 10**9])), ["flat"]),
    ("a flat piece in the model file", tensor0(lambda t: (t.pop("slice"), t.__setitem__("flat", [0, 1]))),
     ["flat piece", "only optimizer files"]),
    ("rank 1", lambda b: b["world"].__setitem__("rank", 1), ["world", "rank"]),
    ("empty rng", lambda b: b.__setitem__("rng", []), ["rng"]),
    ("rng of another seed", lambda b: b.__setitem__("rng", [8]), ["rng", "training.seed"]),
    ("rng a string", lambda b: b.__setitem__("rng", "abc"), ["rng"]),
    ("negative lr", lambda b: b.__setitem__("lr", -0.5), ["lr"]),
    ("lr a string", lambda b: b.__setitem__("lr", "x"), ["lr"]),
    ("loss_scale 0", lambda b: b.__setitem__("loss_scale", 0.0), ["loss_scale"]),
    ("step negative", lambda b: b.__setitem__("step", -3), ["step"]),
    ("step a float", lambda b: b.__setitem__("step", 2.5), ["step"]),
    ("step huge", lambda b: b.__setitem__("step", 2**62), ["step"]),
    ("consumed_samples inconsistent", lambda b: b.__setitem__("consumed_samples", 5), ["consumed_samples"]),
    ("consumed_samples huge", lambda b: b.__setitem__("consumed_samples", 2**63 - 1), ["consumed_samples"]),
    ("loader position inconsistent", lambda b: b["loader"].__setitem__("position", 0), ["loader"]),
    ("loader epoch negative", lambda b: b["loader"].__setitem__("epoch", -1), ["loader", "epoch"]),
    ("loader missing", lambda b: b.pop("loader"), ["loader"]),
    ("threads negative", lambda b: b.__setitem__("threads", -4), ["threads"]),
    ("recipe not an object", lambda b: b.__setitem__("recipe", 3), ["recipe"]),
    ("files entry outside the directory", lambda b: b["files"].__setitem__("../../state.json",
                                                                          b["files"]["recipe.yaml"]), ["files"]),
    ("files entry absolute", lambda b: b["files"].__setitem__("/etc/hostname", b["files"]["recipe.yaml"]), ["files"]),
    ("files bytes a string", lambda b: b["files"]["model.safetensors"].__setitem__("bytes", "12"), ["files", "bytes"]),
    ("format_version a string", lambda b: b.__setitem__("format_version", "1"), ["format_version"]),
]:
    with cases.case(f"resealed field: {name}"):
        run_dir, ckpt = fresh()
        reseal(ckpt, edit)
        resume(run_dir, ckpt, ["state.json"] + must)


def forge_tensor(ckpt, file, tensor, values):
    """Overwrites the first values of a tensor and records the new size/xxh64 in a resealed state.json."""
    path = os.path.join(ckpt, file)
    blob = bytearray(open(path, "rb").read())
    n = struct.unpack("<Q", blob[:8])[0]
    header = json.loads(blob[8:8 + n])
    a = header[tensor]["data_offsets"][0]
    blob[8 + n + a:8 + n + a + 4 * len(values)] = struct.pack(f"<{len(values)}f", *values)
    open(path, "wb").write(blob)
    digest = format(xxh64(bytes(blob)), "016x")
    reseal(ckpt, lambda b: b["files"][file].update({"xxh64": digest, "bytes": len(blob)}))


for name, file, tensor, values, must in [
    ("NaN first moment", "optimizer.safetensors", "exp_avg/transformer.wte.weight", [float("nan")], ["exp_avg"]),
    ("inf second moment", "optimizer.safetensors", "exp_avg_sq/transformer.h.0.ln_1.weight", [float("inf")],
     ["exp_avg_sq"]),
    ("negative second moment", "optimizer.safetensors", "exp_avg_sq/transformer.wpe.weight", [-1.0], ["exp_avg_sq"]),
    ("NaN weight", "model.safetensors", "transformer.h.1.mlp.c_fc.bias", [0.0, float("nan")], ["c_fc.bias"]),
]:
    with cases.case(f"forged data: {name}"):
        run_dir, ckpt = fresh()
        forge_tensor(ckpt, file, tensor, values)
        resume(run_dir, ckpt, [file] + must)

# ---- 4. the `latest` pointer ----
for name, text in [("garbage", "\x00\xffgarbage\n"), ("parent path", "../..\n"), ("absolute path", "/etc\n"),
                   ("a missing step", "step_00000099\n")]:
    with cases.case(f"latest holding {name}: ignored with a note, the newest complete checkpoint is used"):
        run_dir, ckpt = fresh()
        open(os.path.join(run_dir, "checkpoints", "latest"), "w").write(text)
        run_lathe(["train", recipe, "--quiet", "--resume", "auto", "--set", f"output.dir={run_dir}"], rc=0,
                  must=["latest", "ignored", "resuming from " + ckpt], stream="stdout", timeout=60)

# ---- 5. filesystem trouble: named, never an uncaught std::filesystem exception ----
with cases.case("symlink loop at state.json"):
    run_dir, ckpt = fresh()
    os.remove(os.path.join(ckpt, "state.json"))
    os.symlink("state.json", os.path.join(ckpt, "state.json"))
    resume(run_dir, ckpt, ["state.json", "symbolic link"])

with cases.case("symlink loop at model.safetensors"):
    run_dir, ckpt = fresh()
    os.remove(os.path.join(ckpt, "model.safetensors"))
    os.symlink("model.safetensors", os.path.join(ckpt, "model.safetensors"))
    resume(run_dir, ckpt, ["model.safetensors", "symbolic link"])

with cases.case("a FIFO in place of optimizer.safetensors"):
    run_dir, ckpt = fresh()
    os.remove(os.path.join(ckpt, "optimizer.safetensors"))
    os.mkfifo(os.path.join(ckpt, "optimizer.safetensors"))
    resume(run_dir, ckpt, ["optimizer.safetensors", "FIFO"], extra=())

with cases.case("a directory in place of state.json"):
    run_dir, ckpt = fresh()
    os.remove(os.path.join(ckpt, "state.json"))
    os.mkdir(os.path.join(ckpt, "state.json"))
    resume(run_dir, ckpt, ["state.json", "directory"])

with cases.case("--resume at a regular file"):
    run_dir, ckpt = fresh()
    resume(run_dir, os.path.join(ckpt, "recipe.yaml"), ["recipe.yaml", "not a directory"])

with cases.case("resume auto with checkpoints/ a symlink loop"):
    run_dir, ckpt = fresh()
    shutil.rmtree(os.path.join(run_dir, "checkpoints"))
    os.symlink("checkpoints", os.path.join(run_dir, "checkpoints"))
    run_lathe(["train", recipe, "--quiet", "--resume", "auto", "--set", f"output.dir={run_dir}"], rc=1,
              must=["checkpoints", "symbolic link"], timeout=60)

cases.finish()
