#!/usr/bin/env python3
"""Hostile-pass findings on a run's life (issue 23; ../shared/reference/hostile-pass-2026-12-01.md):

  * C1: data.attention: document with data.tokenizer: the end-of-run sample runs with causal
    attention (micro_batch_size 2 ended in "a 1x16 pass while documents for 2x16 are set", exit 1;
    at 1 it sampled with the last batch's document mask): the sample equals `lathe generate` on the
    saved model with the same prompt, seed and options;
  * D1: a new run into an output.dir that holds a run is refused naming the directory and both ways
    forward, the old run untouched; --overwrite moves it aside (DIR.replaced-N) and deletes nothing;
    a directory with only a data cache or unrelated files is no run; under mpirun every rank ends
    with the message;
  * D2: --resume auto with checkpoints present but none valid exits 1 naming each and why, and
    writes nothing over them;
  * S9: output.keep_last 1 with anomaly rollback keeps the newest healthy checkpoint, and the
    rollback happens;
  * S10: meaningless train flags (--stop-after -1/0, --checkpoint-every -5, --save-every -1,
    --resume "") are usage errors naming the flag and its range;
  * U4: an edited loss_scale in state.json (beyond float range, or below the minimum of the recipe
    that wrote it) is reported as a damaged checkpoint field; a raised recipe minimum is applied.
"""
import hashlib
import json
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.environ.get("LATHE_SOURCE_DIR", os.path.join(HERE, "..", "..")), "tests"))
sys.path.insert(0, HERE)
from hostile import LATHE, SANITIZED, Cases, Failure, run_lathe  # noqa: E402
from hostile_ckpt import canonical, reseal_text  # noqa: E402
from kill_test_lib import hostile_recipe, make_data  # noqa: E402

cases = Cases()
tmp = cases.tmp
data = make_data(tmp, "shake", 20000)


def recipe(name, extra=""):
    """TMP/NAME.yaml: HOSTILE_RECIPE (gpt2-debug, vocab 256, 4 steps of 2x16) into TMP/NAME, plus
    `extra` YAML lines."""
    out = os.path.join(tmp, name)
    return hostile_recipe(tmp, data, name, extra, out), out


def snapshot(d):
    """{relative path: md5} of every file under D."""
    out = {}
    for root, _, files in os.walk(d):
        for f in files:
            p = os.path.join(root, f)
            out[os.path.relpath(p, d)] = hashlib.md5(open(p, "rb").read()).hexdigest()
    return out


def body_of(ckpt):
    return json.load(open(os.path.join(ckpt, "state.json")))["body"]


def ckpt_dir(out, step):
    return os.path.join(out, "checkpoints", f"step_{step:08d}")


# ---- C1: the end-of-run sample with document attention ----
for mbs in (2, 1):
    with cases.case(f"C1: document attention + tokenizer, micro_batch_size {mbs}: the sample is causal"):
        # seq_len = n_positions: the trainer's window (seq_len) is generate's (n_positions).
        rec, out = recipe(f"docs{mbs}", "")
        text = open(rec).read().replace("model: {preset: gpt2-debug, vocab_size: 256}",
                                        "model: {preset: gpt2-debug, vocab_size: 256, n_positions: 32}")
        text = text.replace("data: {train:", "data: {tokenizer: byte, attention: document, eod_token: 10, "
                            "reset_position_ids: true, train:")
        text = text.replace("micro_batch_size: 2, seq_len: 16", f"micro_batch_size: {mbs}, seq_len: 32")
        open(rec, "w").write(text)
        p = run_lathe(["train", rec], rc=0, stream="stdout", must=["documents: document attention", "sample:\n"],
                      timeout=120)
        sample = p.stdout[p.stdout.index(b"sample:\n") + len(b"sample:\n"):]
        g = run_lathe(["generate", "--model", os.path.join(out, "model"), "--prompt", "\n", "--max-new-tokens", "200",
                       "--temperature", "0.8", "--top-k", "40", "--top-p", "1", "--seed", "7"], rc=0, stream="stdout")
        # train: "sample:\n" TEXT "\n" (the log line's own "\n"); generate: PROMPT TEXT "\n".
        want = g.stdout[1:]
        if sample != want + b"\n":
            raise Failure(f"the end-of-run sample differs from lathe generate on the saved model:\n"
                          f"  train:    {sample[:120]!r}\n  generate: {want[:120]!r}")

# ---- D1: a run directory is never silently reused ----
rec, out = recipe("run")
run_lathe(["train", rec, "--quiet", "--stop-after", "2"], rc=0, timeout=120)
before = snapshot(out)

with cases.case("D1: a new run into a directory that holds a run is refused, the run untouched"):
    run_lathe(["train", rec, "--quiet", "--set", "optimizer.lr=0.5"], rc=1,
              must=[f"{out}: output.dir already holds a training run", "metrics.jsonl", "checkpoints/",
                    "--resume auto", "--overwrite", "nothing is deleted"])
    if snapshot(out) != before:
        raise Failure("the refused run changed the old run's files")

