// lm_head_loss against a naive double-precision reference (explicit logits and log-softmax), its
// gradients against the analytic double reference and central finite differences, chunking
// invariance, ignored targets, dw accumulation and bit-identical repeats.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "core/error.h"
#include "kernels/cpu/lm_head_tiles.h"
#include "kernels/cpu/ops.h"
#include "reference_ops.h"

namespace {

using Ref = lathe::test::LossRef;
using lathe::test::ref_lm_head_loss;

std::vector<float> randn(size_t n, uint32_t seed, float sd) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.0f, sd);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(gen);
  return v;
}

std::vector<int32_t> make_targets(int64_t N, int64_t V, uint32_t seed) {
  std::mt19937 gen(seed);
  std::vector<int32_t> t(N);
  for (int64_t n = 0; n < N; ++n) t[n] = static_cast<int32_t>(gen() % V);
  // Ignore some rows (including the first when N > 1) to exercise the ignore path.
  for (int64_t n = 0; n < N; n += 5)
    if (N > 1) t[n] = -1;
  return t;
}

double max_abs(const std::vector<double>& v) {
  double m = 0;
  for (double x : v) m = std::max(m, std::fabs(x));
  return m;
}

template <typename A>
void expect_close(const A& got, const std::vector<double>& want, double rtol, const std::string& what) {
  ASSERT_EQ(got.size(), want.size());
  const double tol = rtol * std::max(1.0, max_abs(want));
  size_t bad = 0;
  double worst = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::fabs(static_cast<double>(got[i]) - want[i]);
    if (!(err <= tol)) ++bad;
    worst = std::isnan(err) ? INFINITY : std::max(worst, err);
  }
  EXPECT_EQ(bad, 0u) << what << " worst abs err " << worst << " tol " << tol;
}

struct Out {
  std::vector<float> losses, dx, dw;
  double total;
};

Out run(const std::vector<float>& x, const std::vector<float>& w, const std::vector<int32_t>& tg, int64_t N, int64_t C,
        int64_t V, float grad_scale, bool backward, int64_t chunk, const std::vector<float>& dw_prefill) {
  Out o;
  o.losses.assign(N, NAN);
  o.dx.assign(N * C, NAN);  // must be overwritten
  o.dw = dw_prefill;
  std::vector<float> scratch(std::min(chunk, std::max<int64_t>(N, 1)) * V, NAN);
  o.total =
      lathe::cpu::lm_head_loss(o.losses.data(), backward ? o.dx.data() : nullptr, backward ? o.dw.data() : nullptr,
                               x.data(), w.data(), tg.data(), N, C, V, grad_scale, backward, scratch.data(), chunk);
  return o;
}

