"""Progress and ETA on long commands (issue 13 item 5; src/core/progress.h).

Off a terminal (stderr a pipe) `lathe eval --tasks`, `lathe eval --data`, `lathe export`,
`lathe convert` and `lathe tokenize` print plain periodic lines (one per 10% of the work at least,
no carriage returns, a final 100% line); on a terminal (stderr a pty from python's pty module) the
same commands redraw one bar in place with '\\r'; --no-progress prints nothing on stderr. `lathe
train` puts an ETA (remaining steps x mean step time) in every step log line and eta_s in
metrics.jsonl, reaching 0 at the last step."""
import json
import os
import pty
import re
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "train"))
import megatron_writer  # noqa: E402

LATHE = os.environ.get("LATHE_BIN") or os.path.join(os.environ.get("LATHE_BINARY_DIR", os.path.join(HERE, "..", "..", "build")), "lathe")
TMP = tempfile.mkdtemp(prefix="lathe_progress_")
# OMP_WAIT_POLICY chosen here: on a loaded machine lathe would otherwise note its own choice on stderr.
ENV = dict({k: v for k, v in os.environ.items() if k != "LATHE_PROGRESS"}, OMP_WAIT_POLICY="PASSIVE")
failures = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what, flush=True)
    if not ok:
        failures.append(what)


def run(args):
    p = subprocess.run([LATHE] + args, capture_output=True, text=True, timeout=300, env=ENV)
    if p.returncode != 0:
        print(p.stdout[-2000:], p.stderr[-2000:])
    return p


def run_pty(args):
    """stderr on a pseudo-terminal (isatty true), stdout a pipe; returns (rc, what the terminal got)."""
    master, slave = pty.openpty()
    p = subprocess.Popen([LATHE] + args, stdout=subprocess.PIPE, stderr=slave, env=ENV)
    os.close(slave)
    got = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: every writer closed the terminal
            break
        if not chunk:
            break
        got += chunk
    p.stdout.read()
    rc = p.wait(timeout=300)
    os.close(master)
    return rc, got.decode("utf-8", "replace")


def plain_ok(err, label, total, unit):
    lines = [l for l in err.splitlines() if l.startswith(label + " [")]
    pct = [float(m.group(1)) for l in lines for m in [re.search(r"\]\s+([\d.]+)%", l)] if m]
    return ("\r" not in err and len(lines) >= min(total, 10) and pct == sorted(pct) and pct[-1] == 100.0
            and f"{total}/{total} {unit}" in lines[-1] and "ETA" in lines[-1]), lines


