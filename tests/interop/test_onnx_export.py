#!/usr/bin/env python3
"""ONNX export (`lathe export SRC --to-onnx FILE`) run with onnxruntime's CPU provider against
`lathe logits` on the same weights (lathe's logits are checked against transformers elsewhere:
tests/interop/test_hf_roundtrip.py).

Tiny random models (weights perturbed so biases and norm weights are not trivial): GPT-2 (learned
positions, LayerNorm, GELU tanh, fused c_attn, tied head), Llama (GQA 4/2, untied, rope_theta 5e5)
Qwen2 (q/k/v biases, tied, rope_theta 1e6) and a Mistral with an explicit head_dim (4 heads of 16:
q/o 64 wide with hidden 32). For each:
  * onnx.checker.check_model (full_check: strict shape inference) passes; the graph uses only the
    default ONNX domain at opset 17, and its inputs/outputs are the optimum layout
  * fp32, empty past: logits of two sequences in one batch within 1e-4 of lathe
  * incremental decoding: a 5-token prompt, then one token at a time feeding present.* back as
    past_key_values.*: every step's logits within 1e-4 of lathe's full recompute
  * left padding: a shorter sequence padded on the left (attention_mask 0, positions from 0 at its
    first real token) in a batch with a longer one gives its own logits within 1e-4
  * --static-seq-len 8: fixed input shapes [1, 8], no past inputs, logits within 1e-4
  * --dtype fp16: weights fp16 in the file; logits within 4e-3 x max(1, largest |logit|) of lathe
    fp32 (fp16 keeps 11 significant bits, ~5e-4 relative per rounding of weights and activations;
    measured 4.5e-4 .. 6.7e-4 here with logits up to ~1)
  * --external-data: FILE.<hash>.data holds the weights, logits bit-identical to the inline file
A llama trained by `lathe train` for one step is exported from its run directory (checkpoint) and
compared the same way; the automatic switch to external data (limit lowered by a test hook); a
Mistral with sliding_window 4 step by step against transformers. Bad input: bf16, --static-seq-len beyond max_position_embeddings or without
--to-onnx, a file in a missing directory: exit 1/2 with the value and the fix named.
"""
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "train"))
sys.path.insert(0, os.path.join(HERE, ".."))
import megatron_writer  # noqa: E402
from hostile import run_lathe, Cases  # noqa: E402

try:
    import onnx
    import onnxruntime as ort
    import torch
    import transformers
except ImportError as e:
    print(f"FAIL onnx/onnxruntime/transformers not importable ({e}); run scripts/setup.sh")
    sys.exit(1)
transformers.logging.set_verbosity_error()
ort.set_default_logger_severity(3)

LATHE = os.environ.get("LATHE_BIN", "build/lathe")
TOL = 1e-4
failures = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what, flush=True)
    if not cond:
        failures.append(what)


def run(args):
    p = subprocess.run([LATHE] + [str(a) for a in args], capture_output=True, text=True, errors="replace")
    if p.returncode != 0:
        raise RuntimeError(f"lathe {' '.join(map(str, args))} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    return p.stdout


def make(kind, d, V=96):
    torch.manual_seed({"gpt2": 1, "llama": 2, "qwen2": 3, "mistral_hd": 4}[kind])
    if kind == "gpt2":
        m = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=V,
                                                                 n_positions=64))
    else:
        common = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=48, vocab_size=V, max_position_embeddings=64, rms_norm_eps=1e-5)
        if kind == "llama":
            m = transformers.LlamaForCausalLM(transformers.LlamaConfig(tie_word_embeddings=False, rope_theta=5e5,
                                                                       **common))
        elif kind == "mistral_hd":  # explicit head_dim: 4 heads of 16, q/o 64 wide with hidden 32
            m = transformers.MistralForCausalLM(transformers.MistralConfig(tie_word_embeddings=False, head_dim=16,
                                                                           sliding_window=None, **common))
        else:
            m = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(tie_word_embeddings=True, rope_theta=1e6,
                                                                       **common))
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.05 * torch.randn_like(p))
    m.save_pretrained(d)
    return m.config


