"""lathe report (issue 13): one self-contained HTML file, checked by loading it in headless Chromium.

Runs: a fresh run, a run stopped and resumed (its curves must have no gaps or duplicates), and a
run whose metrics hold non-finite values and skipped steps (crafted from a real run's metrics:
null where the run had NaN, loss_scale and skipped_steps fields as an fp16 run writes them). The
DOM Chromium renders is checked plot by plot (points drawn per run, gaps at the NaN), the
screenshot for structure (size, plots not blank), and the console for errors."""
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "train"))
import megatron_writer  # noqa: E402

LATHE = os.environ.get("LATHE_BIN") or os.path.join(os.environ.get("LATHE_BINARY_DIR", os.path.join(HERE, "..", "..", "build")), "lathe")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
TMP = tempfile.mkdtemp(prefix="lathe_report_")
failures = []
PLOTS = ["loss", "lr", "grad_norm", "tokens_per_s", "mfu", "breakdown", "loss_scale"]


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what, flush=True)
    if not ok:
        failures.append(what)


def run(args, rc=0):
    p = subprocess.run([LATHE] + args, capture_output=True, text=True, timeout=300)
    if p.returncode != rc:
        print(p.stdout[-2000:], p.stderr[-2000:])
    check(p.returncode == rc, f"lathe {' '.join(args[:2])} ... exits {rc}")
    return p


def recipe(data, out, steps=12):
    r = {"model": {"preset": "gpt2-debug"}, "data": {"train": data, "valid_fraction": 0.1},
         "optimizer": {"name": "adamw", "lr": 3e-3}, "schedule": {"name": "cosine", "warmup_steps": 2},
         "training": {"micro_batch_size": 2, "seq_len": 32, "steps": steps, "eval_interval": 4, "eval_batches": 2,
                      "log_interval": 1, "threads": 1, "peak_gflops": 100, "seed": 5},
         "output": {"dir": out, "checkpoint_every": 4}}
    path = out + ".yaml"
    json.dump(r, open(path, "w"))
    return path


def render(html):
    """DOM and screenshot of html in headless Chromium, and its console/JS errors."""
    png = html + ".png"
    base = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--window-size=1600,2400",
            "--enable-logging=stderr", "--v=0"]
    dom = subprocess.run(base + ["--dump-dom", "file://" + html], capture_output=True, text=True, timeout=120)
    shot = subprocess.run(base + [f"--screenshot={png}", "file://" + html], capture_output=True, text=True, timeout=120)
    console = [l for l in (dom.stderr + shot.stderr).splitlines() if "CONSOLE" in l or "Uncaught" in l]
    return dom.stdout, png, console


def plots_in(dom):
    """plot id -> (points, {run: [n of each polyline]})"""
    out = {}
    for m in re.finditer(r'<svg class="plot" id="plot-([a-z_]+)"[^>]*data-points="(\d+)"(.*?)</svg>', dom, re.S):
        lines = {}
        for pm in re.finditer(r'<polyline [^>]*data-run="(\d+)" data-series="([^"]+)" data-n="(\d+)"', m.group(3)):
            lines.setdefault((int(pm.group(1)), pm.group(2)), []).append(int(pm.group(3)))
        out[m.group(1)] = (int(m.group(2)), lines)
    return out


def screenshot_ok(png):
    from PIL import Image
    im = Image.open(png).convert("RGB")
    w, h = im.size
    # Plots are drawn in the run colours (#1f77b4, #d62728, #2ca02c): count such pixels in the plot area.
    px = im.crop((0, 0, w, min(h, 1500))).getdata()
    runs = [(0x1f, 0x77, 0xb4), (0xd6, 0x27, 0x28), (0x2c, 0xa0, 0x2c)]
    blue = sum(1 for p in px if any(all(abs(p[i] - c[i]) < 40 for i in range(3)) for c in runs))
    return (w, h) == (1600, 2400) and blue > 2000, blue