def main():
    import numpy as np
    rng = np.random.default_rng(3)
    data = os.path.join(TMP, "data")
    megatron_writer.write(data, [rng.integers(0, 96, 400) for _ in range(30)])
    out = os.path.join(TMP, "run")
    r = {"model": {"preset": "gpt2-debug"}, "data": {"train": data, "valid_fraction": 0.1},
         "optimizer": {"name": "adamw", "lr": 3e-3}, "schedule": {"name": "cosine", "warmup_steps": 1},
         "training": {"micro_batch_size": 2, "seq_len": 32, "steps": 6, "eval_interval": 0, "log_interval": 1,
                      "threads": 1, "peak_gflops": 100, "seed": 1},
         "output": {"dir": out}}
    json.dump(r, open(out + ".yaml", "w"))
    p = run(["train", out + ".yaml"])
    check(p.returncode == 0, "a small GPT-2 trains")
    steps = [l for l in p.stdout.splitlines() if l.startswith("step ")]
    check(len(steps) == 6 and all(re.search(r"\| ETA \d+:\d\d$", l) for l in steps) and steps[-1].endswith("ETA 0:00"),
          f"every step log line ends with an ETA, 0:00 at the last step ({steps[-1] if steps else None})")
    eta = [json.loads(l)["eta_s"] for l in open(os.path.join(out, "metrics.jsonl")) if '"eta_s"' in l]
    check(len(eta) == 6 and eta[-1] == 0 and all(e >= 0 for e in eta) and eta[0] > 0,
          f"metrics.jsonl eta_s per step, 0 at the end ({eta})")
    model = os.path.join(out, "model")

    # 20 multiple-choice items as token ids: 10% steps are 2 items each.
    items = os.path.join(TMP, "items.jsonl")
    with open(items, "w") as f:
        for i in range(20):
            f.write(json.dumps({"context_ids": [int(x) for x in rng.integers(0, 96, 8)],
                                "ending_ids": [[int(x) for x in rng.integers(0, 96, 3)] for _ in range(3)],
                                "label": i % 3}) + "\n")
    p = run(["eval", "--model", model, "--tasks", items, "--json"])
    ok, lines = plain_ok(p.stderr, "eval tasks", 20, "items")
    check(p.returncode == 0 and ok and len(lines) == 10, f"eval --tasks off a terminal: a line per 10% ({len(lines)} lines)")
    check(json.loads(p.stdout)["items"] == 20, "stdout stays the JSON result")
    p = run(["eval", "--model", model, "--tasks", items, "--no-progress"])
    check(p.returncode == 0 and p.stderr == "", "--no-progress: nothing on stderr")
    rc, term = run_pty(["eval", "--model", model, "--tasks", items])
    check(rc == 0 and "\reval tasks [####################] 100.0%  20/20 items" in term and term.count("\n") == 1,
          f"eval --tasks on a terminal: one bar redrawn with \\r, one newline ({term[-200:]!r})")
    p = run(["eval", "--model", model, "--data", data, "--seq-len", "32", "--batch", "4"])
    ns = int(re.search(r"in (\d+) samples", p.stdout).group(1)) if p.returncode == 0 else -1
    ok, lines = plain_ok(p.stderr, "eval data", ns, "samples")
    check(p.returncode == 0 and ok, f"eval --data off a terminal ({lines[-1] if lines else p.stderr[-300:]})")

    # export / convert: per tensor written.
    exp = os.path.join(TMP, "exp")
    p = run(["export", out, "--to", exp])
    lines = [l for l in p.stderr.splitlines() if l.startswith("write " + exp)]
    check(p.returncode == 0 and lines and "\r" not in p.stderr and re.search(r"100\.0%  (\d+)/\1 tensors", lines[-1]),
          f"export: per-tensor progress lines ({lines[-1] if lines else p.stderr[-300:]})")
    rc, term = run_pty(["convert", "--from-hf", exp, "--to", os.path.join(TMP, "conv")])
    check(rc == 0 and re.search(r"\rwrite \S+ \[#{20}\] 100\.0%  (\d+)/\1 tensors", term) is not None,
          f"convert on a terminal: the bar ({term[-200:]!r})")

    # tokenize: the shared Line, plain lines off a terminal and a bar on one.
    txt = os.path.join(TMP, "corpus.txt")
    with open(txt, "w") as f:
        f.write("to be or not to be\n" * 3000)
    p = run(["tokenize", "-t", "byte", "-i", txt, "-o", os.path.join(TMP, "tok1"), "--batch-bytes", "4096", "-j", "1"])
    tl = [l for l in p.stderr.splitlines() if l.startswith("tokenize [")]
    check(p.returncode == 0 and "\r" not in p.stderr and len(tl) >= 2 and "100.0%" in tl[-1],
          f"tokenize off a terminal: periodic plain lines ({len(tl)})")
    rc, term = run_pty(["tokenize", "-t", "byte", "-i", txt, "-o", os.path.join(TMP, "tok2")])
    check(rc == 0 and "\rtokenize [####################] 100.0%" in term, f"tokenize on a terminal: the bar ({term[-200:]!r})")

    if not failures:
        shutil.rmtree(TMP, ignore_errors=True)
    print(f"{len(failures)} failed" if failures else "all passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
