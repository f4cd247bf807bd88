#!/usr/bin/env python3
"""The Python package (issue 29 items 1-2): `pip install .` into a fresh venv of Debian's python3
(--system-site-packages: Debian's numpy 1.24; --no-build-isolation --no-index: scikit-build-core
and nanobind from scripts/requirements-test.txt, nothing downloaded), then, in that venv, the
package against the lathe binary of the same tree:
  * lathe.__version__ == `lathe --version`
  * lathe.train of the quickstart recipe for 20 steps: losses (RunResult.losses, metrics.jsonl and
    the on_step records) equal `lathe train`'s bit for bit; the final validation loss too; another
    Python thread runs while training (the GIL is released)
  * Recipe.load / to_dict / to_yaml round trip; a bad override and a missing dataset raise
    lathe.Error with the message `lathe train` prints
  * Tokenizer ids equal `lathe encode --lines`'s (byte and a trained BPE); encode_batch with 1 and
    2 workers; decode
  * IndexedDataset items are read-only views of the .bin mmap (no own data, shared memory between
    two views of one item) with the shard's dtype and the file's tokens; .sizes
  * Model.from_pretrained (model directory and run directory): logits [2, T, V] equal `lathe logits`
    bit for bit; loss equals the cross-entropy of those logits; greedy generate equals `lathe generate`;
    dtype bf16 / fp16: logits and loss within the bound of 16-bit rounding of the fp32 ones, fp16
    closer than bf16
  * the `lathe` command pip put in the venv's bin/: --version and `lathe logits` equal the tree's binary's
  * train.log's line after the marker is the OpenMP note import printed, if it printed one
  * lathe.plan equals `lathe plan --json`'s layouts; lathe.check equals `lathe check`'s lines
  * a KeyboardInterrupt raised by on_step at step 5 leaves a checkpoint of step 5 and is raised;
    resume="auto" then finishes with the CLI's losses; SIGINT to the process (Ctrl-C) at step 2
    leaves a checkpoint of step 2 and raises KeyboardInterrupt; a ValueError of on_step propagates;
    a second lathe.train while one runs (from on_step) raises lathe.Error and writes nothing
Skips (77) when the build requirements are not installed (bash scripts/setup.sh --test installs
them). Not run under the sanitizers (the ASan pass of scripts/test.sh runs no py_* test: the
extension would need the ASan runtime preloaded into python).
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.environ.get("LATHE_SOURCE_DIR", os.path.abspath(os.path.join(HERE, "..", "..")))
sys.path.insert(0, os.path.join(HERE, "..", "common"))
from run_harness import LATHE, check, failures, finish  # noqa: E402

STEPS = 20
# The quickstart recipe, shortened: 20 steps, validation at 10 and 20, a log record every step.
SETS = {"training.steps": STEPS, "training.eval_interval": 10, "training.eval_batches": 2,
        "training.log_interval": 1}


def cli(args, **kw):
    p = subprocess.run([LATHE] + args, capture_output=True, text=True, timeout=600, cwd=SRC, **kw)
    return p


def cli_ok(args, what, **kw):
    p = cli(args, **kw)
    if p.returncode != 0:
        raise RuntimeError(f"{what}: lathe {' '.join(args)} exited {p.returncode}:\n{p.stdout[-2000:]}{p.stderr[-2000:]}")
    return p


def cli_error(args):
    """The message after 'lathe CMD: error: ' of a failing command."""
    p = cli(args)
    line = [ln for ln in p.stderr.splitlines() if ": error: " in ln]
    return p.returncode, (line[-1].split(": error: ", 1)[1] if line else p.stderr)


def train_losses(out):
    return [json.loads(ln)["loss"] for ln in open(os.path.join(out, "metrics.jsonl")) if '"loss"' in ln]


def val_losses(out):
    return [r["val_loss"] for r in map(json.loads, open(os.path.join(out, "metrics.jsonl"))) if "val_loss" in r]


def cli_sets(sets):
    return sum((["--set", f"{k}={v}"] for k, v in sets.items()), [])


def inner(tmp):
    """The checks, run by the venv's python with the package installed."""
    import threading

    import numpy as np

    import lathe

    check(lathe.__file__.startswith(os.path.join(tmp, "venv")), f"lathe is imported from the venv ({lathe.__file__})")
    ver = cli_ok(["--version"], "version").stdout.split()
    check(lathe.__version__ == ver[-1], f"lathe.__version__ {lathe.__version__} == the binary's {ver[-1]}")

    # --- data: the quickstart's tokenization, and one document per line for the dataset checks
    data = os.path.join(tmp, "shakespeare_byte")
    text_path = os.path.join(SRC, "data", "tinyshakespeare.txt")
    cli_ok(["tokenize", "--tokenizer", "byte", "--input", text_path, "--output", data], "tokenize")
    lines = os.path.join(tmp, "lines")
    cli_ok(["tokenize", "--tokenizer", "byte", "--input", text_path, "--output", lines, "--split-lines"], "tokenize")
    recipe = os.path.join(SRC, "configs", "quickstart.yaml")
    sets = dict(SETS, **{"data.train": data})

    # --- Recipe
    r = lathe.Recipe.load(recipe, dict(sets, **{"output.dir": os.path.join(tmp, "r")}))
    d = r.to_dict()
    check(d["training"]["steps"] == STEPS and d["data"]["train"] == data, "Recipe.load applies the overrides")
    yml = os.path.join(tmp, "resolved.yaml")
    open(yml, "w").write(r.to_yaml())
    check(lathe.Recipe.load(yml).to_dict() == d, "Recipe.to_yaml loads back to the same recipe")
    rc, msg = cli_error(["train", recipe, "--set", "training.stepz=5"])
    try:
        lathe.Recipe.load(recipe, {"training.stepz": 5})
        check(False, "a misspelt override raises lathe.Error")
    except lathe.Error as e:
        check(rc == 1 and str(e) == msg, f"a misspelt override: lathe.Error with the CLI's message ({e})")

    # --- train: the CLI and the package, the same recipe
    out_cli, out_py = os.path.join(tmp, "cli"), os.path.join(tmp, "py")
    cli_ok(["train", recipe, "--quiet"] + cli_sets(dict(sets, **{"output.dir": out_cli})), "train")
    seen, ticks, running = [], [], [True]

    def spin():
        while running[0]:
            ticks.append(len(seen))
            threading.Event().wait(0.01)

    t = threading.Thread(target=spin)
    t.start()
    nested = []

    def on_step(rec):
        seen.append(rec)
        if not nested:  # a second run while this one trains is refused, not interleaved
            try:
                lathe.train(recipe, dict(sets, **{"output.dir": os.path.join(tmp, "nested")}), quiet=True)
                nested.append("ran")
            except lathe.Error as e:
                nested.append(str(e))

    res = lathe.train(recipe, dict(sets, **{"output.dir": out_py}), on_step=on_step, quiet=True)
    running[0] = False
    t.join()
    want = train_losses(out_cli)
    check(len(want) == STEPS and res.losses == want, f"lathe.train losses == lathe train's, bit for bit ({len(want)} steps)")
    check(train_losses(out_py) == want, "the package's metrics.jsonl losses == the CLI's")
    step_recs = [s for s in seen if "loss" in s]
    check([s["loss"] for s in step_recs] == want and all(isinstance(s, dict) for s in seen),
          f"on_step received every metrics.jsonl record as a dict ({len(seen)} records)")
    recs = [json.loads(ln) for ln in open(os.path.join(out_py, "metrics.jsonl"))]
    check(seen == recs, "on_step's records == metrics.jsonl's")
    check(res.steps == STEPS and res.output_dir == out_py and os.path.isdir(res.model_dir),
          f"RunResult: steps {res.steps}, output_dir, model_dir {res.model_dir}")
    check(res.final_val_loss == val_losses(out_cli)[-1], f"final_val_loss {res.final_val_loss} == the CLI's")
    # The OpenMP note import printed (if the CPUs were oversubscribed) before any run directory existed.
    log = open(os.path.join(out_py, "train.log")).read().splitlines()
    note = lathe._runtime.note.rstrip("\n")
    check(log[1] == note if note else not log[1].startswith("lathe: note: "),
          f"train.log's line after the marker is the runtime note import printed ({note[:60]!r}: {log[1][:60]!r})")
    check(nested and "another lathe.train is running" in nested[0] and not os.path.exists(os.path.join(tmp, "nested")),
          f"a second lathe.train during a run raises lathe.Error and writes nothing ({nested[:1]})")
    check(len(set(ticks)) > 2, f"another Python thread ran while training ({len(set(ticks))} distinct steps seen)")
    rc, msg = cli_error(["train", recipe] + cli_sets(dict(sets, **{"data.train": os.path.join(tmp, "nope"),
                                                                   "output.dir": os.path.join(tmp, "e1")})))
    try:
        lathe.train(recipe, dict(sets, **{"data.train": os.path.join(tmp, "nope"), "output.dir": os.path.join(tmp, "e2")}))
        check(False, "a missing dataset raises lathe.Error")
    except lathe.Error as e:
        check(rc == 1 and str(e) == msg.replace("/e1", "/e2"), f"a missing dataset: lathe.Error with the CLI's message ({e})")

    # --- Tokenizer
    texts = ["ROMEO: But soft, what light", "", "héllo wörld ✓", "First Citizen:\nBefore we proceed"]
    bpe = os.path.join(tmp, "bpe")
    cli_ok(["tokenizer", "train", "--input", text_path, "--vocab-size", "300", "--out", bpe], "tokenizer train")
    for name in ("byte", bpe):
        tok = lathe.Tokenizer.load(name)
        p = cli_ok(["encode", "--tokenizer", name, "--nul"], "encode", input="\0".join(texts))
        want_ids = [[int(x) for x in ln.split()] for ln in p.stdout.split("\n")[:len(texts)]]
        got = [tok.encode(s) for s in texts]
        check(got == want_ids, f"Tokenizer({os.path.basename(name)}).encode == lathe encode")
        for w in (1, 2, None):
            b = tok.encode_batch(texts, workers=w)
            check([a.tolist() for a in b] == want_ids and all(a.dtype == np.int32 for a in b),
                  f"encode_batch(workers={w}) == encode, int32 arrays")
        check([tok.decode(i) for i in got] == texts, "decode(encode(text)) == text")
    tok = lathe.Tokenizer.load("byte")
    check(tok.vocab_size == 256 and tok.eos_id is None, f"byte: vocab_size {tok.vocab_size}, eos_id {tok.eos_id}")

    # --- IndexedDataset
    ds = lathe.IndexedDataset(lines)
    raw = np.fromfile(lines + ".bin", dtype=np.uint16)
    a, b = ds[3], ds[3]
    check(len(ds) > 1000 and a.dtype == np.uint16, f"IndexedDataset: {len(ds)} sequences, dtype {a.dtype}")
    check(not a.flags.owndata and not a.flags.writeable and np.shares_memory(a, b),
          "ds[i] is a read-only view (no own data; two views share memory)")
    sizes = ds.sizes
    off = int(sizes[:3].sum())
    check(np.array_equal(a, raw[off:off + sizes[3]]) and int(sizes.sum()) == raw.size,
          "ds[i] holds the .bin's tokens; sizes add up to the file")
    check(np.array_equal(ds[-1], raw[raw.size - sizes[-1]:]), "ds[-1] is the last sequence")
    try:
        ds[len(ds)]
        check(False, "ds[len] raises IndexError")
    except IndexError:
        check(True, "ds[len] raises IndexError")

    try:
        lathe.IndexedDataset(os.path.join(tmp, "nope"))
        check(False, "IndexedDataset of a missing prefix raises lathe.Error")
    except lathe.Error as e:
        check("nope.idx" in str(e), f"IndexedDataset of a missing prefix raises lathe.Error ({e})")

    # --- Model
    ids = np.array([tok.encode("ROMEO: But soft, what l"), tok.encode("First Citizen:\nBefore w")],
                   dtype=np.int64)
    lf = os.path.join(tmp, "logits.f32")
    cli_ok(["logits", "--model", res.model_dir, "--out", lf] +
           sum((["--tokens", ",".join(map(str, row))] for row in ids), []), "logits")
    for src in (res.model_dir, out_py):
        m = lathe.Model.from_pretrained(src)
        lg = m.logits(ids)
        want_lg = np.fromfile(lf, dtype=np.float32).reshape(lg.shape)
        check(lg.dtype == np.float32 and lg.shape == (2, ids.shape[1], m.config["vocab_size"]) and
              np.array_equal(lg, want_lg), f"Model({os.path.basename(src)}).logits == lathe logits, bit for bit")
    x = lg[:, :-1].astype(np.float64)
    ce = np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1)) + x.max(-1) - np.take_along_axis(
        x, ids[:, 1:, None], -1)[..., 0]
    check(abs(m.loss(ids) - ce.mean()) < 1e-4, f"Model.loss {m.loss(ids):.6f} == the logits' cross-entropy {ce.mean():.6f}")
    for bad_ids, what in ((np.array([[1, 2, 256]]), "token id 256"), (np.zeros((1, 300), np.int32), "300 tokens"),
                          (np.array([[0.5, 1.0]]), "integer array")):
        try:
            m.logits(bad_ids)
            check(False, f"Model.logits refuses {what}")
        except (lathe.Error, TypeError) as e:
            check(what in str(e), f"Model.logits refuses {what} ({type(e).__name__}: {e})")
    prompt = "ROMEO:"
    g = cli_ok(["generate", "--model", res.model_dir, "--prompt", prompt, "--max-new-tokens", "24",
                "--temperature", "0"], "generate").stdout
    new = m.generate(tok.encode(prompt), 24)
    check(prompt + tok.decode(new) + "\n" == g, f"Model.generate (greedy) == lathe generate ({g!r})")

    # --- Model in bf16 / fp16 against fp32 (tests/models/test_model_bf16.cpp's bound): each rounding
    # to the dtype (unit roundoff u = 2^-8 bf16, 2^-11 fp16) adds a relative error <= u; the logits
    # of an L-layer model pass ~12 rounded activations per layer, d = 12 L + 1, independent errors
    # grow as sqrt(d) u: max|half - fp32| / max|fp32| <= K u with K = ceil(2 sqrt(d)). fp16 must be
    # closer than bf16 (the error comes from the storage precision, not from a wrong formula).
    L = m.config["n_layer"]
    K = int(np.ceil(2 * np.sqrt(12 * L + 1)))
    lg32 = m.logits(ids)
    err = {}
    for dtype, u in (("bf16", 2.0 ** -8), ("fp16", 2.0 ** -11)):
        mh = lathe.Model.from_pretrained(res.model_dir, dtype=dtype)
        lh = mh.logits(ids)
        err[dtype] = float(np.abs(lh.astype(np.float64) - lg32).max() / np.abs(lg32).max())
        check(mh.dtype == dtype and lh.dtype == np.float32 and lh.shape == lg32.shape,
              f"Model.from_pretrained(dtype={dtype!r}): {mh.dtype}, float32 logits {lh.shape}")
        check(0 < err[dtype] <= K * u, f"{dtype} logits within K u = {K} x {u:.2e} of fp32's: {err[dtype]:.2e}")
        lo32, loh = m.loss(ids), mh.loss(ids)
        check(abs(loh - lo32) <= K * u * abs(lo32), f"{dtype} loss {loh:.6f} within K u of fp32's {lo32:.6f}")
        first = int(np.argmax(mh.logits(np.array([tok.encode(prompt)]))[0, -1]))
        new_h = mh.generate(tok.encode(prompt), 8)
        check(len(new_h) == 8 and new_h[0] == first,
              f"{dtype} greedy generate (KV cache) starts with the argmax of its own logits ({new_h[:3]})")
    check(err["fp16"] < err["bf16"], f"fp16 closer to fp32 than bf16 ({err['fp16']:.2e} < {err['bf16']:.2e})")
    try:
        lathe.Model.from_pretrained(res.model_dir, dtype="int8")
        check(False, "dtype='int8' raises lathe.Error")
    except lathe.Error as e:
        check("'int8'" in str(e) and "bf16" in str(e), f"dtype='int8' raises lathe.Error naming it ({e})")

    # --- the lathe command pip installed into the venv's bin/: the binary of this tree
    venv_lathe = os.path.join(sys.prefix, "bin", "lathe")
    check(os.access(venv_lathe, os.X_OK), f"pip installed the lathe command ({venv_lathe})")
    if os.access(venv_lathe, os.X_OK):
        v = subprocess.run([venv_lathe, "--version"], capture_output=True, text=True, timeout=60).stdout.split()
        check(v == ver, f"venv lathe --version == the tree's ({' '.join(v)})")
        lf2 = os.path.join(tmp, "logits_venv.f32")
        p = subprocess.run([venv_lathe, "logits", "--model", res.model_dir, "--out", lf2] +
                           sum((["--tokens", ",".join(map(str, row))] for row in ids), []),
                           capture_output=True, text=True, timeout=600)
        check(p.returncode == 0 and open(lf2, "rb").read() == open(lf, "rb").read(),
              "the venv's lathe logits == the tree's binary's, byte for byte")

    # --- plan / check
    pj = json.loads(cli_ok(["plan", recipe, "--world", "4", "--peak-gflops", "100", "--link-gbps", "10",
                            "--memory-gb", "8", "--json"], "plan").stdout)
    lay = lathe.plan(recipe, 4, peak_gflops=100, link_gbps=10, memory_gb=8)
    check(lay == pj["layouts"] and len(lay) > 1, f"lathe.plan == lathe plan --json's layouts ({len(lay)})")
    cs = dict(sets, **{"output.dir": os.path.join(tmp, "chk")})
    want_lines = cli_ok(["check", recipe] + cli_sets(cs), "check").stdout.splitlines()
    got_lines = lathe.check(lathe.Recipe.load(recipe, cs))
    check(got_lines == want_lines, f"lathe.check == lathe check's {len(want_lines)} lines")

    # --- KeyboardInterrupt from on_step: a checkpoint at the step boundary, then raised
    out_ki = os.path.join(tmp, "ki")

    def interrupt(rec):
        if rec.get("step") == 5 and "loss" in rec:
            raise KeyboardInterrupt("stop from on_step")

    try:
        lathe.train(recipe, dict(sets, **{"output.dir": out_ki}), on_step=interrupt, quiet=True)
        check(False, "KeyboardInterrupt raised by on_step is raised by train")
    except KeyboardInterrupt as e:
        check(str(e) == "stop from on_step", f"KeyboardInterrupt raised by on_step is raised by train ({e})")
    ckdir = os.path.join(out_ki, "checkpoints")
    ck = sorted(c for c in os.listdir(ckdir) if c.startswith("step_")) if os.path.isdir(ckdir) else []
    check(ck == ["step_00000005"], f"a checkpoint of step 5 was saved ({ck})")
    res2 = lathe.train(recipe, dict(sets, **{"output.dir": out_ki}), resume="auto", quiet=True)
    check(res2.start_step == 5 and res2.losses == want[5:], "resume='auto' continues at step 6 with the CLI's losses")

    out_sig = os.path.join(tmp, "sig")

    def sigint(rec):  # Ctrl-C: SIGINT to this process while training
        if rec.get("step") == 2 and "loss" in rec:
            os.kill(os.getpid(), signal.SIGINT)

    try:
        lathe.train(recipe, dict(sets, **{"output.dir": out_sig}), on_step=sigint, quiet=True)
        check(False, "SIGINT during lathe.train raises KeyboardInterrupt")
    except KeyboardInterrupt as e:
        saved = os.path.isdir(os.path.join(out_sig, "checkpoints", "step_00000002"))
        check("SIGINT" in str(e) and saved, f"SIGINT: a checkpoint of step 2, then KeyboardInterrupt ({e})")

    try:  # after lathe.train, SIGINT is Python's again (lathe's handler was removed)
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(1000):
            time.sleep(0.01)
        check(False, "after lathe.train, SIGINT raises Python's KeyboardInterrupt again")
    except KeyboardInterrupt:
        check(True, "after lathe.train, SIGINT raises Python's KeyboardInterrupt again")

    def bad(rec):
        raise ValueError("bad callback")

    try:
        lathe.train(recipe, dict(sets, **{"output.dir": os.path.join(tmp, "bad")}), on_step=bad, quiet=True)
        check(False, "a ValueError of on_step propagates")
    except ValueError as e:
        check(str(e) == "bad callback", "a ValueError of on_step propagates")
    print(f"{len(failures)} failed in the venv" if failures else "all passed in the venv")
    return 1 if failures else 0


