// Tests for the mixture-of-experts CPU kernels (kernels/cpu/moe.cpp, issue 28):
//   * the fp32 block forward (router, top-k, permutation, grouped SwiGLU experts, combine), the
//     load-balancing and z losses vs a plain-loop double reference at odd sizes;
//   * every gradient (dx, dwr, dw1, dw2, dw3, through the renormalised top-k weights and the aux /
//     z losses) vs central finite differences of the double reference, with the expert choice
//     frozen (it is piecewise constant: no gradient flows through it);
//   * "+=" for the weight gradients and "=" for dx (buffers pre-filled);
//   * a router tie (the lower expert index wins), an expert that receives no token, the stable
//     permutation on a hand-made example, bad expert indices refused, DeepSeek-V3's selection bias
//     and its update;
//   * bit-identical results for 1 and 2 OpenMP threads;
//   * transformers 4.45.2 as the oracle (torch_reference_moe.py): MixtralSparseMoeBlock and
//     Qwen2MoeSparseMoeBlock, load_balancing_loss_func, router_z_loss_func; values and every gradient.
#include <gtest/gtest.h>
#include <omp.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include "core/error.h"
#include "gradcheck_basic.h"
#include "kernels/cpu/ops.h"

using namespace lathe;
using namespace lathe::test;
using lathe::cpu::MoeActs;
using lathe::cpu::MoeScore;
using lathe::cpu::MoeShape;

namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr double kAuxCoef = 0.3, kZCoef = 0.05;

// ---------------------------------------- double reference ----------------------------------------

struct Params {
  VecD x, wr, w1, w3, w2;
  VecD select_bias;  // [E] or empty: DeepSeek-V3's selection-only bias
};

struct RefResult {
  VecD out;
  std::vector<int> idx;  // [N, k]
  double aux = 0.0, z_sum = 0.0;
};

// The block in double, loops only. With `frozen` non-empty the top-k choice is taken from it.
RefResult ref_forward(const Params& p, const MoeShape& s, const std::vector<int>& frozen = {}) {
  const int64_t N = s.N, C = s.C, F = s.F, E = s.E, k = s.k;
  RefResult r;
  r.out.assign(N * C, 0.0);
  r.idx.assign(N * k, -1);
  VecD psum(E, 0.0), counts(E, 0.0);
  for (int64_t n = 0; n < N; ++n) {
    VecD l(E), pr(E);
    double m = -1e300;
    for (int64_t e = 0; e < E; ++e) {
      double d = 0.0;
      for (int64_t c = 0; c < C; ++c) d += p.x[n * C + c] * p.wr[e * C + c];
      l[e] = d;
      m = std::max(m, d);
    }
    double se = 0.0;
    for (int64_t e = 0; e < E; ++e) se += std::exp(l[e] - m);
    const double lse = m + std::log(se);
    r.z_sum += lse * lse;
    for (int64_t e = 0; e < E; ++e)
      pr[e] = s.score == MoeScore::softmax ? std::exp(l[e] - lse) : 1.0 / (1.0 + std::exp(-l[e]));
    for (int64_t e = 0; e < E; ++e) psum[e] += pr[e];
    std::vector<bool> taken(E, false);
    for (int64_t j = 0; j < k; ++j) {
      int best = -1;
      if (!frozen.empty()) {
        best = frozen[n * k + j];
      } else {
        auto rank = [&](int64_t e) { return p.select_bias.empty() ? pr[e] : pr[e] + p.select_bias[e]; };
        for (int64_t e = 0; e < E; ++e)
          if (!taken[e] && (best < 0 || rank(e) > rank(best))) best = static_cast<int>(e);
      }
      taken[best] = true;
      r.idx[n * k + j] = best;
      counts[best] += 1.0;
    }
    double wsum = 0.0;
    for (int64_t j = 0; j < k; ++j) wsum += pr[r.idx[n * k + j]];
    for (int64_t j = 0; j < k; ++j) {
      const int e = r.idx[n * k + j];
      const double w = s.renormalize ? pr[e] / wsum : pr[e];
      VecD act(F);
      for (int64_t f = 0; f < F; ++f) {
        double g = 0.0, u = 0.0;
        for (int64_t c = 0; c < C; ++c) {
          g += p.w1[(e * F + f) * C + c] * p.x[n * C + c];
          u += p.w3[(e * F + f) * C + c] * p.x[n * C + c];
        }
        act[f] = g / (1.0 + std::exp(-g)) * u;
      }
      for (int64_t c = 0; c < C; ++c) {
        double y = 0.0;
        for (int64_t f = 0; f < F; ++f) y += p.w2[(e * C + c) * F + f] * act[f];
        r.out[n * C + c] += w * y;
      }
    }
  }
  for (int64_t e = 0; e < E; ++e) r.aux += (counts[e] / N) * (psum[e] / N);
  r.aux *= static_cast<double>(E);
  return r;
}