TEST(LmHeadLoss, MatchesDoubleReferenceOverShapesAndChunks) {
  for (int64_t N : {1, 3, 31, 67})
    for (int64_t C : {3, 33})
      for (int64_t V : {1, 3, 67, 1000}) {
        const auto x = randn(N * C, 11 + N + C, 1.0f);
        const auto w = randn(V * C, 17 + V, 0.5f);
        const auto tg = make_targets(N, V, 3 + N + V);
        int64_t count = 0;
        for (auto t : tg) count += t >= 0;
        const float gs = 1.0f / static_cast<float>(std::max<int64_t>(count, 1) + 2);  // as if global batch larger
        std::vector<double> xd(x.begin(), x.end()), wd(w.begin(), w.end());
        const Ref ref = ref_lm_head_loss(xd, wd, tg, N, C, V, gs);
        const auto prefill = randn(V * C, 5, 1.0f);
        std::vector<double> dw_want(V * C);
        for (int64_t i = 0; i < V * C; ++i) dw_want[i] = prefill[i] + ref.dw[i];

        std::vector<int64_t> chunks = {1, std::max<int64_t>(1, N / 2), N, N + 5};
        const std::string tag = "N=" + std::to_string(N) + " C=" + std::to_string(C) + " V=" + std::to_string(V);
        for (const int64_t ch : chunks) {
          const std::string t2 = tag + " chunk=" + std::to_string(ch);
          const Out o = run(x, w, tg, N, C, V, gs, true, ch, prefill);
          expect_close(o.losses, ref.losses, 2e-6, t2 + " losses");
          EXPECT_NEAR(o.total, ref.total, 2e-6 * std::max(1.0, std::fabs(ref.total)) * N) << t2;
          expect_close(o.dx, ref.dx, 2e-5, t2 + " dx");
          expect_close(o.dw, dw_want, 2e-5, t2 + " dw (+= prefill)");
          for (int64_t n = 0; n < N; ++n) {
            if (tg[n] >= 0) continue;
            for (int64_t c = 0; c < C; ++c) ASSERT_EQ(o.dx[n * C + c], 0.0f) << t2 << " ignored row " << n;
          }
          // Forward only: same losses, dx/dw untouched (null).
          const Out f = run(x, w, tg, N, C, V, gs, false, ch, prefill);
          EXPECT_EQ(0, std::memcmp(f.losses.data(), o.losses.data(), N * sizeof(float))) << t2;
          // Repeat: bit-identical.
          const Out o2 = run(x, w, tg, N, C, V, gs, true, ch, prefill);
          EXPECT_EQ(0, std::memcmp(o.losses.data(), o2.losses.data(), N * sizeof(float))) << t2;
          EXPECT_EQ(0, std::memcmp(o.dx.data(), o2.dx.data(), o.dx.size() * sizeof(float))) << t2;
          EXPECT_EQ(0, std::memcmp(o.dw.data(), o2.dw.data(), o.dw.size() * sizeof(float))) << t2;
          EXPECT_EQ(o.total, o2.total) << t2;
        }
      }
}

// The vocabulary cut into column tiles (lm_head_tiles.h): narrow tiles, widths that do not divide
// V, a width of 1 (each tile one column) and one wider than V must all give the reference result
// (per-tile maxima recombined exactly), with ignored rows' dx exactly 0. The default width puts
// V <= 2048 in one tile, so only this test exercises the recombination across tiles.
TEST(LmHeadLoss, ColumnTilesMatchReference) {
  for (int64_t N : {1, 9, 40})
    for (int64_t V : {5, 67, 1000}) {
      const int64_t C = 19;
      const auto x = randn(N * C, 31 + N, 1.5f);
      const auto w = randn(V * C, 37 + V, 0.7f);
      const auto tg = make_targets(N, V, 41 + N + V);
      const float gs = 0.125f;
      std::vector<double> xd(x.begin(), x.end()), wd(w.begin(), w.end());
      const Ref ref = ref_lm_head_loss(xd, wd, tg, N, C, V, gs);
      const auto prefill = randn(V * C, 43, 1.0f);
      std::vector<double> dw_want(V * C);
      for (int64_t i = 0; i < V * C; ++i) dw_want[i] = prefill[i] + ref.dw[i];
      for (int64_t width : {int64_t{1}, int64_t{7}, int64_t{16}, int64_t{64}, int64_t{333}, V + 3})
        for (int64_t chunk : {int64_t{4}, N}) {
          if (width * 20 < V) continue;  // keeps the test short: 1-column tiles only at small V
          const std::string tag = "N=" + std::to_string(N) + " V=" + std::to_string(V) +
                                  " width=" + std::to_string(width) + " chunk=" + std::to_string(chunk);
          std::vector<float> losses(N, NAN), dx(N * C, NAN), dw = prefill;
          std::vector<float> scratch(std::min(chunk, N) * V, NAN);
          const double total =
              lathe::cpu::lm_head_loss_tiled(losses.data(), dx.data(), dw.data(), x.data(), w.data(), tg.data(), N, C,
                                             V, gs, true, scratch.data(), chunk, width);
          expect_close(losses, ref.losses, 2e-6, tag + " losses");
          EXPECT_NEAR(total, ref.total, 2e-6 * std::max(1.0, std::fabs(ref.total)) * N) << tag;
          expect_close(dx, ref.dx, 2e-5, tag + " dx");
          expect_close(dw, dw_want, 2e-5, tag + " dw (+= prefill)");
          for (int64_t n = 0; n < N; ++n) {
            if (tg[n] >= 0) continue;
            for (int64_t c = 0; c < C; ++c) ASSERT_EQ(dx[n * C + c], 0.0f) << tag << " ignored row " << n;
          }
          std::vector<float> losses_f(N, NAN);
          lathe::cpu::lm_head_loss_tiled(losses_f.data(), nullptr, nullptr, x.data(), w.data(), tg.data(), N, C, V, gs,
                                         false, scratch.data(), chunk, width);
          EXPECT_EQ(0, std::memcmp(losses_f.data(), losses.data(), N * sizeof(float))) << tag << " forward only";
        }
    }
}

