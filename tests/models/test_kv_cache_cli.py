"""`lathe generate` with the KV cache (default) against `--no-kv-cache` (full recompute of the
context for every token, the reference path): byte-for-byte the same output for a GPT-2 and a
Llama (GQA, RoPE) Hugging Face directory with random weights, greedy and sampled (temperature 1,
top-k 0, top-p 1: every logit matters), within the 64-position window and running past it.
Small models (2 layers, 48 wide) keep it to a few seconds."""
import os
import subprocess
import sys
import tempfile

LATHE = os.environ.get("LATHE_BIN") or os.path.join(os.environ.get("LATHE_BINARY_DIR", "build"), "lathe")

try:
    import torch
    import transformers
except ImportError as e:  # the oracle's packages are missing here: skipped, with the reason
    print(f"skip: {e}")
    sys.exit(77)


def make_models(root):
    torch.manual_seed(0)
    g = transformers.GPT2Config(n_layer=2, n_embd=48, n_head=4, vocab_size=256, n_positions=64)
    transformers.GPT2LMHeadModel(g).save_pretrained(os.path.join(root, "gpt2"), safe_serialization=True)
    ll = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=48, num_attention_heads=4, num_key_value_heads=2,
                                  intermediate_size=96, vocab_size=256, max_position_embeddings=64)
    transformers.LlamaForCausalLM(ll).save_pretrained(os.path.join(root, "llama"), safe_serialization=True)


def generate(model_dir, extra):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([LATHE, "generate", "--model", model_dir, "--tokenizer", "byte", "--prompt", "To be, or not"] +
                       extra, capture_output=True, env=env, timeout=120)
    if r.returncode != 0:
        raise AssertionError(f"lathe generate {extra} failed ({r.returncode}): {r.stderr.decode(errors='replace')}")
    return r.stdout


failures = 0
with tempfile.TemporaryDirectory() as root:
    make_models(root)
    for family in ("gpt2", "llama"):
        for name, opts in (("greedy, 30 tokens", ["--temperature", "0", "--max-new-tokens", "30"]),
                           ("sampled, 30 tokens", ["--temperature", "1", "--top-k", "0", "--top-p", "1", "--seed",
                                                   "7", "--max-new-tokens", "30"]),
                           ("sampled past the window", ["--temperature", "1", "--top-k", "0", "--top-p", "1",
                                                        "--seed", "11", "--max-new-tokens", "80"])):
            cached = generate(os.path.join(root, family), opts)
            full = generate(os.path.join(root, family), opts + ["--no-kv-cache"])
            ok = cached == full and len(cached) > len("To be, or not")
            failures += not ok
            print(f"{'ok' if ok else 'FAIL'}: {family} {name}: cache == --no-kv-cache"
                  + ("" if ok else f"\n  cache {cached[:120]!r}\n  full  {full[:120]!r}"))
sys.exit(1 if failures else 0)