// The scalar whose gradient the tests check: <out, G> + aux_coef * aux + z_coef * mean z.
double ref_loss(const Params& p, const MoeShape& s, const VecD& G, const std::vector<int>& frozen) {
  const RefResult r = ref_forward(p, s, frozen);
  return dot(r.out, G) + kAuxCoef * r.aux + kZCoef * r.z_sum / s.N;
}

// ------------------------------------------ fp32 kernel ------------------------------------------

struct Buffers {
  VecF logits, probs, topk_w, xp, gate, up, act, y;
  std::vector<int32_t> topk_idx, offsets, slot_token, slot_k, token_slot;
  MoeActs acts;
  explicit Buffers(const MoeShape& s) {
    const int64_t S = s.N * s.k;
    logits.assign(s.N * s.E, kNaN);
    probs.assign(s.N * s.E, kNaN);
    topk_w.assign(S, kNaN);
    topk_idx.assign(S, -7);
    offsets.assign(s.E + 1, -7);
    slot_token.assign(S, -7);
    slot_k.assign(S, -7);
    token_slot.assign(S, -7);
    xp.assign(S * s.C, kNaN);
    gate.assign(S * s.F, kNaN);
    up.assign(S * s.F, kNaN);
    act.assign(S * s.F, kNaN);
    y.assign(S * s.C, kNaN);
    acts = MoeActs{logits.data(),     probs.data(),  topk_idx.data(),   topk_w.data(), offsets.data(),
                   slot_token.data(), slot_k.data(), token_slot.data(), xp.data(),     gate.data(),
                   up.data(),         act.data(),    y.data()};
  }
};

constexpr float kPrefill = 0.25f;  // weight-gradient buffers start here: the kernels add into them

struct KernelRun {
  VecF out, dx, dwr, dw1, dw3, dw2;
  std::vector<int32_t> idx, offsets;
  double aux = 0.0, z_sum = 0.0;
};

// Forward, both balancing losses, and backward of <out, G> + aux_coef * aux + z_coef * mean z.
KernelRun run_kernel(const Params& pd, const MoeShape& s, const VecD& Gd) {
  auto f = [](const VecD& v) { return VecF(v.begin(), v.end()); };
  const VecF x = f(pd.x), wr = f(pd.wr), w1 = f(pd.w1), w3 = f(pd.w3), w2 = f(pd.w2), G = f(Gd);
  Buffers b(s);
  KernelRun r;
  r.out.assign(s.N * s.C, kNaN);
  const VecF bias = f(pd.select_bias);
  cpu::moe_forward(r.out.data(), b.acts, x.data(), wr.data(), w1.data(), w3.data(), w2.data(), s,
                   bias.empty() ? nullptr : bias.data());
  std::vector<double> psum(s.E, 0.0);
  std::vector<int64_t> counts(s.E, 0);
  cpu::moe_load_stats(psum.data(), counts.data(), b.probs.data(), b.topk_idx.data(), s.N, s.E, s.k);
  r.aux = cpu::moe_aux_loss(psum.data(), counts.data(), s.N, s.E);
  VecF dladd(s.N * s.E, 0.0f);
  cpu::moe_aux_loss_backward(dladd.data(), b.probs.data(), counts.data(), s.N, s.N, s.E, kAuxCoef, s.score);
  r.z_sum = cpu::moe_z_loss(dladd.data(), b.logits.data(), s.N, s.E, static_cast<float>(kZCoef / s.N));
  r.dx.assign(s.N * s.C, kNaN);
  r.dwr.assign(wr.size(), kPrefill);
  r.dw1.assign(w1.size(), kPrefill);
  r.dw3.assign(w3.size(), kPrefill);
  r.dw2.assign(w2.size(), kPrefill);
  VecF scratch(cpu::moe_backward_scratch_floats(s), kNaN);
  cpu::moe_backward(r.dx.data(), r.dwr.data(), r.dw1.data(), r.dw3.data(), r.dw2.data(), G.data(), dladd.data(), b.acts,
                    x.data(), wr.data(), w1.data(), w3.data(), w2.data(), s, scratch.data());
  r.idx = b.topk_idx;
  r.offsets = b.offsets;
  return r;
}

