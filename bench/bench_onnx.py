#!/usr/bin/env python3
"""ONNX export at a realistic size (issue 15): a random-init GPT-2 124M (HF GPT2Config defaults) and
a Llama-like model (4 layers, C=1024, GQA 16/4, untied, V=32000), each exported by
`lathe export HF_DIR --to-onnx` in fp32 and fp16 and run with onnxruntime's CPU provider.

  OMP_NUM_THREADS=2 /usr/bin/python3 bench/bench_onnx.py [--build build] [--models gpt2,llama]

Prints per model and dtype: export seconds and file size, the largest |logit difference| against
`lathe logits` (fp32) on 64 random tokens, onnxruntime's time for the 64-token prefill and its mean
time per token over 32 greedy decode steps with the cache.
"""
import argparse
import os
import shutil
import subprocess
import tempfile
import time

import numpy as np
import onnxruntime as ort
import torch
import transformers


def make(kind, d):
    torch.manual_seed(0)
    if kind == "gpt2":
        m = transformers.GPT2LMHeadModel(transformers.GPT2Config())
    else:
        m = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            num_hidden_layers=4, hidden_size=1024, num_attention_heads=16, num_key_value_heads=4,
            intermediate_size=2816, vocab_size=32000, max_position_embeddings=1024, tie_word_embeddings=False))
    m.save_pretrained(d)
    return m.config


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    ap.add_argument("--models", default="gpt2,llama")
    args = ap.parse_args()
    lathe = os.path.join(args.build, "lathe")
    tmp = tempfile.mkdtemp(prefix="lathe_bench_onnx_")
    try:
        for kind in args.models.split(","):
            d = os.path.join(tmp, kind)
            cfg = make(kind, d)
            V, L = cfg.vocab_size, cfg.num_hidden_layers
            KV = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
            D = cfg.hidden_size // cfg.num_attention_heads
            seq = np.random.default_rng(0).integers(0, V, 64).tolist()
            ref_path = os.path.join(tmp, "ref.f32")
            subprocess.run([lathe, "logits", "--model", d, "--tokens", ",".join(map(str, seq)), "--out", ref_path],
                           check=True, capture_output=True)
            ref = np.fromfile(ref_path, np.float32).reshape(64, V)
            for dt in ("fp32", "fp16"):
                path = os.path.join(tmp, f"{kind}_{dt}.onnx")
                t0 = time.time()
                subprocess.run([lathe, "export", d, "--to-onnx", path, "--dtype", dt], check=True, capture_output=True)
                t_export = time.time() - t0
                s = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
                np_dt = np.float16 if dt == "fp16" else np.float32
                feed = {f"past_key_values.{i}.{t}": np.zeros((1, KV, 0, D), np_dt) for i in range(L)
                        for t in ("key", "value")}
                ids = np.array([seq], np.int64)
                feed.update(input_ids=ids, attention_mask=np.ones_like(ids), position_ids=np.arange(64)[None])
                t0 = time.time()
                outs = s.run(None, feed)
                t_prefill = time.time() - t0
                diff = float(np.abs(outs[0][0].astype(np.float32) - ref).max())
                present, tok = outs[1:], int(outs[0][0, -1].argmax())
                t0 = time.time()
                for step in range(32):
                    f = {"input_ids": np.array([[tok]]), "attention_mask": np.ones((1, 65 + step), np.int64),
                         "position_ids": np.array([[64 + step]])}
                    for i in range(L):
                        f[f"past_key_values.{i}.key"], f[f"past_key_values.{i}.value"] = present[2 * i], present[2 * i + 1]
                    o = s.run(None, f)
                    present, tok = o[1:], int(o[0][0, -1].argmax())
                t_decode = (time.time() - t0) / 32
                print(f"{kind} {dt}: export {t_export:.1f} s, {os.path.getsize(path) / 1e6:.0f} MB; max |logit diff| vs "
                      f"lathe fp32 {diff:.2e} (max |logit| {np.abs(ref).max():.2f}); onnxruntime prefill 64 tokens "
                      f"{t_prefill * 1e3:.0f} ms, decode {t_decode * 1e3:.1f} ms/token", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
