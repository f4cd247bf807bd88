#!/usr/bin/env python3
"""Speed when the cores are shared (issue 22 item 5): idle vs loaded, lathe generate and a training step.

  /usr/bin/python3 bench/bench_oversubscribed.py [--build build] [--threads 2] [--reps 3]
      [--tokens 200] [--steps 5] [--env GOMP_SPINCOUNT=10000 ...] [--load N] [--nice -20]

"loaded": N other processes (default: one per online core) spin in a busy loop while lathe runs,
as on a shared node, a laptop, or mpirun with more ranks than cores. Idle and loaded runs are
interleaved, each figure is the median of --reps runs:
  * generate: `lathe generate` on a GPT-2 (L=4, C=256, H=4, byte vocabulary) trained for one step
    in a temporary folder; ms/token = (time of --tokens tokens - time of 1 token) / (tokens - 1),
    so start-up and loading are not counted;
  * train: build/bench/bench_train_step gpt2-small-bench (L=4, C=256, H=4, V=50257) B=4 T=64, fp32,
    its own ms/step (median of --steps steps after a warm-up).
--late: the load arrives AFTER lathe started (its start-up check saw the machine as it was, so it
chose the bounded spin), as when another job starts during a long run:
  * generate: the load starts when the prompt appears on lathe's stdout (model loaded, first token
    not yet computed); ms/token = (time from then to exit for --tokens tokens - the same for 1
    token) / (tokens - 1); the idle figure is measured the same way without load;
  * train: `lathe train` (quickstart GPT-2, n_embd 256, byte vocabulary, micro-batch 4 x seq_len 64,
    log_interval 1) for --steps + 4 steps; the load starts when step 2 is logged and the figure is
    the median of the step times lathe logs from step 4 on (idle: the same steps without load).
Each --env KEY=VALUE is added to lathe's environment (e.g. OMP_WAIT_POLICY=ACTIVE reproduces the
old default; a user's own OMP_WAIT_POLICY / GOMP_SPINCOUNT are always respected by lathe).
Prints the CPU model, lathe's wait policy line (if any) and the loaded/idle ratios.
"""
import argparse
import json
import multiprocessing
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cpu_model():
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown"


NICE = 0


def uptime():
    with open("/proc/loadavg") as f:
        return "load average " + " ".join(f.read().split()[:4]) + " (1/5/15 min, running/total tasks)"


def set_nice():
    if NICE:
        os.nice(NICE)


def busy():
    set_nice()
    while True:
        pass


def start_load(n, settle=True):
    procs = [multiprocessing.Process(target=busy, daemon=True) for _ in range(n)]
    for p in procs:
        p.start()
    if settle:
        time.sleep(0.3)  # let the scheduler settle them on the cores
    return procs


def stop_load(procs):
    for p in procs:
        p.terminate()
    for p in procs:
        p.join()


def run(cmd, env):
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, errors="replace", env=env,
                       preexec_fn=set_nice)
    dt = time.perf_counter() - t0
    if r.returncode != 0:
        sys.exit(f"bench_oversubscribed: {' '.join(cmd)} failed ({r.returncode}):\n{r.stderr}")
    return dt, r


def prepare_model(lathe, tmp, env):
    data = os.path.join(tmp, "shakespeare_byte")
    run([lathe, "tokenize", "--tokenizer", "byte", "--input", os.path.join(ROOT, "data", "tinyshakespeare.txt"),
         "--output", data, "--overwrite"], env)
    out = os.path.join(tmp, "run")
    run([lathe, "train", os.path.join(ROOT, "configs", "quickstart.yaml"), "--set", f"data.train={data}",
         "--set", f"output.dir={out}", "--set", "training.steps=1", "--set", "model.n_embd=256",
         "--set", "training.eval_interval=0", "--set", "schedule.warmup_steps=0",
         "--set", "training.eval_batches=1"], env)
    return os.path.join(out, "model")


def generate_ms_per_token(lathe, model, tokens, env):
    base = [lathe, "generate", "--model", model, "--prompt", "ROMEO:", "--seed", "1", "--max-new-tokens"]
    t1, _ = run(base + ["1"], env)
    tn, r = run(base + [str(tokens)], env)
    notes = [l for l in r.stderr.splitlines() if "wait" in l.lower() or "oversubscri" in l.lower()]
    return 1000.0 * max(tn - t1, 0.0) / (tokens - 1), notes


def generate_late(lathe, model, tokens, env, load_n):
    """Seconds from the prompt's appearance on stdout (the load starts then) to exit."""
    cmd = [lathe, "generate", "--model", model, "--prompt", "ROMEO:", "--seed", "1", "--max-new-tokens", str(tokens)]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, preexec_fn=set_nice)
    seen = b""
    while b"ROMEO:" not in seen:
        c = p.stdout.read(1)
        if not c:
            break
        seen += c
    t0 = time.perf_counter()
    load = start_load(load_n, settle=False) if load_n else []
    try:
        out, err = p.communicate()
        dt = time.perf_counter() - t0
    finally:
        stop_load(load)
    if p.returncode != 0:
        sys.exit(f"bench_oversubscribed: {' '.join(cmd)} failed ({p.returncode}):\n{err.decode(errors='replace')}")
    notes = [l for l in err.decode(errors="replace").splitlines() if "lathe" in l and "note" in l]
    return dt, notes


def generate_late_ms_per_token(lathe, model, tokens, env, load_n):
    t1, _ = generate_late(lathe, model, 1, env, load_n)
    tn, notes = generate_late(lathe, model, tokens, env, load_n)
    return 1000.0 * max(tn - t1, 0.0) / (tokens - 1), notes


STEP_MS = re.compile(r"^step\s+(\d+)/\d+ .*\| ([0-9.]+) ms \|")