// Logits spread over a large range across tiles (tile maxima differ by ~100): the recombination
// exp(tile max - row max) must neither overflow nor lose the dominant tile.
TEST(LmHeadLoss, ColumnTilesWithDistantMaxima) {
  const int64_t N = 6, C = 4, V = 200;
  const auto x = randn(N * C, 51, 1.0f);
  auto w = randn(V * C, 52, 1.0f);
  for (int64_t v = 0; v < V; ++v)
    for (int64_t c = 0; c < C; ++c) w[v * C + c] *= 1.0f + 30.0f * static_cast<float>(v % 50) / 50.0f;
  const auto tg = make_targets(N, V, 53);
  std::vector<double> xd(x.begin(), x.end()), wd(w.begin(), w.end());
  const Ref ref = ref_lm_head_loss(xd, wd, tg, N, C, V, 1.0);
  std::vector<float> losses(N), dx(N * C), dw(V * C, 0.0f), scratch(N * V);
  lathe::cpu::lm_head_loss_tiled(losses.data(), dx.data(), dw.data(), x.data(), w.data(), tg.data(), N, C, V, 1.0f,
                                 true, scratch.data(), N, 16);
  for (int64_t n = 0; n < N; ++n) {
    ASSERT_TRUE(std::isfinite(losses[n])) << n;
    EXPECT_NEAR(losses[n], ref.losses[n], 1e-3 + 1e-5 * std::fabs(ref.losses[n])) << n;
  }
  expect_close(dx, ref.dx, 1e-4, "dx");
}

// The analytic reference gradient checked against central finite differences of the double loss
// (sum over rows of loss * grad_scale), and the float kernel checked against the same.
TEST(LmHeadLoss, GradientsMatchFiniteDifferences) {
  const int64_t N = 7, C = 5, V = 11;
  const auto x = randn(N * C, 1, 1.0f);
  const auto w = randn(V * C, 2, 1.0f);
  auto tg = make_targets(N, V, 4);
  const double gs = 0.25;
  std::vector<double> xd(x.begin(), x.end()), wd(w.begin(), w.end());
  const Ref ref = ref_lm_head_loss(xd, wd, tg, N, C, V, gs);
  const Out o = run(x, w, tg, N, C, V, static_cast<float>(gs), true, 3, std::vector<float>(V * C, 0.0f));
  auto loss = [&](const std::vector<double>& xx, const std::vector<double>& ww) {
    return ref_lm_head_loss(xx, ww, tg, N, C, V, gs).total * gs;
  };
  const double eps = 1e-6;
  for (int64_t i = 0; i < N * C; ++i) {
    auto p = xd, m = xd;
    p[i] += eps;
    m[i] -= eps;
    const double fd = (loss(p, wd) - loss(m, wd)) / (2 * eps);
    EXPECT_NEAR(ref.dx[i], fd, 1e-7) << "dx ref " << i;
    EXPECT_NEAR(o.dx[i], fd, 2e-6) << "dx kernel " << i;
  }
  for (int64_t i = 0; i < V * C; ++i) {
    auto p = wd, m = wd;
    p[i] += eps;
    m[i] -= eps;
    const double fd = (loss(xd, p) - loss(xd, m)) / (2 * eps);
    EXPECT_NEAR(ref.dw[i], fd, 1e-7) << "dw ref " << i;
    EXPECT_NEAR(o.dw[i], fd, 2e-6) << "dw kernel " << i;
  }
}

