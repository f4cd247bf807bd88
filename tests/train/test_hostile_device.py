#!/usr/bin/env python3
"""`device: cuda` where this lathe cannot run it: `lathe check` and `lathe train` both exit 1 with
the same error naming the key, the reason (built without CUDA / no visible GPU) and the fix; a bad
device value names the allowed ones. On a CUDA build with a usable GPU the refusal case is skipped
with a printed reason (it cannot be provoked there) and the rest still runs."""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.environ.get("LATHE_SOURCE_DIR", os.path.join(HERE, "..", "..")), "tests"))
sys.path.insert(0, HERE)
from hostile import Cases, Failure, error_text, run_lathe  # noqa: E402
from kill_test_lib import hostile_recipe, make_data  # noqa: E402

cases = Cases()
tmp = cases.tmp
data = make_data(tmp, "shake", 20000)


def recipe(name, extra=""):
    return hostile_recipe(tmp, data, name, extra)


with cases.case("device: cuda without a usable GPU: check and train refuse with the same reason"):
    rec = recipe("cuda", "device: cuda\n")
    probe = run_lathe(["check", rec], rc=(0, 1))
    if probe.returncode == 0:
        print("SKIP: this lathe has CUDA and a usable GPU, so device: cuda is accepted here", flush=True)
    else:
        must = ["device: cuda: ", "or set device: cpu", rec]
        pc = run_lathe(["check", rec], rc=1, must=["lathe check: error:"] + must)
        pt = run_lathe(["train", rec, "--quiet"], rc=1, must=["lathe train: error:"] + must)
        if error_text(pc) != error_text(pt):
            raise Failure(f"check and train differ:\n  check: {error_text(pc)}\n  train: {error_text(pt)}")
        msg = error_text(pc)
        if "built without CUDA" in msg:
            if "-DLATHE_CUDA=ON" not in msg:
                raise Failure(f"the fix (rebuild with -DLATHE_CUDA=ON) is not named: {msg}")
        elif "CUDA_VISIBLE_DEVICES" not in msg:
            raise Failure(f"neither 'built without CUDA' nor the no-GPU fix in: {msg}")
        if os.path.exists(os.path.join(tmp, "out_cuda", "metrics.jsonl")):
            raise Failure("train wrote metrics before refusing the device")

with cases.case("--set device=cuda is the same refusal as the recipe key"):
    rec = recipe("plain")
    probe = run_lathe(["check", rec, "--set", "device=cuda"], rc=(0, 1))
    if probe.returncode == 1:
        if "device: cuda: " not in error_text(probe):
            raise Failure(error_text(probe))

with cases.case("device: tpu names the allowed values"):
    run_lathe(["check", recipe("tpu", "device: tpu\n")], rc=1,
              must=["device: must be one of cpu, cuda (default cpu), got 'tpu'"])
    run_lathe(["train", recipe("plain2"), "--set", "device=GPU"], rc=1,
              must=["--set device=GPU", "must be one of cpu, cuda"])

with cases.case("device: cpu (explicit) checks as the default does"):
    run_lathe(["check", recipe("cpu", "device: cpu\n")], rc=0, stream="stdout", must=["precision: fp32 compute on cpu"])

cases.finish()
