// Launch configuration of the CUDA attention kernels (kernels/cuda/attention.cu), in plain C++ so
// that the CPU-side logic (tile counts, shared-memory sizes per head dim, grid sizes, block order)
// is unit-tested without a GPU (tests/kernels/test_cuda_launch.cpp).
//
// Tiling (FlashAttention-2 style, CUDA-core fp32 math for fp32 and bf16 storage):
//  * a block is 256 threads viewed as 16 x 16 (ty, tx); query and key tiles are both kTile = 64 rows,
//    so each thread owns 4 x 4 score entries: rows ty + 16 i, key columns tx + 16 j (i, j < 4);
//  * the head dim D is padded up to a bucket DP in {16, 32, 64, 128} (zero columns add exact zeros);
//    a thread owns output columns tx + 16 jj (jj < DP / 16);
//  * shared-memory tiles are fp32 rows of DP + 1 floats (the +1 makes a column walk across 16 rows
//    hit 16 different banks) and score tiles have rows of kTile + 16 floats (rows ty and ty + 1 of
//    one warp land 16 banks apart).
// Kernels and their shared memory (floats):
//  * forward: one block per (query tile, b, h): Q, K, V tiles [64, DP+1] and P [64, 80];
//  * backward dK/dV: one block per (key tile, b, kv head): K, V, Q, dO tiles, P and dS [64, 80],
//    lse and D_i [64]; it loops over the query heads of its group and the query tiles at or after
//    the key tile, so dK, dV are summed by one block in a fixed order (no atomics: deterministic);
//  * backward dQ: one block per (query tile, b, h): Q, dO, K, V tiles, dS [64, 80], lse and D_i
//    [64]; it loops over key tiles (recomputing P and dP instead of atomically adding dQ).
// Blocks are ordered heaviest first (the last query tiles in forward and dQ, the first key tiles in
// dK/dV: they see the most tiles under the causal mask), so the last wave is made of short blocks.
#pragma once
#include <cstddef>
#include <cstdint>

// The helpers below run on the host (tests, launches) and inside the kernels.
#ifdef __CUDACC__
#define LATHE_HD __host__ __device__
#else
#define LATHE_HD
#endif

namespace lathe::cuda::attn {

constexpr int kThreads = 256;             // 16 x 16
constexpr int kTile = 64;                 // query rows and key rows per tile
constexpr int kMaxHeadDim = 128;          // largest supported D
constexpr int kScoreStride = kTile + 16;  // floats per row of a P / dS tile

// The padded head dim the kernels are instantiated for: 16, 32, 64 or 128 (0: D unsupported).
constexpr int head_dim_bucket(int64_t D) {
  if (D < 1 || D > kMaxHeadDim) return 0;
  if (D <= 16) return 16;
  if (D <= 32) return 32;
  if (D <= 64) return 64;
  return 128;
}

LATHE_HD constexpr int64_t num_tiles(int64_t T) { return (T + kTile - 1) / kTile; }

// Shared memory in bytes of each kernel for a head-dim bucket DP.
constexpr size_t forward_smem_bytes(int DP) {
  return sizeof(float) * (3 * static_cast<size_t>(kTile) * (DP + 1) + static_cast<size_t>(kTile) * kScoreStride);
}
constexpr size_t dkdv_smem_bytes(int DP) {
  return sizeof(float) * (4 * static_cast<size_t>(kTile) * (DP + 1) + 2 * static_cast<size_t>(kTile) * kScoreStride +
                          3 * static_cast<size_t>(kTile));
}
constexpr size_t dq_smem_bytes(int DP) {
  return sizeof(float) * (4 * static_cast<size_t>(kTile) * (DP + 1) + static_cast<size_t>(kTile) * kScoreStride +
                          3 * static_cast<size_t>(kTile));
}
// Opt-in shared memory per block of sm_90 (H100 / H200): 227 KiB.
constexpr size_t kMaxSmemSm90 = 232448;
static_assert(dkdv_smem_bytes(kMaxHeadDim) <= kMaxSmemSm90, "the largest attention tile must fit sm_90");

// Grids are one-dimensional: blocks = tiles x (B * heads), at most 2^31 - 1.
constexpr int64_t forward_blocks(int64_t B, int64_t T, int64_t H) { return num_tiles(T) * B * H; }
constexpr int64_t dkdv_blocks(int64_t B, int64_t T, int64_t KVH) { return num_tiles(T) * B * KVH; }
constexpr int64_t dq_blocks(int64_t B, int64_t T, int64_t H) { return num_tiles(T) * B * H; }
constexpr int64_t kMaxGrid = 2147483647;

// Which (tile, head slot) block `block` of a grid over `heads` = B * H (or B * KVH) head slots
// works on. Query-tile grids (forward, dQ) start from the last tile; the dK/dV grid from the first.
struct BlockWork {
  int64_t tile, slot;
};
LATHE_HD constexpr BlockWork query_block(int64_t block, int64_t ntiles, int64_t heads) {
  return {ntiles - 1 - block / heads, block % heads};
}
LATHE_HD constexpr BlockWork key_block(int64_t block, int64_t heads) { return {block / heads, block % heads}; }

// The first key query i may see under a sliding window (window > 0: keys j > i - window, as HF
// Mistral; 0 = none) given its document's first key lo.
LATHE_HD constexpr int64_t window_lo(int64_t lo, int64_t window, int64_t i) {
  return window > 0 && i - window + 1 > lo ? i - window + 1 : lo;
}

// The first key of the tiles a query tile starting at row i0 visits: 0 (causal) or its first row's
// document start (first_doc_start), rounded down to a key tile.
LATHE_HD constexpr int64_t first_key(int64_t first_doc_start, int64_t i0) {
  const int64_t s = first_doc_start < 0 ? 0 : (first_doc_start > i0 ? i0 : first_doc_start);
  return s / kTile * kTile;
}

// dK/dV kernel: whether query tile [i0, ...) (and so every later one) can see a key of the key tile
// [j0, j0 + nk): false once the tile's first query starts its document (or window) after the key
// tile's last key (these first keys never decrease along a sample). first_doc_start: doc_start[i0] (0 without
// documents), clamped into [0, i0] here as in the kernels.
LATHE_HD constexpr bool query_tile_sees_keys(int64_t first_doc_start, int64_t i0, int64_t j0, int64_t nk) {
  const int64_t s = first_doc_start < 0 ? 0 : (first_doc_start > i0 ? i0 : first_doc_start);
  return s <= j0 + nk - 1;
}

// [kTile x kTile] score tiles a causal forward (per query head, no documents) computes for length T:
// query tile q visits key tiles 0..q.
constexpr int64_t causal_score_tiles(int64_t T) { return num_tiles(T) * (num_tiles(T) + 1) / 2; }

}  // namespace lathe::cuda::attn
