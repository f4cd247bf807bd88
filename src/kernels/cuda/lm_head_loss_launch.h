// Launch configuration and scratch layout of the CUDA fused lm head loss
// (kernels/cuda/lm_head_loss.cu), in plain C++ so that it is unit-tested without a GPU.
//
// Scratch of one call (chunk_rows = R rows at a time, vocabulary V), byte offsets 256-aligned:
//   [0, R*V*4)             fp32 logits of one chunk; the fp32 table turns them into dlogits in place
//   [dlogits, + R*V*2)     bf16 table only: the dlogits rounded to bf16 for the two backward GEMMs
//                          (the CPU bf16 table rounds them the same way)
//   [aux, + kAuxBytes)     the first out-of-range target row (uint64) and the loss sum (double)
//   [stats, + 3*R*8)       vocab-parallel row statistics: max, exp-sum, target logit (double)
// so the full N x V logits never exist: memory is R x V whatever N is.
#pragma once
#include <cstddef>
#include <cstdint>
#include <limits>

namespace lathe::cuda::lm_head {

constexpr int kRowThreads = 512;      // one block per row for max / exp-sum / loss / dlogits
constexpr int kReduceThreads = 1024;  // the single block summing the losses in a fixed order
constexpr int kCheckThreads = 256;    // target range check
constexpr size_t kAlign = 256;
constexpr size_t kAuxBytes = 256;

constexpr size_t align_up(size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

struct ScratchLayout {
  size_t logits = 0;   // offset of the fp32 logits [R, V]
  size_t dlogits = 0;  // offset of the bf16 dlogits [R, V] (== logits for fp32: in place)
  size_t aux = 0;      // offset of the auxiliary words
  size_t stats = 0;    // offset of the vocab-parallel statistics [3R] doubles
  size_t bytes = 0;    // total; 0 when the sizes overflow size_t
};

// elem_bytes: 4 (fp32 table) or 2 (bf16 table).
constexpr ScratchLayout scratch_layout(int64_t chunk_rows, int64_t V, int elem_bytes) {
  ScratchLayout s;
  if (chunk_rows < 1 || V < 1) return s;
  const size_t R = static_cast<size_t>(chunk_rows), v = static_cast<size_t>(V);
  constexpr size_t kMax = std::numeric_limits<size_t>::max() / 8;
  if (R > kMax / v) return s;  // R * V * 4 (and * 2) must fit comfortably
  const size_t logits_bytes = align_up(R * v * 4);
  s.logits = 0;
  s.dlogits = elem_bytes == 4 ? 0 : logits_bytes;
  s.aux = elem_bytes == 4 ? logits_bytes : logits_bytes + align_up(R * v * 2);
  s.stats = s.aux + kAuxBytes;
  s.bytes = s.stats + align_up(3 * R * 8);
  return s;
}

// Rows of chunk c of N rows cut every chunk_rows: [first, first + count).
struct ChunkRows {
  int64_t first, count;
};
constexpr int64_t num_chunks(int64_t N, int64_t chunk_rows) { return (N + chunk_rows - 1) / chunk_rows; }
constexpr ChunkRows chunk_rows_of(int64_t c, int64_t N, int64_t chunk_rows) {
  const int64_t first = c * chunk_rows;
  return {first, N - first < chunk_rows ? N - first : chunk_rows};
}

// Blocks of the target check over N rows.
constexpr int64_t check_blocks(int64_t N) { return (N + kCheckThreads - 1) / kCheckThreads; }

// cuBLAS takes int dimensions: every GEMM dimension and leading dimension must fit.
constexpr bool gemm_dims_fit(int64_t chunk_rows, int64_t C, int64_t V) {
  constexpr int64_t kMaxInt = std::numeric_limits<int>::max();
  return chunk_rows <= kMaxInt && C <= kMaxInt && V <= kMaxInt;
}

}  // namespace lathe::cuda::lm_head
