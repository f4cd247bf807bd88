"""Checkpoints resumed and resharded at other layouts (issue 10 item 6, train/reshard.h).

A GPT-2 debug run at TP=2 x DP=2 (4 ranks under mpirun, oversubscribed, 1 thread each) saves at
step 5 and stops; it is resumed
  * at DP=4 (4 ranks, grad_accum 1: the same global batch of 8 samples; --force-resume-changes),
  * in one process (grad_accum 4),
  * at DP=4 from `lathe checkpoint reshard --tensor 1 --data 4 --zero 1` of it,
  * at PP=2 x DP=2 from its reshard to that layout,
  * at TP=2 x DP=2 from a reshard A -> B -> A,
and each continuation must match the uninterrupted TP=2 x DP=2 run within 1e-5 relative on the
losses of steps 6-10 (layouts differ only in float summation order; measured 3e-9), bit for bit at
the saving layout (A -> B -> A). Every global
tensor reassembled from the pieces of each written checkpoint (state.json tables + safetensors,
read here in Python, independently of lathe's reader) must equal the source's bit for bit, and the
round trip A -> B -> A must give files byte-identical to A -> A; `lathe export` of three layouts
must give identical HF weights.
"""
import filecmp
import json
import os
import shutil
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from mpi_train import ENV, LATHE, MPIRUN, check, failures  # noqa: E402
import mpi_train  # noqa: E402

TMP = tempfile.mkdtemp(prefix="lathe_reshard_")
TRAINING = {"micro_batch_size": 2, "seq_len": 32, "grad_accum_steps": 2, "steps": 10, "eval_interval": 0,
            "log_interval": 1, "threads": 1, "peak_gflops": 100, "seed": 5}


def recipe(data, out, **kw):
    return mpi_train.write_recipe(data, "gpt2-debug", out, TRAINING, **kw)


def run(np_, args):
    return mpi_train.run(np_, args, 300, ENV)


def losses(out):
    rows = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl"))]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def rel_after(a, b, first=6, last=10):
    steps = range(first, last + 1)
    if not all(s in a and s in b for s in steps):
        return float("inf")
    return max(abs(a[s] - b[s]) / max(abs(b[s]), 1e-30) for s in steps)


def train(np_, data, name, extra=(), **kw):
    out = os.path.join(TMP, name)
    p, dt = run(np_, ["train", recipe(data, out, **kw), "--quiet", *extra])
    if p.returncode != 0:
        print(p.stdout[-2000:], p.stderr[-3000:])
    check(p.returncode == 0, f"{name}: {np_} process(es) train ({dt:.1f} s)")
    return out


def resume(np_, data, out, name, extra=(), **kw):
    p, dt = run(np_, ["train", recipe(data, out, **kw), "--quiet", "--resume", "auto", *extra])
    if p.returncode != 0:
        print(p.stdout[-2000:], p.stderr[-3000:])
    check(p.returncode == 0, f"{name}: resumed on {np_} process(es) ({dt:.1f} s)")
    return p.returncode == 0


def assemble(ckpt):
    """Every global tensor of a checkpoint from its pieces (state.json "tensors": boxes or flat ranges)."""
    from safetensors.numpy import load_file
    body = json.load(open(os.path.join(ckpt, "state.json")))["body"]
    out, seen = {}, {}
    for file, entries in body["tensors"].items():
        data = load_file(os.path.join(ckpt, file))
        for e in entries:
            shape = tuple(e["global_shape"])
            g = out.setdefault(e["name"], np.full(int(np.prod(shape)), np.nan, dtype=np.float32))
            cnt = seen.setdefault(e["name"], np.zeros(g.size, dtype=np.int32))
            piece = data[e["name"]]
            if "flat" in e:
                a, b = e["flat"]
                g[a:b] = piece.reshape(-1)
                cnt[a:b] += 1
            else:
                view, c = g.reshape(shape), cnt.reshape(shape)
                idx = tuple(slice(a, b) for a, b in e["slice"])
                view[idx] = piece
                c[idx] += 1
    for name, c in seen.items():
        assert (c == 1).all(), f"{ckpt}: {name} is not covered exactly once"
    return out


