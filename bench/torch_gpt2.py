#!/usr/bin/env python3
"""A plain PyTorch GPT-2 training step (fp32, AdamW, tied lm_head, tanh GELU), the baseline that
bench_train.py compares lathe against. Prints one JSON line like bench_train_step.

  torch_gpt2.py L C H V B T [STEPS] [--autocast]

--autocast runs forward and loss under torch.autocast("cpu", dtype=torch.bfloat16) (PyTorch's
mixed precision on CPU: bf16 GEMMs, fp32 master weights and optimizer), the peer of lathe's
precision.compute: bf16.
"""
import json
import math
import resource
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, C, H):
        super().__init__()
        self.H = H
        self.ln_1, self.ln_2 = nn.LayerNorm(C), nn.LayerNorm(C)
        self.c_attn, self.c_proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
        self.c_fc, self.mlp_proj = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)

    def forward(self, x, mask):
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, -1)
        q, k, v = (t.view(B, T, self.H, C // self.H).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(C // self.H))
        att = att.masked_fill(mask[:T, :T] == 0, float("-inf")).softmax(-1)
        x = x + self.c_proj((att @ v).transpose(1, 2).reshape(B, T, C))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, L, C, H, V, P=1024):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, C), nn.Embedding(P, C)
        self.h = nn.ModuleList(Block(C, H) for _ in range(L))
        self.ln_f = nn.LayerNorm(C)
        self.register_buffer("mask", torch.ones(P, P).tril())

    def forward(self, idx, targets):
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T))
        for b in self.h:
            x = b(x, self.mask)
        logits = self.ln_f(x) @ self.wte.weight.T
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


def main():
    autocast = "--autocast" in sys.argv
    args = [a for a in sys.argv[1:] if a != "--autocast"]
    L, C, H, V, B, T = (int(a) for a in args[0:6])
    steps = int(args[6]) if len(args) > 6 else 6
    torch.manual_seed(0)
    model = GPT(L, C, H, V)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=1e-4)
    idx = torch.randint(0, V, (B, T))
    tgt = torch.randint(0, V, (B, T))
    times, cpu = [], []
    for s in range(steps + 1):
        t0, c0 = time.perf_counter(), time.process_time()
        opt.zero_grad(set_to_none=True)
        if autocast:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(idx, tgt)
        else:
            loss = model(idx, tgt)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)  # all of the process's threads
    dt = sum(times[1:]) / steps
    n = sum(p.numel() for p in model.parameters()) - model.wpe.weight.numel()
    flops_tok = 6 * n + 12 * L * C * T
    print(json.dumps({"impl": "torch", "torch": torch.__version__, "autocast_bf16": autocast, "threads": torch.get_num_threads(),
                      "ms_per_step": dt * 1e3, "cpu_ms_per_step": sum(cpu[1:]) / steps * 1e3,
                      "tokens_per_s": B * T / dt, "flops_per_token": flops_tok,
                      "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3}))


if __name__ == "__main__":
    torch.set_num_threads(int(__import__("os").environ.get("OMP_NUM_THREADS", "2")))
    main()
