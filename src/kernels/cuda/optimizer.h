// CUDA optimizer, gradient-norm, non-finite and scale kernels over the flat fp32 buffers
// (kernels/cuda/optimizer.cu), called directly by the trainer's device path (not op-table slots).
// Every pointer is device memory unless it says host; work is issued on runtime.h's stream().
// Apart from optim/optimizer.h's plain types this header needs no CUDA headers (g++ callers).
#pragma once
#include <cstddef>
#include <cstdint>
#include <span>

#include "optim/optimizer.h"

namespace lathe::cuda {

// params, grads and the moments m ("exp_avg"), v ("exp_avg_sq") are device buffers of equal length;
// `ranges` (host) are cut into optim/chunks.h's chunks, one block each (optimizer_launch.h). Same
// formulas in the same order with the same float scalars as optim/adamw.cpp and optim/lamb.cpp:
// results agree with the CPU to a few ulp (nvcc and GCC contract different multiply-adds into FMAs).
void adamw_step(float* params, const float* grads, float* m, float* v, std::span<const optim::ParamRange> ranges,
                const optim::OptimConfig& cfg, double lr, int64_t step, float grad_scale);
// LAMB: pass 1 updates the moments and sums p^2 and u^2 per chunk (double, fixed order); the chunk
// sums come to the host, where the per-tensor trust ratios are formed exactly as optim/lamb.cpp does
// (through `gather` under ZeRO / tensor parallelism when it is set), then pass 2 applies them.
// Waits for the stream (the chunk sums).
void lamb_step(float* params, const float* grads, float* m, float* v, std::span<const optim::ParamRange> ranges,
               const optim::OptimConfig& cfg, double lr, int64_t step, float grad_scale,
               const optim::ChunkSumsGather& gather);
// out_host[c] = sum of squares (double) of grads[c*kChunk, min((c+1)*kChunk, n)) for every chunk c,
// as optim::grad_sq_chunk_sums (one block per chunk, fixed order). Waits.
void grad_sq_chunk_sums(const float* grads, size_t n, double* out_host);
// sqrt of those chunk sums added in chunk order on the host (optim::global_grad_norm). Waits.
double global_grad_norm(const float* grads, size_t n);
// True if any of x[n] is NaN or +-Inf (the trainer's skip-step guard). Waits.
bool has_non_finite(const float* x, size_t n);
// x[i] *= s (clipping, loss-scale unscaling), stream-ordered.
void scale_inplace(float* x, size_t n, float s);

}  // namespace lathe::cuda
