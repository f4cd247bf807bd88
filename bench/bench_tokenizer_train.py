#!/usr/bin/env python3
"""Byte-level BPE training time: `lathe tokenizer train` vs HF `tokenizers` (BpeTrainer, same
settings) on tinyshakespeare repeated to ~50 MB, 32k vocabulary (target: lathe faster than HF).
Also checks that the two merge lists are identical. Both sides use all CPUs they are given
(lathe --threads = CPU count; HF uses its rayon pool, RAYON_NUM_THREADS unset).

usage: /usr/bin/python3 bench/bench_tokenizer_train.py [--lathe build/lathe] [--mb 50] [--vocab 32000]
"""
import argparse
import json
import os
import subprocess
import tempfile
import time

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


def find_shared(*parts):
    for base in (os.path.join(ROOT, "..", "shared"), "/work/shared"):
        p = os.path.join(base, *parts)
        if os.path.exists(p):
            return os.path.abspath(p)
    raise SystemExit(f"cannot find shared/{'/'.join(parts)}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lathe", default=os.environ.get("LATHE_BIN", os.path.join(ROOT, "build", "lathe")))
    ap.add_argument("--mb", type=float, default=50)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--min-frequency", type=int, default=2)
    args = ap.parse_args()
    text = open(find_shared("data", "tinyshakespeare.txt"), encoding="utf-8").read()
    reps = max(1, int(args.mb * 1e6 / len(text.encode()) + 0.5))
    tmp = tempfile.mkdtemp(prefix="lathe_bench_train_")
    corpus = os.path.join(tmp, "corpus.txt")
    with open(corpus, "w") as f:
        f.write(text * reps)
    ncpu = os.cpu_count()
    print(f"corpus {os.path.getsize(corpus) / 1e6:.1f} MB, vocab {args.vocab}, {ncpu} CPUs")

    t = time.time()
    p = subprocess.run([args.lathe, "tokenizer", "train", "--input", corpus, "--vocab-size", str(args.vocab),
                        "--out", os.path.join(tmp, "lathe"), "--special-tokens", "<|endoftext|>",
                        "--min-frequency", str(args.min_frequency), "--threads", str(ncpu), "--no-progress"],
                       capture_output=True, text=True, check=True)
    t_lathe = time.time() - t
    print(p.stderr.strip())

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tr = trainers.BpeTrainer(vocab_size=args.vocab, min_frequency=args.min_frequency,
                             special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                             show_progress=False)
    t = time.time()
    tok.train([corpus], tr)
    t_hf = time.time() - t

    lm = json.load(open(os.path.join(tmp, "lathe", "tokenizer.json")))["model"]["merges"]
    hm = [m.split(" ") if isinstance(m, str) else m for m in json.loads(tok.to_str())["model"]["merges"]]
    print(f"lathe {t_lathe:.2f} s (incl. process start and writing tokenizer.json), HF {t_hf:.2f} s: "
          f"lathe is {t_hf / t_lathe:.2f}x HF; merges {len(lm)} vs {len(hm)}, identical: {lm == hm}")
    subprocess.run(["rm", "-rf", tmp])


if __name__ == "__main__":
    main()
