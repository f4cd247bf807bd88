// One row of LayerNorm / RMSNorm forward in fp32, shared by the fp32 kernels (layernorm.cpp,
// rmsnorm.cpp) and the bf16/fp16 ones (ops_half.cpp, which widen a row, call these, and round the
// output once), so every dtype computes the same statistics in the same order.
#pragma once
#include <cmath>
#include <cstdint>

namespace lathe::cpu {

// o[C] = (x - mean) * rstd * weight (+ bias); *mean, *rstd of x. Two passes (mean, then centred
// sum of squares): no cancellation, and both vectorise. omp simd reduction lets the compiler
// reassociate the float sums; the order is still fixed for a given build.
inline void layernorm_row(float* __restrict o, float* mean, float* rstd, const float* __restrict x,
                          const float* weight, const float* bias, int64_t C, float eps) {
  const float inv_c = 1.0f / static_cast<float>(C);
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t c = 0; c < C; ++c) s += x[c];
  const float m = s * inv_c;
  float v = 0.0f;
#pragma omp simd reduction(+ : v)
  for (int64_t c = 0; c < C; ++c) {
    const float d = x[c] - m;
    v += d * d;
  }
  const float r = 1.0f / std::sqrt(v * inv_c + eps);
  if (bias != nullptr) {
    for (int64_t c = 0; c < C; ++c) o[c] = (x[c] - m) * r * weight[c] + bias[c];
  } else {
    for (int64_t c = 0; c < C; ++c) o[c] = (x[c] - m) * r * weight[c];
  }
  *mean = m;
  *rstd = r;
}

// o[C] = weight * (x * rstd) (HF's order), *rstd = 1 / sqrt(mean(x^2) + eps).
inline void rmsnorm_row(float* __restrict o, float* rstd, const float* __restrict x, const float* weight, int64_t C,
                        float eps) {
  const float inv_c = 1.0f / static_cast<float>(C);
  float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
  for (int64_t c = 0; c < C; ++c) ss += x[c] * x[c];
  const float r = 1.0f / std::sqrt(ss * inv_c + eps);
  for (int64_t c = 0; c < C; ++c) o[c] = weight[c] * (x[c] * r);
  *rstd = r;
}

}  // namespace lathe::cpu
