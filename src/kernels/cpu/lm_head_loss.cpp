// Fused lm head + softmax + cross-entropy, chunked over rows (contract in ops.h).
//
// Per chunk of R = chunk_rows rows (x[N,C], w[V,C], scratch[R,V]):
//   1. logits[R,V] = x_chunk @ w^T                       (one sgemm, OpenBLAS threads)
//   2. per row (OpenMP over rows): max, e = exp(logit - max) written in place with its sum, so the
//      backward needs no second exp; loss = max + log(sum) - logit[target].
//      Backward: row <- e * (grad_scale / sum), then row[target] -= grad_scale; ignored rows -> 0.
//   3. dx_chunk[R,C] = dlogits @ w (overwrite),  dw[V,C] += dlogits^T @ x_chunk   (two sgemms)
// Each V-wide row is read from memory once after the GEMM wrote it; the later passes hit L2
// (a 50257-wide row is 200 KB). Larger chunk_rows keep the GEMMs large and stream w (and dw)
// fewer times: each chunk reads w twice and reads+writes dw once.
#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>

#include "core/error.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/vec_math.h"

namespace lathe::cpu {

double lm_head_loss(float* losses, float* dx, float* dw, const float* x, const float* w, const int32_t* targets,
                    int64_t N, int64_t C, int64_t V, float grad_scale, bool backward, float* scratch,
                    int64_t chunk_rows) {
  LATHE_CHECK(N >= 0 && C >= 1 && V >= 1, "lm_head_loss: invalid shape N={} C={} V={}", N, C, V);
  LATHE_CHECK(chunk_rows >= 1, "lm_head_loss: chunk_rows must be >= 1, got {}", chunk_rows);
  LATHE_CHECK(!backward || (dx != nullptr && dw != nullptr), "lm_head_loss: backward needs dx and dw buffers");
  for (int64_t n = 0; n < N; ++n) {
    LATHE_CHECK(targets[n] < V,
                "lm_head_loss: target {} at row {} is out of range for vocab size {}; "
                "check that the tokenizer's vocabulary matches model.vocab_size",
                targets[n], n, V);
  }

  double total = 0.0;
  for (int64_t n0 = 0; n0 < N; n0 += chunk_rows) {
    const int64_t R = std::min(chunk_rows, N - n0);
    const float* xc = x + n0 * C;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, R, V, C, 1.0f, xc, C, w, C, 0.0f, scratch, V);

    double chunk_total = 0.0;
    // Rows are independent; the chunk's loss sum is reduced in row order below (deterministic).
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < R; ++r) {
      float* s = scratch + r * V;
      const int32_t t = targets[n0 + r];
      if (t < 0) {
        losses[n0 + r] = 0.0f;
        if (backward) std::fill(s, s + V, 0.0f);
        continue;
      }
      const float target_logit = s[t];
      const float m = vec::row_max(s, V);
      // exps stay fp32; their sum is taken in double across blocks so the loss does not drift
      // with the vocabulary size.
      const double sum = vec::exp_shift_sum(s, V, m);
      losses[n0 + r] = static_cast<float>(static_cast<double>(m) + std::log(sum) - static_cast<double>(target_logit));
      if (backward) {
        vec::scale(s, V, static_cast<float>(static_cast<double>(grad_scale) / sum));
        s[t] -= grad_scale;
      }
    }
    for (int64_t r = 0; r < R; ++r) chunk_total += losses[n0 + r];
    total += chunk_total;

    if (backward) {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, R, C, V, 1.0f, scratch, V, w, C, 0.0f, dx + n0 * C, C);
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, V, C, R, 1.0f, scratch, V, xc, C, 1.0f, dw, C);
    }
  }
  return total;
}

}  // namespace lathe::cpu
