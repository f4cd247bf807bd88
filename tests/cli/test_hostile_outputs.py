"""Writing commands against their own inputs and each other (hostile pass 2026-12-01: D3, D4, D5,
D6, H1, S11, S13, U1). Every writer refuses an output path that is one of its inputs, lies inside
the source directory, or is another output of the same command (io::check_output_paths); reshard
refuses absurd data degrees and summarises long file lists; report refuses a run whose
metrics.jsonl has no readable line and says on stderr when it skipped some; SIGINT stops export
and reshard at a safe point with nothing left behind. Each case failed before its fix (exit 0 with
the source destroyed, 71k files, a report of "0 logged steps", leftovers *.tmp).

The signal cases are deterministic: the child starts with SIGINT blocked and pending (exec keeps
both); the tools' StopSignalGuard unblocks it, so it arrives when the guard is installed, before
anything is written, and the tool must stop at its first safe point.
Env: LATHE_BIN, LATHE_SOURCE_DIR."""
import glob
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.environ.get("LATHE_SOURCE_DIR", os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(SRC, "tests"))
sys.path.insert(0, os.path.join(SRC, "tests", "train"))
from hostile import LATHE, Cases, run_lathe  # noqa: E402
from hostile_ckpt import train_base  # noqa: E402

cases = Cases()
_, run_dir, ckpt = train_base(cases.tmp)
model_dir = cases.path("hf")  # a Hugging Face directory source (the 2-step run has no model/ of its own)
run_lathe(["export", ckpt, "--to", model_dir, "--no-progress"], rc=0)


def md5(path):
    return hashlib.md5(open(path, "rb").read()).hexdigest()


def tree_digest(d):
    return {os.path.relpath(p, d): md5(p) for p in sorted(glob.glob(os.path.join(d, "**"), recursive=True))
            if os.path.isfile(p)}


before_ckpt, before_model = tree_digest(ckpt), tree_digest(model_dir)


def unchanged():
    assert tree_digest(ckpt) == before_ckpt, "the source checkpoint changed"
    assert tree_digest(model_dir) == before_model, "the source model directory changed"


# ---- D3: export outputs that are files of the source ------------------------------------------
for name, src, args, must in [
    ("--to-onnx the checkpoint's model.safetensors", ckpt,
     ["--to-onnx", os.path.join(ckpt, "model.safetensors")], ["--to-onnx", "inside the source directory"]),
    ("--to-onnx the checkpoint's state.json (source given as the run)", run_dir,
     ["--to-onnx", os.path.join(ckpt, "state.json")], ["--to-onnx", "state.json", "source directory"]),
    ("--to-gguf the model directory's model.safetensors", model_dir,
     ["--to-gguf", os.path.join(model_dir, "model.safetensors"), "--gguf-tokenizer", "byte"],
     ["--to-gguf", "source directory"]),
    ("--to-onnx a new file inside the source checkpoint", ckpt,
     ["--to-onnx", os.path.join(ckpt, "new.onnx")], ["inside the source directory"]),
    ("--to-onnx through a '..' path to the source's file", ckpt,
     ["--to-onnx", os.path.join(ckpt, "..", os.path.basename(ckpt), "model.safetensors")], ["source directory"]),
    ("--to the source model directory", model_dir, ["--to", model_dir], ["--to", "source directory"]),
]:
    with cases.case("D3: export " + name):
        run_lathe(["export", src, *args], rc=1, must=must)
        unchanged()

with cases.case("D3: an HF source directory: its weights and the names its loader reads are refused, new files not"):
    open(os.path.join(model_dir, "extra.safetensors"), "wb").write(b"x")
    for f in ("extra.safetensors", "model.safetensors.index.json", "lathe.json", "config.json"):
        run_lathe(["export", model_dir, "--to-gguf", os.path.join(model_dir, f), "--gguf-tokenizer", "byte"], rc=1,
                  must=["--to-gguf", f])
    run_lathe(["convert", "--from-hf", model_dir, "--to-gguf", os.path.join(model_dir, "model.safetensors"),
               "--gguf-tokenizer", "byte"], rc=1, must=["--to-gguf", "--from-hf"])
    run_lathe(["logits", "--model", model_dir, "--tokens", "1,2", "--out", os.path.join(model_dir, "config.json")],
              rc=1, must=["--out", "config.json"])
    os.remove(os.path.join(model_dir, "extra.safetensors"))
    unchanged()
    gg = os.path.join(model_dir, "model.gguf")  # a new file beside the HF files: fine
    run_lathe(["export", model_dir, "--to-gguf", gg, "--gguf-tokenizer", "byte"], rc=0)
    os.remove(gg)

with cases.case("D3: export --to-onnx through a symlink to the source's file"):
    link = cases.path("links", "m.onnx")
    os.symlink(os.path.join(ckpt, "model.safetensors"), link)
    run_lathe(["export", ckpt, "--to-onnx", link], rc=1, must=["--to-onnx", "source directory"])
    unchanged()

