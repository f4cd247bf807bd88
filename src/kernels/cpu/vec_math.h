// Vectorised row primitives for the softmax-shaped loops (fused cross-entropy, attention).
// GCC does not vectorise a float->double reduction around a polynomial exp, nor std::max
// reductions, so these are written with GCC vector extensions (16 floats; AVX-512 where the
// target has it, emulated with narrower vectors elsewhere). Results are deterministic: fixed
// lane assignment and a fixed order of combining lanes.
#pragma once
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace lathe::cpu::vec {

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

inline v16f load(const float* p) {
  v16f v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store(float* p, v16f v) { std::memcpy(p, &v, sizeof v); }
inline v16f splat(float x) { return v16f{} + x; }

// exp(x), Cephes expf polynomial (about 1-2 ulp); 0 below -87.3 (inputs here are <= 0).
inline float exp1(float x) {
  const float xc = std::min(std::max(x, -87.3f), 88.3f);
  const float big = 12582912.0f;  // 1.5 * 2^23: adding and subtracting rounds to an integer
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

// The same polynomial on 16 lanes (bit-identical to exp1 lane by lane).
inline v16f exp16(v16f x) {
  const v16f lo = splat(-87.3f), hi = splat(88.3f);
  v16f xc = x < lo ? lo : x;
  xc = xc > hi ? hi : xc;
  const v16f big = splat(12582912.0f);
  const v16f n = (xc * 1.44269504088896341f + big) - big;
  v16f r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  v16f p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const v16f y = p * r * r + r + 1.0f;
  const v16i e = (__builtin_convertvector(n, v16i) + 127) << 23;
  v16f scale;
  std::memcpy(&scale, &e, sizeof scale);
  const v16f res = y * scale;
  return x < lo ? v16f{} : res;
}

inline float row_max(const float* s, int64_t n) {
  float m = -INFINITY;
  int64_t j = 0;
  if (n >= 16) {
    v16f acc = load(s);
    for (j = 16; j + 16 <= n; j += 16) {
      const v16f x = load(s + j);
      acc = acc > x ? acc : x;
    }
    for (int i = 0; i < 16; ++i) m = std::max(m, acc[i]);
  }
  for (; j < n; ++j) m = std::max(m, s[j]);
  return m;
}

// s[j] <- exp(s[j] - m) for j < n; returns the sum. Lanes accumulate in float over blocks of
// 1024 elements (64 terms per lane, each <= 1), blocks are added in double, so the sum of a
// 50k-wide row keeps ~1e-7 relative accuracy.
inline double exp_shift_sum(float* s, int64_t n, float m) {
  double total = 0.0;
  const v16f mv = splat(m);
  int64_t j = 0;
  for (; j + 16 <= n;) {
    v16f acc{};
    const int64_t end = std::min(n - (n - j) % 16, j + 1024);
    for (; j < end; j += 16) {
      const v16f e = exp16(load(s + j) - mv);
      store(s + j, e);
      acc += e;
    }
    double block = 0.0;
    for (int i = 0; i < 16; ++i) block += acc[i];
    total += block;
  }
  for (; j < n; ++j) {
    s[j] = exp1(s[j] - m);
    total += s[j];
  }
  return total;
}

// The sum of exp(s[j] - m) for j < n, accumulated as exp_shift_sum does; s is not written
// (forward-only losses).
inline double exp_shift_sum_nostore(const float* s, int64_t n, float m) {
  double total = 0.0;
  const v16f mv = splat(m);
  int64_t j = 0;
  for (; j + 16 <= n;) {
    v16f acc{};
    const int64_t end = std::min(n - (n - j) % 16, j + 1024);
    for (; j < end; j += 16) acc += exp16(load(s + j) - mv);
    double block = 0.0;
    for (int i = 0; i < 16; ++i) block += acc[i];
    total += block;
  }
  for (; j < n; ++j) total += exp1(s[j] - m);
  return total;
}

// s[j] <- exp(s[j] - m), no sum.
inline void exp_shift(float* s, int64_t n, float m) {
  const v16f mv = splat(m);
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) store(s + j, exp16(load(s + j) - mv));
  for (; j < n; ++j) s[j] = exp1(s[j] - m);
}

inline void scale(float* s, int64_t n, float f) {
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) store(s + j, load(s + j) * f);
  for (; j < n; ++j) s[j] *= f;
}

}  // namespace lathe::cpu::vec
