// Vectorised row primitives for the softmax-shaped loops (fused cross-entropy, attention).
// GCC does not vectorise a float->double reduction around a polynomial exp, nor std::max
// reductions, so these are written with GCC vector extensions. Arithmetic is defined on 16
// logical lanes (lane i takes elements j = i mod 16; lanes are combined in order 0..15), carried
// by the widest vector the target has: one 16-float vector with AVX-512, two 8-float vectors
// otherwise. The results are bit-identical either way, and deterministic. (A plain 16-float GCC
// vector on an AVX2 target lowers its compares and selects lane by lane through the stack: 14x
// slower than the two 8-float halves, measured on exp_shift_sum.)
#pragma once
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels/cpu/pointwise_math.h"

namespace lathe::cpu::vec {

#if defined(__AVX512F__)
constexpr int kW = 16;  // floats per hardware vector
#else
constexpr int kW = 8;
#endif
constexpr int kLanes = 16;           // logical lanes of the reductions
constexpr int kParts = kLanes / kW;  // hardware vectors per 16 logical lanes
typedef float vf __attribute__((vector_size(4 * kW)));
typedef int32_t vi __attribute__((vector_size(4 * kW)));

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
inline vf splat(float x) { return vf{} + x; }

// exp(x), the Cephes expf polynomial (cpu::exp_poly, about 1-2 ulp); 0 below -87.3 (inputs here
// are <= 0).
inline float exp1(float x) {
  const float xc = std::min(std::max(x, -87.3f), 88.3f);
  const float big = 12582912.0f;  // 1.5 * 2^23: adding and subtracting rounds to an integer
  const float n = (xc * 1.44269504088896341f + big) - big;
  const float y = exp_poly(xc, n);
  const int32_t e = (static_cast<int32_t>(n) + 127) << 23;
  return x < -87.3f ? 0.0f : y * std::bit_cast<float>(e);
}

// The same polynomial on kW lanes (bit-identical to exp1 lane by lane).
inline vf expv(vf x) {
  const vf lo = splat(-87.3f), hi = splat(88.3f);
  vf xc = x < lo ? lo : x;
  xc = xc > hi ? hi : xc;
  const vf big = splat(12582912.0f);
  const vf n = (xc * 1.44269504088896341f + big) - big;
  const vf y = exp_poly(xc, n);
  const vi e = (__builtin_convertvector(n, vi) + 127) << 23;
  vf scale;
  std::memcpy(&scale, &e, sizeof scale);
  const vf res = y * scale;
  return x < lo ? vf{} : res;
}

inline float row_max(const float* s, int64_t n) {
  float m = -INFINITY;
  int64_t j = 0;
  if (n >= kW) {
    vf acc = load(s);
    for (j = kW; j + kW <= n; j += kW) {
      const vf x = load(s + j);
      acc = acc > x ? acc : x;
    }
    for (int i = 0; i < kW; ++i) m = std::max(m, acc[i]);  // max is exact: any order gives the same
  }
  for (; j < n; ++j) m = std::max(m, s[j]);
  return m;
}

// Adds the 16 logical lanes of acc in lane order (in double).
inline double lane_sum(const vf (&acc)[kParts]) {
  double block = 0.0;
  for (int u = 0; u < kParts; ++u)
    for (int i = 0; i < kW; ++i) block += acc[u][i];
  return block;
}

// s[j] <- exp(s[j] - m) for j < n; returns the sum. Lanes accumulate in float over blocks of
// 1024 elements (64 terms per lane, each <= 1), blocks are added in double, so the sum of a
// 50k-wide row keeps ~1e-7 relative accuracy.
inline double exp_shift_sum(float* s, int64_t n, float m) {
  double total = 0.0;
  const vf mv = splat(m);
  int64_t j = 0;
  for (; j + kLanes <= n;) {
    vf acc[kParts]{};
    const int64_t end = std::min(n - (n - j) % kLanes, j + 1024);
    for (; j < end; j += kLanes)
      for (int u = 0; u < kParts; ++u) {
        const vf e = expv(load(s + j + u * kW) - mv);
        store(s + j + u * kW, e);
        acc[u] += e;
      }
    total += lane_sum(acc);
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
  const vf mv = splat(m);
  int64_t j = 0;
  for (; j + kLanes <= n;) {
    vf acc[kParts]{};
    const int64_t end = std::min(n - (n - j) % kLanes, j + 1024);
    for (; j < end; j += kLanes)
      for (int u = 0; u < kParts; ++u) acc[u] += expv(load(s + j + u * kW) - mv);
    total += lane_sum(acc);
  }
  for (; j < n; ++j) total += exp1(s[j] - m);
  return total;
}

// s[j] <- exp(s[j] - m), no sum.
inline void exp_shift(float* s, int64_t n, float m) {
  const vf mv = splat(m);
  int64_t j = 0;
  for (; j + kW <= n; j += kW) store(s + j, expv(load(s + j) - mv));
  for (; j < n; ++j) s[j] = exp1(s[j] - m);
}

inline void scale(float* s, int64_t n, float f) {
  int64_t j = 0;
  for (; j + kW <= n; j += kW) store(s + j, load(s + j) * f);
  for (; j < n; ++j) s[j] *= f;
}

}  // namespace lathe::cpu::vec
