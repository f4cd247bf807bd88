#!/usr/bin/env python3
"""Hostile inputs to `lathe checkpoint reshard` / `lathe checkpoint info` (train/reshard.h): degrees the
model cannot take, missing and overlapping pieces, a damaged file, an existing destination. Each
must exit 1 (2 for a usage error) with an error naming the option and value, or the tensor and the
element range, and write nothing. One tiny checkpoint (gpt2-debug, 2 steps) is trained once; the
piece cases start from its reshard to 2 data-parallel writers (flat pieces cut by FlatShards) and
reseal state.json (independent Python XXH64) so that only the piece tables are wrong.
"""
import json
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hostile_ckpt import canonical, reseal_text, train_base  # noqa: E402 (puts tests/ on the path)
from hostile import Cases, run_lathe  # noqa: E402
from kill_test_lib import xxh64  # noqa: E402

cases = Cases()
tmp = cases.tmp
recipe, base_run, BASE = train_base(tmp)
DP2 = os.path.join(tmp, "dp2")
run_lathe(["checkpoint", "reshard", BASE, "--to", DP2, "--data", "2"], rc=0, stream="stdout",
          must=["data 2"], timeout=120)
DP2_CK = os.path.join(DP2, "checkpoints", "step_00000002")
SHARD = ["optimizer-rank0000%d-of-00002.safetensors" % r for r in range(2)]
n_case = [0]


def fresh():
    n_case[0] += 1
    d = os.path.join(tmp, f"case{n_case[0]}")
    shutil.copytree(DP2_CK, d)
    return d


def reseal(ckpt, edit):
    body = json.loads(open(os.path.join(ckpt, "state.json"), encoding="utf-8").read())["body"]
    edit(body)
    reseal_text(ckpt, canonical(body))


def out_dir():
    return os.path.join(tmp, f"out{n_case[0]}")


def reshard_fails(src, must, extra=("--data", "1"), rc=1):
    out = out_dir()
    run_lathe(["checkpoint", "reshard", src, "--to", out, *extra], rc=rc, must=must, timeout=60)
    assert not os.path.exists(os.path.join(out, "checkpoints", "step_00000002")), "a checkpoint was written"


# ---- degrees the model cannot take: named with the value ----
for name, extra, must in [
    ("tensor not dividing the heads", ("--tensor", "3"), ["--tensor 3", "num_attention_heads = 4"]),
    ("pipeline deeper than the layers", ("--pipeline", "3"), ["--pipeline 3", "layers"]),
    ("data 0", ("--data", "0"), ["--data 0", "must be in"]),
    ("zero 4", ("--zero", "4"), ["--zero 4", "must be in"]),
    ("zero 3 with context parallelism", ("--zero", "3", "--context", "2"), ["--zero 3 with --context 2"]),
    ("tensor negative", ("--tensor", "-2"), ["--tensor -2"]),
    ("too many ranks", ("--tensor", "4", "--data", "1048576"), ["ranks"]),
]:
    with cases.case(f"reshard: {name}"):
        fresh()
        reshard_fails(BASE, must, extra)

with cases.case("reshard: usage error (no --to)"):
    run_lathe(["checkpoint", "reshard", BASE], rc=2, must=["--to"])
with cases.case("checkpoint: unknown subcommand"):
    run_lathe(["checkpoint", "merge", BASE], rc=2, must=["merge", "reshard or info"])
with cases.case("reshard: not a checkpoint directory"):
    reshard_fails(tmp, ["state.json", "missing"])
with cases.case("reshard: the destination checkpoint exists"):
    run_lathe(["checkpoint", "reshard", BASE, "--to", DP2, "--data", "2"], rc=1, must=["already exists"])

# ---- pieces: a missing piece and overlapping pieces, named with the tensor and elements ----
with cases.case("reshard: a shard file's pieces copied over another's (overlap)"):
    ck = fresh()
    shutil.copyfile(os.path.join(ck, SHARD[0]), os.path.join(ck, SHARD[1]))
    reseal(ck, lambda b: (b["files"].__setitem__(SHARD[1], b["files"][SHARD[0]]),
                          b["tensors"].__setitem__(SHARD[1], b["tensors"][SHARD[0]])))
    reshard_fails(ck, ["state.json", "held by two pieces", SHARD[0], SHARD[1], "overlap"])
    run_lathe(["checkpoint", "info", ck], rc=1, must=["overlap"])

with cases.case("reshard: a piece missing from the files and the table"):
    ck = fresh()
    from safetensors.numpy import load_file, save_file
    path = os.path.join(ck, SHARD[1])
    tensors = load_file(path)
    body = json.loads(open(os.path.join(ck, "state.json")).read())["body"]
    victim = body["tensors"][SHARD[1]][0]["name"]
    del tensors[victim]
    save_file({k: v for k, v in tensors.items() if not k.startswith("__lathe_pad__/")}, path,
              metadata={"format": "pt"})
    blob = open(path, "rb").read()
    reseal(ck, lambda b: (b["files"][SHARD[1]].update({"bytes": len(blob), "xxh64": format(xxh64(blob), "016x")}),
                          b["tensors"][SHARD[1]].pop(0)))
    reshard_fails(ck, ["state.json", victim, "a piece is missing"])
    run_lathe(["checkpoint", "info", ck], rc=1, must=[victim, "a piece is missing"])

with cases.case("reshard: a flipped byte in a shard (checksum)"):
    ck = fresh()
    path = os.path.join(ck, SHARD[0])
    blob = bytearray(open(path, "rb").read())
    blob[-5] ^= 0x40
    open(path, "wb").write(bytes(blob))
    reshard_fails(ck, [SHARD[0], "checksum"])

with cases.case("reshard: a piece's recorded shape disagrees with the file"):
    ck = fresh()
    def edit(b):
        t = b["tensors"][SHARD[0]][0]
        t["global_shape"] = [t["global_shape"][0] + 1] + t["global_shape"][1:]
    reseal(ck, edit)
    reshard_fails(ck, ["global shape"])

with cases.case("info --verify on a good checkpoint"):
    run_lathe(["checkpoint", "info", DP2_CK, "--verify"], rc=0, stream="stdout",
              must=["data 2", "optimizer-rank00001-of-00002.safetensors", "checksums verified"])

cases.finish()
