// Register-blocked tile products shared by the attention kernels (attention.cpp, the one-rank
// kernel; attention_block.cpp, context parallelism's block kernel).
//
// micro<MR, NV>: C[MR, NV vectors] (= or +=) alpha * sum_k A(i,k) * B[k, :], where A(i,k) =
// A[i*a_rs + k*a_cs] is read as broadcast scalars (so A may be a transposed view) and each B row is
// contiguous along N. OpenBLAS packs both operands on every call, which dominates at these sizes
// (T <= a few hundred, D = 64): measured 25-45 GFLOP/s per core against 135 for large sgemm. This
// register-blocked kernel (MR = 6 rows x NV hardware vectors of columns) needs no packing. Column
// blocks are 64 wide with AVX-512 (6 x 4 accumulators of 16 floats) and 16 wide otherwise (6 x 2 of
// 8 floats: AVX2 has 16 vector registers; 6 x 64 columns there spilled the accumulators to the stack
// on every k, 12% of an AVX2 training step). Each element of C is the same sum in the same k order
// whatever the blocking, so the results do not depend on it.
#pragma once
#include <algorithm>
#include <cstdint>

#include "kernels/cpu/vec_math.h"

namespace lathe::cpu::tiles {

using vec::vf;
constexpr int kColsBig = vec::kW == 16 ? 64 : 16;  // columns of the wide block (a multiple of 16)
constexpr int64_t kMR = 6;                         // rows of one micro tile

template <int MR, int NV>
inline void micro(int64_t K, float alpha, const float* A, int64_t a_rs, int64_t a_cs, const float* B, int64_t ldb,
                  bool accumulate, float* C, int64_t ldc) {
  vf acc[MR][NV];
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v] = vf{};
  for (int64_t k = 0; k < K; ++k) {
    const float* b = B + k * ldb;
    vf bv[NV];
    for (int v = 0; v < NV; ++v) bv[v] = vec::load(b + vec::kW * v);
    const float* a = A + k * a_cs;
    for (int i = 0; i < MR; ++i) {
      const float ai = a[i * a_rs];
      for (int v = 0; v < NV; ++v) acc[i][v] += ai * bv[v];
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v) {
      float* c = C + i * ldc + vec::kW * v;
      vec::store(c, accumulate ? vec::load(c) + alpha * acc[i][v] : alpha * acc[i][v]);
    }
}

// micro<mr, NV> for a run-time row count mr in [1, 6].
template <int NV>
inline void micro_rows(int64_t mr, int64_t K, float alpha, const float* A, int64_t a_rs, int64_t a_cs, const float* B,
                       int64_t ldb, bool accumulate, float* C, int64_t ldc) {
  switch (mr) {
    case 6:
      micro<6, NV>(K, alpha, A, a_rs, a_cs, B, ldb, accumulate, C, ldc);
      break;
    case 5:
      micro<5, NV>(K, alpha, A, a_rs, a_cs, B, ldb, accumulate, C, ldc);
      break;
    case 4:
      micro<4, NV>(K, alpha, A, a_rs, a_cs, B, ldb, accumulate, C, ldc);
      break;
    case 3:
      micro<3, NV>(K, alpha, A, a_rs, a_cs, B, ldb, accumulate, C, ldc);
      break;
    case 2:
      micro<2, NV>(K, alpha, A, a_rs, a_cs, B, ldb, accumulate, C, ldc);
      break;
    default:
      micro<1, NV>(K, alpha, A, a_rs, a_cs, B, ldb, accumulate, C, ldc);
      break;
  }
}

// Column tail of a tile product (< 16 columns: odd head sizes and ragged tiles): plain loops over
// rows [0, M) and the full k range (zero A entries contribute exact zeros).
inline void tail_cols(int64_t M, int64_t j, int64_t N, int64_t K, float alpha, const float* A, int64_t a_rs,
                      int64_t a_cs, const float* B, int64_t ldb, bool accumulate, float* C, int64_t ldc) {
  for (int64_t i = 0; i < M; ++i)
    for (int64_t jj = j; jj < N; ++jj) {
      float acc = 0.0f;
      for (int64_t k = 0; k < K; ++k) acc += A[i * a_rs + k * a_cs] * B[k * ldb + jj];
      C[i * ldc + jj] = accumulate ? C[i * ldc + jj] + alpha * acc : alpha * acc;
    }
}

// dst[T, D] = src[T, D] with row stride ld, packed.
inline void pack_head(float* dst, const float* src, int64_t T, int64_t D, int64_t ld) {
  for (int64_t t = 0; t < T; ++t) std::copy(src + t * ld, src + t * ld + D, dst + t * D);
}

// dst[D, T] = src[T, D] (row stride ld; dst row stride ldd, 0 = T): K or V of one head transposed
// so that Q K^T and dO V^T read contiguous rows of length T. Blocks of 16 source rows keep the
// reads in L1 while every write is a contiguous run.
inline void transpose_head(float* dst, const float* src, int64_t T, int64_t D, int64_t ld, int64_t ldd = 0) {
  if (ldd == 0) ldd = T;
  for (int64_t t0 = 0; t0 < T; t0 += 16) {
    const int64_t t1 = std::min(T, t0 + 16);
    for (int64_t d = 0; d < D; ++d)
      for (int64_t t = t0; t < t1; ++t) dst[d * ldd + t] = src[t * ld + d];
  }
}

}  // namespace lathe::cpu::tiles
