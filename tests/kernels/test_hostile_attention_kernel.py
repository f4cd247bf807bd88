#!/usr/bin/env python3
"""model.attention_kernel (cuDNN SDPA option, issue 12) where it cannot run: `lathe check` and
`lathe train` exit 1 naming the key, the value and the fix, before anything is written: a value
other than lathe | cudnn, cudnn with device: cpu, cudnn with fp32 compute. The recipe key and its
--set override give the same refusal."""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.environ.get("LATHE_SOURCE_DIR", os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(SRC, "tests"))
sys.path.insert(0, os.path.join(SRC, "tests", "train"))
from hostile import Cases, run_lathe  # noqa: E402
from kill_test_lib import HOSTILE_RECIPE as RECIPE, make_data  # noqa: E402

cases = Cases()
tmp = cases.tmp
data = make_data(tmp, "shake", 20000)


def recipe(name, model_extra="", extra=""):
    p = os.path.join(tmp, name + ".yaml")
    text = RECIPE.format(data=data, out=os.path.join(tmp, "out_" + name))
    text = text.replace("vocab_size: 256}", "vocab_size: 256" + model_extra + "}")
    open(p, "w").write(text + extra)
    return p


with cases.case("a value other than lathe | cudnn names the allowed ones"):
    rec = recipe("flash", ", attention_kernel: flash")
    run_lathe(["check", rec], rc=1,
              must=["model.attention_kernel", "must be one of lathe, cudnn (default lathe), got 'flash'"])

with cases.case("cudnn on device: cpu is refused naming the key and the fix (recipe key and --set alike)"):
    must = ["model.attention_kernel", "cudnn runs on GPUs only and this recipe's device is cpu",
            "set device: cuda, or model.attention_kernel: lathe"]
    rec = recipe("cpu", ", attention_kernel: cudnn")
    run_lathe(["check", rec], rc=1, must=["lathe check: error:"] + must)
    run_lathe(["train", rec, "--quiet"], rc=1, must=["lathe train: error:"] + must)
    if os.path.exists(os.path.join(tmp, "out_cpu", "metrics.jsonl")):
        raise AssertionError("train wrote metrics before refusing model.attention_kernel")
    run_lathe(["check", recipe("plain"), "--set", "model.attention_kernel=cudnn"], rc=1, must=must)

with cases.case("cudnn with fp32 compute is refused naming precision.compute"):
    rec = recipe("fp32", ", attention_kernel: cudnn", "device: cuda\n")
    run_lathe(["check", rec], rc=1,
              must=["model.attention_kernel", "bf16 or fp16 only and precision.compute is fp32",
                    "set precision.compute: bf16"])

with cases.case("attention_kernel: lathe (explicit) checks as the default does"):
    run_lathe(["check", recipe("lathe", ", attention_kernel: lathe")], rc=0, stream="stdout")

cases.finish()
