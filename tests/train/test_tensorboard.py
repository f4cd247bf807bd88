#!/usr/bin/env python3
"""output.tensorboard (issue 29 item 4): OUTPUT/tensorboard/events.out.tfevents.* read back by
TensorBoard's own reader (EventAccumulator of the `tensorboard` PyPI package, scripts/requirements-test.txt)
and, independently, by a hand decoder of the TFRecord framing that checks both masked CRC32Cs.
  * a 6-step run with validation and checkpoints: every numeric field of every metrics.jsonl record
    is a scalar GROUP/FIELD whose steps and values (as float32) equal metrics.jsonl's
  * the resolved recipe is the text summary "recipe" (the text plugin's string tensor)
  * the whole run again, then --resume from the step-3 checkpoint (steps 4..6 rewritten): a second
    event file; the reader's per-tag steps stay strictly increasing and equal metrics.jsonl's
  * without the key no tensorboard/ directory is written
Skips (77) when tensorboard is not installed (scripts/setup.sh --test installs it).
"""
import glob
import json
import os
import struct
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import numpy as np  # noqa: E402
from train_helpers import ENV, LATHE, check, finish, patterned_data, write_recipe  # noqa: E402

try:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
except ImportError:
    print("skipped: the tensorboard package is not installed (bash scripts/setup.sh --test installs it)")
    sys.exit(77)

POLY = 0x82F63B78
TABLE = []
for i in range(256):
    c = i
    for _ in range(8):
        c = (c >> 1) ^ POLY if c & 1 else c >> 1
    TABLE.append(c)


def masked_crc(b):
    c = 0xFFFFFFFF
    for x in b:
        c = TABLE[(c ^ x) & 0xFF] ^ (c >> 8)
    c ^= 0xFFFFFFFF
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def records(path):
    """The framed records of PATH; raises on a bad CRC or a torn record."""
    data, out, pos = open(path, "rb").read(), [], 0
    while pos < len(data):
        (n,) = struct.unpack_from("<Q", data, pos)
        (lc,) = struct.unpack_from("<I", data, pos + 8)
        assert lc == masked_crc(data[pos:pos + 8]), f"{path}: length CRC at {pos}"
        body = data[pos + 12:pos + 12 + n]
        (dc,) = struct.unpack_from("<I", data, pos + 12 + n)
        assert len(body) == n and dc == masked_crc(body), f"{path}: data CRC at {pos}"
        out.append(body)
        pos += 16 + n
    return out


def group(rec):
    if "loss" in rec:
        return "train"
    if "checkpoint_s" in rec:
        return "checkpoint"
    if "peak_rss_mb_max_rank" in rec:
        return "run"
    if "tasks_acc" in rec:
        return "tasks"
    return "val"


def expected(out):
    """{tag: [(step, float32 value)]} from OUT/metrics.jsonl."""
    tags = {}
    for line in open(os.path.join(out, "metrics.jsonl")):
        rec = json.loads(line)
        for k, v in rec.items():
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                tags.setdefault(f"{group(rec)}/{k}", []).append((rec["step"], float(np.float32(v))))
    return tags


