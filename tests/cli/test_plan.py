"""lathe plan RECIPE --world N (issue 10): with tensor = pipeline = 1 its memory per rank is the
figure `lathe check --world N` prints (ZeRO and recompute included); layouts the model cannot take
are listed with the reason; the table is sorted by predicted tokens/s with the layouts that fit
first; measured defaults are labelled as such; bad command lines are refused."""
import json
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "train"))
import megatron_writer  # noqa: E402

LATHE = os.environ.get("LATHE_BIN") or os.path.join(
    os.environ.get("LATHE_BINARY_DIR", os.path.join(HERE, "..", "..", "build")), "lathe")
failures = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what, flush=True)
    if not ok:
        failures.append(what)


def run(*args):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([LATHE] + [str(a) for a in args], capture_output=True, text=True, timeout=300, env=env)


def format_bytes(b):  # models/memory.cpp format_bytes
    for unit, f in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if b >= f:
            return f"{b / f:.1f} {unit}"
    return f"{b / 1e3:.1f} KB"


def main():
    import numpy as np
    tmp = tempfile.mkdtemp(prefix="lathe_plan_")
    data = os.path.join(tmp, "data")
    megatron_writer.write(data, [np.arange(400) % 96 for _ in range(20)])
    recipe = os.path.join(tmp, "r.yaml")
    json.dump({"model": {"preset": "gpt2-debug"}, "data": {"train": data, "valid_fraction": 0.1},
               "training": {"micro_batch_size": 4, "seq_len": 32, "grad_accum_steps": 2, "steps": 2},
               "output": {"dir": os.path.join(tmp, "out")}}, open(recipe, "w"))
    fixed = ["--peak-gflops", 50, "--link-gbps", 80, "--memory-gb", 1]

    # 1. tensor = pipeline = 1: the memory `lathe check --world N` prints, for ZeRO 0/1 and recompute modes.
    for world, sets in ((2, []), (2, ["--set", "parallel.zero=1"]), (4, ["--set", "parallel.zero=1", "--set",
                                                                        "recompute=full"]),
                        (1, ["--set", "recompute=selective", "--set", "precision.compute=bf16"])):
        c = run("check", recipe, "--world", world, *sets)
        m = re.search(r"memory: .* = ([0-9.]+ [KMGT]B) fits", c.stdout)
        p = run("plan", recipe, "--world", world, "--json", *fixed, *sets)
        if c.returncode or p.returncode or not m:
            check(False, f"check and plan run ({c.stderr.strip()} {p.stderr.strip()})")
            continue
        j = json.loads(p.stdout)
        zero = 1 if "parallel.zero=1" in sets else 0
        rc = next((s.split("=")[1] for s in sets if s.startswith("recompute=")), "none")
        row = [l for l in j["layouts"] if l["data"] == world and l["tensor"] == 1 and l["pipeline"] == 1
               and l["zero"] == zero and l["recompute"] == rc]
        # lathe check does not count the staging of the gradient buckets' reduction (dist/comm.h),
        # which the plan adds with data > 1: the whole (small) gradient buffer here.
        mem = row[0]["memory"] if row else {"total": -1, "comm": 0, "grads": 0}
        total = mem["total"] - mem["comm"]
        check(format_bytes(total) == m.group(1),
              f"world {world} {' '.join(sets)}: plan's data x 1 x 1 memory {format_bytes(total)} without its "
              f"reduction staging = lathe check's {m.group(1)}")
        check(mem["comm"] == (mem["grads"] if world > 1 else 0),
              f"world {world}: reduction staging {mem['comm']} B = the gradients' {mem['grads']} B with data > 1")

    # 2. Enumeration and rejection on 8 ranks: gpt2-debug has 4 heads and 2 layers.
    p = run("plan", recipe, "--world", 8, "--json", *fixed)
    j = json.loads(p.stdout)
    lay = j["layouts"]
    quads = {(l["data"], l["tensor"], l["pipeline"], l["context"]) for l in lay}
    want = {(8 // (t * pp * c), t, pp, c) for t in (1, 2, 4, 8) for pp in (1, 2, 4, 8) for c in (1, 2, 4, 8)
            if 8 % (t * pp * c) == 0}
    check(quads == want, f"every data x tensor x pipeline x context quadruple of 8 is listed ({len(want)})")
    rej = {(l["tensor"], l["pipeline"]): l.get("reject", "") for l in lay if not l["valid"]}
    check(rej.get((8, 1)) == "tensor 8 does not divide num_attention_heads 4", "tensor 8 rejected: heads")
    check(rej.get((1, 4)) == "pipeline 4 does not divide num_hidden_layers 2", "pipeline 4 rejected: layers")
    # global batch 4 x 2 x 8 = 64 samples; data 2 with micro_batch 4 -> 8 micro-batches >= pipeline 2: valid.
    valid = [l for l in lay if l["valid"]]
    check(all(l["micro_batches"] * 4 * l["data"] == 64 for l in valid), "micro-batches = global batch / (B x data)")
    check(any(l["pipeline"] == 2 and l["tensor"] == 2 and l["sequence"] for l in valid), "t2 x p2 + sp is valid")
    check(not any(l["sequence"] and l["tensor"] == 1 for l in lay), "sequence parallel only with tensor > 1")
    check(not any(l["zero"] > 0 and l["data"] * l["context"] == 1 for l in lay), "ZeRO only with data x context > 1")
    fits = [l for l in valid if l["fits"]]
    tps = [l["tokens_per_s"] for l in fits]
    check(len(fits) == len(valid) and tps == sorted(tps, reverse=True), "sorted by predicted tokens/s")
    check(lay.index(valid[-1]) < min(lay.index(l) for l in lay if not l["valid"]), "valid layouts first")

    # 3. The table: header with the assumed figures, rows, the rejected layouts with reasons.
    p = run("plan", recipe, "--world", 8, *fixed, "--top", 5)
    out = p.stdout
    check(p.returncode == 0 and "peak 50.0 GFLOP/s (given)" in out and "80.0 Gb/s" in out, "header states the figures")
    rows = [l for l in out.splitlines() if re.match(r"\s+\d+\s+\d+\s+\d+\s+\d+\s", l)]
    check(len(rows) == 5, f"--top 5 prints 5 rows ({len(rows)})")
    check("more valid layouts" in out and "rejected (data x tensor x pipeline)" in out, "more and rejected listed")
    check(re.search(r"1x8x1\b.*: tensor 8 does not divide num_attention_heads 4", out) is not None,
          "rejected line names layout and reason")

    # 4. A memory budget nothing fits into.
    p = run("plan", recipe, "--world", 2, "--json", "--peak-gflops", 50, "--link-gbps", 80, "--memory-gb", 1e-5)
    check(all(not l["fits"] for l in json.loads(p.stdout)["layouts"] if l["valid"]), "a tiny budget fits nothing")

    # 5. Measured defaults are labelled.
    p = run("plan", recipe, "--world", 2, "--top", 1)
    check(p.returncode == 0 and "measured here" in p.stdout and "GEMM probe" in p.stdout and "memcpy" in p.stdout,
          "defaults measured here and said so")

    # 6. Bad command lines.
    p = run("plan", recipe)
    check(p.returncode == 2 and "--world" in p.stderr, "--world is required (usage error)")
    p = run("plan", recipe, "--world", 0)
    check(p.returncode == 2, "--world 0 is a usage error")
    p = run("plan", os.path.join(tmp, "missing.yaml"), "--world", 2)
    check(p.returncode == 1 and "missing.yaml" in p.stderr, "a missing recipe is named")
    p = run("plan", recipe, "--world", 2, "--set", "model.num_attention_heads=5")
    check(p.returncode == 1 and "n_head = 5" in p.stderr, "an invalid model is refused naming the field")

    if failures:
        print(f"{len(failures)} failed")
        sys.exit(1)
    print("all passed")


if __name__ == "__main__":
    main()
