// Rotary position embedding, HF rotate_half convention (first half / second half of each head).
//
// Tables: HF computes, all in fp32,
//   inv_freq = 1.0 / (theta ** (arange(0, D, 2).float() / D));  angle = t.float() * inv_freq
// and then cos/sin of the fp32 angle. We reproduce exactly those fp32 roundings (exponent, power,
// reciprocal, product) so that our angles are the same floats as HF's, and evaluate cos/sin of that
// float angle in double before rounding. The tables then agree with HF's to about one ulp, where an
// "exact" double angle would differ from HF by up to half an ulp of t (~1e-4 at t = 2048).
// With positions (documents restarting at 0) row (b,t) reads table row positions[b,t] instead of t.
#include <cmath>

#include "kernels/cpu/ops.h"

namespace lathe::cpu {

namespace {
constexpr int64_t kParallelMin = 1 << 14;
}  // namespace

void rope_tables(float* cos_table, float* sin_table, int64_t T, int64_t D, double theta) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; ++i) {
    // fp32 exponent (2i)/D, fp32 power, fp32 reciprocal, as torch does it.
    const float e = static_cast<float>(2 * i) / static_cast<float>(D);
    const float p =
        static_cast<float>(std::pow(static_cast<double>(static_cast<float>(theta)), static_cast<double>(e)));
    const float inv_freq = 1.0f / p;
    for (int64_t t = 0; t < T; ++t) {
      const float angle = static_cast<float>(t) * inv_freq;  // one fp32 rounding, as torch's outer()
      cos_table[t * half + i] = static_cast<float>(std::cos(static_cast<double>(angle)));
      sin_table[t * half + i] = static_cast<float>(std::sin(static_cast<double>(angle)));
    }
  }
}

void rope_forward(float* x, const float* cos_table, const float* sin_table, int64_t B, int64_t T, int64_t n_heads,
                  int64_t D, int64_t row_stride, const int32_t* positions) {
  const int64_t half = D / 2;
  const int64_t rows = B * T;
#pragma omp parallel for schedule(static) if (rows * n_heads * D >= kParallelMin)
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = positions ? positions[r] : r % T;
    const float* __restrict cs = cos_table + t * half;
    const float* __restrict sn = sin_table + t * half;
    for (int64_t h = 0; h < n_heads; ++h) {
      float* __restrict x1 = x + r * row_stride + h * D;
      float* __restrict x2 = x1 + half;
      // x1' = x1 cos - x2 sin;  x2' = x2 cos + x1 sin
      for (int64_t i = 0; i < half; ++i) {
        const float a = x1[i], b = x2[i];
        x1[i] = a * cs[i] - b * sn[i];
        x2[i] = b * cs[i] + a * sn[i];
      }
    }
  }
}

void rope_backward(float* dx, const float* cos_table, const float* sin_table, int64_t B, int64_t T, int64_t n_heads,
                   int64_t D, int64_t row_stride, const int32_t* positions) {
  const int64_t half = D / 2;
  const int64_t rows = B * T;
#pragma omp parallel for schedule(static) if (rows * n_heads * D >= kParallelMin)
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = positions ? positions[r] : r % T;
    const float* __restrict cs = cos_table + t * half;
    const float* __restrict sn = sin_table + t * half;
    for (int64_t h = 0; h < n_heads; ++h) {
      float* __restrict g1 = dx + r * row_stride + h * D;
      float* __restrict g2 = g1 + half;
      // Transpose of the rotation: dx1 = g1 cos + g2 sin;  dx2 = g2 cos - g1 sin
      for (int64_t i = 0; i < half; ++i) {
        const float a = g1[i], b = g2[i];
        g1[i] = a * cs[i] + b * sn[i];
        g2[i] = b * cs[i] - a * sn[i];
      }
    }
  }
}

}  // namespace lathe::cpu
