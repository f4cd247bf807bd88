// Final-logit soft-capping in the fused lm head loss (Gemma 2's final_logit_softcapping, issue 25):
// logits l -> cap * tanh(l / cap) before the softmax and cross-entropy, dlogits times 1 - tanh^2.
// The capped double reference (reference_ops.h) against central finite differences; the fp32 kernel
// (one tile and many narrow tiles, chunked, forward only), its vocab-parallel path, and the bf16
// table against the reference; a kernel without the cap fails; cap 0 is the kernel of before.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "core/error.h"
#include "kernels/backend.h"
#include "kernels/cpu/lm_head_tiles.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/ops_bf16.h"
#include "kernels/cpu/storage.h"
#include "reference_ops.h"

namespace {

using lathe::test::LossRef;
using lathe::test::ref_lm_head_loss;
using VecD = std::vector<double>;

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
  for (int64_t n = 0; n < N; n += 5)
    if (N > 1) t[n] = -1;
  return t;
}
template <class V>
double rel_err(const V& got, const VecD& want) {
  double scale = 1.0, worst = 0.0;
  for (double w : want) scale = std::max(scale, std::fabs(w));
  for (size_t i = 0; i < got.size(); ++i)
    worst = std::isnan(got[i]) ? INFINITY : std::max(worst, std::fabs(static_cast<double>(got[i]) - want[i]));
  return worst / scale;
}
VecD d(const std::vector<float>& v) { return VecD(v.begin(), v.end()); }

struct Out {
  std::vector<float> losses, dx, dw;
  double total = 0;
};
// tile_width 0: lm_head_loss's own tiling; vp: the vocab-parallel path over the whole vocabulary.
Out run(const std::vector<float>& x, const std::vector<float>& w, const std::vector<int32_t>& tg, int64_t N, int64_t C,
        int64_t V, float gs, float cap, int64_t chunk, int64_t tile_width, bool vp, bool backward = true) {
  Out o;
  o.losses.assign(N, NAN);
  o.dx.assign(N * C, NAN);
  o.dw.assign(V * C, 0.0f);
  std::vector<float> scratch(std::min(chunk, N) * V * 2);
  float* dx = backward ? o.dx.data() : nullptr;
  float* dw = backward ? o.dw.data() : nullptr;
  if (vp) {
    lathe::VocabParallel p;
    p.vocab_begin = 0;
    p.global_V = V;
    o.total = lathe::cpu::lm_head_loss_vocab_parallel(o.losses.data(), dx, dw, x.data(), w.data(), tg.data(), N, C, V,
                                                      gs, backward, scratch.data(), chunk, p, cap);
  } else if (tile_width > 0) {
    o.total = lathe::cpu::lm_head_loss_tiled(o.losses.data(), dx, dw, x.data(), w.data(), tg.data(), N, C, V, gs,
                                             backward, scratch.data(), chunk, tile_width, cap);
  } else {
    o.total = lathe::cpu::lm_head_loss(o.losses.data(), dx, dw, x.data(), w.data(), tg.data(), N, C, V, gs, backward,
                                       scratch.data(), chunk, cap);
  }
  return o;
}

TEST(LmHeadSoftcap, ReferenceGradientMatchesFiniteDifferences) {
  const int64_t N = 4, C = 5, V = 7;
  const double gs = 0.5, cap = 1.3;
  const auto xf = randn(N * C, 1, 1.0f), wf = randn(V * C, 2, 1.0f);
  const auto tg = make_targets(N, V, 3);
  VecD x = d(xf), w = d(wf);
  const LossRef ref = ref_lm_head_loss(x, w, tg, N, C, V, gs, cap);
  auto loss = [&] { return ref_lm_head_loss(x, w, tg, N, C, V, gs, cap).total * gs; };
  for (auto [v, g] : {std::pair{&x, &ref.dx}, std::pair{&w, &ref.dw}})
    for (size_t i = 0; i < v->size(); ++i) {
      const double a = (*v)[i], h = 1e-6;
      (*v)[i] = a + h;
      const double lp = loss();
      (*v)[i] = a - h;
      const double lm = loss();
      (*v)[i] = a;
      EXPECT_NEAR((*g)[i], (lp - lm) / (2 * h), 1e-7) << "element " << i;
    }
}

// Logits of size ~ sqrt(C) * 1 against caps 1.5 and 5: most are capped hard.
TEST(LmHeadSoftcap, MatchesReference) {
  for (int64_t N : {1, 3, 31})
    for (int64_t C : {3, 33})
      for (int64_t V : {1, 67, 301})
        for (float cap : {1.5f, 5.0f})
          for (int mode = 0; mode < 3; ++mode) {  // own tiling, 16-column tiles, vocab-parallel
            const float gs = 0.37f;
            const uint32_t seed = static_cast<uint32_t>(N * 100 + C * 10 + V);
            const auto x = randn(N * C, seed, 1.0f), w = randn(V * C, seed + 1, 1.0f);
            const auto tg = make_targets(N, V, seed + 2);
            const LossRef ref = ref_lm_head_loss(d(x), d(w), tg, N, C, V, gs, cap);
            for (int64_t chunk : {int64_t{1}, N}) {
              SCOPED_TRACE(::testing::Message() << "N=" << N << " C=" << C << " V=" << V << " cap=" << cap
                                                << " mode=" << mode << " chunk=" << chunk);
              const Out o = run(x, w, tg, N, C, V, gs, cap, chunk, mode == 1 ? 16 : 0, mode == 2);
              EXPECT_LE(rel_err(o.losses, ref.losses), 2e-6);
              EXPECT_NEAR(o.total, ref.total, 2e-6 * (1.0 + std::fabs(ref.total)));
              EXPECT_LE(rel_err(o.dx, ref.dx), 2e-6);
              EXPECT_LE(rel_err(o.dw, ref.dw), 2e-6);
              const Out f = run(x, w, tg, N, C, V, gs, cap, chunk, mode == 1 ? 16 : 0, mode == 2, false);
              EXPECT_EQ(f.total, o.total) << "forward-only total";
            }
          }
}

