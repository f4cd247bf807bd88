// Attention logit soft-capping and the explicit score scale (Gemma 2, issue 25): scores
// s = scale * q.k, then softcap * tanh(s / softcap) before the mask and softmax (transformers 4.45.2
// Gemma2Attention). The double reference (reference_ops.h, AttnShape::scale / softcap) is checked
// against central finite differences; the fp32 kernel against it at odd sizes with windows and
// documents, with inputs large enough that most scores pass the cap; a kernel without the cap (or
// with the plain scale) fails the same comparison; softcap 0 is the kernel of before bit for bit;
// the bf16 and fp16 tables within their dtype's tolerance (as test_backend_ops).
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "core/error.h"
#include "kernels/backend.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/storage.h"
#include "reference_ops.h"

namespace {

using Shape = lathe::test::AttnShape;
using VecD = std::vector<double>;

std::vector<float> randn(size_t n, uint32_t seed, float sd = 1.0f) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.0f, sd);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(gen);
  return v;
}

std::vector<int32_t> random_docs(int64_t B, int64_t T, int64_t max_len, uint32_t seed) {
  std::mt19937 gen(seed);
  std::vector<int32_t> ds(B * T);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T;) {
      const int64_t len = 1 + static_cast<int64_t>(gen() % max_len);
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
  r.dqkv.assign(qkv.size(), NAN);
  std::vector<float> scratch(lathe::cpu::attention_scratch_floats(s.T, s.D), NAN);
  lathe::cpu::attention_forward(r.out.data(), r.lse.data(), qkv.data(), s.B, s.T, s.H, s.KVH, s.D, scratch.data(), ds,
                                window, static_cast<float>(s.scale), static_cast<float>(s.softcap));
  lathe::cpu::attention_backward(r.dqkv.data(), dout.data(), qkv.data(), r.out.data(), r.lse.data(), s.B, s.T, s.H,
                                 s.KVH, s.D, scratch.data(), ds, window, static_cast<float>(s.scale),
                                 static_cast<float>(s.softcap));
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
template <class V>
double rel_err(const V& got, const VecD& want) {
  double scale = 1.0, worst = 0.0;
  for (double w : want) scale = std::max(scale, std::fabs(w));
  for (size_t i = 0; i < got.size(); ++i)
    worst = std::isnan(got[i]) ? INFINITY : std::max(worst, std::fabs(static_cast<double>(got[i]) - want[i]));
  return worst / scale;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// The capped, rescaled double reference against central differences of L = sum(out * dout).
TEST(AttentionSoftcap, ReferenceGradientMatchesFiniteDifferences) {
  Shape s{2, 9, 4, 2, 3};
  s.scale = 0.9;
  s.softcap = 0.8;
  const int64_t ld = (s.H + 2 * s.KVH) * s.D;
  const auto qf = randn(s.B * s.T * ld, 21, 1.5f), gf = randn(s.B * s.T * s.H * s.D, 22);
  const std::vector<int32_t> ds = {0, 0, 0, 0, 0, 0, 6, 6, 6, 0, 1, 1, 1, 1, 1, 1, 1, 1};
  for (const std::vector<int32_t>& docs : {std::vector<int32_t>{}, ds}) {
    const std::vector<int64_t> first = lathe::test::ref_first_keys(docs, 4, s);
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

// fp32 kernel against the reference at odd sizes: caps that bind (scores of size ~2-4 against caps
// 0.5 and 2), the explicit scale, windows and documents.
TEST(AttentionSoftcap, MatchesReference) {
  const std::pair<int64_t, int64_t> heads[] = {{1, 1}, {4, 2}, {3, 3}};
  for (int64_t T : {1, 2, 17, 45, 100})
    for (int64_t D : {1, 3, 16})
      for (auto [H, KVH] : heads)
        for (double cap : {0.5, 2.0})
          for (double scale : {0.0, 0.37})
            for (int64_t window : {0, 15})
              for (bool docs : {false, true}) {
                Shape s{2, T, H, KVH, D};
                s.scale = static_cast<float>(scale);  // the kernel's float, exactly
                s.softcap = cap;
                const int64_t ld = (H + 2 * KVH) * D;
                const uint32_t seed = static_cast<uint32_t>(T * 31 + D * 7 + H + window + (docs ? 3 : 0));
                const auto qkv = randn(s.B * T * ld, seed, 2.0f), dout = randn(s.B * T * H * D, seed + 1);
                const std::vector<int32_t> ds = docs ? random_docs(s.B, T, 30, seed) : std::vector<int32_t>{};
                const Result r = run(qkv, dout, s, docs ? ds.data() : nullptr, window);
                const Ref want = reference(qkv, dout, s, ds, window);
                SCOPED_TRACE(::testing::Message()
                             << "T=" << T << " H=" << H << " KVH=" << KVH << " D=" << D << " cap=" << cap
                             << " scale=" << scale << " window=" << window << " docs=" << docs);
                EXPECT_LE(rel_err(r.out, want.out), 2e-5);
                EXPECT_LE(rel_err(r.lse, want.lse), 2e-5);
                EXPECT_LE(rel_err(r.dqkv, want.dqkv), 5e-5);
              }
}

// The comparison above sees the cap and the scale: the reference without the cap, or with
// 1/sqrt(D) instead of the explicit scale, is far outside its tolerance.
TEST(AttentionSoftcap, WrongCapOrScaleFails) {
  Shape s{2, 45, 4, 2, 16};
  s.scale = static_cast<float>(0.37);
  s.softcap = 1.0;
  const int64_t ld = (s.H + 2 * s.KVH) * s.D;
  const auto qkv = randn(s.B * s.T * ld, 5, 2.0f), dout = randn(s.B * s.T * s.H * s.D, 6);
  const Result r = run(qkv, dout, s, nullptr, 0);
  EXPECT_LE(rel_err(r.dqkv, reference(qkv, dout, s, {}, 0).dqkv), 5e-5);
  Shape uncapped = s, rescaled = s, wider = s;
  uncapped.softcap = 0.0;
  rescaled.scale = 0.0;
  wider.softcap = 1.1;
  for (const Shape& w : {uncapped, rescaled, wider}) {
    const Ref off = reference(qkv, dout, w, {}, 0);
    EXPECT_GT(rel_err(r.out, off.out), 1e-3) << ::testing::PrintToString(w);
    EXPECT_GT(rel_err(r.dqkv, off.dqkv), 1e-3) << ::testing::PrintToString(w);
  }
}

// softcap 0 and scale 0 are the kernel of before (the default arguments), bit for bit; an explicit
// scale equal to 1/sqrt(D) too.
TEST(AttentionSoftcap, OffIsBitIdentical) {
  const Shape s{2, 67, 4, 2, 8};
  const int64_t ld = (s.H + 2 * s.KVH) * s.D;
  const auto qkv = randn(s.B * s.T * ld, 3), dout = randn(s.B * s.T * s.H * s.D, 4);
  std::vector<float> out(s.B * s.T * s.H * s.D), lse(s.B * s.H * s.T), dqkv(qkv.size());
  std::vector<float> scratch(lathe::cpu::attention_scratch_floats(s.T, s.D));
  lathe::cpu::attention_forward(out.data(), lse.data(), qkv.data(), s.B, s.T, s.H, s.KVH, s.D, scratch.data());
  lathe::cpu::attention_backward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), s.B, s.T, s.H, s.KVH,
                                 s.D, scratch.data());
  const Result off = run(qkv, dout, s, nullptr, 0);
  EXPECT_TRUE(same_bits(out, off.out) && same_bits(lse, off.lse) && same_bits(dqkv, off.dqkv));
  Shape explicit_scale = s;
  explicit_scale.scale = 1.0f / std::sqrt(8.0f);
  const Result ex = run(qkv, dout, explicit_scale, nullptr, 0);
  EXPECT_TRUE(same_bits(out, ex.out) && same_bits(dqkv, ex.dqkv));
}

TEST(AttentionSoftcap, BitIdenticalAcrossThreadCounts) {
  Shape s{2, 91, 6, 2, 8};
  s.softcap = 0.7;
  const int64_t ld = (s.H + 2 * s.KVH) * s.D;
  const auto qkv = randn(s.B * s.T * ld, 41, 2.0f), dout = randn(s.B * s.T * s.H * s.D, 42);
  const auto ds = random_docs(s.B, s.T, 50, 43);
  const int saved = omp_get_max_threads();
  omp_set_num_threads(1);
  const Result one = run(qkv, dout, s, ds.data(), 24);
  omp_set_num_threads(3);
  const Result three = run(qkv, dout, s, ds.data(), 24);
  omp_set_num_threads(saved);
  EXPECT_TRUE(same_bits(one.out, three.out) && same_bits(one.lse, three.lse) && same_bits(one.dqkv, three.dqkv));
}

TEST(AttentionSoftcap, RejectsBadCapAndScale) {
  const auto qkv = randn(6 * 3 * 4, 1), dout = randn(6 * 4, 2);
  for (auto [scale, cap, what] : {std::tuple{0.0, -1.0, "softcap = -1"}, std::tuple{0.0, double(NAN), "softcap = nan"},
                                  std::tuple{-0.5, 0.0, "scale = -0.5"}}) {
    Shape s{1, 6, 1, 1, 4};
    s.scale = scale;
    s.softcap = cap;
    try {
      run(qkv, dout, s, nullptr, 0);
      ADD_FAILURE() << "accepted " << what;
    } catch (const lathe::Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  }
}

// The bf16 and fp16 tables (fp32 math on widened heads) against the double reference on the
// rounded inputs, within the dtype's tolerance (test_backend_ops: 3e-2 bf16, 4e-3 fp16).
template <class P>
void check_half_table(lathe::DType dt, double tol) {
  const lathe::Ops& o = lathe::ops_for(lathe::cpu_backend(), dt);
  for (int64_t window : {0, 9}) {
    Shape s{2, 37, 4, 2, 16};
    s.scale = static_cast<float>(0.3);
    s.softcap = 1.5;
    const int64_t ld = (s.H + 2 * s.KVH) * s.D, nq = s.B * s.T * ld, no = s.B * s.T * s.H * s.D;
    auto round = [](std::vector<float> v) {
      std::vector<uint16_t> h(v.size());
      P::from_f32(h.data(), v.data(), static_cast<int64_t>(v.size()));
      P::to_f32(v.data(), h.data(), static_cast<int64_t>(v.size()));
      return std::make_pair(v, h);
    };
    const auto [qkv, qkv16] = round(randn(nq, 71 + window, 2.0f));
    const auto [dout, dout16] = round(randn(no, 72 + window));
    const Ref want = reference(qkv, dout, s, {}, window);
    std::vector<uint16_t> out16(no), dq16(nq);
    std::vector<float> lse(s.B * s.H * s.T);
    std::vector<uint8_t> scratch(o.attention_scratch_bytes(s.T, s.D));
    o.attention_forward(out16.data(), lse.data(), qkv16.data(), s.B, s.T, s.H, s.KVH, s.D, scratch.data(), nullptr,
                        window, static_cast<float>(s.scale), static_cast<float>(s.softcap));
    o.attention_backward(dq16.data(), dout16.data(), qkv16.data(), out16.data(), lse.data(), s.B, s.T, s.H, s.KVH, s.D,
                         scratch.data(), nullptr, window, static_cast<float>(s.scale), static_cast<float>(s.softcap));
    std::vector<float> out(no), dq(nq);
    P::to_f32(out.data(), out16.data(), no);
    P::to_f32(dq.data(), dq16.data(), nq);
    SCOPED_TRACE(::testing::Message() << "window " << window);
    EXPECT_LE(rel_err(out, want.out), tol);
    EXPECT_LE(rel_err(lse, want.lse), tol);
    EXPECT_LE(rel_err(dq, want.dqkv), tol);
  }
}
TEST(AttentionSoftcap, HalfTablesMatchReference) {
  check_half_table<lathe::cpu::Bf16>(lathe::DType::BF16, 3e-2);
  check_half_table<lathe::cpu::Fp16>(lathe::DType::F16, 4e-3);
}

}  // namespace
