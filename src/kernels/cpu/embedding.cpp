// Token + learned position embedding.
//   forward:  out[B,T,C] = wte[tokens[b,t], :] + wpe[pos(b,t), :]   (pos = t, or positions[b,t])
//   backward: dwte[V,C] += scatter-add of dout rows by token; dwpe[T,C] += sum over b of dout[b,t,:]
//             (with positions: a scatter-add by position, done as dwte's)
//
// The scatter-add is parallelised over column blocks, not over tokens: every thread walks all B*T
// tokens in (b,t) order but owns a disjoint range of columns, so rows hit by several tokens are
// summed in a fixed order with no atomics and the result does not depend on the thread count.
#include <omp.h>

#include <cstring>

#include "kernels/cpu/ops.h"

namespace lathe::cpu {

namespace {
constexpr int64_t kParallelMin = 1 << 14;
// Columns per block: one cache line of floats, so threads never write the same line of dwte.
constexpr int64_t kColBlock = 16;
}  // namespace

void embedding_forward(float* out, const int32_t* tokens, const float* wte, const float* wpe, int64_t B, int64_t T,
                       int64_t C, const int32_t* positions, int64_t vocab_begin, int64_t vocab_rows) {
  const int64_t rows = B * T;
#pragma omp parallel for schedule(static) if (rows * C >= kParallelMin)
  for (int64_t r = 0; r < rows; ++r) {
    float* __restrict o = out + r * C;
    const int64_t v = static_cast<int64_t>(tokens[r]) - vocab_begin;
    if (v < 0 || v >= vocab_rows) {  // another shard's token: a zero row (+ wpe)
      if (wpe != nullptr)
        std::memcpy(o, wpe + static_cast<int64_t>(positions ? positions[r] : r % T) * C, sizeof(float) * C);
      else
        std::memset(o, 0, sizeof(float) * C);
      continue;
    }
    const float* __restrict e = wte + v * C;
    if (wpe != nullptr) {
      const float* __restrict p = wpe + static_cast<int64_t>(positions ? positions[r] : r % T) * C;
      for (int64_t c = 0; c < C; ++c) o[c] = e[c] + p[c];
    } else {
      std::memcpy(o, e, sizeof(float) * C);
    }
  }
}

void embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int64_t B, int64_t T,
                        int64_t C, const int32_t* positions, int64_t vocab_begin, int64_t vocab_rows) {
  const int64_t rows = B * T;
  const int64_t nblocks = (C + kColBlock - 1) / kColBlock;
  const bool par = rows * C >= kParallelMin;
#pragma omp parallel if (par)
  {
    // Each thread owns one contiguous run of column blocks [c0, c1) and walks the rows in order,
    // so each row of dout is read as one contiguous segment per thread.
    const int64_t nt = omp_get_num_threads(), tid = omp_get_thread_num();
    const int64_t b0 = nblocks * tid / nt, b1 = nblocks * (tid + 1) / nt;
    const int64_t c0 = b0 * kColBlock, c1 = (b1 * kColBlock < C) ? b1 * kColBlock : C;
    if (c0 < c1) {
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t v = static_cast<int64_t>(tokens[r]) - vocab_begin;
        if (v < 0 || v >= vocab_rows) continue;  // another shard's row
        float* __restrict d = dwte + v * C;
        const float* __restrict g = dout + r * C;
        for (int64_t c = c0; c < c1; ++c) d[c] += g[c];
      }
      if (dwpe != nullptr && positions != nullptr)  // rows of dwpe hit by several tokens: as dwte
        for (int64_t r = 0; r < rows; ++r) {
          float* __restrict d = dwpe + static_cast<int64_t>(positions[r]) * C;
          const float* __restrict g = dout + r * C;
          for (int64_t c = c0; c < c1; ++c) d[c] += g[c];
        }
    }
    if (dwpe != nullptr && positions == nullptr) {
      // dwpe rows are disjoint per t; the batch sum runs in b order.
#pragma omp for schedule(static) nowait
      for (int64_t t = 0; t < T; ++t) {
        float* __restrict d = dwpe + t * C;
        for (int64_t b = 0; b < B; ++b) {
          const float* __restrict g = dout + (b * T + t) * C;
          for (int64_t c = 0; c < C; ++c) d[c] += g[c];
        }
      }
    }
  }
}

}  // namespace lathe::cpu