def main():
    if not CHROMIUM:
        print("SKIPPED: chromium not found (apt-get install chromium); the report was not rendered -- not a pass")
        return 77
    import numpy as np
    rng = np.random.default_rng(3)
    docs = [(np.arange(300) * (d % 5 + 1) + rng.integers(0, 3, 300)) % 96 for d in range(40)]
    data = os.path.join(TMP, "data")
    megatron_writer.write(data, docs)

    fresh = os.path.join(TMP, "fresh")
    run(["train", recipe(data, fresh), "--quiet"])
    resumed = os.path.join(TMP, "resumed")
    r = recipe(data, resumed)
    run(["train", r, "--quiet", "--stop-after", "6"])
    run(["train", r, "--quiet", "--resume", "auto"])
    steps = [json.loads(l)["step"] for l in open(os.path.join(resumed, "metrics.jsonl")) if '"loss"' in l]
    check(steps == list(range(1, 13)), f"the resumed run's metrics hold steps 1..12 once each ({steps})")

    # A run with non-finite values and skipped steps (as a run with NaN-skips writes them).
    skipped = os.path.join(TMP, "nan_skips")
    shutil.copytree(fresh, skipped)
    recs = [json.loads(l) for l in open(os.path.join(skipped, "metrics.jsonl"))]
    with open(os.path.join(skipped, "metrics.jsonl"), "w") as f:
        for rec in recs:
            if "loss" in rec:
                rec["loss_scale"] = 65536.0 / (2 if rec["step"] >= 5 else 1)
                rec["skipped_steps"] = 1 if rec["step"] >= 5 else 0
                if rec["step"] == 5:
                    rec["loss"] = None
                    rec["grad_norm"] = None
            f.write(json.dumps(rec) + "\n")
        f.write('{"step": 13, "loss": 1.0, "trunc')  # a line cut by a crash

    # One run.
    p = run(["report", fresh])
    html1 = os.path.join(fresh, "report.html")
    check(os.path.exists(html1) and "wrote" in p.stdout, "lathe report RUN_DIR writes RUN_DIR/report.html")
    text = open(html1).read()
    check("http://" not in text.replace('xmlns="http://www.w3.org/2000/svg"', "") and "https://" not in text
          and "<script" not in text, "the report is self-contained (no network references, no scripts)")
    dom, png, console = render(html1)
    plots = plots_in(dom)
    check(set(plots) == set(PLOTS), f"one run: every plot is rendered ({sorted(plots)})")
    for name in PLOTS:
        check(plots.get(name, (0, {}))[0] > 0, f"one run: plot {name} has points ({plots.get(name, (0,))[0]})")
    check(plots["loss"][1].get((0, "loss")) == [12], f"one run: 12 raw loss points in one curve ({plots['loss'][1]})")
    check(plots["loss_scale"][0] > 0 and (0, "loss_scale") in plots["loss_scale"][1],
          "one run: the loss scale the trainer records (1 in fp32) is plotted")
    ok, blue = screenshot_ok(png)
    check(ok, f"one run: the screenshot is 1600x2400 with the curves drawn ({blue} run-coloured pixels)")
    check(not console, f"one run: no console errors ({console[:3]})")
    check("openblas_kernel" in dom and "lathe_version" in dom, "one run: hardware and version from run_info.json")

    # Three runs overlaid: fresh, resumed, NaN-skips.
    out = os.path.join(TMP, "compare.html")
    run(["report", fresh, resumed, skipped, "--out", out])
    dom, png, console = render(out)
    plots = plots_in(dom)
    check(set(plots) == set(PLOTS), "three runs: every plot is rendered")
    loss = plots["loss"][1]
    check(loss.get((0, "loss")) == [12] and loss.get((1, "loss")) == [12],
          f"three runs: fresh and resumed loss curves have 12 points, no gap ({loss.get((1, 'loss'))})")
    check(loss.get((2, "loss")) == [4, 7], f"three runs: the NaN step breaks the third run's curve ({loss.get((2, 'loss'))})")
    check(plots["loss_scale"][0] > 0 and (2, "loss_scale") in plots["loss_scale"][1]
          and (2, "skipped_steps") in plots["loss_scale"][1], "three runs: loss scale and skipped steps plotted")
    check(re.search(r"skipped line \d+ of metrics.jsonl", dom) is not None, "three runs: the truncated metrics line is named")
    check(dom.count('class="legend"') == 1 and dom.count("<span data-run=") == 3, "three runs: a legend entry per run")
    check("resolved recipe" in dom.lower() and dom.count("step_0000") >= 3, "three runs: recipe and checkpoints listed")
    ok, blue = screenshot_ok(png)
    check(ok, f"three runs: screenshot with curves ({blue} run-coloured pixels)")
    check(not console, f"three runs: no console errors ({console[:3]})")

    # Errors.
    p = run(["report", TMP], rc=1)
    check("no metrics.jsonl" in p.stderr, "a directory that is not a run: the error says what is missing")
    p = run(["report", fresh, resumed], rc=2)
    check("--out" in p.stderr, "several runs without --out: usage error naming --out")

    if not failures:
        shutil.rmtree(TMP, ignore_errors=True)
    print(f"{len(failures)} failed" if failures else "all passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