# ---- D5: two outputs of one export on the same path -------------------------------------------
with cases.case("D5: --to-onnx and --to-gguf on the same file"):
    same = cases.path("onx", "same.bin")
    run_lathe(["export", run_dir, "--to-onnx", same, "--to-gguf", same, "--gguf-tokenizer", "byte"], rc=1,
              must=["--to-gguf", "--to-onnx", "same path"])
    assert not os.path.exists(same)

with cases.case("D5: --to-gguf on the ONNX external-data file's name"):
    c = cases.path("onx", "c.onnx")
    run_lathe(["export", run_dir, "--to-onnx", c, "--external-data", "--to-gguf", c + ".data",
               "--gguf-tokenizer", "byte"], rc=1, must=["--to-gguf", "external-data"])
    run_lathe(["export", run_dir, "--to-onnx", c, "--external-data", "--to-gguf", c + ".0123456789abcdef.data",
               "--gguf-tokenizer", "byte"], rc=1, must=["--to-gguf", "external-data"])
    assert not os.path.exists(c)

with cases.case("D5: --to-onnx on a file --to writes"):
    out = cases.path("hfout")
    run_lathe(["export", run_dir, "--to", out, "--to-onnx", os.path.join(out, "model.safetensors")], rc=1,
              must=["--to-onnx", "model.safetensors", "same path"])

with cases.case("control: --to DIR with --to-onnx DIR/model.onnx and --to-gguf beside it are written"):
    out = cases.path("ok_out")
    run_lathe(["export", run_dir, "--to", out, "--to-onnx", os.path.join(out, "model.onnx"), "--to-gguf",
               os.path.join(out, "model.gguf"), "--gguf-tokenizer", "byte", "--no-progress"], rc=0)
    for f in ("model.safetensors", "model.onnx", "model.gguf"):
        assert os.path.isfile(os.path.join(out, f)), f

# ---- D6: external data published in an order a kill cannot mismatch ---------------------------
with cases.case("D6: external data under a content-hash name; a stale pair member and temporaries are removed"):
    d = cases.path("ext", "x")[:-2]
    x = os.path.join(d, "m.onnx")
    for leftover in (x + ".tmp", x + ".0000000000000000.data.tmp", x + ".data.tmp"):
        open(leftover, "wb").write(b"stale")
    orphan = x + ".ffffffffffffffff.data"  # a data file a killed export renamed but never paired
    open(orphan, "wb").write(b"orphan")
    keep = os.path.join(d, "m.onnx.notes")  # not of the export's naming: kept
    open(keep, "w").write("mine")
    run_lathe(["export", run_dir, "--to-onnx", x, "--external-data"], rc=0)
    names = sorted(os.listdir(d))
    data = [n for n in names if n.startswith("m.onnx.") and n.endswith(".data")]
    assert len(data) == 1 and len(data[0]) == len("m.onnx.") + 16 + len(".data"), names
    assert data[0].encode() in open(x, "rb").read(), "the graph names its data file"
    assert names == sorted(["m.onnx", data[0], "m.onnx.notes"]), names
    # The same export again: same bytes, same name; the pair stays one graph + one data file.
    run_lathe(["export", run_dir, "--to-onnx", x, "--external-data"], rc=0)
    assert sorted(os.listdir(d)) == names, os.listdir(d)
    # An inline export to the same path removes the data file the old graph named.
    run_lathe(["export", run_dir, "--to-onnx", x], rc=0)
    assert sorted(os.listdir(d)) == ["m.onnx", "m.onnx.notes"], os.listdir(d)


def run_with_pending_sigint(args):
    """lathe ARGS started with SIGINT blocked and pending (see the module docstring)."""
    def pre():
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        os.kill(os.getpid(), signal.SIGINT)
    return subprocess.run([LATHE] + args, capture_output=True, text=True, timeout=120, preexec_fn=pre,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))


with cases.case("D6: SIGINT during export --to-onnx: exit 1 naming SIGINT, no file and no temporary left"):
    d = cases.path("sig", "x")[:-2]
    p = run_with_pending_sigint(["export", run_dir, "--to-onnx", os.path.join(d, "s.onnx"), "--external-data"])
    assert p.returncode == 1 and "SIGINT" in p.stderr, (p.returncode, p.stderr)
    assert os.listdir(d) == [], os.listdir(d)

with cases.case("D6: SIGINT during checkpoint reshard: exit 1 naming SIGINT, no step directory, no *.tmp"):
    dst = cases.path("sig_reshard")
    p = run_with_pending_sigint(["checkpoint", "reshard", ckpt, "--to", dst, "--data", "2"])
    assert p.returncode == 1 and "SIGINT" in p.stderr, (p.returncode, p.stderr)
    root = os.path.join(dst, "checkpoints")
    assert not os.path.exists(root) or os.listdir(root) == [], os.listdir(root)
    unchanged()

