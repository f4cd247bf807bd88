// dbias[N] += column sums of dout[M, N], shared by the fp32 and bf16 matmul backward: each block of
// 64 columns is summed row by row in a local fp32 accumulator (vectorised over the block), then
// added once. Each column is summed in row order, so the result does not depend on the thread
// count. `load` turns one stored element into fp32 (identity for fp32, widening for bf16).
#pragma once
#include <cstdint>

namespace lathe::cpu {

template <class T, class Load>
void add_column_sums(float* dbias, const T* dout, int64_t M, int64_t N, Load load) {
  // 64 columns: a multiple of the cache line, so blocks of different threads never share a line of
  // dbias. Below 2^14 elements an OpenMP fork costs more than the loop.
  constexpr int64_t kColBlock = 64, kParallelMin = 1 << 14;
  const int64_t nblocks = (N + kColBlock - 1) / kColBlock;
#pragma omp parallel for schedule(static) if (M * N >= kParallelMin)
  for (int64_t blk = 0; blk < nblocks; ++blk) {
    const int64_t j0 = blk * kColBlock;
    const int64_t w = (N - j0 < kColBlock) ? N - j0 : kColBlock;
    float acc[kColBlock] = {};
    if (w == kColBlock) {
      for (int64_t i = 0; i < M; ++i) {
        const T* __restrict row = dout + i * N + j0;
        for (int64_t j = 0; j < kColBlock; ++j) acc[j] += load(row[j]);
      }
    } else {
      for (int64_t i = 0; i < M; ++i) {
        const T* __restrict row = dout + i * N + j0;
        for (int64_t j = 0; j < w; ++j) acc[j] += load(row[j]);
      }
    }
    for (int64_t j = 0; j < w; ++j) dbias[j0 + j] += acc[j];
  }
}

}  // namespace lathe::cpu
