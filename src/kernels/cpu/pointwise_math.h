// Element formulas of the pointwise kernels (pointwise.cpp, one template for every storage type):
// the same fp32 math whatever the storage type. See pointwise.cpp for why.
#pragma once
#include <bit>
#include <cmath>
#include <cstdint>

namespace lathe::cpu {

// The Cephes expf polynomial, the one copy every exp of the CPU kernels uses (exp_vec below,
// vec::exp1 and vec::expv in vec_math.h): for x in the clamped range and n = round(x / ln2) (a
// float), returns e^(x - n ln2) with r = x - n ln2 in two steps (Cody-Waite) so that r keeps full
// precision. V is float or a GCC float vector (lane by lane, bit-identical to float). The callers
// differ only in the clamp and in how they scale by 2^n, which set their results at the ends of
// the range (kept as they are: the bits of every kernel depend on them).
template <class V>
inline V exp_poly(V x, V n) {
  V r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  V p = V{} + 1.9875691500e-4f;  // the constant in every lane
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  return p * r * r + r + 1.0f;
}

inline float exp_vec(float x) {
  // Clamp so that 2^n stays a normal float: exp saturates at ~2.4e38 and ~1.2e-38, which is
  // exact enough for every use here (sigmoid of |g| > 87 is 0 or 1 to float precision).
  x = x < -87.0f ? -87.0f : x;
  x = x > 88.0f ? 88.0f : x;
  // n = round(x / ln2) with the 1.5*2^23 trick (round-to-nearest, vectorises everywhere).
  const float shifter = 12582912.0f;
  const float t = x * 1.44269504088896341f + shifter;
  const float n = t - shifter;
  const float y = exp_poly(x, n);
  // Scale by 2^n through the exponent bits; n is in [-126, 127]. n is read from the mantissa of t
  // (t = shifter + n exactly) rather than converted from float, so a NaN input has no undefined
  // float-to-int conversion: it just propagates through y.
  const int32_t ni = std::bit_cast<int32_t>(t) - std::bit_cast<int32_t>(shifter);
  return y * std::bit_cast<float>((ni + 127) << 23);
}

inline float sigmoid_vec(float x) { return 1.0f / (1.0f + exp_vec(-x)); }

constexpr float kGeluS = 0.7978845608028654f;  // sqrt(2/pi)
constexpr float kGeluA = 0.044715f;

inline float gelu_elem(float x) {
  const float u = kGeluS * (x + kGeluA * x * x * x);
  return x * sigmoid_vec(2.0f * u);
}
inline float gelu_grad_elem(float x, float d) {
  const float u = kGeluS * (x + kGeluA * x * x * x);
  const float du = kGeluS * (1.0f + 3.0f * kGeluA * x * x);
  const float sg = sigmoid_vec(2.0f * u);
  return d * (sg + 2.0f * x * sg * (1.0f - sg) * du);
}

// Exact GELU (HF "gelu", torch gelu(approximate="none")): x * Phi(x), Phi(x) = erfc(-x/sqrt2) / 2
// (erfc, not 1 + erf: no cancellation for negative x);
// gelu'(x) = Phi(x) + x * phi(x), phi(x) = exp(-x^2/2) / sqrt(2 pi). libm's erfcf/expf (scalar).
constexpr float kInvSqrt2 = 0.70710678118654752f;
constexpr float kInvSqrt2Pi = 0.39894228040143268f;
inline float gelu_erf_elem(float x) { return 0.5f * x * std::erfc(-x * kInvSqrt2); }
inline float gelu_erf_grad_elem(float x, float d) {
  const float cdf = 0.5f * std::erfc(-x * kInvSqrt2);
  return d * (cdf + x * kInvSqrt2Pi * std::exp(-0.5f * x * x));
}

}  // namespace lathe::cpu
