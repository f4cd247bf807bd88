// attention_forward / attention_backward against a naive double-precision reference that
// materialises the full causal softmax, and the reference's gradient against central finite
// differences (so the reference itself is checked, not trusted).
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "core/error.h"
#include "kernels/cpu/ops.h"
#include "reference_ops.h"

namespace {

using Shape = lathe::test::AttnShape;
using lathe::test::ref_attention_bwd;
using lathe::test::ref_attention_fwd;

std::vector<float> randn(size_t n, uint32_t seed, float sd = 1.0f) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.0f, sd);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(gen);
  return v;
}

double max_abs(const std::vector<double>& v) {
  double m = 0;
  for (double x : v) m = std::max(m, std::fabs(x));
  return m;
}

struct AttnResult {
  std::vector<float> out, lse, dqkv;
};

AttnResult run_kernel(const std::vector<float>& qkv, const std::vector<float>& dout, const Shape& s) {
  AttnResult r;
  r.out.assign(s.B * s.T * s.H * s.D, NAN);
  r.lse.assign(s.B * s.H * s.T, NAN);
  r.dqkv.assign(qkv.size(), NAN);  // must be overwritten
  std::vector<float> scratch(lathe::cpu::attention_scratch_floats(s.T, s.D), NAN);
  lathe::cpu::attention_forward(r.out.data(), r.lse.data(), qkv.data(), s.B, s.T, s.H, s.KVH, s.D, scratch.data());
  lathe::cpu::attention_backward(r.dqkv.data(), dout.data(), qkv.data(), r.out.data(), r.lse.data(), s.B, s.T, s.H,
                                 s.KVH, s.D, scratch.data());
  return r;
}

void expect_close(const std::vector<float>& got, const std::vector<double>& want, double rtol, const char* what,
                  const Shape& s) {
  ASSERT_EQ(got.size(), want.size());
  const double tol = rtol * std::max(1.0, max_abs(want));
  size_t bad = 0;
  double worst = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::fabs(static_cast<double>(got[i]) - want[i]);
    if (!(err <= tol)) ++bad;  // NaN counts as bad
    if (std::isnan(got[i]))
      worst = INFINITY;
    else
      worst = std::max(worst, err);
  }
  EXPECT_EQ(bad, 0u) << what << " B=" << s.B << " T=" << s.T << " H=" << s.H << " KVH=" << s.KVH << " D=" << s.D
                     << " worst abs err " << worst << " tol " << tol;
}

class AttentionShapes : public ::testing::TestWithParam<Shape> {};

