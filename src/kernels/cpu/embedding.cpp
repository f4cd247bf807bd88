// Token + learned position embedding.
//   forward:  out[B,T,C] = wte[tokens[b,t], :] + wpe[pos(b,t), :]   (pos = t, or positions[b,t])
//   backward: dwte[V,C] += scatter-add of dout rows by token; dwpe[T,C] += sum over b of dout[b,t,:]
//             (with positions: a scatter-add by position, done as dwte's)
//
// One template per kernel for every storage type (kernels/cpu/storage.h): 16-bit rows are widened,
// the sum wte + wpe rounded once; the gradients are fp32 whatever the storage.
//
// The scatter-add is parallelised over column blocks, not over tokens: every thread walks all B*T
// tokens in (b,t) order but owns a disjoint range of columns, so rows hit by several tokens are
// summed in a fixed order with no atomics and the result does not depend on the thread count.
#include <omp.h>

#include <algorithm>
#include <cstring>

#include "kernels/cpu/op_slots.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/storage.h"

namespace lathe::cpu {

namespace {
// Rows are independent (forward) or summed in a fixed order whatever the thread count (backward);
// each table keeps the threshold it had.
template <class S>
constexpr int64_t kParallelMin = S::kFp32 ? 1 << 14 : 1 << 15;
// Columns per block: one cache line of floats, so threads never write the same line of dwte.
constexpr int64_t kColBlock = 16;

template <class S>
void forward(void* out_v, const int32_t* tokens, const void* wte_v, const void* wpe_v, int64_t B, int64_t T, int64_t C,
             const int32_t* positions, int64_t vocab_begin, int64_t vocab_rows) {
  using St = typename S::T;
  const int64_t rows = B * T;
  auto* out = as<S>(out_v);
  const auto *wte = as<S>(wte_v), *wpe = as<S>(wpe_v);
#pragma omp parallel if (rows * C >= kParallelMin<S>)
  {
    float* eb = work_row<S>(0, static_cast<size_t>(C));
    float* pb = work_row<S>(1, static_cast<size_t>(C));
    float* ob = work_row<S>(2, static_cast<size_t>(C));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      St* o = out + r * C;
      const int64_t v = static_cast<int64_t>(tokens[r]) - vocab_begin;
      if (v < 0 || v >= vocab_rows) {  // another shard's token: a zero row (+ wpe, exact)
        if (wpe != nullptr)
          std::memcpy(o, wpe + static_cast<int64_t>(positions ? positions[r] : r % T) * C, sizeof(St) * C);
        else
          std::memset(o, 0, sizeof(St) * C);
        continue;
      }
      if (wpe == nullptr) {
        std::memcpy(o, wte + v * C, sizeof(St) * C);  // a copy: exact
        continue;
      }
      const float* __restrict e = read_row<S>(eb, wte + v * C, C);
      const float* __restrict p = read_row<S>(pb, wpe + static_cast<int64_t>(positions ? positions[r] : r % T) * C, C);
      float* __restrict ov = out_row<S>(ob, o);
      for (int64_t c = 0; c < C; ++c) ov[c] = e[c] + p[c];
      write_row<S>(o, ov, C);
    }
  }
}

template <class S>
void backward(float* dwte, float* dwpe, const void* dout_v, const int32_t* tokens, int64_t B, int64_t T, int64_t C,
              const int32_t* positions, int64_t vocab_begin, int64_t vocab_rows) {
  const int64_t rows = B * T;
  const auto* dout = as<S>(dout_v);
  const int64_t nblocks = (C + kColBlock - 1) / kColBlock;
#pragma omp parallel if (rows * C >= kParallelMin<S>)
  {
    // Each thread owns one contiguous run of column blocks [c0, c1) and walks the rows in order,
    // so each row of dout is read (widened) as one contiguous segment per thread.
    const int64_t nt = omp_get_num_threads(), tid = omp_get_thread_num();
    const int64_t b0 = nblocks * tid / nt, b1 = nblocks * (tid + 1) / nt;
    const int64_t c0 = b0 * kColBlock, c1 = std::min(b1 * kColBlock, C);
    float* gb = work_row<S>(0, static_cast<size_t>(C));
    if (c0 < c1) {
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t v = static_cast<int64_t>(tokens[r]) - vocab_begin;
        if (v < 0 || v >= vocab_rows) continue;  // another shard's row
        float* __restrict d = dwte + v * C;
        const float* __restrict g = read_row<S>(gb, dout + r * C + c0, c1 - c0);
        for (int64_t c = c0; c < c1; ++c) d[c] += g[c - c0];
      }
      if (dwpe != nullptr && positions != nullptr)  // rows of dwpe hit by several tokens: as dwte
        for (int64_t r = 0; r < rows; ++r) {
          float* __restrict d = dwpe + static_cast<int64_t>(positions[r]) * C;
          const float* __restrict g = read_row<S>(gb, dout + r * C + c0, c1 - c0);
          for (int64_t c = c0; c < c1; ++c) d[c] += g[c - c0];
        }
    }
    if (dwpe != nullptr && positions == nullptr) {
      // dwpe rows are disjoint per t; the batch sum runs in b order.
#pragma omp for schedule(static) nowait
      for (int64_t t = 0; t < T; ++t) {
        float* __restrict d = dwpe + t * C;
        for (int64_t b = 0; b < B; ++b) {
          const float* __restrict g = read_row<S>(gb, dout + (b * T + t) * C, C);
          for (int64_t c = 0; c < C; ++c) d[c] += g[c];
        }
      }
    }
  }
}

}  // namespace

void embedding_forward(float* out, const int32_t* tokens, const float* wte, const float* wpe, int64_t B, int64_t T,
                       int64_t C, const int32_t* positions, int64_t vocab_begin, int64_t vocab_rows) {
  forward<F32>(out, tokens, wte, wpe, B, T, C, positions, vocab_begin, vocab_rows);
}

void embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int64_t B, int64_t T,
                        int64_t C, const int32_t* positions, int64_t vocab_begin, int64_t vocab_rows) {
  backward<F32>(dwte, dwpe, dout, tokens, B, T, C, positions, vocab_begin, vocab_rows);
}

template <class S>
void add_embedding(Ops& o) {
  o.embedding_forward = forward<S>;
  o.embedding_backward = backward<S>;
}
LATHE_CPU_ADD_SLOTS(add_embedding)

}  // namespace lathe::cpu
