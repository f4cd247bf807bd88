#!/usr/bin/env python3
"""Recipes that `lathe check` passed while `lathe train` refused them, or that trained nonsense
(issue 23; hostile pass 2026-12-01 S3, S4, S12, H3). `check` and `train` run one preflight
(train/preflight.h), so each case asserts both refuse, with the same message, before step 1:
  * S3: training.eval_tasks (missing file, bad JSON, a label out of range, an ending longer than
    seq_len named by file and line, which train only met at the first scoring);
  * S4: data.attention: document / reset_position_ids / mask_loss_after_eod with the byte tokenizer
    and no data.eod_token;
  * S12: data of EOD ids only with mask_loss_after_eod (no target: "loss 0.0000" before);
  * H3: SIGINT during a long blend planning stops it (exit 75, no cache written, no step run).

Env: LATHE_BIN, LATHE_SOURCE_DIR. Run: /usr/bin/python3 test_hostile_recipe.py
"""
import json
import os
import re
import signal
import subprocess
import sys
import threading

import numpy as np

SRC = os.environ.get("LATHE_SOURCE_DIR", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(SRC, "tests"))
sys.path.insert(0, os.path.join(SRC, "tests", "train"))
import megatron_writer  # noqa: E402
from hostile import LATHE, Cases, run_lathe  # noqa: E402

cases = Cases()
DATA = cases.path("data", "d")
megatron_writer.write(DATA, [np.append((np.arange(60 + d) % 50) + 40, 10) for d in range(16)])
EOD_ONLY = cases.path("data", "eod_only")
megatron_writer.write(EOD_ONLY, [np.full(70, 10) for _ in range(8)])


def recipe(name, data_extra=None, training_extra=None):
    data = {"train": DATA, "valid_fraction": 0.1, "tokenizer": "byte"}
    data.update(data_extra or {})
    training = {"micro_batch_size": 2, "seq_len": 16, "steps": 2, "eval_interval": 0, "peak_gflops": 100,
                "threads": 1}
    training.update(training_extra or {})
    r = {"model": {"preset": "gpt2-debug", "vocab_size": 256}, "data": data,
         "optimizer": {"name": "adamw", "lr": 1e-3}, "schedule": {"name": "constant"}, "training": training,
         "output": {"dir": cases.path("runs", name)}}
    return cases.write(name + ".yaml", json.dumps(r))


def both_refuse(r, must):
    """check and train exit 1 with every string of `must`; train before its first step."""
    run_lathe(["check", r], rc=1, must=must, timeout=60)
    p = run_lathe(["train", r], rc=1, must=must, timeout=60)
    assert "step " not in p.stdout.decode(), p.stdout.decode()[-2000:]


def tasks(name, lines):
    return cases.write(name, "".join(line + "\n" for line in lines))


GOOD = json.dumps({"context": "the cat", "endings": [" sat", " ran"], "label": 0})

with cases.case("control: eval_tasks, documents and mask_loss_after_eod with an EOD id check and train"):
    r = recipe("ok", {"attention": "document", "mask_loss_after_eod": True, "eod_token": 10},
               {"eval_tasks": tasks("good.jsonl", [GOOD, GOOD])})
    run_lathe(["check", r], rc=0, stream="stdout", must=["training.eval_tasks", "2 items", "can start"])
    run_lathe(["train", r, "--quiet"], rc=0, timeout=120)

with cases.case("S3: training.eval_tasks missing, bad JSON, label out of range, not an object: check refuses"):
    bad = {"missing.jsonl": (None, ["missing.jsonl"]),
           "badjson.jsonl": ([GOOD, "{not json"], ["badjson.jsonl line 2"]),
           "label.jsonl": ([json.dumps({"context": "a", "endings": [" b", " c"], "label": 5})],
                           ["label.jsonl line 1", "label"]),
           "five.jsonl": (["5"], ["five.jsonl line 1", "expected an object"])}
    for name, (lines, must) in bad.items():
        path = cases.path(name) if lines is None else tasks(name, lines)
        both_refuse(recipe("t_" + name, training_extra={"eval_tasks": path}), ["training.eval_tasks"] + must)

