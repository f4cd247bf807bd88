// Launch configuration of the CUDA kernels and the device choice, in plain C++ (no CUDA headers) so
// that it is compiled and tested on machines without a GPU (tests/cuda/test_cuda_launch.cpp).
// Every kernel of kernels/cuda/*.cu takes its grid from here; scratch sizes the op tables report
// (layernorm_scratch_bytes, ...) are computed here too, so the host side of a launch is testable.
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>

namespace lathe::cuda {

constexpr int kThreads = 256;                // threads per block of the 1-D (elementwise) kernels
constexpr int kWarp = 32;                    // threads per warp
constexpr int kWarpsPerBlock = 8;            // row kernels: one warp per row, 8 rows per block
constexpr int64_t kMaxBlocks = 1 << 20;      // grid-stride loops cover the rest (gridDim.x < 2^31)
constexpr int64_t kNormPartials = 512;       // norm backward: warps that each own a partial dweight row
constexpr int64_t kColSumMaxPartials = 256;  // matmul dbias: row chunks summed separately, then in order
constexpr int64_t kColSumMinRows = 32;       // ... of at least this many rows each
constexpr size_t kCublasLtWorkspaceBytes = size_t{32} << 20;  // NVIDIA's recommendation for Hopper

constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Blocks of `threads` for n elements with a grid-stride loop: at least 1, at most kMaxBlocks.
constexpr int64_t grid_1d(int64_t n, int64_t threads = kThreads) {
  return std::clamp<int64_t>(ceil_div(std::max<int64_t>(n, 1), threads), 1, kMaxBlocks);
}
// Blocks of kWarpsPerBlock warps for `rows` rows handled one warp per row (grid-stride over rows).
constexpr int64_t grid_rows(int64_t rows) { return grid_1d(rows, kWarpsPerBlock); }

// Norm backward: min(N, kNormPartials) warps; warp w handles rows w, w + P, ... and accumulates its
// parameter-gradient partials in its own scratch row (no atomics), a second kernel sums the rows
// 0..P-1 in order per column. Scratch floats: kNormPartials * (2 C) for LayerNorm (dweight, dbias),
// kNormPartials * C for RMSNorm.
constexpr int64_t norm_partials(int64_t N) { return std::clamp<int64_t>(N, 1, kNormPartials); }
constexpr size_t layernorm_scratch_bytes(int64_t C) { return static_cast<size_t>(kNormPartials * 2 * C) * 4; }
constexpr size_t rmsnorm_scratch_bytes(int64_t C) { return static_cast<size_t>(kNormPartials * C) * 4; }

// Column sums of a [M, N] matrix (matmul's dbias += sum over rows of dout), deterministic: rows are
// cut into `partials` chunks of `rows_per_partial` rows; pass 1 writes one partial row per chunk,
// pass 2 adds the partials of each column in chunk order.
struct ColSumPlan {
  int64_t partials;
  int64_t rows_per_partial;
  size_t scratch_bytes;  // partials * N floats
};
constexpr ColSumPlan col_sum_plan(int64_t M, int64_t N) {
  const int64_t p = std::clamp<int64_t>(M / kColSumMinRows, 1, kColSumMaxPartials);
  const int64_t rows = ceil_div(std::max<int64_t>(M, 1), p);
  const int64_t used = ceil_div(std::max<int64_t>(M, 1), rows);  // no empty chunk
  return {used, rows, static_cast<size_t>(used * std::max<int64_t>(N, 1)) * 4};
}

// The GPU of this process: its local rank (the launcher's OMPI_COMM_WORLD_LOCAL_RANK, else
// LOCAL_RANK (torchrun, srun wrappers), else 0) modulo the device count. Each argument is the
// variable's value or nullptr when unset. Throws lathe::Error naming the variable and its value when
// it is not a non-negative integer, and when device_count < 1.
struct DeviceChoice {
  int device;
  int local_rank;
  std::string source;  // "OMPI_COMM_WORLD_LOCAL_RANK=3", "LOCAL_RANK=1" or "default (no local rank set)"
};
DeviceChoice choose_device(const char* ompi_local_rank, const char* local_rank, int device_count);

}  // namespace lathe::cuda