def train_late_ms_per_step(lathe, data, tmp, steps, env, load_n):
    out = os.path.join(tmp, "late_run")
    cmd = [lathe, "train", os.path.join(ROOT, "configs", "quickstart.yaml"), "--set", f"data.train={data}",
           "--set", f"output.dir={out}", "--overwrite", "--set", f"training.steps={steps + 4}",
           "--set", "model.n_embd=256", "--set", "training.eval_interval=0", "--set", "schedule.warmup_steps=0",
           "--set", "training.eval_batches=1", "--set", "training.log_interval=1",
           "--set", "training.micro_batch_size=4", "--set", "training.seq_len=64"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, preexec_fn=set_nice,
                         text=True, errors="replace")
    load, times, lines = [], [], []
    try:
        for line in p.stdout:
            lines.append(line)
            m = STEP_MS.match(line)
            if not m:
                continue
            step = int(m.group(1))
            if step == 2 and load_n:
                load = start_load(load_n, settle=False)
            if step >= 4:
                times.append(float(m.group(2)))
        p.wait()
    finally:
        stop_load(load)
    if p.returncode != 0 or not times:
        sys.exit(f"bench_oversubscribed: {' '.join(cmd)} failed ({p.returncode}):\n{''.join(lines[-30:])}")
    notes = [l.strip() for l in lines if "lathe" in l and "note" in l]
    return statistics.median(times), notes


def train_ms_per_step(bench, steps, env):
    _, r = run([bench, "gpt2-small-bench", "4", "64", str(steps)], env)
    notes = [l for l in r.stderr.splitlines() if "wait" in l.lower() or "oversubscri" in l.lower()]
    return json.loads(r.stdout.strip().splitlines()[-1])["ms_per_step"], notes


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--load", type=int, default=os.cpu_count(), help="busy processes when loaded")
    ap.add_argument("--env", action="append", default=[], help="KEY=VALUE for lathe's environment")
    ap.add_argument("--late", action="store_true", help="the load arrives after lathe started (see above)")
    ap.add_argument("--only", choices=["generate", "train"], help="measure only one of the two")
    ap.add_argument("--nice", type=int, default=0,
                    help="run lathe and the load at this nice value (root: e.g. -20 on a machine others share, "
                         "so their work barely counts; both sides get it, so the comparison stays fair)")
    a = ap.parse_args()
    global NICE
    NICE = a.nice
    lathe = os.path.join(a.build, "lathe")
    bench = os.path.join(a.build, "bench", "bench_train_step")
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads))
    for kv in a.env:
        k, _, v = kv.partition("=")
        env[k] = v
    print(f"CPU: {cpu_model()}, {os.cpu_count()} online CPUs; lathe with {a.threads} threads; "
          f"loaded = {a.load} busy processes{' arriving after start' if a.late else ''}; "
          f"extra env: {' '.join(a.env) or '(none)'}")
    print(f"machine before: {uptime()}", flush=True)
    kinds = [a.only] if a.only else ["generate", "train"]
    if "train" in kinds and not a.late and not os.path.exists(bench):
        sys.exit(f"bench_oversubscribed: {bench} not found: cmake --build {a.build} --target bench_train_step")
    res = {(k, s): [] for k in kinds for s in ("idle", "loaded")}
    notes = set()
    with tempfile.TemporaryDirectory() as tmp:
        # The model is made with passive waiting whatever --env says (it is not measured).
        prep_env = dict(env, OMP_WAIT_POLICY="PASSIVE")
        prep_env.pop("GOMP_SPINCOUNT", None)
        model = prepare_model(lathe, tmp, prep_env)
        data = os.path.join(tmp, "shakespeare_byte")
        for rep in range(a.reps):
            for state in ("idle", "loaded") if rep % 2 == 0 else ("loaded", "idle"):
                if a.late:
                    n_load = a.load if state == "loaded" else 0
                    if "generate" in kinds:
                        ms, n = generate_late_ms_per_token(lathe, model, a.tokens, env, n_load)
                        res[("generate", state)].append(ms)
                        print(f"  generate {state} (late): {ms:.2f} ms/token", flush=True)
                        notes.update(n)
                    if "train" in kinds:
                        ms, n = train_late_ms_per_step(lathe, data, tmp, a.steps, env, n_load)
                        res[("train", state)].append(ms)
                        print(f"  train {state} (late): {ms:.1f} ms/step", flush=True)
                        notes.update(n)
                    continue
                load = start_load(a.load) if state == "loaded" else []
                try:
                    if "generate" in kinds:
                        ms, n = generate_ms_per_token(lathe, model, a.tokens, env)
                        res[("generate", state)].append(ms)
                        print(f"  generate {state}: {ms:.2f} ms/token", flush=True)
                        notes.update(n)
                    if "train" in kinds:
                        ms, n = train_ms_per_step(bench, a.steps, env)
                        res[("train", state)].append(ms)
                        print(f"  train {state}: {ms:.1f} ms/step", flush=True)
                        notes.update(n)
                finally:
                    stop_load(load)
    print(f"machine after: {uptime()}")
    for n in sorted(notes):
        print(f"  lathe said: {n}")
    unit = {"generate": "ms/token", "train": "ms/step"}
    for k in kinds:
        idle, loaded = statistics.median(res[(k, "idle")]), statistics.median(res[(k, "loaded")])
        runs = lambda s: " ".join(f"{x:.2f}" for x in res[(k, s)])
        print(f"{k:<9} idle {idle:9.2f} {unit[k]}  loaded {loaded:9.2f} {unit[k]}  loaded/idle {loaded / idle:6.2f}x"
              f"   (runs idle: {runs('idle')}; loaded: {runs('loaded')})")


if __name__ == "__main__":
    main()
