// Vocab-parallel lm head + softmax + cross-entropy (tensor parallelism, Megatron's
// VocabParallelEmbedding / vocab_parallel_cross_entropy): the whole logits never exist, not even
// one chunk of them. Per chunk of R rows, on each of the tp ranks (w[V, C] = rows
// [vocab_begin, vocab_begin + V) of global_V):
//   1. logits[R, V] = x_chunk @ w^T                       (local columns only)
//   2. m[R] = row max, all-reduced (max)                  -> the whole row's max, exactly
//   3. s <- exp(s - m) in place; sum[R] (double) and the target logit (its owning shard; 0 on the
//      others) all-reduced (sum)                          -> sum over the whole row, target logit
//      loss = m + log(sum) - target                       (the same on every rank)
//      backward: s <- s * grad_scale / sum, s[target] -= grad_scale on the owning shard
//   4. dx_chunk = dlogits @ w (this shard's partial; the caller all-reduces dx), dw += dlogits^T @ x
// Two collectives of R and 2R doubles per chunk. Against one process the values differ only in the
// order the exp sum is added (per shard, then across shards) and in the GEMMs' split of V, so losses
// agree to ~1e-7 relative and gradients to the fp32 rounding of the GEMM sums.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "core/error.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/lm_head_tiles.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/storage.h"
#include "kernels/cpu/vec_math.h"

namespace lathe::cpu {

void check_vocab_parallel_args(const int32_t* targets, int64_t N, int64_t C, int64_t V, int64_t chunk_rows,
                               bool backward, bool have_grads, const VocabParallel& vp) {
  LATHE_CHECK(N >= 0 && C >= 1 && V >= 1, "lm_head_loss: invalid shape N={} C={} V={}", N, C, V);
  LATHE_CHECK(chunk_rows >= 1, "lm_head_loss: chunk_rows must be >= 1, got {}", chunk_rows);
  LATHE_CHECK(!backward || have_grads, "lm_head_loss: backward needs dx and dw buffers");
  LATHE_CHECK(vp.vocab_begin >= 0 && vp.vocab_begin + V <= vp.global_V,
              "lm_head_loss: vocab shard [{}, {}) is not inside the vocabulary of {} rows", vp.vocab_begin,
              vp.vocab_begin + V, vp.global_V);
  for (int64_t n = 0; n < N; ++n)
    LATHE_CHECK(targets[n] < vp.global_V,
                "lm_head_loss: target {} at row {} is out of range for vocab size {}; "
                "check that the tokenizer's vocabulary matches model.vocab_size",
                targets[n], n, vp.global_V);
}

double vocab_parallel_softmax_rows(float* s, float* losses, const int32_t* targets, int64_t R, int64_t V,
                                   float grad_scale, bool backward, const VocabParallel& vp, float softcap) {
  // [R] row maxima, then [2R]: sums of exp, target logits. Host memory (the CPU backend's).
  std::vector<double> red(static_cast<size_t>(3 * R));
  double* mx = red.data();
  double* sums = red.data() + R;
  double* tgt = sums + R;
  auto local_target = [&](int64_t r) -> int64_t {  // column of row r's target in this shard, or -1
    const int64_t t = static_cast<int64_t>(targets[r]) - vp.vocab_begin;
    return targets[r] >= 0 && t >= 0 && t < V ? t : -1;
  };
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < R; ++r) mx[r] = vec::row_max(s + r * V, V);
  if (vp.all_reduce) vp.all_reduce(vp.ctx, mx, R, true);
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < R; ++r) {
    float* row = s + r * V;
    const int64_t t = local_target(r);
    tgt[r] = t >= 0 ? static_cast<double>(row[t]) : 0.0;  // before the exp overwrites it
    const float m = static_cast<float>(mx[r]);
    // capped: the row keeps the capped logits (the backward needs them for 1 - tanh^2)
    sums[r] = targets[r] < 0   ? 0.0
              : softcap > 0.0f ? vec::exp_shift_sum_nostore(row, V, m)
                               : vec::exp_shift_sum(row, V, m);
  }
  if (vp.all_reduce) vp.all_reduce(vp.ctx, sums, 2 * R, false);
  double total = 0.0;
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < R; ++r) {
    float* row = s + r * V;
    if (targets[r] < 0) {
      losses[r] = 0.0f;
      if (backward) std::fill(row, row + V, 0.0f);
      continue;
    }
    losses[r] = static_cast<float>(mx[r] + std::log(sums[r]) - tgt[r]);
    if (backward && softcap > 0.0f) {
      const float f = static_cast<float>(static_cast<double>(grad_scale) / sums[r]), m = static_cast<float>(mx[r]);
      const int64_t t = local_target(r);
      for (int64_t j = 0; j < V; ++j) {
        const float th = row[j] / softcap;
        float d = std::exp(row[j] - m) * f;
        if (j == t) d -= grad_scale;
        row[j] = d * (1.0f - th * th);
      }
    } else if (backward) {
      vec::scale(row, V, static_cast<float>(static_cast<double>(grad_scale) / sums[r]));
      const int64_t t = local_target(r);
      if (t >= 0) row[t] -= grad_scale;
    }
  }
  for (int64_t r = 0; r < R; ++r) total += losses[r];  // row order: deterministic
  return total;
}

