// The training-step ops of a backend (as ggml's opt_step_adamw is an op like any other): the
// AdamW and LAMB updates, the gradient norm and its chunk sums, the non-finite check and the
// in-place scale, over flat fp32 buffers in the backend's memory. Each backend registers one
// `StepOps` table (Backend::step_ops(); kernels/cpu/step.h on the CPU, kernels/cuda/optimizer.h
// on CUDA); tests/kernels/test_backend_ops.cpp checks every table against the same references.
//
// The types are plain, so kernels/ does not depend on optim/: optim::ParamRange, optim::ChunkSums
// and optim::ChunkSumsGather are these types, and optim's optimizers call the CPU kernels, so
// the CPU table and optim/ are one implementation (bit for bit).
//
// Work split: the ranges are cut into fixed chunks of kStepChunk elements of the flat buffer (and
// at range ends). Reductions are summed per chunk in double and the chunk sums added in chunk
// order, so results do not depend on the thread count, and a ZeRO shard (cut at kStepChunk
// multiples) holds whole chunks: its chunk sums are exactly those of a single process.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

namespace lathe {

// A parameter tensor's place in the flat buffers: [offset, offset + size), whether it gets weight
// decay, and which tensor it is (its index in the model's table; -1: this range alone). A tensor
// cut by a ZeRO shard boundary appears as one range on each rank holding part of it, with one id.
// Elements not covered by any range are left untouched.
struct StepRange {
  size_t offset;
  size_t size;
  bool decay;
  int64_t tensor = -1;
};

// LAMB's per-tensor norms come from partial sums per chunk. Under ZeRO a tensor's chunks sit on
// several ranks: the step hands its chunk sums (flat order) to a gather, which returns the chunk
// sums of every rank in flat order (rank order), so each rank adds a tensor's chunks in the order
// a single process does: bit-identical trust ratios. An empty gather: this rank's sums alone.
struct StepChunkSums {
  int64_t tensor;  // StepRange::tensor of the chunk's range
  double p, u;     // sum of p^2 and of u^2 over the chunk
};
using StepChunkSumsGather = std::function<std::vector<StepChunkSums>(const std::vector<StepChunkSums>&)>;

// The hyper-parameters AdamW and LAMB read (the recipe's optimizer section: optim::step_hyper;
// no defaults here, they are the recipe's).
struct StepHyper {
  double beta1, beta2, eps, weight_decay;
};

constexpr size_t kStepChunk = 8192;

struct StepChunk {
  size_t range;       // index into the ranges
  size_t begin, end;  // element offsets in the flat buffer
};

inline std::vector<StepChunk> make_step_chunks(std::span<const StepRange> ranges) {
  std::vector<StepChunk> chunks;
  for (size_t r = 0; r < ranges.size(); ++r)
    for (size_t b = ranges[r].offset, e = ranges[r].offset + ranges[r].size; b < e;) {
      const size_t next = std::min((b / kStepChunk + 1) * kStepChunk, e);
      chunks.push_back({r, b, next});
      b = next;
    }
  return chunks;
}

// The norm from per-chunk sums of squares: added in chunk order, then the square root.
inline double norm_from_step_chunk_sums(const double* sums, size_t nchunks) {
  double total = 0.0;
  for (size_t c = 0; c < nchunks; ++c) total += sums[c];
  return std::sqrt(total);
}

struct StepOps {
  const char* backend = "";  // which table this is (errors and test names)

  // AdamW (torch.optim.AdamW's arithmetic; kernels/cpu/step.h states it) over the chunks of
  // `ranges` (host memory); params, grads and the moments m ("exp_avg"), v ("exp_avg_sq") are
  // backend buffers indexed by the ranges' offsets. g = grads * grad_scale. step counts from 1.
  void (*adamw_step)(float* params, const float* grads, float* m, float* v, std::span<const StepRange> ranges,
                     const StepHyper& hyper, double lr, int64_t step, float grad_scale) = nullptr;
  // LAMB (apex FusedLAMB's arithmetic; kernels/cpu/step.h), per-tensor trust ratios from the chunk
  // sums (through `gather` when it is set). Waits.
  void (*lamb_step)(float* params, const float* grads, float* m, float* v, std::span<const StepRange> ranges,
                    const StepHyper& hyper, double lr, int64_t step, float grad_scale,
                    const StepChunkSumsGather& gather) = nullptr;
  // out_host[c] = sum of squares (double) of grads[c*kStepChunk, min((c+1)*kStepChunk, n)). Waits.
  void (*grad_sq_chunk_sums)(const float* grads, size_t n, double* out_host) = nullptr;
  // sqrt of those chunk sums added in chunk order (NaN/Inf in: NaN/Inf out). Waits.
  double (*global_grad_norm)(const float* grads, size_t n) = nullptr;
  // True if any of x[n] is NaN or +-Inf. Waits.
  bool (*has_non_finite)(const float* x, size_t n) = nullptr;
  // x[i] *= s (clipping, loss-scale unscaling), ordered with the backend's other work.
  void (*scale_inplace)(float* x, size_t n, float s) = nullptr;
  // The device of this process the buffers live on (the NCCL communicator's GPU); -1 on the host.
  int (*device_index)() = nullptr;
};

// Calls f(name, implemented) for every slot of `ops`, in declaration order.
template <typename F>
void for_each_step_op(const StepOps& o, F&& f) {
#define LATHE_STEP_OP(name) f(#name, o.name != nullptr)
  LATHE_STEP_OP(adamw_step);
  LATHE_STEP_OP(lamb_step);
  LATHE_STEP_OP(grad_sq_chunk_sums);
  LATHE_STEP_OP(global_grad_norm);
  LATHE_STEP_OP(has_non_finite);
  LATHE_STEP_OP(scale_inplace);
  LATHE_STEP_OP(device_index);
#undef LATHE_STEP_OP
}
static_assert(sizeof(StepOps) == sizeof(const char*) + 7 * sizeof(void (*)()),
              "StepOps gained or lost a slot: update for_each_step_op");

}  // namespace lathe
