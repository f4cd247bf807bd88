#!/usr/bin/env python3
"""On-paper step time and memory per rank for data-parallel training (issue 8), from a measured
compute rate and a stated network bandwidth. Nothing here is measured except the inputs.

  /usr/bin/python3 bench/dp_estimate.py [--gflops 180] [--net-gbs 0.9 12.5] [--tokens 524288]

Model per step (one global batch of --tokens tokens, fp32, AdamW):
  compute   = tokens/dp x (6N + 12 L C T) FLOP / (gflops x 1e9)          (per rank, in parallel)
  reduction = ring all-reduce of the 4N-byte gradients: 2 (dp-1)/dp x 4N bytes per rank / bandwidth
              (ZeRO 1/2: reduce-scatter + all-gather of parameters, the same bytes)
  step      = compute + max(0, reduction - backward share of compute (2/3) hidden by overlap)
  memory    = params 4N + grads 4N (ZeRO 2: 4N/dp after reduction) + moments 8N (ZeRO >= 1: 8N/dp)
              + activations of one micro-batch of T tokens as lathe allocates them (models/transformer.cpp,
                flash-style attention keeps no T x T matrix): L x T x (4C + (H+2KV)D + HD + FF + F) x 4 bytes
The default rate is what lathe reaches on this 2-core VM (GPT-2 124M, B=4, T=256: ~180 GFLOP/s,
82% of the GEMM probe); 0.9 GB/s is Open MPI's all-reduce between two ranks here, 12.5 GB/s a
100 Gb/s network.
"""
import argparse

MODELS = {  # name: N, L, C, H, KV heads, F (MLP width), gated MLP, T
    "GPT-2 1.5B": (1.558e9, 48, 1600, 25, 25, 6400, False, 1024),
    "Llama 8B": (8.03e9, 32, 4096, 32, 8, 14336, True, 8192),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gflops", type=float, default=180.0, help="sustained GFLOP/s of one rank")
    ap.add_argument("--net-gbs", type=float, nargs="+", default=[0.9, 12.5])
    ap.add_argument("--tokens", type=int, default=524288, help="tokens per global batch")
    a = ap.parse_args()
    for name, (N, L, C, H, KV, F, gated, T) in MODELS.items():
        flop_tok = 6 * N + 12 * L * C * T
        D = C // H
        act = L * T * (4 * C + (H + 2 * KV) * D + H * D + (2 * F if gated else F) + F) * 4
        print(f"\n{name}: N={N / 1e9:.2f}B, {flop_tok / 1e9:.1f} GFLOP/token, global batch {a.tokens} tokens, "
              f"rank rate {a.gflops:.0f} GFLOP/s")
        hdr = f"{'dp':>5} {'compute s':>10}" + "".join(f" {f'step s @{b:g}GB/s':>16}" for b in a.net_gbs)
        print(hdr + f" {'mem GB ZeRO0':>13} {'ZeRO1':>7} {'ZeRO2':>7}")
        for dp in (8, 16, 64, 256, 1024):
            compute = a.tokens / dp * flop_tok / (a.gflops * 1e9)
            row = f"{dp:>5} {compute:10.1f}"
            for b in a.net_gbs:
                red = 2 * (dp - 1) / dp * 4 * N / (b * 1e9)
                row += f" {compute + max(0.0, red - compute * 2 / 3):16.1f}"
            m0 = (16 * N + act) / 1e9
            m1 = (8 * N + 8 * N / dp + act) / 1e9
            m2 = (4 * N + 4 * N / dp + 8 * N / dp + act) / 1e9
            print(row + f" {m0:13.1f} {m1:7.1f} {m2:7.1f}")


if __name__ == "__main__":
    main()