with cases.case("D1: lathe check refuses what train refuses (the same message), and passes --resume auto / --overwrite"):
    run_lathe(["check", rec], rc=1, must=[f"{out}: output.dir already holds a training run", "--overwrite"])
    run_lathe(["check", rec, "--resume", "auto"], rc=0, stream="stdout", must=["can start"])
    run_lathe(["check", rec, "--overwrite"], rc=0, stream="stdout", must=["would be moved aside", "can start"])
    if snapshot(out) != before:
        raise Failure("lathe check changed the old run's files")

with cases.case("D1: a resume from a checkpoint elsewhere into a directory that holds a run is refused"):
    rec2, out2 = recipe("other")
    run_lathe(["train", rec2, "--quiet", "--stop-after", "2"], rc=0, timeout=120)
    run_lathe(["train", rec2, "--quiet", "--resume", ckpt_dir(out, 2)], rc=1,
              must=[f"{out2}: output.dir already holds a training run", f"resuming from {ckpt_dir(out, 2)}"])

with cases.case("D1: --overwrite with --resume auto is a usage error"):
    run_lathe(["train", rec, "--quiet", "--overwrite", "--resume", "auto"], rc=2, must=["--overwrite", "--resume auto"])
    if snapshot(out) != before:
        raise Failure("the refused run changed the old run's files")

with cases.case("D1: --overwrite moves the old run aside (nothing deleted) and starts a new one"):
    rec3, out3 = recipe("ow")
    run_lathe(["train", rec3, "--quiet", "--stop-after", "2"], rc=0, timeout=120)
    old = snapshot(out3)
    p = run_lathe(["train", rec3, "--quiet", "--overwrite", "--set", "training.steps=2"], rc=0, stream="stdout",
                  must=["--overwrite: moved the old run", f"{out3}.replaced-1"], timeout=120)
    if snapshot(out3 + ".replaced-1") != old:
        raise Failure("the old run moved aside is not byte-identical to what it was")
    if not os.path.isdir(os.path.join(out3, "model")) or len(open(os.path.join(out3, "metrics.jsonl")).readlines()) < 2:
        raise Failure(f"no new run in {out3}: {os.listdir(out3)}")
    run_lathe(["train", rec3, "--quiet", "--overwrite", "--set", "training.steps=2"], rc=0, stream="stdout",
              must=[f"{out3}.replaced-2"], timeout=120)
    if snapshot(out3 + ".replaced-1") != old:
        raise Failure("a second --overwrite touched the first one moved aside")

with cases.case("D1: a directory with only a data cache and unrelated files is no run"):
    rec4, out4 = recipe("cacheonly")
    os.makedirs(os.path.join(out4, "data_cache"))
    open(os.path.join(out4, "notes.txt"), "w").write("mine\n")
    os.makedirs(os.path.join(out4, "checkpoints"))  # empty: nothing to lose
    run_lathe(["train", rec4, "--quiet", "--set", "training.steps=2"], rc=0, timeout=120)
    if open(os.path.join(out4, "notes.txt")).read() != "mine\n":
        raise Failure("an unrelated file was changed")

if shutil.which("mpirun") and not SANITIZED:
    with cases.case("D1 under mpirun -np 2: every rank ends with the message, the run untouched"):
        env = dict(os.environ, OMP_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                   OMPI_MCA_rmaps_base_oversubscribe="1")
        p = subprocess.run([shutil.which("mpirun"), "-np", "2", LATHE, "train", rec, "--quiet"], capture_output=True,
                           text=True, timeout=120, env=env)
        n = p.stderr.count("output.dir already holds a training run")
        if p.returncode == 0 or n != 2:
            raise Failure(f"exit {p.returncode}, the message {n} times (want 2):\n{p.stderr[-2000:]}")
        if snapshot(out) != before:
            raise Failure("the refused run changed the old run's files")
else:
    print("mpirun case skipped (no mpirun, or a sanitizer build)")


# ---- D2: --resume auto when no checkpoint is valid ----
def edited_run(name, edit, extra="", steps=2):
    """A run stopped after `steps` steps whose newest checkpoint's state.json is edited by `edit`
    (on the body) and resealed. Returns (recipe, out, checkpoint)."""
    rec, out = recipe(name, extra)
    run_lathe(["train", rec, "--quiet", "--stop-after", str(steps)], rc=0, timeout=120)
    ck = ckpt_dir(out, steps)
    body = body_of(ck)
    edit(body)
    reseal_text(ck, canonical(body))
    return rec, out, ck


for field, value, must in (("health.healthy", "yes", "health.healthy"), ("loss_scale", 0, "loss_scale"),
                           ("loader.epoch", -1, "loader.epoch")):
    def edit(b, field=field, value=value):
        *path, key = field.split(".")
        for k in path:
            b = b[k]
        b[key] = value

    with cases.case(f"D2: --resume auto with its only checkpoint refused ({field}) exits 1, writes nothing"):
        rec, out, ck = edited_run("d2_" + field, edit)
        snap = snapshot(out)
        run_lathe(["train", rec, "--quiet", "--resume", "auto"], rc=1,
                  must=["none of the 1 checkpoint can be resumed", ck, must, "--overwrite"])
        if snapshot(out) != snap:
            raise Failure("the refused resume changed the run's files")