Params random_params(const MoeShape& s, Rng& rng) {
  Params p;
  auto d = [&](int64_t n, float scale) { return to_double(randn(static_cast<size_t>(n), rng, scale)); };
  p.x = d(s.N * s.C, 1.0f);
  p.wr = d(s.E * s.C, 1.0f);  // router scaled so that routing is far from uniform
  p.w1 = d(s.E * s.F * s.C, 0.6f);
  p.w3 = d(s.E * s.F * s.C, 0.6f);
  p.w2 = d(s.E * s.C * s.F, 0.6f);
  return p;
}

VecD minus_prefill(const VecF& g) {
  VecD r(g.size());
  for (size_t i = 0; i < g.size(); ++i) r[i] = static_cast<double>(g[i]) - kPrefill;
  return r;
}

// Forward vs the reference, then every gradient vs finite differences of the reference.
void check_block(Params p, const MoeShape& s, uint64_t seed, const std::string& what) {
  Rng rng(seed);
  const VecD G = to_double(randn(static_cast<size_t>(s.N * s.C), rng, 1.0f));
  const KernelRun r = run_kernel(p, s, G);
  const RefResult ref = ref_forward(p, s);
  for (size_t i = 0; i < ref.idx.size(); ++i)
    ASSERT_EQ(r.idx[i], ref.idx[i]) << what << ": top-k choice " << i << " differs from the reference";
  expect_close(r.out, ref.out, 1e-5 * (1.0 + max_abs(ref.out)), 1e-4, what + " out");
  EXPECT_NEAR(r.aux, ref.aux, 1e-5 * (1.0 + ref.aux)) << what << " aux loss";
  EXPECT_NEAR(r.z_sum, ref.z_sum, 1e-5 * (1.0 + ref.z_sum)) << what << " z loss";
  for (float v : r.dx) ASSERT_TRUE(std::isfinite(v)) << what << ": dx must be overwritten";

  const std::vector<int> frozen = ref.idx;
  auto loss = [&] { return ref_loss(p, s, G, frozen); };
  const double tol = 2e-4;
  check_fd(loss, p.x, to_double(r.dx), rng, what + " dx", 1e-5, tol);
  check_fd(loss, p.wr, minus_prefill(r.dwr), rng, what + " dwr", 1e-5, tol);
  check_fd(loss, p.w1, minus_prefill(r.dw1), rng, what + " dw1", 1e-5, tol);
  check_fd(loss, p.w3, minus_prefill(r.dw3), rng, what + " dw3", 1e-5, tol);
  check_fd(loss, p.w2, minus_prefill(r.dw2), rng, what + " dw2", 1e-5, tol);
}

MoeShape odd_shape(MoeScore score, bool renorm) {
  MoeShape s;
  s.N = 7, s.C = 5, s.F = 6, s.E = 4, s.k = 2, s.score = score, s.renormalize = renorm;
  return s;
}

}  // namespace

// ========================================= the block ==========================================

TEST(Moe, SoftmaxRenormalisedMixtral) {
  const MoeShape s = odd_shape(MoeScore::softmax, true);
  Rng rng(11);
  check_block(random_params(s, rng), s, 12, "softmax+renorm");
}

TEST(Moe, SoftmaxNotRenormalisedQwen2) {
  const MoeShape s = odd_shape(MoeScore::softmax, false);
  Rng rng(21);
  check_block(random_params(s, rng), s, 22, "softmax");
}

TEST(Moe, SigmoidWithAndWithoutRenormalisation) {
  for (bool renorm : {true, false}) {
    const MoeShape s = odd_shape(MoeScore::sigmoid, renorm);
    Rng rng(31 + renorm);
    check_block(random_params(s, rng), s, 33 + renorm, renorm ? "sigmoid+renorm" : "sigmoid");
  }
}

