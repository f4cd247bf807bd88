#!/usr/bin/env python3
"""Hostile blends (recipe data.blend, issue 11) through `lathe check`, `lathe train` and
`lathe data blend-plan`: every bad entry is refused with exit 1 and an error naming the entry index
and key (data.blend[i].weight, data.blend[i].prefix, ...) and the fix; a corrupt plan cache is
never used; a resume whose blended prefix changed size is refused naming loader.blend. Bounded time
and memory per case (tests/hostile.py).

Env: LATHE_BIN, LATHE_SOURCE_DIR. Run: /usr/bin/python3 test_hostile_blend.py
"""
import json
import os
import sys

import numpy as np

SRC = os.environ.get("LATHE_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(SRC, "tests"))
sys.path.insert(0, os.path.join(SRC, "tests", "train"))
import megatron_writer  # noqa: E402
from hostile import Cases, run_lathe  # noqa: E402

cases = Cases()


def dataset(name, ndocs=12, lo=0, dtype=np.uint16):
    docs = [(np.arange(80 + d) % 50) + lo for d in range(ndocs)]
    prefix = cases.path("data", name)
    megatron_writer.write(prefix, docs, dtype=dtype)
    return prefix


WEB, CODE = dataset("web"), dataset("code", lo=60)


def recipe(name, blend, data_extra=None, training_extra=None):
    data = {"blend": blend}
    data.update(data_extra or {})
    training = {"micro_batch_size": 2, "seq_len": 16, "steps": 4, "seed": 7, "eval_interval": 0, "peak_gflops": 100,
                "threads": 1}
    training.update(training_extra or {})
    r = {"model": {"preset": "gpt2-debug", "vocab_size": 256}, "data": data,
         "optimizer": {"name": "adamw", "lr": 3e-3}, "schedule": {"name": "constant"}, "training": training,
         "output": {"dir": cases.path("runs", name)}}
    return cases.write(name + ".yaml", json.dumps(r))


def good(**kw):
    return [{"prefix": WEB, "weight": 0.7}, {"prefix": CODE, "weight": 0.3, **kw}]


def check(name, blend, must, **kw):
    run_lathe(["check", recipe(name, blend, **kw)], rc=1, must=must)


with cases.case("control: a valid blend checks, trains, and plans"):
    r = recipe("ok", good())
    run_lathe(["check", r], rc=0, stream="stdout", must=["data.blend[1] " + CODE, "can start"])
    run_lathe(["train", r, "--quiet"], rc=0, stream="stdout", timeout=120)
    run_lathe(["data", "blend-plan", r], rc=0, stream="stdout", must=["reused", "70.00%"])

with cases.case("weight 0 names the entry and the key"):
    check("w0", good(weight=0), ["data.blend[1].weight", "0 must be > 0"])
with cases.case("negative weight"):
    check("wneg", [{"prefix": WEB, "weight": -1}], ["data.blend[0].weight", "-1 must be > 0"])
with cases.case("weight missing"):
    check("wmiss", [{"prefix": WEB}], ["data.blend[0].weight", "is missing"])
with cases.case("weight not a number"):
    check("wstr", [{"prefix": WEB, "weight": "heavy"}], ["data.blend[0].weight", "expected a number"])
with cases.case("weight infinite"):
    r = recipe("winf", [{"prefix": WEB, "weight": 1e999}])
    cases.write("winf.yaml", open(r).read().replace("Infinity", "1e999"))  # YAML reads 1e999 as +inf
    run_lathe(["check", r], rc=1, must=["data.blend[0].weight", "not a finite number"])
with cases.case("negative epochs"):
    check("eneg", good(epochs=-2), ["data.blend[1].epochs", "-2 must be > 0"])
with cases.case("prefix key missing"):
    check("pmiss", [{"weight": 1}], ["data.blend[0].prefix", "is missing"])
with cases.case("unknown key in an entry suggests the right one"):
    check("typo", [{"prefix": WEB, "wieght": 1}], ["unknown key 'data.blend[0].wieght'", "data.blend[0].weight"])
with cases.case("blend not a list"):
    check("notlist", {"prefix": WEB, "weight": 1}, ["data.blend", "expected a list"])
with cases.case("an entry that is not a mapping"):
    check("notmap", [WEB], ["data.blend[0]", "expected a mapping"])
with cases.case("empty blend"):
    check("empty", [], ["data.blend", "empty list"])
with cases.case("both data.train and data.blend"):
    check("both", good(), ["data.blend", "data.train", "both set"], data_extra={"train": WEB})
with cases.case("neither data.train nor data.blend"):
    run_lathe(["check", cases.write("neither.yaml", json.dumps({"model": {"preset": "gpt2-debug"},
                                                                 "training": {"eval_interval": 0}}))],
              rc=1, must=["data.train", "is missing", "data.blend"])
with cases.case("a missing prefix names the entry and the path"):
    missing = cases.path("data", "nope")
    check("nofile", good() + [{"prefix": missing, "weight": 1}], ["data.blend[2].prefix " + missing, "nope.idx"])
with cases.case("datasets of different token dtypes"):
    wide = dataset("wide", dtype=np.int32)
    check("dtype", [{"prefix": WEB, "weight": 1}, {"prefix": wide, "weight": 1}],
          ["data.blend[1].prefix " + wide, "token dtype I32 differs from data.blend[0]", "re-tokenize"])
with cases.case("token ids beyond the model's vocabulary"):
    big = dataset("big", lo=300)
    check("vocab", good() + [{"prefix": big, "weight": 1}],
          ["data.blend[2].prefix " + big, "contains token id 349", "model.vocab_size is 256"])
with cases.case("a dataset too small for one sample"):
    tiny = cases.path("data", "tiny")
    megatron_writer.write(tiny, [np.arange(5)])
    check("tiny", good() + [{"prefix": tiny, "weight": 1}], ["data.blend[2].prefix " + tiny, "no sample"])
with cases.case("the run needs more epochs than a dataset's cap"):
    check("cap", good(epochs=0.01), [CODE, "beyond its cap epochs: 0.01"])
with cases.case("periodic validation without data.valid"):
    check("noval", good(), ["training.eval_interval", "data.blend", "data.valid"], training_extra={"eval_interval": 2})
with cases.case("blend-plan on a recipe without a blend"):
    r = cases.write("plain.yaml", json.dumps({"model": {"preset": "gpt2-debug", "vocab_size": 256},
                                              "data": {"train": WEB}, "training": {"eval_interval": 0}}))
    run_lathe(["data", "blend-plan", r], rc=1, must=["no data.blend", WEB])

with cases.case("a corrupt plan cache is rebuilt, never used"):
    r = recipe("corrupt", good())
    run_lathe(["train", r, "--quiet"], rc=0, timeout=120)
    cache = cases.path("runs", "corrupt", "data_cache")
    f = os.path.join(cache, [n for n in os.listdir(cache) if n.startswith("blend-")][0])
    blob = bytearray(open(f, "rb").read())
    for cut in (len(blob) - 3, 0):  # truncated, then empty
        open(f, "wb").write(bytes(blob[:cut]))
        p = run_lathe(["train", r, "--overwrite"], rc=0, stream="stdout", timeout=120,  # the cache stays in place
                      must=["rebuilt (the cache was unusable"])
    assert open(f, "rb").read() == bytes(blob), "the rebuilt cache equals the original"

with cases.case("resume after a blended prefix changed size is refused naming loader.blend"):
    r = recipe("resume", good(), training_extra={"steps": 6})
    run_lathe(["train", r, "--quiet", "--stop-after", "3"], rc=0, timeout=120)
    megatron_writer.write(CODE, [(np.arange(90 + d) % 50) + 60 for d in range(14)])
    run_lathe(["train", r, "--quiet", "--resume", "auto"], rc=1, timeout=120,
              must=["state.json", "loader.blend", "changed its size", "--force-resume-changes"])


with cases.case("document attention: a blended prefix without the EOD id is named; an EOD id beyond the vocabulary"):
    eod_web = cases.path("data", "eod_web")
    megatron_writer.write(eod_web, [np.append(np.arange(40 + d) % 50, 255) for d in range(12)])
    doc = {"attention": "document", "eod_token": 255, "tokenizer": "byte"}  # as real corpora
    run_lathe(["check", recipe("eod_ok", [{"prefix": eod_web, "weight": 1}], data_extra=doc)], rc=0, stream="stdout",
              must=[f"data.blend[0].prefix {eod_web}: 12 of 12 sequences checked end with the EOD id 255"])
    check("eod_missing", [{"prefix": eod_web, "weight": 1}, {"prefix": CODE, "weight": 1}],
          [f"data.blend[1].prefix {CODE}: the EOD id 255 occurs nowhere", "--append-eos"], data_extra=doc)
    check("eod_vocab", [{"prefix": eod_web, "weight": 1}], ["data.eod_token", "256"],
          data_extra={"attention": "document", "eod_token": 256, "tokenizer": "byte"})

# ------------------------------------------------------------------------------ issue 23 (hostile pass 2026-12-01)
with cases.case("S5: weights 1e308 + 1e308 overflow their sum: both datasets keep their 50% share"):
    r = recipe("huge_w", [{"prefix": WEB, "weight": 1e308}, {"prefix": CODE, "weight": 1e308}])
    p = run_lathe(["check", r], rc=0, stream="stdout", must=["(50.00%)"])
    assert p.stdout.decode().count("(50.00%)") == 4, p.stdout.decode()  # asked and planned, per dataset
    p = run_lathe(["data", "blend-plan", r], rc=0, stream="stdout")
    assert p.stdout.decode().count(" 50.000% ") == 2, p.stdout.decode()  # observed
    assert p.stdout.decode().count(" 50.00%  ") == 2, p.stdout.decode()  # asked (was 0.00%: the sum overflowed)

with cases.case("S12: one dataset named twice (data/a, ./data/a, data//a) is refused naming both entries"):
    d, b = os.path.split(WEB)
    for other in (os.path.join(d, ".", b), d + "//" + b, os.path.join(d, "..", os.path.basename(d), b)):
        check("dup", [{"prefix": WEB, "weight": 1}, {"prefix": CODE, "weight": 1}, {"prefix": other, "weight": 2}],
              ["data.blend[2].prefix " + other, "same dataset as data.blend[0].prefix " + WEB, "merge"])
    link = cases.path("data", "weblink")
    for ext in (".bin", ".idx"):
        os.symlink(WEB + ext, link + ext)
    check("duplink", [{"prefix": WEB, "weight": 1}, {"prefix": link, "weight": 1}],
          ["data.blend[1].prefix " + link, "data.blend[0].prefix " + WEB])


def cache_files(name):
    d = cases.path("runs", name, "data_cache")
    return sorted(os.listdir(d)) if os.path.isdir(d) else []


with cases.case("S4: a directory at the blend-cache path: check refuses as train does, before planning"):
    r = recipe("cachedir", good())
    run_lathe(["train", r, "--quiet"], rc=0, timeout=120)
    [plan] = cache_files("cachedir")
    f = cases.path("runs", "cachedir", "data_cache", plan)
    os.remove(f)
    os.makedirs(os.path.join(f, "inside"))
    for cmd in ("check", "train"):
        run_lathe([cmd, r], rc=1, timeout=120, must=[plan, "is a directory", "remove it"])
    data_cache = cases.path("runs", "cachedir2", "data_cache")
    os.makedirs(os.path.dirname(data_cache), exist_ok=True)
    open(data_cache, "w").write("x")  # data_cache itself a file
    run_lathe(["check", recipe("cachedir2", good())], rc=1, must=["data_cache", "not a directory"])

with cases.case("H2/U3: a blend plan beyond memory is refused naming its size and the keys, never a generic OOM"):
    rb = {"enabled": True, "rollback_after": 2, "skip_samples": 10 ** 12}
    r = recipe("huge_skip", good(), training_extra={"anomaly": rb})
    text = json.loads(open(r).read())
    text["output"]["checkpoint_every"] = 2
    open(r, "w").write(json.dumps(text))
    for cmd in (["check", r], ["train", r], ["data", "blend-plan", r]):
        run_lathe(cmd, rc=1, timeout=60, must=["blend plan", "training.anomaly.skip_samples 1000000000000",
                                               "training.anomaly.max_rollbacks"], must_not=["out of memory"])
    # 2 x 10^12 samples (24 TB): beyond any machine (the cap is half its memory, 1 TiB when unknown).
    r = recipe("huge_steps", good(), training_extra={"steps": 10 ** 12})
    for cmd in (["check", r], ["data", "blend-plan", r]):
        run_lathe(cmd, rc=1, timeout=60, must=["blend plan of 2000000000000 samples", "training.steps 1000000000000"],
                  must_not=["out of memory"])

with cases.case("D6: stale blend-plan temporaries of dead writers are removed, live and foreign files kept"):
    r = recipe("stale", good())
    run_lathe(["train", r, "--quiet"], rc=0, timeout=120)
    [plan] = cache_files("stale")
    h = "0123456789abcdef"
    stale = [f"blend-{h}.bin.tmp", f"blend-{h}.bin.999999999.tmp", f"blend-{h}.bin.999999999", "blend-fedcba9876543210.bin"]
    keep = [f"blend-{h}.bin.{os.getpid()}.tmp", "notes.txt", "blend-x.bin.tmp", f"blend-{h}.bin.12ab.tmp"]
    for n in stale + keep:
        open(cases.path("runs", "stale", "data_cache", n), "w").write("x")
    # --overwrite: the old run moves aside, its data_cache/ comes back into the new run (train/run_dir.h)
    run_lathe(["train", r, "--quiet", "--overwrite"], rc=0, timeout=120)  # reuses the plan, cleans the directory
    assert cache_files("stale") == sorted([plan] + keep), cache_files("stale")
    for n in keep[1:]:
        os.remove(cases.path("runs", "stale", "data_cache", n))
    os.remove(cases.path("runs", "stale", "data_cache", plan))
    run_lathe(["train", r, "--quiet", "--overwrite"], rc=0, timeout=120)  # rebuilds: written under a PID name, renamed
    assert cache_files("stale") == sorted([plan, keep[0]]), cache_files("stale")



def reseal_state(ckpt, edit):
    """Edits the text of state.json's body (edit: str -> str) and recomputes body_xxh64 with the
    independent Python XXH64 of tests/train/kill_test_lib.py, so only lathe's field checks can object."""
    from kill_test_lib import xxh64
    path = os.path.join(ckpt, "state.json")
    text = open(path, encoding="utf-8").read()
    head, tail = '{"body":', ',"body_xxh64":'
    body = edit(text[len(head):text.rindex(tail)])
    open(path, "w", encoding="utf-8").write(head + body + tail + '"' + format(xxh64(body.encode()), "016x") + '"}\n')


with cases.case("state.json loader.blend edited: wrong counts, wrong type, counts beyond the position"):
    import re
    r = recipe("edited", good(), training_extra={"steps": 6})
    run_lathe(["train", r, "--quiet", "--stop-after", "3"], rc=0, timeout=120)
    ckpt = cases.path("runs", "edited", "checkpoints", "step_00000003")
    orig = open(os.path.join(ckpt, "state.json"), encoding="utf-8").read()
    taken = re.search(r'"taken":\[(\d+),(\d+)\]', orig)
    assert taken, orig[:400]
    a, b = int(taken.group(1)), int(taken.group(2))
    for new, must in ((f'"taken":[{a - 1},{b + 1}]', ["loader.blend", "does not match this run's blend plan"]),
                      ('"taken":"many"', ["loader.blend.taken", "state.json"]),
                      (f'"taken":[{a + 100},{b}]', ["loader.blend.taken[0]", "state.json"])):
        open(os.path.join(ckpt, "state.json"), "w", encoding="utf-8").write(orig)
        reseal_state(ckpt, lambda t: t.replace(taken.group(0), new))
        run_lathe(["train", r, "--quiet", "--resume", ckpt], rc=1, timeout=120, must=must)
    open(os.path.join(ckpt, "state.json"), "w", encoding="utf-8").write(orig)
    run_lathe(["train", r, "--quiet", "--resume", ckpt], rc=0, timeout=120)  # the original resumes

cases.finish()
