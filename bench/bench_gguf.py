#!/usr/bin/env python3
"""GGUF export at a realistic size, run by llama.cpp (llama-cpp-python, CPU): export time and size,
f32 logits of llama.cpp against `lathe logits`, llama.cpp's decode speed. Random init.

    OMP_NUM_THREADS=2 python3 bench/bench_gguf.py [--lathe build/lathe]
"""
import argparse
import os
import shutil
import subprocess
import tempfile
import time

import numpy as np
import torch
import transformers
import llama_cpp

ap = argparse.ArgumentParser()
ap.add_argument("--lathe", default="build/lathe")
args = ap.parse_args()
SHARED = "/work/shared/data/gpt2"
if not os.path.exists(SHARED):
    SHARED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "data", "gpt2")
tmp = tempfile.mkdtemp(prefix="lathe_bench_gguf_")
torch.manual_seed(0)
models = {
    "gpt2-124m": transformers.GPT2LMHeadModel(transformers.GPT2Config()),
    "llama-4L-C1024-GQA": transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=4, hidden_size=1024, num_attention_heads=16, num_key_value_heads=4,
        intermediate_size=2816, vocab_size=50257, max_position_embeddings=1024, tie_word_embeddings=False)),
}
for name, m in models.items():
    d = os.path.join(tmp, name)
    m.save_pretrained(d)
    for f in ("encoder.json", "vocab.bpe"):
        shutil.copy(os.path.join(SHARED, f), d)
    g = os.path.join(tmp, name + ".gguf")
    t0 = time.time()
    subprocess.run([args.lathe, "convert", "--from-hf", d, "--to-gguf", g], check=True, capture_output=True)
    t_export = time.time() - t0
    ids = list(range(1000, 1064))
    lf = os.path.join(tmp, "l.bin")
    subprocess.run([args.lathe, "logits", "--model", d, "--tokens", ",".join(map(str, ids)), "--out", lf],
                   check=True, capture_output=True)
    ref = np.fromfile(lf, dtype=np.float32).reshape(len(ids), -1)
    llm = llama_cpp.Llama(model_path=g, n_ctx=256, n_threads=2, logits_all=True, verbose=False, type_k=0, type_v=0)
    llm.eval(ids)
    got = np.array(llm.scores[:len(ids)], dtype=np.float32)
    t0 = time.time()
    for _ in range(32):
        llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
    ms = (time.time() - t0) / 32 * 1e3
    print(f"{name}: export {t_export:.1f} s, {os.path.getsize(g) / 1e6:.0f} MB f32; llama.cpp vs lathe logits "
          f"max |diff| {np.abs(got - ref).max():.2e} (max |logit| {np.abs(ref).max():.2f}); "
          f"llama.cpp decode {ms:.0f} ms/token (2 threads)", flush=True)
shutil.rmtree(tmp)
