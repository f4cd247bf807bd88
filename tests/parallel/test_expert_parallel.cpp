// Expert parallelism's MoE block (parallel/expert_parallel.h) on the thread communicator, against
// the oracle of one process: each rank's own tokens through cpu::moe_forward / moe_backward with
// every expert local. Outputs, input and router gradients per rank, and the expert weight
// gradients summed over the ranks (what the data-parallel reduction forms), must agree. The ranks
// hold different token counts, and routing leaves some (source, owner) pairs without rows.
#include <gtest/gtest.h>

#include <cmath>
#include <mutex>
#include <random>
#include <vector>

#include "core/error.h"
#include "dist/comm.h"
#include "kernels/cpu/ops.h"
#include "parallel/expert_parallel.h"

using namespace lathe;
using lathe::cpu::MoeActs;
using lathe::cpu::MoeShape;
using VecF = std::vector<float>;

namespace {

struct Buffers {
  VecF logits, probs, topk_w, xp, gate, up, act, y;
  std::vector<int32_t> topk_idx, offsets, slot_token, slot_k, token_slot;
  MoeActs acts;
  explicit Buffers(const MoeShape& s) {
    const size_t S = static_cast<size_t>(s.N * s.k);
    logits.resize(static_cast<size_t>(s.N * s.E));
    probs.resize(static_cast<size_t>(s.N * s.E));
    topk_w.resize(S);
    topk_idx.resize(S);
    offsets.resize(static_cast<size_t>(s.E + 1));
    slot_token.resize(S);
    slot_k.resize(S);
    token_slot.resize(S);
    xp.resize(S * static_cast<size_t>(s.C));
    gate.resize(S * static_cast<size_t>(s.F));
    up.resize(S * static_cast<size_t>(s.F));
    act.resize(S * static_cast<size_t>(s.F));
    y.resize(S * static_cast<size_t>(s.C));
    acts = MoeActs{logits.data(),     probs.data(),  topk_idx.data(),   topk_w.data(), offsets.data(),
                   slot_token.data(), slot_k.data(), token_slot.data(), xp.data(),     gate.data(),
                   up.data(),         act.data(),    y.data()};
  }
};

VecF randn(size_t n, uint64_t seed, float std) {
  std::mt19937_64 g(seed);
  std::normal_distribution<float> d(0.0f, std);
  VecF v(n);
  for (auto& x : v) x = d(g);
  return v;
}

struct Result {
  VecF out, dx, dwr, dw1, dw3, dw2;
};

// One rank's block: with `ep` the expert-parallel path, else every expert here.
Result run_block(parallel::ExpertParallel* ep, const MoeShape& s, const VecF& x, const VecF& wr, const VecF& w1,
                 const VecF& w3, const VecF& w2, const VecF& dout, const VecF& dladd) {
  Buffers b(s);
  Result r;
  r.out.assign(static_cast<size_t>(s.N * s.C), NAN);
  r.dx.assign(r.out.size(), NAN);
  r.dwr.assign(wr.size(), 0.0f);
  r.dw1.assign(w1.size(), 0.0f);
  r.dw3.assign(w3.size(), 0.0f);
  r.dw2.assign(w2.size(), 0.0f);
  VecF scratch(cpu::moe_backward_scratch_floats(s), NAN);
  for (int layer = 0; layer < 2; ++layer) {  // twice: a layer's state is reused, results must repeat
    if (ep) {
      ep->forward(r.out.data(), b.acts, x.data(), wr.data(), w1.data(), w3.data(), w2.data(), s, 3);
    } else {
      cpu::moe_forward(r.out.data(), b.acts, x.data(), wr.data(), w1.data(), w3.data(), w2.data(), s);
    }
    if (layer == 0) continue;
    if (ep)
      ep->backward(r.dx.data(), r.dwr.data(), r.dw1.data(), r.dw3.data(), r.dw2.data(), dout.data(), dladd.data(),
                   b.acts, x.data(), wr.data(), w1.data(), w3.data(), w2.data(), s, scratch.data(), 3);
    else
      cpu::moe_backward(r.dx.data(), r.dwr.data(), r.dw1.data(), r.dw3.data(), r.dw2.data(), dout.data(), dladd.data(),
                        b.acts, x.data(), wr.data(), w1.data(), w3.data(), w2.data(), s, scratch.data());
  }
  return r;
}

void expect_near(const VecF& got, const VecF& want, float tol, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  size_t bad = 0;
  for (size_t i = 0; i < got.size(); ++i)
    if (!(std::fabs(got[i] - want[i]) <= tol * (1.0f + std::fabs(want[i])))) {
      if (bad++ < 3) ADD_FAILURE() << what << "[" << i << "]: " << got[i] << " vs " << want[i];
    }
  EXPECT_EQ(bad, 0u) << what;
}

// G ranks, `experts` experts, rank r holds 5 + 3 r tokens.
void check_against_one_process(int G, int64_t experts, int64_t k) {
  const int64_t C = 8, F = 12, E = experts;
  const VecF wr = randn(static_cast<size_t>(E * C), 1, 0.5f), w1 = randn(static_cast<size_t>(E * F * C), 2, 0.3f),
             w3 = randn(static_cast<size_t>(E * F * C), 3, 0.3f), w2 = randn(static_cast<size_t>(E * C * F), 4, 0.3f);
  std::mutex m;
  std::vector<Result> ep_res(static_cast<size_t>(G)), ref_res(static_cast<size_t>(G));
  dist::run_threads(G, [&](dist::Communicator& c) {
    MoeShape s;
    s.N = 5 + 3 * c.rank();
    s.C = C;
    s.F = F;
    s.E = E;
    s.k = k;
    const VecF x = randn(static_cast<size_t>(s.N * C), 10 + static_cast<uint64_t>(c.rank()), 1.0f);
    const VecF dout = randn(x.size(), 20 + static_cast<uint64_t>(c.rank()), 1.0f);
    const VecF dladd = randn(static_cast<size_t>(s.N * E), 30 + static_cast<uint64_t>(c.rank()), 0.1f);
    parallel::ExpertParallel ep(c, E);
    EXPECT_EQ(ep.local_experts(), E / G);
    EXPECT_EQ(ep.first_expert(), E / G * c.rank());
    Result got = run_block(&ep, s, x, wr, w1, w3, w2, dout, dladd);
    Result want = run_block(nullptr, s, x, wr, w1, w3, w2, dout, dladd);
    std::lock_guard<std::mutex> lk(m);
    ep_res[static_cast<size_t>(c.rank())] = std::move(got);
    ref_res[static_cast<size_t>(c.rank())] = std::move(want);
  });
  // fp32 rounding of reordered sums over C = 8 or F = 12 terms: 1e-5 relative is ~100 ulp.
  const float tol = 1e-5f;
  auto sum = [&](std::vector<Result>& rs, VecF Result::*f) {
    VecF t((rs[0].*f).size(), 0.0f);
    for (auto& r : rs)
      for (size_t i = 0; i < t.size(); ++i) t[i] += (r.*f)[i];
    return t;
  };
  for (int r = 0; r < G; ++r) {
    const std::string at = " of rank " + std::to_string(r);
    expect_near(ep_res[static_cast<size_t>(r)].out, ref_res[static_cast<size_t>(r)].out, tol, "out" + at);
    expect_near(ep_res[static_cast<size_t>(r)].dx, ref_res[static_cast<size_t>(r)].dx, tol, "dx" + at);
    expect_near(ep_res[static_cast<size_t>(r)].dwr, ref_res[static_cast<size_t>(r)].dwr, tol, "dwr" + at);
    // A rank's gradient of an expert it does not own stays exactly zero.
    const size_t per = static_cast<size_t>(F * C), L = static_cast<size_t>(E / G);
    for (size_t e = 0; e < static_cast<size_t>(E); ++e) {
      if (e / L == static_cast<size_t>(r)) continue;
      for (size_t i = 0; i < per; ++i) {
        ASSERT_EQ(ep_res[static_cast<size_t>(r)].dw1[e * per + i], 0.0f) << e;
      }
    }
  }
  expect_near(sum(ep_res, &Result::dw1), sum(ref_res, &Result::dw1), tol, "sum of dw1");
  expect_near(sum(ep_res, &Result::dw3), sum(ref_res, &Result::dw3), tol, "sum of dw3");
  expect_near(sum(ep_res, &Result::dw2), sum(ref_res, &Result::dw2), tol, "sum of dw2");
}

}  // namespace

TEST(ExpertParallel, TwoRanksFourExpertsTop2EqualsOneProcess) { check_against_one_process(2, 4, 2); }
TEST(ExpertParallel, ThreeRanksSixExpertsTop2EqualsOneProcess) { check_against_one_process(3, 6, 2); }
TEST(ExpertParallel, TwoRanksEightExpertsTop1EqualsOneProcess) { check_against_one_process(2, 8, 1); }
TEST(ExpertParallel, OneRankIsThePlainBlock) { check_against_one_process(1, 4, 2); }

TEST(ExpertParallel, ExpertsNotDivisibleByTheGroupAreNamed) {
  dist::run_threads(3, [](dist::Communicator& c) {
    try {
      parallel::ExpertParallel ep(c, 4);
      ADD_FAILURE() << "no error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("parallel.expert = 3 does not divide the model's 4 experts"),
                std::string::npos)
          << e.what();
    }
  });
}