def lathe_logits(model_dir, seqs, V):
    out = os.path.join(model_dir, "ref.f32")
    args = ["logits", "--model", model_dir, "--out", out]
    for s in seqs:
        args += ["--tokens", ",".join(map(str, s))]
    run(args)
    flat = np.fromfile(out, dtype=np.float32)
    res, at = [], 0
    for s in seqs:
        n = len(s) * V
        res.append(flat[at:at + n].reshape(len(s), V))
        at += n
    assert at == flat.size
    return res


class Runner:
    def __init__(self, path, cfg):
        self.sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        self.L = cfg.num_hidden_layers
        self.KV = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.D = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.inputs = {i.name: i for i in self.sess.get_inputs()}
        self.dtype = np.float16 if self.sess.get_outputs()[0].type == "tensor(float16)" else np.float32

    def empty_past(self, B):
        return [np.zeros((B, self.KV, 0, self.D), self.dtype) for _ in range(2 * self.L)]

    def __call__(self, ids, mask=None, pos=None, past=None):
        ids = np.asarray(ids, np.int64)
        B, S = ids.shape
        P = 0 if past is None else past[0].shape[2]
        if mask is None:
            mask = np.ones((B, P + S), np.int64)
        if pos is None:
            pos = np.broadcast_to(np.arange(P, P + S, dtype=np.int64), (B, S))
        feed = {"input_ids": ids, "attention_mask": np.asarray(mask, np.int64),
                "position_ids": np.ascontiguousarray(pos, np.int64)}
        if "past_key_values.0.key" in self.inputs:
            past = past if past is not None else self.empty_past(B)
            for i in range(self.L):
                feed[f"past_key_values.{i}.key"] = past[2 * i]
                feed[f"past_key_values.{i}.value"] = past[2 * i + 1]
        outs = self.sess.run(None, feed)
        return outs[0].astype(np.float32), outs[1:]


