// Block attention for context parallelism on CUDA (issue 27): the twin of kernels/cpu/ops.h's
// "block attention" section (same BlockAttention description, same masks, same "=" / "+=" rules),
// every pointer device memory, issued on the process's stream (runtime.h). fp32 only.
// Positions and document starts are device memory and trusted (the CPU twin validates them).
// Correctness-first: one thread per query row (forward, dQ) or key row (dK, dV), each output
// written by one thread in a fixed order (deterministic, no atomics); no tensor cores, no shared
// memory tiling. Head size D <= 256.
#pragma once
#include <cstdint>

#include "kernels/cpu/ops.h"  // BlockAttention

namespace lathe::cuda {

void attention_block_forward(const cpu::BlockAttention& a, float* out, int64_t ldo, float* lse);
void attention_block_backward(const cpu::BlockAttention& a, const float* out, const float* dout, int64_t ldo,
                              const float* lse, float* dq, int64_t lddq, float* dk, int64_t lddk, float* dv,
                              int64_t lddv);
void attention_lse_merge(float* out, float* lse, const float* out_b, const float* lse_b, int64_t B, int64_t T,
                         int64_t H, int64_t D, int64_t ldo);

}  // namespace lathe::cuda
