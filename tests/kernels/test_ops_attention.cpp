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

namespace {

struct Shape {
  int64_t B, T, H, KVH, D;
};
void PrintTo(const Shape& s, std::ostream* os) {
  *os << "B=" << s.B << " T=" << s.T << " H=" << s.H << " KVH=" << s.KVH << " D=" << s.D;
}

std::vector<float> randn(size_t n, uint32_t seed, float sd = 1.0f) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.0f, sd);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(gen);
  return v;
}

// Naive causal GQA attention in double. out[B,T,H*D].
void ref_forward(std::vector<double>& out, std::vector<double>& lse, const std::vector<double>& qkv, const Shape& s) {
  const int64_t ld = (s.H + 2 * s.KVH) * s.D, rep = s.H / s.KVH;
  const double scale = 1.0 / std::sqrt(static_cast<double>(s.D));
  out.assign(s.B * s.T * s.H * s.D, 0.0);
  lse.assign(s.B * s.H * s.T, 0.0);
  std::vector<double> p(s.T);
  for (int64_t b = 0; b < s.B; ++b)
    for (int64_t h = 0; h < s.H; ++h) {
      const int64_t g = h / rep;
      for (int64_t i = 0; i < s.T; ++i) {
        double m = -INFINITY;
        for (int64_t j = 0; j <= i; ++j) {
          double acc = 0;
          for (int64_t d = 0; d < s.D; ++d)
            acc += qkv[(b * s.T + i) * ld + h * s.D + d] * qkv[(b * s.T + j) * ld + (s.H + g) * s.D + d];
          p[j] = acc * scale;
          m = std::max(m, p[j]);
        }
        double sum = 0;
        for (int64_t j = 0; j <= i; ++j) sum += std::exp(p[j] - m);
        lse[(b * s.H + h) * s.T + i] = m + std::log(sum);
        for (int64_t j = 0; j <= i; ++j) {
          const double pj = std::exp(p[j] - m) / sum;
          for (int64_t d = 0; d < s.D; ++d)
            out[(b * s.T + i) * s.H * s.D + h * s.D + d] += pj * qkv[(b * s.T + j) * ld + (s.H + s.KVH + g) * s.D + d];
        }
      }
    }
}

// Analytic gradient of L = sum(out * dout) w.r.t. qkv, double, with the full softmax matrix.
std::vector<double> ref_backward(const std::vector<double>& qkv, const std::vector<double>& dout, const Shape& s) {
  const int64_t ld = (s.H + 2 * s.KVH) * s.D, rep = s.H / s.KVH, T = s.T, D = s.D;
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  std::vector<double> dqkv(qkv.size(), 0.0), P(T * T), dP(T * T);
  auto Q = [&](int64_t b, int64_t t, int64_t h, int64_t d) { return qkv[(b * T + t) * ld + h * D + d]; };
  for (int64_t b = 0; b < s.B; ++b)
    for (int64_t h = 0; h < s.H; ++h) {
      const int64_t g = h / rep, kc = (s.H + g) * D, vc = (s.H + s.KVH + g) * D;
      for (int64_t i = 0; i < T; ++i) {
        double m = -INFINITY;
        for (int64_t j = 0; j <= i; ++j) {
          double acc = 0;
          for (int64_t d = 0; d < D; ++d) acc += Q(b, i, h, d) * qkv[(b * T + j) * ld + kc + d];
          P[i * T + j] = acc * scale;
          m = std::max(m, P[i * T + j]);
        }
        double sum = 0;
        for (int64_t j = 0; j <= i; ++j) sum += std::exp(P[i * T + j] - m);
        for (int64_t j = 0; j <= i; ++j) P[i * T + j] = std::exp(P[i * T + j] - m) / sum;
      }
      for (int64_t i = 0; i < T; ++i) {
        const double* dO = &dout[(b * T + i) * s.H * D + h * D];
        double rowdot = 0;
        for (int64_t j = 0; j <= i; ++j) {
          double acc = 0;
          for (int64_t d = 0; d < D; ++d) acc += dO[d] * qkv[(b * T + j) * ld + vc + d];
          dP[i * T + j] = acc;
          rowdot += acc * P[i * T + j];
        }
        for (int64_t j = 0; j <= i; ++j) {
          const double ds = P[i * T + j] * (dP[i * T + j] - rowdot) * scale;
          for (int64_t d = 0; d < D; ++d) {
            dqkv[(b * T + i) * ld + h * D + d] += ds * qkv[(b * T + j) * ld + kc + d];
            dqkv[(b * T + j) * ld + kc + d] += ds * Q(b, i, h, d);
            dqkv[(b * T + j) * ld + vc + d] += P[i * T + j] * dO[d];
          }
        }
      }
    }
  return dqkv;
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
  ref_forward(out_ref, lse_ref, qkv_d, s);
  expect_close(r.out, out_ref, 2e-5, "out", s);
  expect_close(r.lse, lse_ref, 2e-5, "lse", s);
  expect_close(r.dqkv, ref_backward(qkv_d, dout_d, s), 5e-5, "dqkv", s);

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
    const auto grad = ref_backward(qkv, dout, s);
    const AttnResult r = run_kernel(qkvf, doutf, s);
    auto loss = [&](const std::vector<double>& in) {
      std::vector<double> o, l;
      ref_forward(o, l, in, s);
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
  ref_forward(out_ref, lse_ref, qkv_d, s);
  expect_close(r.out, out_ref, 1e-4, "out", s);
  expect_close(r.lse, lse_ref, 1e-5, "lse", s);
  expect_close(r.dqkv, ref_backward(qkv_d, dout_d, s), 1e-3, "dqkv", s);
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