// Large logits (|logit| ~ 1e3): max subtraction keeps loss and softmax finite and accurate.
TEST(LmHeadLoss, LargeLogitsStable) {
  const int64_t N = 9, C = 4, V = 300;
  const auto x = randn(N * C, 21, 30.0f);
  const auto w = randn(V * C, 22, 30.0f);
  const auto tg = make_targets(N, V, 23);
  std::vector<double> xd(x.begin(), x.end()), wd(w.begin(), w.end());
  const Ref ref = ref_lm_head_loss(xd, wd, tg, N, C, V, 1.0);
  const Out o = run(x, w, tg, N, C, V, 1.0f, true, 4, std::vector<float>(V * C, 0.0f));
  for (int64_t n = 0; n < N; ++n) {
    ASSERT_TRUE(std::isfinite(o.losses[n]));
    // Losses are differences of logits of magnitude ~4000: float logits carry ~4e-4 abs error.
    EXPECT_NEAR(o.losses[n], ref.losses[n], 1e-2 + 1e-5 * ref.losses[n]) << n;
  }
  expect_close(o.dx, ref.dx, 1e-3, "dx");
}

TEST(LmHeadLoss, RejectsOutOfRangeTarget) {
  std::vector<float> x(4, 1.0f), w(8, 1.0f), losses(1), scratch(4);
  std::vector<int32_t> tg = {4};
  EXPECT_THROW(lathe::cpu::lm_head_loss(losses.data(), nullptr, nullptr, x.data(), w.data(), tg.data(), 1, 2, 4, 1.0f,
                                        false, scratch.data(), 1),
               lathe::Error);
}

TEST(LmHeadLoss, AllTargetsIgnored) {
  const int64_t N = 4, C = 3, V = 5;
  const auto x = randn(N * C, 1, 1.0f), w = randn(V * C, 2, 1.0f);
  std::vector<int32_t> tg(N, -1);
  const auto prefill = randn(V * C, 3, 1.0f);
  const Out o = run(x, w, tg, N, C, V, 1.0f, true, 2, prefill);
  EXPECT_EQ(o.total, 0.0);
  for (float l : o.losses) EXPECT_EQ(l, 0.0f);
  for (float d : o.dx) EXPECT_EQ(d, 0.0f);
  EXPECT_EQ(0, std::memcmp(o.dw.data(), prefill.data(), prefill.size() * sizeof(float)));
}

}  // namespace

// vec_math's rows are defined on 16 logical lanes whatever the hardware width (one AVX-512 vector
// or two AVX2 halves): lane i sums elements j = i mod 16 in float over blocks of 1024, the lanes
// are added in order in double, the tail in scalar. This scalar model of that order must give the
// same bits on every build, so an AVX2 machine and an AVX-512 machine agree.
TEST(VecMath, ExpShiftSumIsTheSixteenLaneModelBitForBit) {
  namespace vec = lathe::cpu::vec;
  for (int64_t n : {1, 15, 16, 17, 100, 1023, 1024, 1040, 5000}) {
    std::vector<float> s = randn(static_cast<size_t>(n), 7 + static_cast<uint32_t>(n), 3.0f), e = s;
    const float m = vec::row_max(s.data(), n);
    EXPECT_EQ(m, *std::max_element(s.begin(), s.end())) << "n=" << n;
    double model = 0.0;
    int64_t j = 0;
    for (; j + 16 <= n;) {
      float lane[16] = {};
      const int64_t end = std::min(n - (n - j) % 16, j + 1024);
      for (; j < end; j += 16)
        for (int i = 0; i < 16; ++i) {
          e[j + i] = vec::exp1(s[j + i] - m);
          lane[i] += e[j + i];
        }
      double block = 0.0;
      for (float x : lane) block += x;
      model += block;
    }
    for (; j < n; ++j) model += (e[j] = vec::exp1(s[j] - m));
    std::vector<float> got = s;
    const double sum = vec::exp_shift_sum(got.data(), n, m);
    EXPECT_EQ(sum, model) << "n=" << n;
    EXPECT_EQ(vec::exp_shift_sum_nostore(s.data(), n, m), model) << "n=" << n;
    EXPECT_EQ(0, std::memcmp(got.data(), e.data(), sizeof(float) * n)) << "n=" << n;
  }
}