def outer():
    py = os.environ.get("LATHE_TEST_PYTHON", "/usr/bin/python3")
    missing = subprocess.run([py, "-c", "import scikit_build_core, nanobind, numpy"], capture_output=True, text=True)
    if missing.returncode != 0:
        print("skipped: scikit-build-core / nanobind / numpy not installed for " + py +
              " (bash scripts/setup.sh --test installs them):\n" + missing.stderr.strip().splitlines()[-1])
        return 77
    tmp = tempfile.mkdtemp(prefix="lathe-pkg-")
    venv = os.path.join(tmp, "venv")
    subprocess.run([py, "-m", "venv", "--system-site-packages", venv], check=True)
    env = dict(os.environ, CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 2))
    if shutil.which("ccache"):
        env["CMAKE_ARGS"] = (env.get("CMAKE_ARGS", "") + " -DCMAKE_CXX_COMPILER_LAUNCHER=ccache").strip()
    pip = subprocess.run([os.path.join(venv, "bin", "pip"), "install", "--no-build-isolation", "--no-index",
                          "--no-deps", SRC], capture_output=True, text=True, env=env, timeout=3600)
    check(pip.returncode == 0, "pip install --no-build-isolation . into a fresh venv" +
          ("" if pip.returncode == 0 else ":\n" + pip.stdout[-3000:] + pip.stderr[-3000:]))
    if pip.returncode != 0:
        return finish(tmp)
    p = subprocess.run([os.path.join(venv, "bin", "python"), os.path.abspath(__file__), "--inner", tmp],
                       env=dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2")))
    check(p.returncode == 0, "the checks in the venv passed")
    return finish(tmp)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--inner":
        sys.exit(inner(sys.argv[2]))
    sys.exit(outer())