# ---- H1 / S11: reshard degrees and destinations -----------------------------------------------
info = json.loads(run_lathe(["checkpoint", "info", ckpt, "--json"], rc=0, stream="stdout").stdout)
params = info["parameters"]

with cases.case("H1: reshard --data above the number of parameters is refused, nothing written"):
    dst = cases.path("h1")
    run_lathe(["checkpoint", "reshard", ckpt, "--to", dst, "--data", params + 1], rc=1, timeout=60,
              must=[f"--data {params + 1}", f"{params} parameters"])
    run_lathe(["checkpoint", "reshard", ckpt, "--to", dst, "--data", 1000000], rc=1, timeout=60, must=["--data"])
    assert not os.path.exists(os.path.join(dst, "checkpoints")) or not os.listdir(os.path.join(dst, "checkpoints"))

with cases.case("H1: the 'wrote' line of many files is a summary, not every name"):
    p = run_lathe(["checkpoint", "reshard", ckpt, "--to", cases.path("d8"), "--data", 8], rc=0, stream="stdout")
    line = [ln for ln in p.stdout.decode().splitlines() if ln.startswith("wrote ")][0]
    assert "10 files" in line and "..." in line and "optimizer-rank00007-of-00008" in line, line
    assert "optimizer-rank00003" not in line, line

with cases.case("S11: reshard --to '' is refused (it wrote ./checkpoints)"):
    cwd = cases.path("cwd", "x")[:-2]
    run_lathe(["checkpoint", "reshard", ckpt, "--to", ""], rc=1, must=["--to", "empty"], cwd=cwd)
    assert os.listdir(cwd) == [], os.listdir(cwd)

with cases.case("S11: reshard --to the source step directory (or inside it) is refused"):
    for to in (ckpt, os.path.join(ckpt, "sub")):
        run_lathe(["checkpoint", "reshard", ckpt, "--to", to], rc=1, must=["--to", "source checkpoint"])
    unchanged()
    assert not os.path.exists(os.path.join(ckpt, "checkpoints")) and not os.path.exists(os.path.join(ckpt, "sub"))

# ---- D4 / S13: lathe report ----------------------------------------------------------------
rp = cases.path("rp")
shutil.copytree(run_dir, rp)

with cases.case("D4: report --out RUN/metrics.jsonl is refused, the metrics kept"):
    m = os.path.join(rp, "metrics.jsonl")
    h = md5(m)
    run_lathe(["report", rp, "--out", m], rc=1, must=["--out", "metrics.jsonl"])
    run_lathe(["report", rp, "--out", os.path.join(rp, "checkpoints", "r.html")], rc=1, must=["checkpoints"])
    assert md5(m) == h

with cases.case("control: report to the default RUN/report.html"):
    run_lathe(["report", rp], rc=0, must=["report.html"], stream="stdout")

with cases.case("S13: a metrics.jsonl of random bytes: exit 1 naming the file"):
    bad = cases.path("rb")
    os.makedirs(bad, exist_ok=True)
    open(os.path.join(bad, "metrics.jsonl"), "wb").write(bytes((i * 7919 + 13) % 256 for i in range(4000)))
    run_lathe(["report", bad], rc=1, must=["metrics.jsonl", "none of its"])
    assert not os.path.exists(os.path.join(bad, "report.html"))

with cases.case("S13: skipped lines of a readable metrics.jsonl are counted on stderr"):
    part = cases.path("part")
    shutil.copytree(run_dir, part)
    m = os.path.join(part, "metrics.jsonl")
    text = open(m).read()
    open(m, "w").write("{broken\n" + text + '{"step": 9, "loss":')
    n = len([ln for ln in text.splitlines() if ln]) + 2
    run_lathe(["report", part], rc=0, must=["skipped 2 of", f"of {n} lines", "line 1"])

# ---- U1: --static-seq-len bounds --------------------------------------------------------------
with cases.case("U1: --static-seq-len 0 names a readable bound, no 300-digit number"):
    p = run_lathe(["export", run_dir, "--to-onnx", cases.path("u1.onnx"), "--static-seq-len", "0"], rc=2,
                  must=["--static-seq-len", ">= 1"])
    assert len(p.stderr) < 600 and "179769" not in p.stderr.decode(), p.stderr

with cases.case("U1: --static-seq-len above n_positions says to leave it out for dynamic shapes"):
    run_lathe(["export", run_dir, "--to-onnx", cases.path("u1b.onnx"), "--static-seq-len", "100000"], rc=1,
              must=["--static-seq-len 100000", "leave it out"], must_not=["0 = dynamic"])

cases.finish()