TEST(Moe, TopOneAndTopAll) {
  for (int64_t k : {1, 4}) {
    MoeShape s = odd_shape(MoeScore::softmax, true);
    s.k = k;
    Rng rng(40 + k);
    check_block(random_params(s, rng), s, 50 + k, "k=" + std::to_string(k));
  }
}

// An expert no token chooses: its rows are empty (skipped), its weight gradients untouched, and
// every gradient still matches (its router row still gets the softmax / aux / z gradients).
TEST(Moe, ExpertWithNoToken) {
  const MoeShape s = odd_shape(MoeScore::softmax, true);
  Rng rng(61);
  Params p = random_params(s, rng);
  for (int64_t n = 0; n < s.N; ++n) p.x[n * s.C] = 2.0 + std::fabs(p.x[n * s.C]);
  for (int64_t c = 0; c < s.C; ++c) p.wr[3 * s.C + c] = c == 0 ? -20.0 : 0.0;  // logit_3 <= -40
  const KernelRun r = run_kernel(p, s, VecD(s.N * s.C, 1.0));
  ASSERT_EQ(r.offsets[3], r.offsets[4]) << "expert 3 should receive no token";
  ASSERT_EQ(r.offsets[4], s.N * s.k);
  for (int64_t i = 3 * s.F * s.C; i < 4 * s.F * s.C; ++i) {
    ASSERT_EQ(r.dw1[i], kPrefill) << "dw1 of the empty expert changed at " << i;
    ASSERT_EQ(r.dw3[i], kPrefill) << "dw3 of the empty expert changed at " << i;
    ASSERT_EQ(r.dw2[i], kPrefill) << "dw2 of the empty expert changed at " << i;
  }
  check_block(p, s, 62, "empty expert");
}

// Router rows 1 and 2 equal: their logits (and probs) tie on every token, and expert 1 must be
// chosen before expert 2; gradients still match with the choice frozen.
TEST(Moe, RouterTieInTheBlock) {
  const MoeShape s = odd_shape(MoeScore::softmax, true);
  Rng rng(71);
  Params p = random_params(s, rng);
  for (int64_t c = 0; c < s.C; ++c) p.wr[2 * s.C + c] = p.wr[1 * s.C + c];
  const KernelRun r = run_kernel(p, s, VecD(s.N * s.C, 1.0));
  int seen = 0;
  for (int64_t n = 0; n < s.N; ++n) {
    const int32_t* idx = r.idx.data() + n * s.k;
    const bool has1 = idx[0] == 1 || idx[1] == 1, has2 = idx[0] == 2 || idx[1] == 2;
    EXPECT_FALSE(has2 && !has1) << "token " << n << " chose expert 2 over the tied expert 1";
    if (has1 && has2) {
      EXPECT_EQ(idx[0], 1) << "token " << n << ": the tie must list expert 1 first";
    }
    seen += has1;
  }
  EXPECT_GT(seen, 0) << "the tie case was not exercised; change the seed";
  check_block(p, s, 72, "tie");
}

// ====================================== router and permutation ======================================

// DeepSeek-V3's aux-loss-free bias: it changes the choice only; the weights are the unbiased
// scores of the chosen experts (renormalised or not).
TEST(Moe, SelectBiasChangesTheChoiceNotTheWeights) {
  const VecF logits = {0, 1, 2, 3};
  const VecF bias = {10, 0, 0, 0};
  for (bool renorm : {false, true}) {
    VecF probs(4), w(2);
    std::vector<int32_t> idx(2);
    cpu::moe_router_forward(probs.data(), idx.data(), w.data(), logits.data(), 1, 4, 2, MoeScore::sigmoid, renorm,
                            bias.data());
    EXPECT_EQ(idx, (std::vector<int32_t>{0, 3}));
    const float s = renorm ? probs[0] + probs[3] : 1.0f;
    EXPECT_EQ(w[0], probs[0] / s);
    EXPECT_EQ(w[1], probs[3] / s);
  }
  // In the block: every gradient still matches with the biased choice frozen.
  const MoeShape s = odd_shape(MoeScore::sigmoid, true);
  Rng rng(101);
  Params p = random_params(s, rng);
  p.select_bias = {0.0, -0.3, 0.2, 0.5};
  check_block(p, s, 102, "select bias");
}