// The comparison sees the cap: the uncapped reference (or another cap) is far from the kernel.
TEST(LmHeadSoftcap, WrongCapFails) {
  const int64_t N = 31, C = 33, V = 67;
  const auto x = randn(N * C, 9, 1.0f), w = randn(V * C, 10, 1.0f);
  const auto tg = make_targets(N, V, 11);
  const Out o = run(x, w, tg, N, C, V, 0.1f, 3.0f, N, 0, false);
  for (double cap : {0.0, 3.3}) {
    const LossRef off = ref_lm_head_loss(d(x), d(w), tg, N, C, V, 0.1, cap);
    EXPECT_GT(rel_err(o.losses, off.losses), 1e-3) << "cap " << cap;
    EXPECT_GT(rel_err(o.dx, off.dx), 1e-3) << "cap " << cap;
  }
}

// Cap 0 is the kernel of before, bit for bit (the default argument).
TEST(LmHeadSoftcap, OffIsBitIdentical) {
  const int64_t N = 31, C = 33, V = 301;
  const auto x = randn(N * C, 19, 1.0f), w = randn(V * C, 20, 1.0f);
  const auto tg = make_targets(N, V, 21);
  Out a;
  a.losses.assign(N, 0.0f);
  a.dx.assign(N * C, 0.0f);
  a.dw.assign(V * C, 0.0f);
  std::vector<float> scratch(N * V * 2);
  a.total = lathe::cpu::lm_head_loss(a.losses.data(), a.dx.data(), a.dw.data(), x.data(), w.data(), tg.data(), N, C, V,
                                     0.2f, true, scratch.data(), 8);
  const Out b = run(x, w, tg, N, C, V, 0.2f, 0.0f, 8, 0, false);
  EXPECT_EQ(a.total, b.total);
  EXPECT_EQ(std::memcmp(a.dx.data(), b.dx.data(), a.dx.size() * 4), 0);
  EXPECT_EQ(std::memcmp(a.dw.data(), b.dw.data(), a.dw.size() * 4), 0);
}

TEST(LmHeadSoftcap, RejectsNegativeCap) {
  const auto x = randn(2 * 3, 1, 1.0f), w = randn(5 * 3, 2, 1.0f);
  const std::vector<int32_t> tg = {1, 2};
  for (bool vp : {false, true}) {
    try {
      run(x, w, tg, 2, 3, 5, 1.0f, -2.0f, 2, 0, vp);
      ADD_FAILURE() << "accepted softcap -2";
    } catch (const lathe::Error& e) {
      EXPECT_NE(std::string(e.what()).find("softcap = -2"), std::string::npos) << e.what();
    }
  }
}

// The bf16 table (fp32 logits, dlogits rounded once to bf16) within bf16's tolerance.
TEST(LmHeadSoftcap, Bf16TableMatchesReference) {
  if (!lathe::cpu::bf16_matmul_available()) GTEST_SKIP() << "the CPU bf16 table needs oneDNN";
  const lathe::Ops& o = lathe::ops_for(lathe::cpu_backend(), lathe::DType::BF16);
  const int64_t N = 31, C = 33, V = 301;
  auto round = [](std::vector<float> v) {
    std::vector<uint16_t> h(v.size());
    lathe::cpu::Bf16::from_f32(h.data(), v.data(), static_cast<int64_t>(v.size()));
    lathe::cpu::Bf16::to_f32(v.data(), h.data(), static_cast<int64_t>(v.size()));
    return std::make_pair(v, h);
  };
  const auto [x, x16] = round(randn(N * C, 31, 1.0f));
  const auto [w, w16] = round(randn(V * C, 32, 1.0f));
  const auto tg = make_targets(N, V, 33);
  const LossRef ref = ref_lm_head_loss(d(x), d(w), tg, N, C, V, 0.37, 2.0);
  std::vector<float> losses(N), dw(V * C, 0.0f);
  std::vector<uint16_t> dx16(N * C);
  std::vector<uint8_t> scratch(o.lm_head_loss_scratch_bytes(8, V));
  o.lm_head_loss(losses.data(), dx16.data(), dw.data(), x16.data(), w16.data(), tg.data(), N, C, V, 0.37f, true,
                 scratch.data(), 8, nullptr, 2.0f);
  std::vector<float> dx(N * C);
  lathe::cpu::Bf16::to_f32(dx.data(), dx16.data(), N * C);
  EXPECT_LE(rel_err(losses, ref.losses), 3e-2);
  EXPECT_LE(rel_err(dx, ref.dx), 3e-2);
  EXPECT_LE(rel_err(dw, ref.dw), 3e-2);
}

}  // namespace