def maxdiff(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def check_graph(path, cfg, static):
    onnx.checker.check_model(path, full_check=True)
    m = onnx.load(path, load_external_data=False)
    domains = {op.domain for op in m.opset_import}
    versions = [op.version for op in m.opset_import]
    ops = {n.op_type for n in m.graph.node}
    node_domains = {n.domain for n in m.graph.node}
    ins = [i.name for i in m.graph.input]
    outs = [o.name for o in m.graph.output]
    L = cfg.num_hidden_layers
    want_in = ["input_ids", "attention_mask", "position_ids"]
    want_out = ["logits"]
    if not static:
        for i in range(L):
            want_in += [f"past_key_values.{i}.key", f"past_key_values.{i}.value"]
            want_out += [f"present.{i}.key", f"present.{i}.value"]
    check(domains == {""} and min(versions) >= 17 and node_domains <= {""},
          f"{os.path.basename(path)}: checker passes, default domain only, opset {versions}, ops {sorted(ops)}")
    check(ins == want_in and outs == want_out, f"{os.path.basename(path)}: inputs {ins[:5]}.. outputs {outs[:3]}..")
    return m


def check_family(tmp, kind):
    d = os.path.join(tmp, kind)
    cfg = make(kind, d)
    V = cfg.vocab_size
    rng = np.random.default_rng({"gpt2": 1, "llama": 2, "qwen2": 3, "mistral_hd": 4}[kind])
    a = rng.integers(0, V, 12).tolist()
    b = rng.integers(0, V, 12).tolist()
    short = rng.integers(0, V, 7).tolist()
    ref_a, ref_b, ref_short = lathe_logits(d, [a, b, short], V)

    path = os.path.join(tmp, f"{kind}.onnx")
    print(run(["export", d, "--to-onnx", path]).strip().splitlines()[-1])
    m = check_graph(path, cfg, False)
    if kind == "gpt2":
        names = {t.name for t in m.graph.initializer}
        check("transformer.h.0.attn.c_attn.weight.q" in names and "lm_head.weight" not in names,
              "gpt2: fused c_attn split into q/k/v initializers, head tied (no lm_head initializer)")
    r = Runner(path, cfg)

    logits, present = r([a, b])
    check(maxdiff(logits[0], ref_a) < TOL and maxdiff(logits[1], ref_b) < TOL,
          f"{kind} fp32 batch of 2, empty past: max |diff| {max(maxdiff(logits[0], ref_a), maxdiff(logits[1], ref_b)):.2e}")
    check(present[0].shape == (2, r.KV, 12, r.D), f"{kind}: present.0.key shape {present[0].shape}")

    # incremental decoding: prompt of 5, then 1 token per step with the cache
    logits, past = r([a[:5]])
    worst = maxdiff(logits[0], ref_a[:5])
    for t in range(5, len(a)):
        step, past = r([[a[t]]], past=past)
        worst = max(worst, maxdiff(step[0, 0], ref_a[t]))
    check(worst < TOL and past[0].shape[2] == len(a),
          f"{kind} incremental decoding (prompt 5 + 7 steps with past key/values) = full recompute: {worst:.2e}")

    # left padding: `short` padded to 12 in a batch with `a`
    pad = len(a) - len(short)
    ids = [a, [0] * pad + short]
    mask = [[1] * len(a), [0] * pad + [1] * len(short)]
    pos = [list(range(len(a))), [0] * pad + list(range(len(short)))]
    logits, _ = r(ids, mask, pos)
    check(maxdiff(logits[1, pad:], ref_short) < TOL and maxdiff(logits[0], ref_a) < TOL,
          f"{kind} left-padded batch (attention_mask, position_ids): {maxdiff(logits[1, pad:], ref_short):.2e}")

    spath = os.path.join(tmp, f"{kind}_static.onnx")
    run(["export", d, "--to-onnx", spath, "--static-seq-len", 8])
    m = check_graph(spath, cfg, True)
    dims = [[dd.dim_value for dd in i.type.tensor_type.shape.dim] for i in m.graph.input]
    rs = Runner(spath, cfg)
    logits, _ = rs([a[:8]])
    check(dims == [[1, 8]] * 3 and maxdiff(logits[0], ref_a[:8]) < TOL,
          f"{kind} static [1, 8] graph, input dims {dims}: {maxdiff(logits[0], ref_a[:8]):.2e}")

    hpath = os.path.join(tmp, f"{kind}_fp16.onnx")
    run(["export", d, "--to-onnx", hpath, "--dtype", "fp16"])
    check_graph(hpath, cfg, False)
    mh = onnx.load(hpath)
    wte = [t for t in mh.graph.initializer if t.name in ("transformer.wte.weight", "model.embed_tokens.weight")][0]
    rh = Runner(hpath, cfg)
    logits, past = rh([a[:6]])
    step, _ = rh([a[6:9]], past=past)
    ref = np.concatenate([ref_a[:6], ref_a[6:9]])
    got = np.concatenate([logits[0], step[0]])
    tol16 = 4e-3 * max(1.0, float(np.abs(ref).max()))
    check(wte.data_type == onnx.TensorProto.FLOAT16 and rh.dtype == np.float16 and maxdiff(got, ref) < tol16,
          f"{kind} fp16 (prompt 6 + 3 with past): max |diff| {maxdiff(got, ref):.2e} < {tol16:.2e}")

    epath = os.path.join(tmp, f"{kind}_ext.onnx")
    run(["export", d, "--to-onnx", epath, "--external-data"])
    check_graph(epath, cfg, False)
    le, _ = Runner(epath, cfg)([a, b])
    li, _ = r([a, b])
    edata = external_data_file(epath)
    check(os.path.getsize(edata) > os.path.getsize(epath) and np.array_equal(le, li),
          f"{kind} external data: {os.path.getsize(edata)} B in {os.path.basename(edata)}, "
          f"{os.path.getsize(epath)} B model, logits identical to the inline file")


def check_trained_run(tmp):
    d = os.path.join(tmp, "llama")  # made by check_family
    V = 96
    data = os.path.join(tmp, "ids")
    rng = np.random.default_rng(0)
    megatron_writer.write(data, [rng.integers(0, V, 400) for _ in range(3)])
    recipe = os.path.join(tmp, "r.yaml")
    run_dir = os.path.join(tmp, "run")
    open(recipe, "w").write(f"""
model: {{init_from: {d}}}
data: {{train: {data}, valid_fraction: 0.0}}
training: {{micro_batch_size: 2, seq_len: 16, steps: 1, eval_interval: 0, peak_gflops: 100}}
output: {{dir: {run_dir}, checkpoint_every: 1}}
""")
    run(["train", recipe])
    ckpt = os.path.join(run_dir, "checkpoints", sorted(os.listdir(os.path.join(run_dir, "checkpoints")))[0])
    exp = os.path.join(tmp, "exported")
    path = os.path.join(tmp, "trained.onnx")
    run(["export", ckpt if os.path.isdir(ckpt) else run_dir, "--to", exp, "--to-onnx", path])
    seq = rng.integers(0, V, 10).tolist()
    (ref,) = lathe_logits(exp, [seq], V)
    (ref_init,) = lathe_logits(d, [seq], V)
    cfg = transformers.AutoConfig.from_pretrained(exp)
    logits, _ = Runner(path, cfg)([seq])
    check(maxdiff(logits[0], ref) < TOL and maxdiff(ref, ref_init) > 1e-3,
          f"llama trained 1 step, exported from its checkpoint: {maxdiff(logits[0], ref):.2e} "
          f"(the step moved logits by {maxdiff(ref, ref_init):.2e})")


def external_data_file(path):
    """The external-data file beside PATH: PATH.<16 hex digits of its XXH64>.data (the name changes
    with the contents, so a graph and its data are published in an order a kill cannot mismatch)."""
    found = [f for f in glob.glob(glob.escape(path) + ".*.data")
             if re.fullmatch(r"[0-9a-f]{16}", f[len(path) + 1:-len(".data")])]
    return found[0] if len(found) == 1 else None


def check_auto_external(tmp):
    """The switch to external data above the protobuf limit, on a tiny model: the test hook lowers
    the limit from 2 GiB to 50 kB (the llama export is ~106 kB inline)."""
    d = os.path.join(tmp, "llama")
    path = os.path.join(tmp, "auto.onnx")
    p = subprocess.run([LATHE, "export", d, "--to-onnx", path], capture_output=True, text=True,
                       env=dict(os.environ, LATHE_TEST_ONNX_INLINE_LIMIT="50000"))
    cfg = transformers.AutoConfig.from_pretrained(d)
    ok = p.returncode == 0 and external_data_file(path) is not None
    if ok:
        check_graph(path, cfg, False)
        seq = [[3, 1, 4, 1, 5, 9, 2, 6]]
        ok = np.array_equal(Runner(path, cfg)(seq)[0], Runner(os.path.join(tmp, "llama.onnx"), cfg)(seq)[0])
    check(ok, f"above the inline limit the weights go to FILE.data by themselves: {p.stdout.strip()[-120:]}")
    # The hook is read by the CLI and handed to the library (OnnxExportOptions::inline_limit): a
    # value that is not a byte count is refused by name, before the model is loaded.
    bad = os.path.join(tmp, "bad_limit.onnx")
    p = subprocess.run([LATHE, "export", d, "--to-onnx", bad], capture_output=True, text=True,
                       env=dict(os.environ, LATHE_TEST_ONNX_INLINE_LIMIT="50kB"))
    check(p.returncode == 1 and "LATHE_TEST_ONNX_INLINE_LIMIT=50kB" in p.stderr and not os.path.exists(bad),
          f"a malformed LATHE_TEST_ONNX_INLINE_LIMIT is refused by name: {p.stderr.strip()[-160:]}")


def check_sliding_window(tmp):
    """Mistral with sliding_window 4 against transformers (the exported graph's own mask; lathe's
    kernels are checked in tests/models/test_sliding_window.cpp): token i attends to keys i-3..i."""
    d = os.path.join(tmp, "mistral")
    torch.manual_seed(4)
    cfg = transformers.MistralConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                     intermediate_size=48, vocab_size=96, max_position_embeddings=64,
                                     sliding_window=4, tie_word_embeddings=False)
    m = transformers.MistralForCausalLM(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.05 * torch.randn_like(p))
    m.save_pretrained(d)
    seq = np.random.default_rng(4).integers(0, 96, 12).tolist()
    m = transformers.MistralForCausalLM.from_pretrained(d, attn_implementation="eager").eval()
    with torch.no_grad():
        ref = m(torch.tensor([seq])).logits[0].numpy()
        full = transformers.MistralForCausalLM.from_pretrained(d, attn_implementation="eager",
                                                               sliding_window=None).eval()
        nowin = full(torch.tensor([seq])).logits[0].numpy()
    path = os.path.join(tmp, "mistral.onnx")
    run(["export", d, "--to-onnx", path])
    r = Runner(path, cfg)
    logits, past = r([seq[:3]])
    got = [logits[0]]
    for t in range(3, len(seq)):
        step, past = r([[seq[t]]], past=past)
        got.append(step[0])
    got = np.concatenate(got)
    check(maxdiff(got, ref) < TOL and maxdiff(nowin, ref) > 1e-3,
          f"mistral sliding_window 4, prompt 3 + 9 steps vs transformers: {maxdiff(got, ref):.2e} "
          f"(the window changes logits by {maxdiff(nowin, ref):.2e})")


