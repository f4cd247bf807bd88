"""Document-aware samples in training (issue 11 item 1): data.attention: document,
data.reset_position_ids, data.mask_loss_after_eod, data.eod_token.

The numerics of document attention are checked against PyTorch per document in
tests/models/test_doc_attention.cpp; this test drives the recipe keys through `lathe train`:
  * gpt2 (fp32) and llama (bf16) train with all three options on data whose documents end with an
    EOD token; the run logs the documents line and its losses differ from the causal run's;
  * the masked loss is the mean over the targets left: 2 ranks under mpirun give the losses of one
    process (the count of kept targets is summed over ranks); so does tensor parallelism over 2;
  * resume from a checkpoint mid-run is bit-exact with documents;
  * bad values name the key: an unknown attention mode, an EOD id outside the vocabulary, document
    attention without any EOD id (byte tokenizer, no data.eod_token).
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import megatron_writer  # noqa: E402

LATHE = os.environ.get("LATHE_BIN") or os.path.join(
    os.environ.get("LATHE_BINARY_DIR", os.path.join(HERE, "..", "..", "build")), "lathe")
SANITIZED = os.environ.get("LATHE_SANITIZED", "0") in ("1", "ON", "TRUE", "true")
MPIRUN = shutil.which("mpirun")
EOD = 95
failures = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what, flush=True)
    if not ok:
        failures.append(what)


def recipe(tmp, data, name, preset, prec="fp32", docs=True, steps=6, accum=2, **data_keys):
    out = os.path.join(tmp, name)
    # A tokenizer, as real corpora have: the run ends with a sample, which must run causal (issue 23 C1).
    d = {"train": data, "valid_fraction": 0.1, "tokenizer": "byte"}
    if docs:
        d.update({"attention": "document", "reset_position_ids": True, "mask_loss_after_eod": True, "eod_token": EOD})
    d.update(data_keys)
    r = {"model": {"preset": preset, "vocab_size": 256}, "data": d,
         "optimizer": {"name": "adamw", "lr": 3e-3}, "schedule": {"name": "cosine", "warmup_steps": 2},
         "training": {"micro_batch_size": 4, "seq_len": 64, "grad_accum_steps": accum, "steps": steps,
                      "eval_interval": 3, "eval_batches": 2, "log_interval": 1, "peak_gflops": 100, "seed": 5},
         "precision": {"compute": prec}, "output": {"dir": out, "checkpoint_every": 3}}
    with open(out + ".yaml", "w") as f:
        json.dump(r, f)
    return out


def run(args, np_=1, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1" if np_ > 1 else "2", OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_rmaps_base_oversubscribe="1")
    cmd = ([MPIRUN, "-np", str(np_)] if np_ > 1 else []) + [LATHE] + args
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if p.returncode != 0:
        print(p.stdout[-1500:], p.stderr[-2000:])
    return p


def losses(out, key="loss"):
    return [json.loads(l)[key] for l in open(os.path.join(out, "metrics.jsonl")) if f'"{key}"' in l]


def main():
    import numpy as np
    tmp = tempfile.mkdtemp(prefix="lathe_documents_")
    rng = np.random.default_rng(3)
    data = os.path.join(tmp, "data")
    # Documents of 1 to 90 tokens (many shorter than a sample of 64), each ended by the EOD id.
    docs = []
    for d in range(150):
        n = int(rng.integers(0, 90))
        docs.append(np.concatenate([(np.arange(n) * (d % 7 + 1) + rng.integers(0, 3, n)) % 90, [EOD]]))
    megatron_writer.write(data, docs)

    for preset, prec in (("gpt2-debug", "fp32"), ("llama-debug", "bf16")):
        out = recipe(tmp, data, f"{preset}_docs", preset, prec)
        p = run(["train", out + ".yaml"])
        check(p.returncode == 0 and f"documents: document attention, positions restart at each document, loss "
              f"after EOD masked (EOD id {EOD})" in p.stdout and "sample:" in p.stdout,
              f"{preset} {prec}: trains with documents, logs them, ends with a sample")
        base = recipe(tmp, data, f"{preset}_causal", preset, prec, docs=False)
        q = run(["train", base + ".yaml"])
        check(q.returncode == 0 and "documents:" not in q.stdout, f"{preset} {prec}: the causal run logs no documents")
        if p.returncode == 0 and q.returncode == 0:
            a, b = losses(out), losses(base)
            check(len(a) == 6 and all(np.isfinite(a)) and a != b,
                  f"{preset} {prec}: finite losses that differ from causal attention ({a[-1]:.4f} vs {b[-1]:.4f})")
            va = losses(out, "val_loss")
            check(len(va) >= 1 and all(np.isfinite(va)), f"{preset} {prec}: validation with documents ({va})")
            # Resume from step 3: bit-exact losses and weights.
            ref_w = open(os.path.join(out, "model", "model.safetensors"), "rb").read()
            shutil.rmtree(os.path.join(out, "model"))
            ck = os.path.join(out, "checkpoints")
            for s in sorted(os.listdir(ck)):
                if s.startswith("step_") and s != "step_00000003":
                    shutil.rmtree(os.path.join(ck, s))
            with open(os.path.join(ck, "latest"), "w") as f:
                f.write("step_00000003")
            r = run(["train", out + ".yaml", "--resume", "auto"])
            check(r.returncode == 0 and losses(out)[-3:] == a[-3:]
                  and open(os.path.join(out, "model", "model.safetensors"), "rb").read() == ref_w,
                  f"{preset} {prec}: resume at step 3 with documents is bit-exact")

    # The masked mean is global: 2 ranks (1 thread each) = 1 process with the same global batch
    # (accumulation 4 instead of 2), to float summation order.
    if MPIRUN and not SANITIZED:
        one = recipe(tmp, data, "dp1", "gpt2-debug", accum=4)
        two = recipe(tmp, data, "dp2", "gpt2-debug")
        p1, p2 = run(["train", one + ".yaml", "--quiet"]), run(["train", two + ".yaml", "--quiet"], np_=2)
        if p1.returncode == 0 and p2.returncode == 0:
            a, b = losses(one), losses(two)
            err = max(abs(x - y) for x, y in zip(a, b))
            check(len(a) == len(b) == 6 and err < 1e-6, f"2 ranks give the losses of 1 process (max diff {err:.1e})")
        else:
            check(False, "mpirun -np 2 and 1 process train with documents")
        # Tensor parallelism: each rank's heads get the same documents (llama: RoPE positions too).
        one = recipe(tmp, data, "tp1", "llama-debug", steps=4)
        two = recipe(tmp, data, "tp2", "llama-debug", steps=4)
        r = json.load(open(two + ".yaml"))
        r["parallel"] = {"tensor": 2}
        json.dump(r, open(two + ".yaml", "w"))
        p1, p2 = run(["train", one + ".yaml", "--quiet"]), run(["train", two + ".yaml", "--quiet"], np_=2)
        if p1.returncode == 0 and p2.returncode == 0:
            a, b = losses(one), losses(two)
            err = max(abs(x - y) for x, y in zip(a, b))
            check(len(a) == len(b) == 4 and err < 1e-6,
                  f"tensor parallel 2 gives the losses of 1 process (max diff {err:.1e})")
        else:
            check(False, "mpirun -np 2 with parallel.tensor 2 and 1 process train with documents")
    else:
        print("mpirun case skipped (no mpirun, or a sanitizer build)")

    # Bad values name the key.
    out = recipe(tmp, data, "bad", "gpt2-debug")
    for sets, must in ((["data.attention=documents"], ["data.attention", "causal", "document"]),
                       (["data.eod_token=256"], ["data.eod_token", "256", "vocabulary"]),
                       (["data.eod_token=-1", "data.tokenizer=byte", "model.vocab_size=256"],
                        ["data.eod_token", "no EOS"])):
        args = ["train", out + ".yaml"]
        for s in sets:
            args += ["--set", s]
        p = run(args)
        check(p.returncode == 1 and all(m in p.stderr for m in must),
              f"{' '.join(sets)}: refused naming {must} ({p.stderr.strip()[-200:]})")
    if not failures:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{len(failures)} failed" if failures else "all passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