TEST(Moe, SelectBiasUpdateFollowsTheLoadError) {
  const std::vector<int64_t> counts = {5, 3, 4, 4};  // mean 4
  VecF bias = {0.5f, 0.5f, 0.5f, 0.5f};
  cpu::moe_update_select_bias(bias.data(), counts.data(), 4, 0.125f);
  EXPECT_EQ(bias, (VecF{0.375f, 0.625f, 0.5f, 0.5f}));
}

TEST(Moe, RouterTiesLowerIndexWins) {
  const VecF logits = {1, 3, 3, 0, /**/ 2, 2, 2, 2, /**/ 0, 5, -1, 5};
  const int64_t N = 3, E = 4, k = 2;
  for (MoeScore score : {MoeScore::softmax, MoeScore::sigmoid}) {
    VecF probs(N * E), w(N * k);
    std::vector<int32_t> idx(N * k);
    cpu::moe_router_forward(probs.data(), idx.data(), w.data(), logits.data(), N, E, k, score, true);
    EXPECT_EQ(idx, (std::vector<int32_t>{1, 2, 0, 1, 1, 3}));
    for (float v : w) EXPECT_EQ(v, 0.5f);  // equal scores renormalise to exactly one half each
  }
}

TEST(Moe, PermutationIsStableByExpert) {
  const std::vector<int32_t> topk = {2, 0, /**/ 0, 1, /**/ 2, 1, /**/ 0, 2};
  const int64_t N = 4, E = 3, k = 2;
  std::vector<int32_t> offsets(E + 1), slot_token(N * k), slot_k(N * k), token_slot(N * k);
  cpu::moe_permute(offsets.data(), slot_token.data(), slot_k.data(), token_slot.data(), topk.data(), N, E, k);
  EXPECT_EQ(offsets, (std::vector<int32_t>{0, 3, 5, 8}));
  EXPECT_EQ(slot_token, (std::vector<int32_t>{0, 1, 3, 1, 2, 0, 2, 3}));
  EXPECT_EQ(slot_k, (std::vector<int32_t>{1, 0, 0, 1, 1, 0, 0, 1}));
  for (int64_t i = 0; i < N * k; ++i) {
    EXPECT_EQ(slot_token[token_slot[i]], i / k) << "token_slot is not the inverse at " << i;
    EXPECT_EQ(slot_k[token_slot[i]], i % k) << "token_slot is not the inverse at " << i;
  }
}

TEST(Moe, BadExpertIndexRefused) {
  const std::vector<int32_t> topk = {0, 3};
  std::vector<int32_t> offsets(4), a(2), b(2), c(2);
  EXPECT_THROW(cpu::moe_permute(offsets.data(), a.data(), b.data(), c.data(), topk.data(), 1, 3, 2), Error);
  MoeShape s = odd_shape(MoeScore::softmax, true);
  s.k = 5;  // more than E = 4
  Buffers buf(odd_shape(MoeScore::softmax, true));
  VecF x(s.N * s.C), out(s.N * s.C);
  EXPECT_THROW(cpu::moe_forward(out.data(), buf.acts, x.data(), x.data(), x.data(), x.data(), x.data(), s), Error);
}

// ===================================== determinism ======================================

TEST(Moe, BitIdenticalAcrossThreadCounts) {
  MoeShape s;
  s.N = 257, s.C = 48, s.F = 64, s.E = 8, s.k = 2;  // big enough to take every OpenMP path
  Rng rng(81);
  const Params p = random_params(s, rng);
  const VecD G = to_double(randn(static_cast<size_t>(s.N * s.C), rng, 1.0f));
  const int saved = omp_get_max_threads();
  omp_set_num_threads(1);
  const KernelRun a = run_kernel(p, s, G);
  omp_set_num_threads(2);
  const KernelRun b = run_kernel(p, s, G);
  const KernelRun c = run_kernel(p, s, G);
  omp_set_num_threads(saved);
  for (const KernelRun* r : {&b, &c}) {
    EXPECT_TRUE(bit_equal(a.out, r->out)) << "out";
    EXPECT_TRUE(bit_equal(a.dx, r->dx)) << "dx";
    EXPECT_TRUE(bit_equal(a.dwr, r->dwr)) << "dwr";
    EXPECT_TRUE(bit_equal(a.dw1, r->dw1)) << "dw1";
    EXPECT_TRUE(bit_equal(a.dw3, r->dw3)) << "dw3";
    EXPECT_TRUE(bit_equal(a.dw2, r->dw2)) << "dw2";
    EXPECT_EQ(a.aux, r->aux);
    EXPECT_EQ(a.z_sum, r->z_sum);
  }
}

