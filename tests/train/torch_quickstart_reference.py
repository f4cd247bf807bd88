#!/usr/bin/env python3
"""PyTorch run of configs/quickstart.yaml, to derive the convergence threshold of
test_convergence.py. Same model (GPT-2 L=4 C=128 H=4, byte vocabulary 256, 256 positions), same
data (tinyshakespeare bytes, windows of 129 tokens, last 10% of windows held out), same
hyper-parameters (AdamW lr 1e-3 betas (0.9, 0.95) wd 0.1 on matrices, clip 1.0, cosine with 20
warm-up steps to 1e-4, B=16, T=128, 600 steps); its own init and shuffle. Prints the final
validation loss over the whole held-out split. Not run by CTest (it takes minutes):

  /usr/bin/python3 tests/train/torch_quickstart_reference.py [STEPS]
"""
import math
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
from torch_gpt2 import GPT  # noqa: E402


def main():
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 600
    torch.manual_seed(1234)
    torch.set_num_threads(2)
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "data", "tinyshakespeare.txt")
    toks = torch.from_numpy(np.frombuffer(open(src, "rb").read(), dtype=np.uint8).astype(np.int64))
    B, T, lr, min_lr, warm = 16, 128, 1e-3, 1e-4, 20
    n = (len(toks) - 1) // T
    n_valid = round(0.1 * n)
    train_ids, valid_ids = np.arange(n - n_valid), np.arange(n - n_valid, n)
    model = GPT(4, 128, 4, 256, P=256)
    for name, p in model.named_parameters():  # GPT-2 init
        if p.dim() >= 2:
            std = 0.02 / math.sqrt(8) if name.endswith(("c_proj.weight", "mlp_proj.weight")) else 0.02
            torch.nn.init.normal_(p, 0.0, std)
        elif "ln" in name and name.endswith("weight"):
            torch.nn.init.ones_(p)
        else:
            torch.nn.init.zeros_(p)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95), eps=1e-8)
    rng = np.random.default_rng(1234)
    order, pos = rng.permutation(train_ids), 0

    def batch(ids):
        x = torch.stack([toks[i * T : i * T + T + 1] for i in ids])
        return x[:, :-1], x[:, 1:]

    for step in range(steps):
        if step < warm:
            cur = lr * (step + 1) / warm
        else:
            p = (step - warm) / max(1, steps - warm)
            cur = min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * p))
        for g in opt.param_groups:
            g["lr"] = cur
        if pos + B > len(order):
            order, pos = rng.permutation(train_ids), 0
        x, y = batch(order[pos : pos + B])
        pos += B
        opt.zero_grad()
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 100 == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    with torch.no_grad():
        tot = 0.0
        for i in range(0, len(valid_ids), 64):
            x, y = batch(valid_ids[i : i + 64])
            tot += model(x, y).item() * len(x)
    print(f"final validation loss {tot / len(valid_ids):.4f} ({len(valid_ids)} windows of {T})")


if __name__ == "__main__":
    main()
