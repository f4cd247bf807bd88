// CUDA training-step ops (kernels/step_ops.h) over the flat fp32 buffers (kernels/cuda/optimizer.cu):
// the AdamW / LAMB updates, gradient norm and chunk sums, non-finite check and scale, registered as
// the CUDA backend's StepOps table (kernels/cuda/backend_cuda.cpp: cuda_backend().step_ops()).
// Every pointer is device memory unless it says host; work is issued on runtime.h's stream().
// This header needs no CUDA headers (g++ callers).
#pragma once
#include <cstddef>
#include <cstdint>
#include <span>

#include "kernels/step_ops.h"

namespace lathe::cuda {

// params, grads and the moments m ("exp_avg"), v ("exp_avg_sq") are device buffers of equal length;
// `ranges` (host) are cut into kernels/step_ops.h's chunks, one block each (optimizer_launch.h). Same
// formulas in the same order with the same float scalars as kernels/cpu/step.cpp (optim/'s):
// results agree with the CPU to a few ulp (nvcc and GCC contract different multiply-adds into FMAs).
void adamw_step(float* params, const float* grads, float* m, float* v, std::span<const StepRange> ranges,
                const StepHyper& hyper, double lr, int64_t step, float grad_scale);
// LAMB: pass 1 updates the moments and sums p^2 and u^2 per chunk (double, fixed order); the chunk
// sums come to the host, where the per-tensor trust ratios are formed exactly as the CPU does
// (through `gather` under ZeRO / tensor parallelism when it is set), then pass 2 applies them.
// Waits for the stream (the chunk sums).
void lamb_step(float* params, const float* grads, float* m, float* v, std::span<const StepRange> ranges,
               const StepHyper& hyper, double lr, int64_t step, float grad_scale, const StepChunkSumsGather& gather);
// out_host[c] = sum of squares (double) of grads[c*kStepChunk, min((c+1)*kStepChunk, n)) for every
// chunk c, as the CPU's grad_sq_chunk_sums (one block per chunk, fixed order). Waits.
void grad_sq_chunk_sums(const float* grads, size_t n, double* out_host);
// sqrt of those chunk sums added in chunk order on the host (norm_from_step_chunk_sums). Waits.
double global_grad_norm(const float* grads, size_t n);
// True if any of x[n] is NaN or +-Inf (the trainer's skip-step guard). Waits.
bool has_non_finite(const float* x, size_t n);
// x[i] *= s (clipping, loss-scale unscaling), stream-ordered.
void scale_inplace(float* x, size_t n, float s);

}  // namespace lathe::cuda
