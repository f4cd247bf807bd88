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
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>

#include <cblas.h>
#include <omp.h>

#include "core/error.h"
#include "kernels/cpu/ops.h"

namespace lathe::cpu {
namespace {

// exp(x) for float, about 1-2 ulp (Cephes expf polynomial), vectorisable (no libm call). Returns
// 0 below -87.3; inputs here are <= 0 after max subtraction. Same as in attention.cpp.
inline float exp_approx(float x) {
  const float xc = std::min(std::max(x, -87.3f), 88.3f);
  const float big = 12582912.0f;  // 1.5 * 2^23: adding and subtracting it rounds to an integer
  const float n = (xc * 1.44269504088896341f + big) - big;
  float r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  const int32_t e = (static_cast<int32_t>(n) + 127) << 23;
  return x < -87.3f ? 0.0f : y * std::bit_cast<float>(e);
}

// Max of a row with several independent lanes (vectorised; max is exact so order is irrelevant).
inline float row_max(const float* s, int64_t n) {
  float m = -INFINITY;
#pragma omp simd reduction(max : m)
  for (int64_t j = 0; j < n; ++j) m = std::max(m, s[j]);
  return m;
}

}  // namespace

double lm_head_loss(float* losses, float* dx, float* dw, const float* x, const float* w, const int32_t* targets,
                    int64_t N, int64_t C, int64_t V, float grad_scale, bool backward, float* scratch,
                    int64_t chunk_rows) {
  LATHE_CHECK(N >= 0 && C >= 1 && V >= 1, "lm_head_loss: invalid shape N={} C={} V={}", N, C, V);
  LATHE_CHECK(chunk_rows >= 1, "lm_head_loss: chunk_rows must be >= 1, got {}", chunk_rows);
  LATHE_CHECK(!backward || (dx != nullptr && dw != nullptr), "lm_head_loss: backward needs dx and dw buffers");
  for (int64_t n = 0; n < N; ++n) {
    LATHE_CHECK(targets[n] < V, "lm_head_loss: target {} at row {} is out of range for vocab size {}; "
                "check that the tokenizer's vocabulary matches model.vocab_size", targets[n], n, V);
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
      const float m = row_max(s, V);
      // The sum of up to ~10^5 terms is accumulated in double (lanes of the vector loop), so the
      // loss does not drift with the vocabulary size; the exps themselves stay fp32.
      double sum = 0.0;
#pragma omp simd reduction(+ : sum)
      for (int64_t j = 0; j < V; ++j) {
        const float e = exp_approx(s[j] - m);
        s[j] = e;
        sum += static_cast<double>(e);
      }
      losses[n0 + r] = static_cast<float>(static_cast<double>(m) + std::log(sum) - static_cast<double>(target_logit));
      if (backward) {
        const float f = static_cast<float>(static_cast<double>(grad_scale) / sum);
#pragma omp simd
        for (int64_t j = 0; j < V; ++j) s[j] *= f;
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
