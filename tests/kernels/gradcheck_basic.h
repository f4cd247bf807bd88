// Helpers for the kernel tests: random data, tolerance comparisons, and central finite differences
// on a double-precision forward.
//
// The checking scheme for every op:
//   1. fp32 kernel forward   vs  plain-loop double reference forward
//   2. fp32 kernel backward  vs  plain-loop double reference backward (analytic)
//   3. double reference backward vs central finite differences of the double forward
// so the analytic reference is itself verified, and the kernel is verified against it.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "core/rng.h"

namespace lathe::test {

using VecF = std::vector<float>;
using VecD = std::vector<double>;

inline VecF randn(size_t n, Rng& rng, float scale = 1.0f) {
  VecF v(n);
  for (auto& x : v) x = rng.normal() * scale;
  return v;
}

inline VecD to_double(const VecF& v) { return VecD(v.begin(), v.end()); }

// Asserts |got - want| <= atol + rtol * |want| elementwise; reports the worst element.
inline void expect_close(const float* got, const double* want, size_t n, double atol, double rtol,
                         const std::string& what) {
  double worst = 0.0;
  size_t worst_i = 0;
  bool bad = false;
  for (size_t i = 0; i < n; ++i) {
    const double err = std::fabs(static_cast<double>(got[i]) - want[i]);
    const double lim = atol + rtol * std::fabs(want[i]);
    if (!(err <= lim)) {  // also catches NaN
      if (!bad || err / lim > worst) {
        worst = err / lim;
        worst_i = i;
      }
      bad = true;
    }
  }
  EXPECT_FALSE(bad) << what << ": element " << worst_i << " got " << got[worst_i] << " want " << want[worst_i]
                    << " (n=" << n << ", atol=" << atol << ", rtol=" << rtol << ")";
}
inline void expect_close(const VecF& got, const VecD& want, double atol, double rtol, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  expect_close(got.data(), want.data(), got.size(), atol, rtol, what);
}
inline void expect_close_d(const VecD& got, const VecD& want, double atol, double rtol, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::fabs(got[i] - want[i]);
    if (!(err <= atol + rtol * std::fabs(want[i]))) {
      ADD_FAILURE() << what << ": element " << i << " got " << got[i] << " want " << want[i];
      return;
    }
  }
}

inline bool bit_equal(const VecF& a, const VecF& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

inline double max_abs(const VecD& v) {
  double m = 0.0;
  for (double x : v) m = std::max(m, std::fabs(x));
  return m;
}

// Indices to probe with finite differences: all of them when n is small, else `k` spread out
// (first, last, and random ones in between).
inline std::vector<size_t> probe_indices(size_t n, Rng& rng, size_t k = 24) {
  std::vector<size_t> idx;
  if (n <= k) {
    for (size_t i = 0; i < n; ++i) idx.push_back(i);
    return idx;
  }
  idx.push_back(0);
  idx.push_back(n - 1);
  while (idx.size() < k) idx.push_back(static_cast<size_t>(rng.below(n)));
  return idx;
}

// Checks the analytic gradient `grad` of the scalar `loss(x)` against central finite differences
// at the probe indices of x. `x` is modified during the check and restored.
inline void check_fd(const std::function<double()>& loss, VecD& x, const VecD& grad, Rng& rng, const std::string& what,
                     double h = 1e-5, double tol = 1e-6) {
  ASSERT_EQ(x.size(), grad.size()) << what;
  for (size_t i : probe_indices(x.size(), rng)) {
    const double x0 = x[i];
    x[i] = x0 + h;
    const double lp = loss();
    x[i] = x0 - h;
    const double lm = loss();
    x[i] = x0;
    const double fd = (lp - lm) / (2.0 * h);
    EXPECT_NEAR(grad[i], fd, tol * (1.0 + std::fabs(fd))) << what << ": finite difference at index " << i;
  }
}

// sum_i out[i] * g[i]: the scalar whose gradient w.r.t. out is g.
inline double dot(const VecD& out, const VecD& g) {
  double s = 0.0;
  for (size_t i = 0; i < out.size(); ++i) s += out[i] * g[i];
  return s;
}

}  // namespace lathe::test