def read_back(out):
    acc = EventAccumulator(os.path.join(out, "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    tags = acc.Tags()
    return acc, {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in tags["scalars"]}


def compare(out, what, steps=6):
    acc, got = read_back(out)
    want = expected(out)
    check(sorted(got) == sorted(want), f"{what}: the scalar tags are metrics.jsonl's numeric fields "
          f"(missing {sorted(set(want) - set(got))[:5]}, extra {sorted(set(got) - set(want))[:5]})")
    bad = [t for t in want if got.get(t) != want[t]]
    check(not bad, f"{what}: every tag's (step, value) list equals metrics.jsonl's (differ: {bad[:5]})")
    nonmono = [t for t, v in got.items() if any(b[0] <= a[0] for a, b in zip(v, v[1:]))]
    check(not nonmono, f"{what}: every tag's steps strictly increasing ({nonmono[:5]})")
    check(len(want.get("train/loss", [])) == steps, f"{what}: {steps} loss points")
    return acc


def main():
    tmp = tempfile.mkdtemp(prefix="lathe_tensorboard_")
    data = patterned_data(tmp, np.random.default_rng(0))
    training = {"micro_batch_size": 2, "seq_len": 16, "steps": 6, "log_interval": 1, "eval_interval": 2,
                "peak_gflops": 100}
    out = os.path.join(tmp, "run")
    recipe = write_recipe(out, data, training, output={"dir": out, "tensorboard": True, "checkpoint_every": 3})
    p = subprocess.run([LATHE, "train", recipe, "--quiet"], capture_output=True, text=True, env=ENV, timeout=600)
    check(p.returncode == 0, "trains with output.tensorboard: true " + p.stderr[-300:])
    files = sorted(glob.glob(os.path.join(out, "tensorboard", "events.out.tfevents.*")))
    check(len(files) == 1, "one event file")
    n = sum(len(records(f)) for f in files)
    check(n > 6 * 15, f"the hand decoder reads {n} records, every CRC right")
    acc = compare(out, "fresh run")
    text = acc.Tensors("recipe") if "recipe" in acc.Tags()["tensors"] else []
    yaml = open(os.path.join(out, "recipe.yaml")).read()
    check(len(text) == 1 and yaml in text[0].tensor_proto.string_val[0].decode(),
          "the text summary 'recipe' holds recipe.yaml")
    check(acc.SummaryMetadata("recipe").plugin_data.plugin_name == "text", "its plugin is 'text'")
    check(acc.file_version == 2.0, f"file_version brain.Event:2 (read as {acc.file_version!r})")
    check("tensorboard: true" in yaml, "the resolved recipe states output.tensorboard")

    # Back to step 3 (steps 4..6 are written again by the resumed session).
    p = subprocess.run([LATHE, "train", recipe, "--quiet", "--resume", os.path.join(out, "checkpoints", "step_00000003")],
                       capture_output=True, text=True, env=ENV, timeout=600)
    check(p.returncode == 0, "resumes from the step-3 checkpoint " + p.stderr[-300:])
    files = sorted(glob.glob(os.path.join(out, "tensorboard", "events.out.tfevents.*")))
    check(len(files) == 2 and files[1].endswith("step0000000003"), f"a second event file: {files}")
    compare(out, "after the resume")

    # An anomaly rollback (loss spikes at steps 5 and 7, test hook train/fault_plan.h) back to the
    # step-4 checkpoint: metrics.jsonl restarts there, and so do the curves.
    out = os.path.join(tmp, "rollback")
    anomaly = {"enabled": True, "warmup_steps": 2, "grad_norm_z_threshold": 0, "lr_steps": 0, "rollback_after": 2,
               "rollback_window": 3, "max_rollbacks": 3, "skip_samples": 0}
    recipe = write_recipe(out, data, dict(training, steps=10, eval_interval=0, anomaly=anomaly),
                          output={"dir": out, "tensorboard": True, "checkpoint_every": 2})
    p = subprocess.run([LATHE, "train", recipe, "--quiet"], capture_output=True, text=True, timeout=600,
                       env=dict(ENV, LATHE_TEST_LOSS_SPIKE_STEPS="5,7"))
    events = [json.loads(l)["event"] for l in open(os.path.join(out, "anomalies.jsonl"))] if p.returncode == 0 else []
    check("rollback" in events, f"the spikes roll the run back: {events} {p.stderr[-300:]}")
    compare(out, "after a rollback", steps=10)

    out = os.path.join(tmp, "plain")
    p = subprocess.run([LATHE, "train", write_recipe(out, data, training), "--quiet"], capture_output=True, text=True,
                       env=ENV, timeout=600)
    check(p.returncode == 0 and not os.path.exists(os.path.join(out, "tensorboard")), "no key: no tensorboard/")
    check("tensorboard:" not in open(os.path.join(out, "recipe.yaml")).read(), "no key: not in the resolved recipe")
    return finish(tmp)


if __name__ == "__main__":
    sys.exit(main())
