#!/usr/bin/env python3
"""PyTorch oracle for tests/models/test_doc_attention.cpp (document-aware samples, issue 11).

Reads what the C++ test wrote (HF model dir, docs.safetensors with tokens, masked targets, flags
[document attention, reset positions, mask loss, EOD id], lathe's logits and loss; grads.safetensors)
and recomputes them in float64 with the reference model of torch_reference.py the way a user of
HF would without any packing: each sample is cut after every EOD token and every document runs as
a batch of its own (positions 0.. of the document with reset_position_ids, else its offsets in the
sample). Without document attention the whole sample runs at once with restarted positions per
token, each row on its own. The loss is the mean over the targets that are not -1 (lathe's masked
targets, checked against the EOD rule here). Exit code 1 when a tensor's error
max|lathe - torch| / max|torch| exceeds 1e-5.
"""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_reference import Model, compare, failures, finish, grad_error, read_st  # noqa: E402

TOL = 1e-5


def documents(row, eod):
    """[(start, end)) pieces of one sample: a document ends AT its EOD token."""
    out, start = [], 0
    for t, tok in enumerate(row.tolist()):
        if tok == eod:
            out.append((start, t + 1))
            start = t + 1
    if start < len(row):
        out.append((start, len(row)))
    return out


def main(d):
    cfg = json.load(open(f"{d}/model/config.json"))
    sd = read_st(f"{d}/model/model.safetensors")
    docs = read_st(f"{d}/docs.safetensors")
    grads = read_st(f"{d}/grads.safetensors")
    toks, tgts = docs["tokens"].long(), docs["targets"].long()
    attention, reset, mask, eod = (int(x) for x in docs["flags"].tolist())
    B, T = toks.shape
    V = cfg["vocab_size"]

    # lathe's targets: -1 exactly where the input is EOD when masking (the test's raw targets are >= 0)
    expect_masked = (toks == eod) if mask else torch.zeros_like(toks, dtype=torch.bool)
    if not torch.equal(tgts < 0, expect_masked):
        failures.append("targets: lathe masked other positions than the inputs' EOD tokens")

    model = Model(cfg, sd)
    logits = torch.zeros(B, T, V, dtype=torch.float64)
    pieces = []
    for b in range(B):
        segs = documents(toks[b], eod)
        pieces.append(len(segs))
        if attention:
            for s, e in segs:
                pos = torch.arange(e - s) if reset else torch.arange(s, e)
                logits[b, s:e] = model(toks[b : b + 1, s:e], pos)[0]
        else:
            pos = torch.zeros(T, dtype=torch.long)
            for s, e in segs:
                pos[s:e] = torch.arange(e - s) if reset else torch.arange(s, e)
            logits[b] = model(toks[b : b + 1], pos)[0]
    worst = {"logits": compare("logits", docs["logits"], logits, TOL)}
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, V), tgts.reshape(-1), ignore_index=-1)
    worst["loss"] = compare("loss", docs["loss"], loss, TOL)
    loss.backward()
    worst["grads"] = grad_error(model, sd, grads, TOL)
    print(
        f"{cfg['model_type']} documents per sample {pieces} (attention {'document' if attention else 'causal'}, "
        f"reset positions {bool(reset)}, loss mask {bool(mask)}): "
        + ", ".join(f"{k} {v:.2e}" for k, v in worst.items())
        + f" (tolerance {TOL})"
    )
    return finish()


if __name__ == "__main__":
    torch.set_default_dtype(torch.float64)
    sys.exit(main(sys.argv[1]))