// ================================== transformers oracle ===================================

namespace {

namespace fs = std::filesystem;

void write_bin(const fs::path& dir, const char* name, const VecF& v) {
  std::ofstream f(dir / (std::string(name) + ".bin"), std::ios::binary);
  f.write(reinterpret_cast<const char*>(v.data()), static_cast<std::streamsize>(v.size() * sizeof(float)));
  ASSERT_TRUE(f.good()) << "could not write " << (dir / name).string();
}

VecF minus_prefill_f(const VecF& g) {
  VecF r(g.size());
  for (size_t i = 0; i < g.size(); ++i) r[i] = g[i] - kPrefill;
  return r;
}

// Runs the block as `kernel_family` computes it and asks torch_reference_moe.py whether it equals
// transformers' `oracle_family`; returns the script's exit code (output in `log`).
int oracle(const MoeShape& s, const char* kernel_family, const char* oracle_family, uint64_t seed, std::string& log) {
  MoeShape ks = s;
  ks.renormalize = std::string(kernel_family) == "mixtral";
  Rng rng(seed);
  const Params p = random_params(ks, rng);
  const VecD G = to_double(randn(static_cast<size_t>(s.N * s.C), rng, 1.0f));
  const KernelRun r = run_kernel(p, ks, G);
  const fs::path dir = fs::temp_directory_path() / ("lathe_moe_oracle_" + std::to_string(getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  auto f = [](const VecD& v) { return VecF(v.begin(), v.end()); };
  write_bin(dir, "x", f(p.x));
  write_bin(dir, "wr", f(p.wr));
  write_bin(dir, "w1", f(p.w1));
  write_bin(dir, "w3", f(p.w3));
  write_bin(dir, "w2", f(p.w2));
  write_bin(dir, "g", f(G));
  write_bin(dir, "out", r.out);
  write_bin(dir, "aux", VecF{static_cast<float>(r.aux)});
  write_bin(dir, "z", VecF{static_cast<float>(r.z_sum / s.N)});
  write_bin(dir, "dx", r.dx);
  write_bin(dir, "dwr", minus_prefill_f(r.dwr));
  write_bin(dir, "dw1", minus_prefill_f(r.dw1));
  write_bin(dir, "dw3", minus_prefill_f(r.dw3));
  write_bin(dir, "dw2", minus_prefill_f(r.dw2));
  const std::string cmd = std::string("/usr/bin/python3 ") + LATHE_SOURCE_DIR +
                          "/tests/kernels/torch_reference_moe.py check " + dir.string() + " " + oracle_family + " " +
                          std::to_string(s.N) + " " + std::to_string(s.C) + " " + std::to_string(s.F) + " " +
                          std::to_string(s.E) + " " + std::to_string(s.k) + " 2>&1";
  FILE* pipe = popen(cmd.c_str(), "r");
  if (pipe == nullptr) return -1;
  char buf[512];
  while (fgets(buf, sizeof(buf), pipe) != nullptr) log += buf;
  const int status = pclose(pipe);
  fs::remove_all(dir);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

}  // namespace

TEST(MoeOracle, MixtralAndQwen2MoeBlocksInTransformers) {
  if (!fs::exists("/usr/bin/python3")) GTEST_SKIP() << "/usr/bin/python3 (torch, transformers 4.45.2) not found";
  MoeShape s;
  s.N = 33, s.C = 16, s.F = 24, s.E = 8, s.k = 2;
  for (const char* family : {"mixtral", "qwen2_moe"}) {
    std::string log;
    const int rc = oracle(s, family, family, 91, log);
    EXPECT_EQ(rc, 0) << family << " differs from transformers:\n" << log;
    if (rc == 0) std::printf("%s", log.c_str());
  }
  // Negative control: the kernel without renormalisation is NOT Mixtral.
  std::string log;
  EXPECT_EQ(oracle(s, "qwen2_moe", "mixtral", 91, log), 1) << "the oracle did not catch a wrong block:\n" << log;
}