def check_phi3(tmp):
    """phi3 through the llama graph (fused qkv_proj / gate_up_proj read by role): sliding_window 3
    reaches 4 keys (flash-attn's (3, 3), as lathe computes it; its own oracle test is
    tests/models/test_phi3.cpp), so lathe's logits are the reference, full and incremental; a
    longrope phi3 (short and long factors picked by the length) is refused."""
    d = os.path.join(tmp, "phi3")
    torch.manual_seed(6)
    cfg = transformers.Phi3Config(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                  intermediate_size=48, vocab_size=96, max_position_embeddings=64,
                                  sliding_window=3, pad_token_id=0, tie_word_embeddings=False)
    m = transformers.Phi3ForCausalLM(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.05 * torch.randn_like(p))
        for layer in m.model.layers:  # q/k rows larger, so that the window matters
            layer.self_attn.qkv_proj.weight[:48].mul_(10.0)
    m.save_pretrained(d)
    seq = np.random.default_rng(6).integers(0, 96, 12).tolist()
    ref = lathe_logits(d, [seq], 96)[0]
    path = os.path.join(tmp, "phi3.onnx")
    run(["export", d, "--to-onnx", path])
    r = Runner(path, cfg)
    full, _ = r([seq])
    logits, past = r([seq[:3]])
    got = [logits[0]]
    for t in range(3, len(seq)):
        step, past = r([[seq[t]]], past=past)
        got.append(step[0])
    got = np.concatenate(got)
    with torch.no_grad():
        nowin = m(torch.tensor([seq])).logits[0].numpy()  # transformers' eager: no window
    check(maxdiff(full[0], ref) < TOL and maxdiff(got, ref) < TOL and maxdiff(nowin, ref) > 1e-3,
          f"phi3 sliding_window 3 (4 keys), full {maxdiff(full[0], ref):.2e} and prompt 3 + 9 steps "
          f"{maxdiff(got, ref):.2e} vs lathe (the window changes logits by {maxdiff(nowin, ref):.2e})")
    c = json.load(open(os.path.join(d, "config.json")))
    c["rope_scaling"] = {"type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4}
    c["original_max_position_embeddings"] = 16
    json.dump(c, open(os.path.join(d, "config.json"), "w"))
    p = subprocess.run([LATHE, "export", d, "--to-onnx", os.path.join(tmp, "phi3_long.onnx")], capture_output=True,
                       text=True)
    check(p.returncode != 0 and "different short_factor and long_factor" in p.stderr,
          f"phi3 longrope: ONNX export refused ({p.stderr.strip()[-200:]})")


def check_gemma2(tmp):
    """gemma2 (sandwich norms, (1 + w) RMSNorm baked into fp32 initializers, GeGLU, embedding x
    sqrt(hidden), query_pre_attn_scalar, attention and final logit soft caps, sliding layers 0 and 2
    with window 4 < 12 tokens: a mask per window) against transformers' Gemma2ForCausalLM, eager,
    use_cache=False: full sequence and prompt 3 + 9 incremental steps within 1e-4; the caps and the
    window bind (transformers without them differs by far more); fp16 within 4x the error that rounding the weights to fp16 alone makes."""
    d = os.path.join(tmp, "gemma2")
    torch.manual_seed(25)
    cfg = transformers.Gemma2Config(num_hidden_layers=3, hidden_size=48, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=16, intermediate_size=64, vocab_size=101,
                                    max_position_embeddings=64, query_pre_attn_scalar=20, sliding_window=4,
                                    attn_logit_softcapping=5.0, final_logit_softcapping=3.0)
    m = transformers.Gemma2ForCausalLM(cfg)
    with torch.no_grad():
        for p_ in m.parameters():
            p_.normal_(0.0, 0.5) if p_.dim() >= 2 else p_.copy_(0.1 * torch.randn_like(p_))
    m.save_pretrained(d, safe_serialization=True)
    seq = np.random.default_rng(25).integers(0, 101, 12).tolist()

    def hf(**kw):
        mm = transformers.Gemma2ForCausalLM.from_pretrained(d, attn_implementation="eager", **kw).eval()
        with torch.no_grad():
            return mm(torch.tensor([seq]), use_cache=False).logits[0].numpy()
    ref = hf()
    loose = min(maxdiff(hf(attn_logit_softcapping=None), ref), maxdiff(hf(final_logit_softcapping=None), ref),
                maxdiff(hf(sliding_window=64), ref))
    path = os.path.join(tmp, "gemma2.onnx")
    run(["export", d, "--to-onnx", path])
    check_graph(path, cfg, False)
    r = Runner(path, cfg)
    full, _ = r([seq])
    logits, past = r([seq[:3]])
    got = [logits[0]]
    for t in range(3, len(seq)):
        step, past = r([[seq[t]]], past=past)
        got.append(step[0])
    got = np.concatenate(got)
    check(maxdiff(full[0], ref) < TOL and maxdiff(got, ref) < TOL and loose > 1e-2,
          f"gemma2 vs transformers: full {maxdiff(full[0], ref):.2e}, prompt 3 + 9 steps {maxdiff(got, ref):.2e} "
          f"(without a cap or the window transformers differs by at least {loose:.2e})")
    path16 = os.path.join(tmp, "gemma2_16.onnx")
    run(["export", d, "--to-onnx", path16, "--dtype", "fp16"])
    r16 = Runner(path16, cfg)
    l16, _ = r16([seq])
    # The bound is the model's own sensitivity to fp16: transformers on the fp16-rounded weights (computing
    # in fp32) gives the error of rounding the weights alone (7.2e-3 here: matrices of std 0.5 amplify it);
    # the graph also rounds every activation once or twice per op, an error of the same order, so 4x it.
    mm = transformers.Gemma2ForCausalLM.from_pretrained(d, attn_implementation="eager").eval()
    with torch.no_grad():
        for p_ in mm.parameters():
            p_.copy_(p_.half().float())
        w16 = maxdiff(mm(torch.tensor([seq]), use_cache=False).logits[0].numpy(), ref)
    bound = 4 * w16
    check(maxdiff(l16[0], ref) < bound, f"gemma2 fp16 graph vs transformers fp32: {maxdiff(l16[0], ref):.2e} "
          f"(bound {bound:.2e})")


def check_rope_scaling(tmp):
    """RoPE scaling baked into the tables: a llama with yarn (inv_freq ramp and the cos/sin
    attention factor) against transformers 4.45, full and incremental; a copy with llama3 scaling
    and partial_rotary_factor 0.5 (transformers 4.45's llama cannot run partial rotary; lathe's
    logits are the oracle there, themselves checked against transformers with GPT-NeoX's partial
    rotation in tests/models/test_rope_scaling); dynamic NTK refused (its tables follow the length)."""
    d = os.path.join(tmp, "llama_yarn")
    torch.manual_seed(5)
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=48, vocab_size=96, max_position_embeddings=64, rms_norm_eps=1e-5,
                                   tie_word_embeddings=False, rope_theta=500.0,
                                   rope_scaling={"rope_type": "yarn", "factor": 4.0})
    m = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for n, p in m.named_parameters():
            p.add_(0.05 * torch.randn_like(p))
            if "q_proj" in n or "k_proj" in n:
                p.mul_(15.0)  # attention scores O(1-10): RoPE and its factor move the logits
    m.save_pretrained(d)
    seq = np.random.default_rng(5).integers(0, 96, 20).tolist()
    with torch.no_grad():
        ref = m.eval()(torch.tensor([seq])).logits[0].numpy()
        plain = transformers.LlamaForCausalLM.from_pretrained(d, rope_scaling=None).eval()
        noscale = plain(torch.tensor([seq])).logits[0].numpy()
    path = os.path.join(tmp, "llama_yarn.onnx")
    run(["export", d, "--to-onnx", path])
    r = Runner(path, cfg)
    full, _ = r([seq])
    logits, past = r([seq[:6]])
    got = [logits[0]]
    for t in range(6, len(seq)):
        step, past = r([[seq[t]]], past=past)
        got.append(step[0])
    got = np.concatenate(got)
    check(maxdiff(full[0], ref) < TOL and maxdiff(got, ref) < TOL and maxdiff(noscale, ref) > 1e-2,
          f"llama yarn x4 vs transformers: full {maxdiff(full[0], ref):.2e}, prompt 6 + 14 steps {maxdiff(got, ref):.2e} "
          f"(yarn changes the logits by {maxdiff(noscale, ref):.2e})")

    def edited(name, edit):
        e = os.path.join(tmp, name)
        shutil.copytree(d, e)
        c = json.load(open(os.path.join(e, "config.json")))
        edit(c)
        json.dump(c, open(os.path.join(e, "config.json"), "w"))
        return e

    p3 = edited("llama3_partial", lambda c: c.update(
        partial_rotary_factor=0.5, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 16}))
    want = lathe_logits(p3, [seq], 96)[0]
    path3 = os.path.join(tmp, "llama3_partial.onnx")
    run(["export", p3, "--to-onnx", path3])
    r3 = Runner(path3, cfg)
    full3, _ = r3([seq])
    logits, past = r3([seq[:6]])
    got3 = [logits[0]]
    for t in range(6, len(seq)):
        step, past = r3([[seq[t]]], past=past)
        got3.append(step[0])
    got3 = np.concatenate(got3)
    check(maxdiff(full3[0], want) < TOL and maxdiff(got3, want) < TOL and maxdiff(want, ref) > 1e-2,
          f"llama3 scaling + partial_rotary_factor 0.5 vs lathe logits: full {maxdiff(full3[0], want):.2e}, "
          f"incremental {maxdiff(got3, want):.2e}")
    pd = edited("llama_dynamic", lambda c: c.update(rope_scaling={"rope_type": "dynamic", "factor": 2.0}))
    cases = Cases()
    with cases.case("dynamic NTK refused"):
        run_lathe(["export", pd, "--to-onnx", os.path.join(tmp, "dyn.onnx")], rc=1,
                  must=["rope_scaling type 'dynamic'", "baked", "rope_scaling null"])
    check(not cases.failed and not os.path.exists(os.path.join(tmp, "dyn.onnx")),
          "dynamic NTK: clear refusal, no file left")
    shutil.rmtree(cases.tmp, ignore_errors=True)