with cases.case("S3: an ending longer than seq_len is refused before training, naming file and line"):
    long_item = json.dumps({"context": "a", "endings": [" b", "x" * 4096], "label": 0})
    path = tasks("long.jsonl", [GOOD, GOOD, long_item])
    both_refuse(recipe("t_long", training_extra={"eval_tasks": path}),
                ["long.jsonl line 3", "ending 1 has 4096 tokens", "training.seq_len"])

for key, value in (("attention", "document"), ("mask_loss_after_eod", True), ("reset_position_ids", True)):
    with cases.case(f"S4: data.{key} with the byte tokenizer and no data.eod_token: check refuses as train does"):
        both_refuse(recipe(f"eod_{key}", {key: value}), ["data.eod_token is needed", "'byte' has no EOS token"])

with cases.case("S12: data of EOD ids only with mask_loss_after_eod: refused as having no targets"):
    both_refuse(recipe("eod_only", {"train": EOD_ONLY, "mask_loss_after_eod": True, "eod_token": 10}),
                ["data.train " + EOD_ONLY, "EOD id 10", "no token is a target"])
    r = recipe("eod_only_valid", {"valid": EOD_ONLY, "mask_loss_after_eod": True, "eod_token": 10},
               {"eval_interval": 1})
    both_refuse(r, ["data.valid " + EOD_ONLY, "no token is a target"])
    # Without the mask the same data trains (every target is the EOD id: a real loss).
    run_lathe(["check", recipe("eod_only_nomask", {"train": EOD_ONLY})], rc=0, stream="stdout", must=["can start"])


with cases.case("H3: SIGINT during blend planning stops it: exit 75, no plan cache, no step"):
    out = cases.path("runs", "sigint")
    r = recipe("sigint", {"blend": [{"prefix": DATA, "weight": 0.7}, {"prefix": EOD_ONLY, "weight": 0.3}]},
               {"steps": 50_000_000})  # 100M samples: a 1.2 GB plan, seconds of planning
    text = json.loads(open(r).read())
    del text["data"]["train"], text["data"]["valid_fraction"]
    open(r, "w").write(json.dumps(text))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.Popen([LATHE, "train", r], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    killer = threading.Timer(120, p.kill)  # a hang fails the case below (rc -9)
    killer.start()
    seen = []
    for line in iter(p.stdout.readline, b""):
        seen.append(line.decode())
        if "SIGINT stops it" in seen[-1]:
            p.send_signal(signal.SIGINT)
            break
    rest, err = p.communicate()
    killer.cancel()
    log = "".join(seen) + rest.decode()
    assert p.returncode == 75, f"exit {p.returncode}\nstdout: {log[-2000:]}\nstderr: {err.decode()[-2000:]}"
    assert "planning stopped by a signal" in err.decode(), err.decode()
    assert "step " not in log and "saved checkpoint" not in log, log[-2000:]
    cache = os.path.join(out, "data_cache")
    left = os.listdir(cache) if os.path.isdir(cache) else []
    assert not left, f"the interrupted run left {left}"


with cases.case("H3: SIGINT after planning, during the remaining startup checks: stopped before step 1 (exit 75)"):
    # A large training.eval_tasks file keeps preflight's last step busy for a while after the model
    # line; the signal sent then must not let the run reach step 1.
    item = json.dumps({"context": "the quick brown fox " * 10, "endings": [" jumps", " sleeps"], "label": 0})
    big = tasks("big.jsonl", [item] * 100_000)
    r = recipe("sigint_late", training_extra={"eval_tasks": big, "steps": 4})
    p = subprocess.Popen([LATHE, "train", r], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    killer = threading.Timer(120, p.kill)
    killer.start()
    seen = []
    for line in iter(p.stdout.readline, b""):
        seen.append(line.decode())
        if re.match(r"model \w+: \d+ parameters$", seen[-1].strip()):  # preflight's line before eval_tasks
            p.send_signal(signal.SIGINT)
            break
    rest, err = p.communicate()
    killer.cancel()
    log = "".join(seen) + rest.decode()
    assert p.returncode == 75, f"exit {p.returncode}\nstdout: {log[-2000:]}\nstderr: {err.decode()[-2000:]}"
    assert "stopped before step 1" in err.decode(), err.decode()
    assert "step " not in log.replace("step 1", ""), log[-2000:]
    assert not os.path.exists(cases.path("runs", "sigint_late", "checkpoints", "step_00000001")), log[-2000:]

cases.finish()
