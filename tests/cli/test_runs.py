#!/usr/bin/env python3
"""lathe runs DIR [--json] [--html FILE] (issue 29 item 5): the experiment index over a directory
holding a finished run, a run stopped by --stop-after, a run stopped by SIGINT, a run that ended
with an error (non-finite gradients past training.max_skipped_steps, test hook), a run killed with
SIGKILL while training (no end record; shown "running" while its process lived) and a run of an
older version (no train.log, metrics.jsonl cut mid-line after its last checkpoint).
Checks each row's status and figures against the runs' own metrics.jsonl, the recipe hash (equal
for one recipe in two directories, different for another), and the --html page (the index table,
one loss curve per run with metrics)."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "train"))
import numpy as np  # noqa: E402
from train_helpers import ENV, LATHE, check, finish, patterned_data, write_recipe  # noqa: E402

TRAINING = {"micro_batch_size": 2, "seq_len": 16, "steps": 6, "log_interval": 1, "eval_interval": 2,
            "peak_gflops": 100}


def train(recipe, *args, env=None):
    return subprocess.run([LATHE, "train", recipe, "--quiet", *args], capture_output=True, text=True,
                          env=env or ENV, timeout=600)


def records(out):
    return [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl")) if l.strip()]


def index(root):
    p = subprocess.run([LATHE, "runs", root, "--json"], capture_output=True, text=True, timeout=120)
    check(p.returncode == 0, "lathe runs --json exits 0 " + p.stderr[-300:])
    return {r["run"]: r for r in json.loads(p.stdout)} if p.returncode == 0 else {}


def wait_for(cond, what, limit=300):
    t0 = time.time()
    while not cond():
        if time.time() - t0 > limit:
            check(False, f"waited for {what}")
            return False
        time.sleep(0.2)
    return True


def main():
    tmp = tempfile.mkdtemp(prefix="lathe_runs_")
    rng = np.random.default_rng(0)
    data = patterned_data(tmp, rng)
    tasks = os.path.join(tmp, "tasks.jsonl")  # multiple-choice items (as tests/train/test_eval_tasks_training.py)
    with open(tasks, "w") as f:
        for i in range(6):
            ctx = [(i + j) * 3 % 96 for j in range(8)]
            endings = [[int(x) for x in rng.integers(0, 96, 2)] for _ in range(3)]
            f.write(json.dumps({"context_ids": ctx, "ending_ids": endings, "label": i % 3}) + "\n")
    TRAINING.update(eval_tasks=tasks, eval_tasks_interval=3)
    root = os.path.join(tmp, "runs")
    os.makedirs(os.path.join(root, "group"))
    out = {k: os.path.join(root, k) for k in ["finished", "stopped", "sigint", "crashed", "killed", "old"]}
    out["stopped"] = os.path.join(root, "group", "stopped")

    check(train(write_recipe(out["finished"], data, TRAINING)).returncode == 0, "finished run")
    check(train(write_recipe(out["stopped"], data, TRAINING), "--stop-after", "4").returncode == 0, "stopped run")
    env = dict(ENV, LATHE_TEST_NONFINITE_STEPS="1,2")
    check(train(write_recipe(out["crashed"], data, dict(TRAINING, max_skipped_steps=2)), env=env).returncode == 1,
          "crashed run ends with an error")
    # An older version's run: no train.log, killed after its step-3 checkpoint (metrics cut mid-line).
    check(train(write_recipe(out["old"], data, dict(TRAINING, steps=5)), "--stop-after", "3").returncode == 0, "old run")
    os.remove(os.path.join(out["old"], "train.log"))
    with open(os.path.join(out["old"], "metrics.jsonl"), "a") as f:
        f.write('{"step":4,"loss":4.4')
    # A long run, SIGINT once it has trained a step; another killed (SIGKILL) while it trains.
    long = {k: v for k, v in TRAINING.items() if not k.startswith("eval_tasks")}
    long.update(steps=1000000, eval_interval=0)
    procs = {}
    for k in ["sigint", "killed"]:
        procs[k] = subprocess.Popen([LATHE, "train", write_recipe(out[k], data, long), "--quiet"], env=ENV,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for k in procs:
        wait_for(lambda: os.path.exists(os.path.join(out[k], "metrics.jsonl")) and
                 os.path.getsize(os.path.join(out[k], "metrics.jsonl")) > 0, f"{k}: a first step")
    rows = index(root)
    check(rows.get("killed", {}).get("status") == "running", f"a training run is 'running': {rows.get('killed', {}).get('status')}")
    procs["sigint"].send_signal(signal.SIGINT)
    check(procs["sigint"].wait(timeout=300) == 75, "SIGINT: checkpoint and exit 75")
    procs["killed"].kill()
    procs["killed"].wait(timeout=60)

    p = subprocess.run([LATHE, "runs", root], capture_output=True, text=True, timeout=120)
    print(p.stdout)
    check(p.returncode == 0 and p.stdout.splitlines()[0].split()[:2] == ["run", "status"], "the text table")
    rows = index(root)
    check(sorted(rows) == ["crashed", "finished", "group/stopped", "killed", "old", "sigint"], f"six runs: {sorted(rows)}")
    if len(rows) != 6:
        return finish(tmp)
    sig_step = max(r["step"] for r in records(out["sigint"]) if "loss" in r)
    want = {"finished": "finished", "group/stopped": "stopped at step 4", "crashed": "crashed", "killed": "crashed",
            "old": "stopped at step 3", "sigint": f"stopped at step {sig_step}"}
    for k, s in want.items():
        check(rows[k]["status"] == s, f"{k}: status {rows[k]['status']!r} == {s!r}")
    check("not finite" in rows["crashed"].get("error", "") or "max_skipped_steps" in rows["crashed"].get("error", ""),
          f"crashed: the error is in the row: {rows['crashed'].get('error', '')[:100]!r}")

    f = rows["finished"]
    recs = records(out["finished"])
    steps = [r for r in recs if "loss" in r]
    vals = [r["val_loss"] for r in recs if "val_loss" in r]
    check(f["model"] == "gpt2" and f["parameters"] == json.load(open(os.path.join(out["finished"], "run_info.json")))["parameters"],
          "model and parameters")
    check(f["data"] == data and f["step"] == 6 and f["steps"] == 6 and f["tokens"] == steps[-1]["tokens"],
          "data, steps, tokens")
    check(f["train_loss"] == steps[-1]["loss"] and f["val_loss"] == vals[-1] and f["best_val_loss"] == min(vals),
          "final train loss, final and best validation loss")
    check(f["schedule"] == {"name": "cosine", "lr": 0.003, "warmup_steps": 2, "min_lr": 0.0}, f"schedule {f['schedule']}")
    tps = sorted(r["tokens_per_s"] for r in steps)
    check(abs(f["tokens_per_s"] - (tps[2] + tps[3]) / 2) < 1e-9 * tps[3], "median tokens/s")
    check(abs(f["step_time_s"] - sum(r["ms_per_step"] for r in steps) / 1e3) < 1e-9, "time in steps")
    accs = [r["tasks_acc"] for r in recs if "tasks_acc" in r]
    check(len(accs) == 2 and f["tasks_acc"] == accs[-1], f"task accuracy: the last tasks_acc ({f['tasks_acc']})")
    check(rows["killed"]["tasks_acc"] is None, "no tasks: tasks_acc null")
    h = {k: rows[k]["recipe_hash"] for k in rows}
    check(h["finished"] == h["group/stopped"] and h["finished"] != h["crashed"] and re.fullmatch("[0-9a-f]{16}", h["finished"]),
          f"recipe hash: one recipe in two directories shares it, another differs ({h})")
    check(rows["group/stopped"]["step"] == 4 and rows["group/stopped"]["best_val_loss"] is not None, "stopped: step 4")

    page = os.path.join(tmp, "index.html")
    p = subprocess.run([LATHE, "runs", root, "--html", page], capture_output=True, text=True, timeout=120)
    check(p.returncode == 0 and os.path.exists(page), "--html writes the page " + p.stderr[-300:])
    html = open(page).read() if os.path.exists(page) else ""
    check(html.count('<tr data-status="') == 6 and 'data-status="stopped at step 4"' in html, "the index table")
    loss_plot = html[html.find('id="plot-loss"'):]
    loss_plot = loss_plot[:loss_plot.find("</svg>")]
    runs_drawn = set(re.findall(r'data-run="(\d+)" data-series="loss"', loss_plot))
    check(len(runs_drawn) == 6, f"overlaid loss curves of the six runs ({sorted(runs_drawn)})")
    check("<script" not in html and "http://" not in html.replace("http://www.w3.org/2000/svg", ""), "self-contained")
    one = subprocess.run([LATHE, "runs", out["finished"] + "/", "--json"], capture_output=True, text=True, timeout=60)
    check(one.returncode == 0 and [r["run"] for r in json.loads(one.stdout)] == ["finished"],
          "a run directory itself (with a trailing slash) is one row named after it")
    p = subprocess.run([LATHE, "runs", os.path.join(tmp, "nope")], capture_output=True, text=True, timeout=60)
    check(p.returncode == 1 and "nope: not a directory" in p.stderr, "a missing DIR is named")
    return finish(tmp)


if __name__ == "__main__":
    sys.exit(main())