def check_bad_input(tmp):
    d = os.path.join(tmp, "gpt2")
    cases = Cases()
    with cases.case("bf16 ONNX refused"):
        run_lathe(["export", d, "--to-onnx", os.path.join(tmp, "x.onnx"), "--dtype", "bf16"], rc=1,
                  must=["--to-onnx", "fp32 or fp16", "bf16"])
    with cases.case("--static-seq-len beyond max_position_embeddings"):
        run_lathe(["export", d, "--to-onnx", os.path.join(tmp, "x.onnx"), "--static-seq-len", "65"], rc=1,
                  must=["--static-seq-len 65", "max_position_embeddings = 64"])
    with cases.case("--static-seq-len without --to-onnx"):
        run_lathe(["export", d, "--to", os.path.join(tmp, "x"), "--static-seq-len", "8"], rc=1,
                  must=["--static-seq-len", "--to-onnx"])
    with cases.case("--static-seq-len 0 is a usage error"):
        run_lathe(["export", d, "--to-onnx", os.path.join(tmp, "x.onnx"), "--static-seq-len", "0"], rc=2,
                  must=["--static-seq-len"])
    with cases.case("output in a missing directory"):
        run_lathe(["export", d, "--to-onnx", os.path.join(tmp, "no", "such", "x.onnx")], rc=1,
                  must=[os.path.join(tmp, "no", "such")])
    check(not os.path.exists(os.path.join(tmp, "x.onnx")), "no ONNX file left behind by refused exports")
    check(not cases.failed, "bad input: clear errors")
    shutil.rmtree(cases.tmp, ignore_errors=True)


def main():
    tmp = tempfile.mkdtemp(prefix="lathe_onnx_test_")
    try:
        for kind in ("gpt2", "llama", "qwen2", "mistral_hd"):
            check_family(tmp, kind)
        check_trained_run(tmp)
        check_auto_external(tmp)
        check_sliding_window(tmp)
        check_phi3(tmp)
        check_gemma2(tmp)
        check_rope_scaling(tmp)
        check_bad_input(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{len(failures) == 0:d} passed, {len(failures) > 0:d} failed")
    if failures:
        print("FAILURES:\n  " + "\n  ".join(failures))
        sys.exit(1)


if __name__ == "__main__":
    main()
