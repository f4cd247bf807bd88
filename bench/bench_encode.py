#!/usr/bin/env python3
"""Single-thread encode throughput: lathe vs HF `tokenizers`, same tokenizer, same text, same run.

Text: tinyshakespeare repeated to 50 MB (--mb). Both sides encode the same ~64 KB chunks (split
at newlines, add_special_tokens=False): lathe through `lathe encode --bench` (C++ API timing,
no printing), HF through Tokenizer.encode in a Python loop (one call per chunk, so the Python
overhead is negligible). Token counts must agree.

usage: /usr/bin/python3 bench/bench_encode.py [--lathe build/lathe] [--mb 50]
       [--tokenizer gpt2|llama3-style|DIR-with-tokenizer.json]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers  # noqa: E402

here = os.path.dirname(os.path.abspath(__file__))
ap = argparse.ArgumentParser()
ap.add_argument("--lathe", default=os.environ.get("LATHE_BIN", os.path.join(here, "..", "build", "lathe")))
ap.add_argument("--mb", type=float, default=50)
ap.add_argument("--tokenizer", default="gpt2")
ap.add_argument("--data", default="/work/shared/data")
args = ap.parse_args()

shakes_path = os.path.join(args.data, "tinyshakespeare.txt")
if not os.path.exists(shakes_path):
    shakes_path = os.path.join(here, "..", "data", "tinyshakespeare.txt")
gpt2 = os.path.join(args.data, "gpt2")
tmp = tempfile.mkdtemp(prefix="lathe_bench_encode_")


def gpt2_hf():
    t = Tokenizer(models.BPE.from_file(os.path.join(gpt2, "encoder.json"), os.path.join(gpt2, "vocab.bpe")))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.add_special_tokens(["<|endoftext|>"])
    return t


if args.tokenizer == "gpt2":
    hf, lathe_tok = gpt2_hf(), gpt2
elif args.tokenizer == "llama3-style":
    j = json.loads(gpt2_hf().to_str())
    j["model"]["ignore_merges"] = True
    hf = Tokenizer.from_str(json.dumps(j))
    hf.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"
                                   r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    lathe_tok = os.path.join(tmp, "llama3")
    os.makedirs(lathe_tok)
    hf.save(os.path.join(lathe_tok, "tokenizer.json"))
else:
    hf, lathe_tok = Tokenizer.from_file(os.path.join(args.tokenizer, "tokenizer.json")), args.tokenizer

base = open(shakes_path, "rb").read()
target = int(args.mb * 1e6)
data = (base * (target // len(base) + 1))[:target]
data = data[:data.rfind(b"\n") + 1]
path = os.path.join(tmp, "text.txt")
open(path, "wb").write(data)

out = subprocess.run([args.lathe, "encode", "--tokenizer", lathe_tok, "--bench"], stdin=open(path, "rb"),
                     capture_output=True, check=True).stdout.decode().split()
f = dict(zip(out[0::2], out[1::2]))
lathe_mbs, lathe_tokens = float(f["MB/s"]), int(f["tokens"])

text = data.decode("utf-8")
chunks, pos = [], 0
while pos < len(text):  # same chunking as lathe --bench (64 KB, then to the next newline; chars ~ bytes here)
    end = min(len(text), pos + 65536)
    nl = text.find("\n", end)
    end = len(text) if nl < 0 else nl + 1
    chunks.append(text[pos:end])
    pos = end
t0 = time.perf_counter()
hf_tokens = sum(len(hf.encode(c, add_special_tokens=False).ids) for c in chunks)
hf_s = time.perf_counter() - t0
hf_mbs = len(data) / 1e6 / hf_s

print(f"tokenizer {args.tokenizer}, {len(data) / 1e6:.1f} MB of tinyshakespeare, single thread")
print(f"  lathe           {lathe_mbs:8.2f} MB/s  ({lathe_tokens} tokens)")
print(f"  HF tokenizers   {hf_mbs:8.2f} MB/s  ({hf_tokens} tokens)")
print(f"  speedup         {lathe_mbs / hf_mbs:8.2f}x")
if lathe_tokens != hf_tokens:
    sys.exit(f"token counts differ: lathe {lathe_tokens} vs HF {hf_tokens}")