TEST_P(AttentionShapes, MatchesDoubleReference) {
  const Shape s = GetParam();
  const int64_t ld = (s.H + 2 * s.KVH) * s.D;
  const auto qkv = randn(s.B * s.T * ld, 1234 + s.T * 7 + s.D, 1.0f);
  const auto dout = randn(s.B * s.T * s.H * s.D, 99 + s.T, 1.0f);
  const AttnResult r = run_kernel(qkv, dout, s);

  std::vector<double> qkv_d(qkv.begin(), qkv.end()), dout_d(dout.begin(), dout.end()), out_ref, lse_ref;
  ref_attention_fwd(out_ref, lse_ref, qkv_d, s);
  expect_close(r.out, out_ref, 2e-5, "out", s);
  expect_close(r.lse, lse_ref, 2e-5, "lse", s);
  expect_close(r.dqkv, ref_attention_bwd(qkv_d, dout_d, s), 5e-5, "dqkv", s);

  // Bit-identical on repeat.
  const AttnResult r2 = run_kernel(qkv, dout, s);
  EXPECT_EQ(0, std::memcmp(r.out.data(), r2.out.data(), r.out.size() * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(r.lse.data(), r2.lse.data(), r.lse.size() * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(r.dqkv.data(), r2.dqkv.data(), r.dqkv.size() * sizeof(float)));
}

std::vector<Shape> all_shapes() {
  std::vector<Shape> v;
  const int64_t Ts[] = {1, 3, 31, 33, 67};
  const int64_t Ds[] = {1, 3, 8};
  const std::pair<int64_t, int64_t> heads[] = {{1, 1}, {4, 4}, {4, 2}, {6, 1}, {3, 3}};
  for (int64_t B : {1, 2})
    for (int64_t T : Ts)
      for (int64_t D : Ds)
        for (auto [H, KVH] : heads) v.push_back({B, T, H, KVH, D});
  v.push_back({2, 130, 4, 2, 64});  // several full 64-row query blocks plus a ragged one
  v.push_back({1, 256, 2, 1, 64});
  return v;
}

INSTANTIATE_TEST_SUITE_P(Ops, AttentionShapes, ::testing::ValuesIn(all_shapes()));

// The double reference gradient against central finite differences of the double forward, so the
// analytic reference is itself verified. Also the float kernel against the same differences.
TEST(Attention, ReferenceGradientMatchesFiniteDifferences) {
  const Shape shapes[] = {{1, 5, 4, 2, 3}, {2, 4, 6, 1, 2}, {1, 7, 3, 3, 1}, {1, 9, 2, 1, 8}};
  for (const Shape& s : shapes) {
    const int64_t ld = (s.H + 2 * s.KVH) * s.D;
    const auto qkvf = randn(s.B * s.T * ld, 7 + s.T, 1.0f);
    const auto doutf = randn(s.B * s.T * s.H * s.D, 8 + s.T, 1.0f);
    std::vector<double> qkv(qkvf.begin(), qkvf.end()), dout(doutf.begin(), doutf.end());
    const auto grad = ref_attention_bwd(qkv, dout, s);
    const AttnResult r = run_kernel(qkvf, doutf, s);
    auto loss = [&](const std::vector<double>& in) {
      std::vector<double> o, l;
      ref_attention_fwd(o, l, in, s);
      double acc = 0;
      for (size_t i = 0; i < o.size(); ++i) acc += o[i] * dout[i];
      return acc;
    };
    const double eps = 1e-5;
    for (size_t i = 0; i < qkv.size(); ++i) {
      auto p = qkv, m = qkv;
      p[i] += eps;
      m[i] -= eps;
      const double fd = (loss(p) - loss(m)) / (2 * eps);
      EXPECT_NEAR(grad[i], fd, 1e-6 * std::max(1.0, std::fabs(fd))) << "reference, element " << i;
      EXPECT_NEAR(r.dqkv[i], fd, 5e-5 * std::max(1.0, std::fabs(fd))) << "kernel, element " << i;
    }
  }
}

// Large scores (sharp softmax) must not overflow: lse is computed with max subtraction.
TEST(Attention, LargeScoresStayFinite) {
  const Shape s{1, 33, 2, 1, 8};
  const int64_t ld = (s.H + 2 * s.KVH) * s.D;
  const auto qkv = randn(s.B * s.T * ld, 5, 30.0f);
  const auto dout = randn(s.B * s.T * s.H * s.D, 6, 1.0f);
  const AttnResult r = run_kernel(qkv, dout, s);
  std::vector<double> qkv_d(qkv.begin(), qkv.end()), dout_d(dout.begin(), dout.end()), out_ref, lse_ref;
  ref_attention_fwd(out_ref, lse_ref, qkv_d, s);
  expect_close(r.out, out_ref, 1e-4, "out", s);
  expect_close(r.lse, lse_ref, 1e-5, "lse", s);
  expect_close(r.dqkv, ref_attention_bwd(qkv_d, dout_d, s), 1e-3, "dqkv", s);
}

// Every (b, h) / (b, kv head) task is computed the same way whichever thread runs it, so results
// are bit-identical across thread counts (not only across repeats).
TEST(Attention, BitIdenticalAcrossThreadCounts) {
  const Shape s{2, 67, 6, 2, 8};
  const int64_t ld = (s.H + 2 * s.KVH) * s.D;
  const auto qkv = randn(s.B * s.T * ld, 41, 1.0f);
  const auto dout = randn(s.B * s.T * s.H * s.D, 42, 1.0f);
  const int saved = omp_get_max_threads();
  omp_set_num_threads(1);
  const AttnResult one = run_kernel(qkv, dout, s);
  omp_set_num_threads(3);
  const AttnResult three = run_kernel(qkv, dout, s);
  omp_set_num_threads(saved);
  EXPECT_EQ(0, std::memcmp(one.out.data(), three.out.data(), one.out.size() * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(one.lse.data(), three.lse.data(), one.lse.size() * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(one.dqkv.data(), three.dqkv.data(), one.dqkv.size() * sizeof(float)));
}

TEST(Attention, RejectsBadHeadCounts) {
  std::vector<float> buf(1024);
  EXPECT_THROW(lathe::cpu::attention_forward(buf.data(), buf.data(), buf.data(), 1, 2, 3, 2, 4, buf.data()),
               lathe::Error);
}

}  // namespace
