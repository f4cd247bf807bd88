// Sliding-window attention (window > 0, issue 25 item 5) of the fp32 kernel against the naive
// double reference with each query's first key max(doc_start, t - window + 1) (reference_ops.h's
// ref_first_keys, written as transformers 4.45.2's Mistral mask: key j excluded when j <= t - window).
// The reference itself is checked against finite differences here; then forward and backward at odd
// sizes, with and without documents, windows of 1, around the 16-key tiles and the 32-row blocks,
// and >= T (the same as none). A window off by one fails the comparison; tiles outside the window
// are never computed (the work counter); bad windows are refused. The bf16/fp16 tables (and the CUDA
// ones where a GPU is present) are covered by test_backend_ops's "window" case.
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
using VecD = std::vector<double>;

std::vector<float> randn(size_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(gen);
  return v;
}

// doc_start [B, T] from document lengths in [1, max_len] (a length-1 document every so often).
std::vector<int32_t> random_docs(int64_t B, int64_t T, int64_t max_len, uint32_t seed) {
  std::mt19937 gen(seed);
  std::vector<int32_t> ds(B * T);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T;) {
      const int64_t len = gen() % 4 == 0 ? 1 : 1 + static_cast<int64_t>(gen() % max_len);
      for (int64_t i = t; i < std::min(T, t + len); ++i) ds[b * T + i] = static_cast<int32_t>(t);
      t += len;
    }
  return ds;
}

struct Result {
  std::vector<float> out, lse, dqkv;
};

Result run(const std::vector<float>& qkv, const std::vector<float>& dout, const Shape& s, const int32_t* ds,
           int64_t window) {
  Result r;
  r.out.assign(s.B * s.T * s.H * s.D, NAN);
  r.lse.assign(s.B * s.H * s.T, NAN);
  r.dqkv.assign(qkv.size(), NAN);  // must be overwritten everywhere
  std::vector<float> scratch(lathe::cpu::attention_scratch_floats(s.T, s.D), NAN);
  lathe::cpu::attention_forward(r.out.data(), r.lse.data(), qkv.data(), s.B, s.T, s.H, s.KVH, s.D, scratch.data(), ds,
                                window);
  lathe::cpu::attention_backward(r.dqkv.data(), dout.data(), qkv.data(), r.out.data(), r.lse.data(), s.B, s.T, s.H,
                                 s.KVH, s.D, scratch.data(), ds, window);
  return r;
}

struct Ref {
  VecD out, lse, dqkv;
};
Ref reference(const std::vector<float>& qkv, const std::vector<float>& dout, const Shape& s,
              const std::vector<int32_t>& ds, int64_t window) {
  const std::vector<int64_t> first = lathe::test::ref_first_keys(ds, window, s);
  const VecD q(qkv.begin(), qkv.end()), g(dout.begin(), dout.end());
  Ref r;
  lathe::test::ref_attention_fwd(r.out, r.lse, q, s, first.data());
  r.dqkv = lathe::test::ref_attention_bwd(q, g, s, first.data());
  return r;
}