// Local logits in fp32 whatever the storage; a 16-bit table rounds dlogits once to 16 bits for the
// two backward GEMMs (gemm.h) and gets dx rounded once.
template <class S>
double lm_head_loss_vp(float* losses, void* dx_v, float* dw, const void* x_v, const void* w_v, const int32_t* targets,
                       int64_t N, int64_t C, int64_t V, float grad_scale, bool backward, void* scratch_v,
                       int64_t chunk_rows, const VocabParallel& vp, float softcap) {
  using St = typename S::T;
  check_vocab_parallel_args(targets, N, C, V, chunk_rows, backward, dx_v != nullptr && dw != nullptr, vp);
  LATHE_CHECK(std::isfinite(softcap) && softcap >= 0.0f,
              "lm_head_loss: softcap = {} must be finite and >= 0 (0 = no final logit soft-capping)", softcap);
  const auto *x = as<S>(x_v), *w = as<S>(w_v);
  auto* dx = as<S>(dx_v);
  float* logits = static_cast<float*>(scratch_v);
  St* dlog = nullptr;  // the 16-bit dlogits after the fp32 logits
  if constexpr (!S::kFp32)
    dlog = reinterpret_cast<St*>(static_cast<char*>(scratch_v) +
                                 static_cast<size_t>(std::min(chunk_rows, std::max<int64_t>(N, 1))) *
                                     static_cast<size_t>(V) * sizeof(float));
  double total = 0.0;
  for (int64_t n0 = 0; n0 < N; n0 += chunk_rows) {
    const int64_t R = std::min(chunk_rows, N - n0);
    const St* xc = x + n0 * C;
    Gemm<S>::logits(logits, xc, w, R, C, V);
    if (softcap > 0.0f) head::softcap_logits(logits, R * V, softcap);
    total += vocab_parallel_softmax_rows(logits, losses + n0, targets + n0, R, V, grad_scale, backward, vp, softcap);
    if (!backward) continue;
    if constexpr (S::kFp32) {
      Gemm<S>::bwd(dx + n0 * C, dw, nullptr, logits, xc, w, R, C, V);
    } else {
#pragma omp parallel for schedule(static)
      for (int64_t r = 0; r < R; ++r) S::from_f32(dlog + r * V, logits + r * V, V);
      Gemm<S>::bwd(dx + n0 * C, dw, nullptr, dlog, xc, w, R, C, V);
    }
  }
  return total;
}

#define LATHE_VP(S)                                                                                            \
  template double lm_head_loss_vp<S>(float*, void*, float*, const void*, const void*, const int32_t*, int64_t, \
                                     int64_t, int64_t, float, bool, void*, int64_t, const VocabParallel&, float);
LATHE_VP(F32)
LATHE_VP(Bf16)
LATHE_VP(Fp16)
#undef LATHE_VP

double lm_head_loss_vocab_parallel(float* losses, float* dx, float* dw, const float* x, const float* w,
                                   const int32_t* targets, int64_t N, int64_t C, int64_t V, float grad_scale,
                                   bool backward, float* scratch, int64_t chunk_rows, const VocabParallel& vp,
                                   float softcap) {
  return lm_head_loss_vp<F32>(losses, dx, dw, x, w, targets, N, C, V, grad_scale, backward, scratch, chunk_rows, vp,
                              softcap);
}

}  // namespace lathe::cpu