def same_tensors(a, b):
    ta, tb = assemble(a), assemble(b)
    return set(ta) == set(tb) and all(ta[k].tobytes() == tb[k].tobytes() for k in ta), len(ta)


def reshard(src, dst, *args):
    p, _ = run(1, ["checkpoint", "reshard", src, "--to", dst, *args])
    if p.returncode != 0:
        print(p.stdout[-1000:], p.stderr[-2000:])
    check(p.returncode == 0, f"lathe checkpoint reshard {' '.join(args)}")
    return os.path.join(dst, "checkpoints", "step_00000005")


def main():
    if not MPIRUN:
        print("FAIL mpirun not found (apt-get install openmpi-bin)")
        return 1
    data = mpi_train.make_data(TMP)
    straight = losses(train(4, data, "straight", parallel__tensor=2))
    half = train(4, data, "half", extra=("--stop-after", "5"), parallel__tensor=2, output__checkpoint_every=5)
    ck = os.path.join(half, "checkpoints", "step_00000005")
    files = sorted(os.listdir(ck))
    check("optimizer-rank00001-of-00002.safetensors" in files, f"TP=2 x DP=2 wrote 2 optimizer shards ({files})")

    # Resume at DP=4 and in one process (the same global batch of 8 samples per step).
    dp4 = os.path.join(TMP, "dp4")
    shutil.copytree(half, dp4)
    if resume(4, data, dp4, "TP2xDP2 -> DP4", extra=("--force-resume-changes",), training__grad_accum_steps=1):
        e = rel_after(losses(dp4), straight)
        check(e <= 1e-5, f"TP=2 x DP=2 -> DP=4: steps 6-10 match the uninterrupted run (max rel {e:.2e} <= 1e-5)")
    one = os.path.join(TMP, "one")
    shutil.copytree(half, one)
    if resume(1, data, one, "TP2xDP2 -> one process", extra=("--force-resume-changes",),
              training__grad_accum_steps=4):
        e = rel_after(losses(one), straight)
        check(e <= 1e-5, f"TP=2 x DP=2 -> one process: steps 6-10 match (max rel {e:.2e} <= 1e-5)")

    # Offline reshard to DP=4 x ZeRO 1: the layout's files, every global tensor unchanged, resumes.
    rs = os.path.join(TMP, "rs_dp4")
    rck = reshard(ck, rs, "--tensor", "1", "--data", "4", "--zero", "1")
    got = sorted(f for f in os.listdir(rck) if f.startswith("optimizer"))
    check(got == ["optimizer-rank%05d-of-00004.safetensors" % r for r in range(4)], f"DP=4 shard files ({got})")
    ok, n = same_tensors(ck, rck)
    check(ok and n > 0, f"TP=2 x DP=2 -> DP=4 reshard: all {n} global tensors byte-identical")
    saved = json.load(open(os.path.join(rck, "state.json")))["body"]["recipe"]["parallel"]
    check((saved["tensor"], saved["data"], saved["zero"]) == (1, 4, 1), f"the recipe records the layout ({saved})")
    if resume(4, data, rs, "resharded DP4", extra=("--force-resume-changes",), training__grad_accum_steps=1,
              parallel__zero=1):
        e = rel_after(losses(rs), straight)
        check(e <= 1e-5, f"resharded DP=4 ZeRO 1: steps 6-10 match the uninterrupted run (max rel {e:.2e})")
        # The resumed run's own checkpoint (layout B, re-saved by the trainer) has every tensor of the
        # straight run's within the same tolerance; its step-5 input was the byte-identical reshard.

    # To a pipeline layout: PP=2 x DP=2 on 4 ranks (2 micro-batches per step, one per stage).
    pp = os.path.join(TMP, "rs_pp2")
    reshard(ck, pp, "--tensor", "1", "--pipeline", "2", "--data", "2")
    if resume(4, data, pp, "resharded PP2xDP2", parallel__pipeline=2):
        e = rel_after(losses(pp), straight)
        check(e <= 1e-5, f"resharded PP=2 x DP=2: steps 6-10 match the uninterrupted run (max rel {e:.2e})")

    # Round trip A -> B -> A: byte-identical files to A -> A; resumes at A.
    a1 = reshard(ck, os.path.join(TMP, "a1"), "--tensor", "2", "--data", "2", "--zero", "0")
    b = reshard(a1, os.path.join(TMP, "b"), "--tensor", "1", "--data", "3", "--zero", "2")
    a2 = reshard(b, os.path.join(TMP, "a2"), "--tensor", "2", "--data", "2", "--zero", "0")
    names = sorted(os.listdir(a1))
    check(names == sorted(os.listdir(a2)) and all(filecmp.cmp(os.path.join(a1, f), os.path.join(a2, f), shallow=False)
                                                   for f in names),
          f"reshard A -> B -> A gives byte-identical files to A -> A ({names})")
    ok, n = same_tensors(ck, b)
    check(ok, f"the B layout (DP=3, FlatShards cut) holds the same {n} global tensors")
    ok, n = same_tensors(ck, a2)
    check(ok, f"A -> B -> A holds the trainer's {n} global tensors bit for bit")
    if resume(4, data, os.path.join(TMP, "a2"), "A -> B -> A at TP2xDP2", parallel__tensor=2):
        # The same layout as the run that saved: a resume is exact, so the continuation must equal
        # the uninterrupted run bit for bit (the moments went through two reshards unchanged).
        e = rel_after(losses(os.path.join(TMP, "a2")), straight)
        check(e == 0, f"A -> B -> A resumed at TP=2 x DP=2: steps 6-10 equal the uninterrupted run (max rel {e:.2e})")

    # lathe export merges any layout into one HF directory: the same weights from every layout.
    exported = []
    for src in (ck, rck, b):
        d = os.path.join(TMP, "hf_%d" % len(exported))
        p, _ = run(1, ["export", src, "--to", d])
        check(p.returncode == 0, f"lathe export {src}" + ("" if p.returncode == 0 else p.stderr[-500:]))
        exported.append(d)
    if all(os.path.exists(os.path.join(d, "model.safetensors")) for d in exported):
        from safetensors.numpy import load_file
        w = [load_file(os.path.join(d, "model.safetensors")) for d in exported]
        check(all(set(x) == set(w[0]) and all(x[k].tobytes() == w[0][k].tobytes() for k in x) for x in w[1:]),
              f"lathe export of TP=2 x DP=2, DP=4 and DP=3 checkpoints: identical HF weights ({len(w[0])} tensors)")

    p, _ = run(1, ["checkpoint", "info", ck, "--json"])
    info = json.loads(p.stdout) if p.returncode == 0 else {}
    want_layout = {"tensor": 2, "pipeline": 1, "data": 2, "zero": 0, "context": 1}
    check(info.get("layout") == want_layout and info.get("step") == 5,
          f"lathe checkpoint info --json names the layout and step ({info.get('layout')})")
    n_params = sum(v.size for k, v in assemble(ck).items() if "/" not in k)
    check(info.get("parameters") == n_params and info.get("pieces", 0) >= info.get("weights", 0) + info.get("moments", 0),
          f"info counts {info.get('parameters')} parameters (the tables hold {n_params}) and {info.get('pieces')} pieces")

    shutil.rmtree(TMP, ignore_errors=True)
    if failures:
        print(f"{len(failures)} check(s) failed")
        return 1
    print("all resharding checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