// Worst |got - want| over max(1, max |want|).
double rel_err(const std::vector<float>& got, const VecD& want) {
  double scale = 1.0, worst = 0.0;
  for (double w : want) scale = std::max(scale, std::fabs(w));
  for (size_t i = 0; i < got.size(); ++i)
    worst = std::isnan(got[i]) ? INFINITY : std::max(worst, std::fabs(static_cast<double>(got[i]) - want[i]));
  return worst / scale;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// The windowed double reference's gradient against central differences of L = sum(out * dout).
TEST(AttentionWindow, ReferenceGradientMatchesFiniteDifferences) {
  const Shape s{2, 9, 4, 2, 3};
  const int64_t ld = (s.H + 2 * s.KVH) * s.D;
  const auto qf = randn(s.B * s.T * ld, 21), gf = randn(s.B * s.T * s.H * s.D, 22);
  const std::vector<int32_t> ds = {0, 0, 0, 0, 0, 0, 6, 6, 6, 0, 1, 1, 1, 1, 1, 1, 1, 1};
  for (const std::vector<int32_t>& docs : {std::vector<int32_t>{}, ds}) {
    const std::vector<int64_t> first = lathe::test::ref_first_keys(docs, 3, s);
    VecD q(qf.begin(), qf.end());
    const VecD g(gf.begin(), gf.end());
    const VecD grad = lathe::test::ref_attention_bwd(q, g, s, first.data());
    auto loss = [&] {
      VecD out, lse;
      lathe::test::ref_attention_fwd(out, lse, q, s, first.data());
      double l = 0;
      for (size_t i = 0; i < out.size(); ++i) l += out[i] * g[i];
      return l;
    };
    for (size_t i = 0; i < q.size(); ++i) {
      const double x = q[i], h = 1e-6;
      q[i] = x + h;
      const double lp = loss();
      q[i] = x - h;
      const double lm = loss();
      q[i] = x;
      EXPECT_NEAR(grad[i], (lp - lm) / (2 * h), 1e-6) << "qkv element " << i;
    }
  }
}

// Forward and backward against the reference at odd sizes, windows and documents.
TEST(AttentionWindow, MatchesReference) {
  const std::pair<int64_t, int64_t> heads[] = {{1, 1}, {4, 2}, {3, 3}};
  for (int64_t T : {1, 2, 17, 45, 100, 131})
    for (int64_t D : {1, 3, 16})
      for (auto [H, KVH] : heads)
        for (int64_t window : {1, 2, 15, 16, 17, 33, 64, 99})
          for (bool docs : {false, true}) {
            if (window > T + 1) continue;
            const Shape s{2, T, H, KVH, D};
            const int64_t ld = (H + 2 * KVH) * D;
            const auto qkv = randn(s.B * T * ld, static_cast<uint32_t>(11 + T * 7 + D + H + window));
            const auto dout = randn(s.B * T * H * D, static_cast<uint32_t>(5 + T + D + window));
            const std::vector<int32_t> ds =
                docs ? random_docs(s.B, T, 40, static_cast<uint32_t>(T + window)) : std::vector<int32_t>{};
            const Result r = run(qkv, dout, s, docs ? ds.data() : nullptr, window);
            const Ref want = reference(qkv, dout, s, ds, window);
            SCOPED_TRACE(::testing::Message() << "B=2 T=" << T << " H=" << H << " KVH=" << KVH << " D=" << D
                                              << " window=" << window << " docs=" << docs);
            // fp32 sums against double, as test_ops_attention (2e-5 forward, 5e-5 gradient).
            EXPECT_LE(rel_err(r.out, want.out), 2e-5);
            EXPECT_LE(rel_err(r.lse, want.lse), 2e-5);
            EXPECT_LE(rel_err(r.dqkv, want.dqkv), 5e-5);
          }
}

// A window one key wider or narrower than the kernel's is a different function: the comparison
// above fails for it (the tolerance is far below the difference).
TEST(AttentionWindow, WindowOffByOneFails) {
  const Shape s{1, 70, 2, 1, 8};
  const int64_t ld = (s.H + 2 * s.KVH) * s.D;
  const auto qkv = randn(s.T * ld, 31), dout = randn(s.T * s.H * s.D, 32);
  const Result r = run(qkv, dout, s, nullptr, 20);
  for (int64_t w : {19, 21}) {
    const Ref off = reference(qkv, dout, s, {}, w);
    EXPECT_GT(rel_err(r.out, off.out), 1e-3) << "window " << w;
    EXPECT_GT(rel_err(r.dqkv, off.dqkv), 1e-3) << "window " << w;
  }
  const Ref same = reference(qkv, dout, s, {}, 20);
  EXPECT_LE(rel_err(r.out, same.out), 2e-5);
}

// window >= T is full causal attention, bit for bit (the kernel's plain path); a window of 1 is
// each token's own value.
TEST(AttentionWindow, WideWindowIsCausalAndWindowOneIsSelf) {
  const Shape s{2, 67, 4, 2, 8};
  const int64_t ld = (s.H + 2 * s.KVH) * s.D;
  const auto qkv = randn(s.B * s.T * ld, 3), dout = randn(s.B * s.T * s.H * s.D, 4);
  const Result causal = run(qkv, dout, s, nullptr, 0);
  for (int64_t w : {s.T, s.T + 1, int64_t{1} << 40}) {
    const Result wide = run(qkv, dout, s, nullptr, w);
    EXPECT_TRUE(same_bits(causal.out, wide.out) && same_bits(causal.dqkv, wide.dqkv)) << "window " << w;
  }
  EXPECT_FALSE(same_bits(causal.out, run(qkv, dout, s, nullptr, s.T - 1).out));
  const Result self = run(qkv, dout, s, nullptr, 1);
  for (int64_t b = 0; b < s.B; ++b)
    for (int64_t t = 0; t < s.T; ++t)
      for (int64_t h = 0; h < s.H; ++h)
        for (int64_t d = 0; d < s.D; ++d)
          ASSERT_EQ(self.out[((b * s.T + t) * s.H + h) * s.D + d],
                    qkv[(b * s.T + t) * ld + (s.H + s.KVH + h / 2) * s.D + d]);
}

// Deterministic and independent of the thread count.
TEST(AttentionWindow, BitIdenticalAcrossThreadCounts) {
  const Shape s{2, 91, 6, 2, 8};
  const int64_t ld = (s.H + 2 * s.KVH) * s.D;
  const auto qkv = randn(s.B * s.T * ld, 41), dout = randn(s.B * s.T * s.H * s.D, 42);
  const auto ds = random_docs(s.B, s.T, 50, 43);
  const int saved = omp_get_max_threads();
  omp_set_num_threads(1);
  const Result one = run(qkv, dout, s, ds.data(), 24);
  omp_set_num_threads(3);
  const Result three = run(qkv, dout, s, ds.data(), 24);
  omp_set_num_threads(saved);
  EXPECT_TRUE(same_bits(one.out, three.out));
  EXPECT_TRUE(same_bits(one.lse, three.lse));
  EXPECT_TRUE(same_bits(one.dqkv, three.dqkv));
}

// Tiles left of the window are never computed. At T = 512 a query block of 32 rows [i0, i0 + 32)
// needs keys from i0 - window + 1 rounded down to 16: with window 64, keys [i0 - 64, i0 + 32)
// (6 key tiles x 2 row tiles) once i0 >= 64, so forward and backward count
// H x (2 x (2 + 4) + 14 x 2 x 6) tiles, against H x 8 x (4 + 8 + ... + 32) for causal attention.
TEST(AttentionWindow, TilesOutsideTheWindowAreSkipped) {
  const Shape s{1, 512, 2, 1, 8};
  const int64_t ld = (s.H + 2 * s.KVH) * s.D;
  const auto qkv = randn(s.T * ld, 7), dout = randn(s.T * s.H * s.D, 8);
  auto tiles = [&](int64_t window) {
    const lathe::cpu::AttentionTiles a = lathe::cpu::attention_tiles();
    run(qkv, dout, s, nullptr, window);
    const lathe::cpu::AttentionTiles b = lathe::cpu::attention_tiles();
    return std::make_pair(b.forward - a.forward, b.backward - a.backward);
  };
  const auto causal = tiles(0), windowed = tiles(64);
  EXPECT_EQ(causal.first, s.H * 4 * (4 + 8 + 12 + 16 + 20 + 24 + 28 + 32));
  EXPECT_EQ(windowed.first, s.H * (2 * (2 + 4) + 14 * 2 * 6));
  EXPECT_EQ(windowed.second, windowed.first);
}

TEST(AttentionWindow, RejectsNegativeWindow) {
  const Shape s{1, 6, 1, 1, 4};
  const auto qkv = randn(s.T * 3 * s.D, 1), dout = randn(s.T * s.D, 2);
  try {
    run(qkv, dout, s, nullptr, -1);
    ADD_FAILURE() << "accepted window -1";
  } catch (const lathe::Error& e) {
    EXPECT_NE(std::string(e.what()).find("window = -1"), std::string::npos) << e.what();
  }
}

}  // namespace