with cases.case("D2: a valid older checkpoint is resumed, the refused newer one moved aside intact"):
    rec, out = recipe("d2_older")
    run_lathe(["train", rec, "--quiet", "--set", "output.checkpoint_every=1", "--stop-after", "2"], rc=0, timeout=120)
    ck2 = ckpt_dir(out, 2)
    body = body_of(ck2)
    body["loss_scale"] = 0
    reseal_text(ck2, canonical(body))
    damaged = open(os.path.join(ck2, "state.json"), "rb").read()
    run_lathe(["train", rec, "--quiet", "--resume", "auto", "--set", "output.checkpoint_every=1"], rc=0,
              stream="stdout", must=[f"resuming from {ckpt_dir(out, 1)}", "moved newer checkpoint"], timeout=120)
    aside = [n for n in os.listdir(os.path.join(out, "checkpoints")) if n.startswith("step_00000002.abandoned")]
    if len(aside) != 1 or open(os.path.join(out, "checkpoints", aside[0], "state.json"), "rb").read() != damaged:
        raise Failure(f"the damaged step 2 is not kept aside intact: {os.listdir(os.path.join(out, 'checkpoints'))}")

# ---- S9: keep_last 1 with anomaly rollback ----
with cases.case("S9: keep_last 1 with anomaly rollback keeps the newest healthy checkpoint and rolls back to it"):
    rec, out = recipe("s9", "")
    text = open(rec).read().replace("steps: 4,", "steps: 12,").replace(
        "threads: 1}", "threads: 1, anomaly: {enabled: true, warmup_steps: 4, grad_norm_z_threshold: 0, "
        "rollback_after: 2, rollback_window: 3, max_rollbacks: 3}}")
    text = text.replace("output: {dir:", "output: {checkpoint_every: 2, keep_last: 1, dir:")
    open(rec, "w").write(text)
    p = run_lathe(["train", rec], rc=0, stream="stdout", timeout=180,
                  env={"LATHE_TEST_LOSS_SPIKE_STEPS": "9,11"}, must=["ROLLBACK 1 of 3"],
                  must_not=["no checkpoint recorded as healthy"])
    ev = [json.loads(x) for x in open(os.path.join(out, "anomalies.jsonl"))]
    back = [e for e in ev if e["event"] == "rollback"]
    if len(back) != 1 or back[0]["to_step"] != 8:
        raise Failure(f"want one rollback to step 8: {ev}")
    kept = sorted(n for n in os.listdir(os.path.join(out, "checkpoints")) if n.startswith("step_") and "." not in n)
    if kept != ["step_00000012"]:
        raise Failure(f"keep_last 1 at the end (a healthy step 12): {kept}")

# ---- S10: meaningless train flags ----
rec, _ = recipe("s10")
for args, must in ((["--stop-after", "-1"], ["--stop-after -1", ">= 1"]),
                   (["--stop-after", "0"], ["--stop-after 0", ">= 1"]),
                   (["--checkpoint-every", "-5"], ["--checkpoint-every -5", ">= 0"]),
                   (["--save-every", "-1"], ["--save-every -1", ">= 0"]),
                   (["--resume", ""], ["--resume is empty", "auto"])):
    with cases.case("S10: lathe train " + " ".join(a if a else '""' for a in args)):
        run_lathe(["train", rec, "--quiet", *args], rc=2, must=["usage error"] + must)
        if os.path.exists(os.path.join(tmp, "s10")):
            raise Failure("a usage error must come before any work")


# ---- U4: the loss scale of an edited checkpoint ----
LS = "precision: {loss_scale: {enabled: true, initial: 1024}}\n"
for value, must in ((1e-300, ["field 'loss_scale'", "1e-300", "2^-126"]), (1e300, ["field 'loss_scale'", "2^100"]),
                    (0.5, ["field 'loss_scale' is 0.5", "below the minimum loss scale 1"])):
    with cases.case(f"U4: loss_scale {value} in state.json is a damaged checkpoint field"):
        rec, out, ck = edited_run(f"u4_{value}", lambda b, v=value: b.__setitem__("loss_scale", v), LS)
        run_lathe(["train", rec, "--quiet", "--resume", ck], rc=1,
                  must=[os.path.join(ck, "state.json"), "damaged or was edited by hand"] + must,
                  must_not=["non-finite at the minimum loss scale"])

with cases.case("U4: a recipe minimum raised since the checkpoint starts the scale at the new minimum"):
    rec, out, ck = edited_run("u4_raised", lambda b: b.__setitem__("loss_scale", 2), LS)
    run_lathe(["train", rec, "--quiet", "--resume", ck, "--set", "precision.loss_scale.min=4",
               "--force-resume-changes"], rc=0, stream="stdout", must=["below precision.loss_scale.min 4", "starting at 4"],
              timeout=120)

cases.finish()
