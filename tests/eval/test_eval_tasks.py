"""lathe eval --tasks (issue 13, multiple-choice evaluation) against transformers/torch in float64
on the same weights: the log-likelihood of every ending (tolerance 1e-4 absolute: lathe computes the
logits in fp32), the picks with and without length normalisation, acc and acc_norm. Items come as
text (the model directory's byte tokenizer; bytes are the token ids, checked with `lathe encode`)
and as token ids; a context longer than the model's positions is cut from the left. Bad items are
named by file and line."""
import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "train"))
import megatron_writer  # noqa: E402

LATHE = os.environ.get("LATHE_BIN") or os.path.join(os.environ.get("LATHE_BINARY_DIR", os.path.join(HERE, "..", "..", "build")), "lathe")
TMP = tempfile.mkdtemp(prefix="lathe_eval_tasks_")
failures = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what, flush=True)
    if not ok:
        failures.append(what)


def lathe(args, rc=0, stdin=None):
    p = subprocess.run([LATHE] + args, capture_output=True, text=True, timeout=300, input=stdin)
    if p.returncode != rc:
        print(p.stdout[-2000:], p.stderr[-2000:])
    return p


def main():
    import numpy as np
    import torch
    from transformers import GPT2LMHeadModel

    # A small GPT-2 trained a few steps on text bytes, so that endings have different likelihoods.
    text = open(os.path.join(HERE, "..", "..", "data", "tinyshakespeare.txt"), "rb").read()[:200000] \
        if os.path.exists(os.path.join(HERE, "..", "..", "data", "tinyshakespeare.txt")) else b"to be or not to be " * 5000
    docs = [np.frombuffer(text[i:i + 2000], dtype=np.uint8).astype(np.int64) for i in range(0, len(text) - 2000, 2000)]
    data = os.path.join(TMP, "data")
    megatron_writer.write(data, docs)
    out = os.path.join(TMP, "run")
    r = {"model": {"preset": "gpt2-debug", "vocab_size": 256, "n_positions": 64},
         "data": {"train": data, "valid_fraction": 0.05, "tokenizer": "byte"},
         "optimizer": {"name": "adamw", "lr": 3e-3}, "schedule": {"name": "cosine", "warmup_steps": 2},
         "training": {"micro_batch_size": 4, "seq_len": 32, "steps": 30, "eval_interval": 0, "threads": 1,
                      "peak_gflops": 100, "seed": 1},
         "output": {"dir": out}}
    json.dump(r, open(out + ".yaml", "w"))
    p = lathe(["train", out + ".yaml", "--quiet"])
    check(p.returncode == 0, "a small byte-level GPT-2 trains")
    model_dir = os.path.join(out, "model")

    items = [
        {"context": "First Citizen:\nBefore we proceed any further, hear me ", "endings": ["speak.", "xqzv!", "a"], "label": 0},
        {"context": "ROMEO: ", "endings": ["I will", "zzzzzzzz", "the the the"], "label": 1},
        {"context_ids": [84, 111, 32, 98, 101], "ending_ids": [[32, 111, 114], [32, 110, 111, 116, 32, 116, 111], [122]], "label": 2},
        # 100 bytes of context: more than the 64 positions, cut from the left.
        {"context": "x" * 90 + "And so ", "endings": ["the king", "q"], "label": 0},
    ]
    tasks = os.path.join(TMP, "tasks.jsonl")
    with open(tasks, "w") as f:
        for it in items:
            f.write(json.dumps(it) + "\n")
    p = lathe(["eval", "--model", model_dir, "--tasks", tasks, "--json"])
    check(p.returncode == 0, "lathe eval --tasks runs")
    got = json.loads(p.stdout.strip().splitlines()[-1])
    enc = lathe(["encode", "--tokenizer", "byte"], stdin="Hi é")
    check(enc.stdout.split() == ["72", "105", "32", "195", "169"], "the byte tokenizer's ids are the UTF-8 bytes")

    hf = GPT2LMHeadModel.from_pretrained(model_dir).double().eval()
    n_pos = hf.config.n_positions
    want_ll, picks, picks_norm = [], [], []
    for it in items:
        ctx = it["context_ids"] if "context_ids" in it else list(it["context"].encode())
        ends = it["ending_ids"] if "ending_ids" in it else [list(e.encode()) for e in it["endings"]]
        lls = []
        for e in ends:
            keep = min(len(ctx), n_pos - len(e))
            seq = ctx[len(ctx) - keep:] + e
            with torch.no_grad():
                logp = torch.log_softmax(hf(torch.tensor([seq])).logits[0], -1)
            lls.append(sum(float(logp[keep + k - 1, t]) for k, t in enumerate(e)))
        want_ll.append(lls)
        picks.append(int(np.argmax(lls)))
        picks_norm.append(int(np.argmax([l / len(e) for l, e in zip(lls, ends)])))
    worst = max(abs(a - b) for gi, wi in zip(got["per_item"], want_ll) for a, b in zip(gi["loglik"], wi))
    check(worst < 1e-4, f"every ending's log-likelihood within 1e-4 of torch float64 (worst {worst:.2e})")
    check([g["pick"] for g in got["per_item"]] == picks and [g["pick_norm"] for g in got["per_item"]] == picks_norm,
          f"picks equal torch's (sum {picks}, normalised {picks_norm})")
    acc = sum(p == it["label"] for p, it in zip(picks, items)) / len(items)
    acc_norm = sum(p == it["label"] for p, it in zip(picks_norm, items)) / len(items)
    check(abs(got["acc"] - acc) < 1e-12 and abs(got["acc_norm"] - acc_norm) < 1e-12,
          f"acc {got['acc']} and acc_norm {got['acc_norm']} equal torch's ({acc}, {acc_norm})")
    p = lathe(["eval", "--model", model_dir, "--tasks", tasks])
    check(p.returncode == 0 and "acc_norm" in p.stdout, "the plain output names acc and acc_norm")

    for name, line, must in [
        ("a label out of range", {"context": "a", "endings": ["b", "c"], "label": 5}, "label"),
        ("one ending", {"context": "a", "endings": ["b"], "label": 0}, "at least 2"),
        ("a token id beyond the vocabulary", {"context_ids": [1], "ending_ids": [[300], [2]], "label": 0}, "vocab_size"),
        ("no context", {"endings": ["b", "c"], "label": 0}, "context"),
    ]:
        bad = os.path.join(TMP, "bad.jsonl")
        open(bad, "w").write(json.dumps(items[0]) + "\n" + json.dumps(line) + "\n")
        p = lathe(["eval", "--model", model_dir, "--tasks", bad], rc=1)
        check(p.returncode == 1 and "bad.jsonl line 2" in p.stderr and must in p.stderr,
              f"{name}: error names the file, the line and '{must}'")
    p = lathe(["eval", "--model", model_dir], rc=2)
    check(p.returncode == 2 and "--tasks" in p.stderr, "neither --data nor --tasks: usage error naming both")

    if not failures:
        shutil.rmtree(TMP, ignore_errors=True)
    print(f"{len(failures)} failed" if failures else "all passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
