// Work split of the CUDA optimizer and gradient-norm kernels (kernels/cuda/optimizer.cu), in plain
// C++ so that it is unit-tested without a GPU: the flat ranges are cut exactly as kernels/step_ops.h
// cuts them (multiples of kStepChunk of the flat buffer, and range ends), one thread block per
// chunk. Per-chunk sums (LAMB's p^2 / u^2, the gradient's sum of squares) are therefore the same
// partition the CPU reduces, which keeps ZeRO shards' chunk sums exchangeable with a single
// process's and the final order of additions (chunk order, on the host) identical.
#pragma once
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "kernels/step_ops.h"

namespace lathe::cuda::optim_launch {

constexpr int kThreads = 256;  // threads per chunk block: 8192 / 256 = 32 elements per thread

// One chunk as the kernels read it (device copy of StepChunk plus its range's decay flag).
struct DeviceChunk {
  int64_t begin, end;  // element offsets in the flat buffer
  int32_t range;       // index into the ranges
  int32_t decay;       // 1: the range gets weight decay
};

inline std::vector<DeviceChunk> device_chunks(std::span<const StepRange> ranges) {
  std::vector<DeviceChunk> out;
  for (const StepChunk& c : make_step_chunks(ranges))
    out.push_back({static_cast<int64_t>(c.begin), static_cast<int64_t>(c.end), static_cast<int32_t>(c.range),
                   ranges[c.range].decay ? 1 : 0});
  return out;
}

// Chunks of a plain buffer of n elements (gradient norm, non-finite check): ceil(n / kChunk).
constexpr size_t flat_chunks(size_t n) { return (n + kStepChunk - 1) / kStepChunk; }

// Blocks of an elementwise kernel over n elements with `per_thread` elements per thread.
constexpr size_t elementwise_blocks(size_t n, size_t per_thread = 4) {
  const size_t per_block = static_cast<size_t>(kThreads) * per_thread;
  return (n + per_block - 1) / per_block;
}

// Grids are one-dimensional (at most 2^31 - 1 blocks): a flat buffer up to 2^31 chunks of 8192.
constexpr size_t kMaxBlocks = 2147483647u;

}  // namespace lathe::cuda::optim_launch
