// Block attention (context parallelism, issue 27): the sequence cut into 2N load-balanced chunks
// (rank i holds chunks i and 2N-1-i), each rank's rows attended block by block to every rank's
// keys and merged by log-sum-exp, must equal the one-rank attention_forward / attention_backward
// on the whole sequence (itself checked against a double reference and finite differences in
// test_ops_attention / test_attention_doc): causal, documents (length-1 ones, ones crossing
// chunks), sliding window, odd chunk lengths, GQA. Also: blocks with no visible pair compute no
// tile and leave the merge unchanged; the backward against finite differences on one block;
// determinism across thread counts.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "core/error.h"
#include "reference_ops.h"
#include "kernels/cpu/ops.h"

namespace {

using lathe::cpu::BlockAttention;

using lathe::test::randn;
using lathe::test::random_docs;

struct Case {
  int64_t B, T, H, KVH, D, N;  // N ranks: 2N chunks of T / (2N)
  int64_t max_doc = 0;          // 0: causal, else random documents up to this length
  int64_t window = 0;
  float scale = 0.0f, softcap = 0.0f;  // Gemma 2's score scale and soft cap (0 = none)
};

// Global rows of rank r: chunks r and 2N-1-r.
std::vector<int32_t> rank_rows(int64_t T, int64_t N, int64_t r) {
  const int64_t C = T / (2 * N);
  std::vector<int32_t> p;
  for (int64_t c : {r, 2 * N - 1 - r})
    for (int64_t t = c * C; t < (c + 1) * C; ++t) p.push_back(static_cast<int32_t>(t));
  return p;
}

struct Whole {
  std::vector<float> out, lse, dqkv;
};

Whole one_rank(const Case& c, const std::vector<float>& qkv, const std::vector<float>& dout, const int32_t* ds) {
  Whole w;
  w.out.assign(c.B * c.T * c.H * c.D, NAN);
  w.lse.assign(c.B * c.H * c.T, NAN);
  w.dqkv.assign(qkv.size(), NAN);
  std::vector<float> scratch(lathe::cpu::attention_scratch_floats(c.T, c.D));
  lathe::cpu::attention_forward(w.out.data(), w.lse.data(), qkv.data(), c.B, c.T, c.H, c.KVH, c.D, scratch.data(), ds,
                                c.window, c.scale, c.softcap);
  lathe::cpu::attention_backward(w.dqkv.data(), dout.data(), qkv.data(), w.out.data(), w.lse.data(), c.B, c.T, c.H,
                                 c.KVH, c.D, scratch.data(), ds, c.window, c.scale, c.softcap);
  return w;
}

// rows of src [B, T, W] at positions p -> [B, p.size(), W]
std::vector<float> take_rows(const std::vector<float>& src, int64_t B, int64_t T, int64_t W,
                             const std::vector<int32_t>& p) {
  const int64_t n = static_cast<int64_t>(p.size());
  std::vector<float> dst(B * n * W);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < n; ++i)
      std::copy_n(src.begin() + (b * T + p[i]) * W, W, dst.begin() + (b * n + i) * W);
  return dst;
}

// Every rank's blocks simulated in one process; results scattered back to global rows.
Whole blocked(const Case& c, const std::vector<float>& qkv, const std::vector<float>& dout, const int32_t* ds,
              bool break_merge = false) {
  const int64_t W = (c.H + 2 * c.KVH) * c.D, HD = c.H * c.D;
  Whole w;
  w.out.assign(c.B * c.T * HD, NAN);
  w.lse.assign(c.B * c.H * c.T, NAN);
  w.dqkv.assign(qkv.size(), 0.0f);
  std::vector<std::vector<int32_t>> rows(c.N);
  std::vector<std::vector<float>> lq(c.N), lo(c.N), ll(c.N), ldo(c.N), ldq(c.N);
  for (int64_t r = 0; r < c.N; ++r) {
    rows[r] = rank_rows(c.T, c.N, r);
    lq[r] = take_rows(qkv, c.B, c.T, W, rows[r]);
  }
  const int64_t Tl = static_cast<int64_t>(rows[0].size());
  auto block = [&](int64_t r, int64_t s, std::vector<int32_t>& qdoc) {
    BlockAttention a;
    a.B = c.B, a.Tq = Tl, a.Tk = Tl, a.H = c.H, a.KVH = c.KVH, a.D = c.D;
    a.q = lq[r].data(), a.ldq = W, a.k = lq[s].data() + HD, a.ldk = W, a.v = lq[s].data() + HD + c.KVH * c.D,
    a.ldv = W;
    a.q_pos = rows[r].data(), a.k_pos = rows[s].data(), a.window = c.window;
    a.scale = c.scale, a.softcap = c.softcap;
    if (ds) {
      qdoc.resize(c.B * Tl);
      for (int64_t b = 0; b < c.B; ++b)
        for (int64_t i = 0; i < Tl; ++i) qdoc[b * Tl + i] = ds[b * c.T + rows[r][i]];
      a.q_doc = qdoc.data();
    }
    return a;
  };
  // forward: rank r merges the blocks of sources r, r-1, ... (ring order)
  for (int64_t r = 0; r < c.N; ++r) {
    std::vector<int32_t> qdoc;
    lo[r].assign(c.B * Tl * HD, NAN);
    ll[r].assign(c.B * c.H * Tl, NAN);
    std::vector<float> ob(lo[r].size()), lb(ll[r].size());
    for (int64_t step = 0; step < c.N; ++step) {
      const int64_t s = (r - step + c.N) % c.N;
      const BlockAttention a = block(r, s, qdoc);
      if (step == 0) {
        lathe::cpu::attention_block_forward(a, lo[r].data(), HD, ll[r].data());
      } else {
        lathe::cpu::attention_block_forward(a, ob.data(), HD, lb.data());
        if (break_merge) lb[0] += 0.5f;
        lathe::cpu::attention_lse_merge(lo[r].data(), ll[r].data(), ob.data(), lb.data(), c.B, Tl, c.H, c.D, HD);
      }
    }
    ldo[r] = take_rows(dout, c.B, c.T, HD, rows[r]);
  }
  // backward: dq of rank r, dk/dv into source s's rows
  std::vector<std::vector<float>> dl(c.N, std::vector<float>(c.B * Tl * W, 0.0f));
  for (int64_t r = 0; r < c.N; ++r) {
    std::vector<int32_t> qdoc;
    for (int64_t step = 0; step < c.N; ++step) {
      const int64_t s = (r - step + c.N) % c.N;
      const BlockAttention a = block(r, s, qdoc);
      lathe::cpu::attention_block_backward(a, lo[r].data(), ldo[r].data(), HD, ll[r].data(), dl[r].data(), W,
                                           dl[s].data() + HD, W, dl[s].data() + HD + c.KVH * c.D, W);
    }
  }
  for (int64_t r = 0; r < c.N; ++r)
    for (int64_t b = 0; b < c.B; ++b)
      for (int64_t i = 0; i < Tl; ++i) {
        const int64_t t = rows[r][i];
        std::copy_n(lo[r].begin() + (b * Tl + i) * HD, HD, w.out.begin() + (b * c.T + t) * HD);
        std::copy_n(dl[r].begin() + (b * Tl + i) * W, W, w.dqkv.begin() + (b * c.T + t) * W);
        for (int64_t h = 0; h < c.H; ++h) w.lse[(b * c.H + h) * c.T + t] = ll[r][(b * c.H + h) * Tl + i];
      }
  return w;
}

void expect_close(const std::vector<float>& got, const std::vector<float>& want, double rtol, const char* what,
                  const Case& c) {
  ASSERT_EQ(got.size(), want.size());
  double scale = 1.0, worst = 0.0;
  for (float w : want) scale = std::max(scale, std::fabs(static_cast<double>(w)));
  size_t bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::fabs(static_cast<double>(got[i]) - want[i]);
    if (!(err <= rtol * scale)) ++bad;
    worst = std::isnan(got[i]) ? INFINITY : std::max(worst, err);
  }
  EXPECT_EQ(bad, 0u) << what << " B=" << c.B << " T=" << c.T << " H=" << c.H << " KVH=" << c.KVH << " D=" << c.D
                     << " N=" << c.N << " docs<=" << c.max_doc << " window=" << c.window << ": worst abs err " << worst;
}

void check_case(const Case& c) {
  const int64_t W = (c.H + 2 * c.KVH) * c.D;
  const uint32_t seed = static_cast<uint32_t>(c.T * 131 + c.N * 17 + c.D + c.max_doc * 7 + c.window);
  const auto qkv = randn(c.B * c.T * W, seed);
  const auto dout = randn(c.B * c.T * c.H * c.D, seed + 1);
  std::vector<int32_t> ds;
  if (c.max_doc > 0) ds = random_docs(c.B, c.T, c.max_doc, seed + 2);
  const int32_t* dsp = ds.empty() ? nullptr : ds.data();
  const Whole ref = one_rank(c, qkv, dout, dsp), got = blocked(c, qkv, dout, dsp);
  expect_close(got.out, ref.out, 2e-5, "out", c);
  expect_close(got.lse, ref.lse, 2e-5, "lse", c);
  expect_close(got.dqkv, ref.dqkv, 5e-5, "dqkv", c);
}

TEST(AttentionBlock, LoadBalancedChunksEqualOneRankCausal) {
  for (int64_t N : {1, 2, 3, 4})
    for (int64_t C : {1, 5, 16, 23})  // chunk lengths: odd, one tile, tiles + a ragged end
      for (auto [H, KVH] : {std::pair<int64_t, int64_t>{1, 1}, {4, 2}, {3, 1}})
        check_case({2, 2 * N * C, H, KVH, 8, N});
}

TEST(AttentionBlock, LoadBalancedChunksEqualOneRankDocuments) {
  for (int64_t N : {2, 3, 4})
    for (int64_t C : {3, 17, 40})
      for (int64_t max_doc : {1, 4, 30, 200})  // length-1 documents, documents crossing chunks
        check_case({2, 2 * N * C, 4, 2, 16, N, max_doc});
}

TEST(AttentionBlock, LoadBalancedChunksEqualOneRankWindow) {
  for (int64_t N : {2, 4})
    for (int64_t window : {1, 7, 40})
      for (int64_t max_doc : {0, 25}) check_case({1, 2 * N * 21, 2, 1, 8, N, max_doc, window});
}

TEST(AttentionBlock, HeadSize64) { check_case({1, 2 * 2 * 50, 4, 2, 64, 2, 60}); }

// Gemma 2: a score scale other than 1/sqrt(D) and soft-capped scores, as the one-rank kernel's
// trailing arguments (itself checked against transformers in test_ops_attention / test_gemma2).
TEST(AttentionBlock, ScoreScaleAndSoftCapEqualOneRank) {
  for (int64_t N : {2, 3})
    for (int64_t max_doc : {0, 30})
      for (float cap : {0.0f, 1.5f, 50.0f}) {
        Case c{2, 2 * N * 19, 4, 2, 16, N, max_doc};
        c.scale = 0.7f, c.softcap = cap;
        check_case(c);
        c.window = 9;
        check_case(c);
      }
  check_case({1, 2 * 2 * 40, 4, 2, 64, 2, 0, 0, 0.125f, 30.0f});
}

// A broken merge is caught (the test is not blind to the merge).
TEST(AttentionBlock, BrokenMergeFails) {
  const Case c{1, 24, 2, 1, 8, 2};
  const int64_t W = (c.H + 2 * c.KVH) * c.D;
  const auto qkv = randn(c.B * c.T * W, 5);
  const auto dout = randn(c.B * c.T * c.H * c.D, 6);
  const Whole ref = one_rank(c, qkv, dout, nullptr), bad = blocked(c, qkv, dout, nullptr, true);
  double worst = 0.0;
  for (size_t i = 0; i < ref.out.size(); ++i) worst = std::max(worst, std::fabs(double(bad.out[i]) - ref.out[i]));
  EXPECT_GT(worst, 1e-3);
}

// Keys wholly in the future, or wholly before every query's document, compute no tile; the block's
// rows get out = 0, lse = -inf, and merging them leaves the other side's bits unchanged.
TEST(AttentionBlock, EmptyBlocksSkipAllTilesAndMergeAsIdentity) {
  const int64_t B = 1, T = 20, H = 2, KVH = 1, D = 8, W = (H + 2 * KVH) * D;
  const auto qkv = randn(B * T * W, 9);
  std::vector<int32_t> qp(T), kp(T), doc(T, 100);
  for (int64_t t = 0; t < T; ++t) qp[t] = static_cast<int32_t>(100 + t), kp[t] = static_cast<int32_t>(t);
  BlockAttention a;
  a.B = B, a.Tq = T, a.Tk = T, a.H = H, a.KVH = KVH, a.D = D;
  a.q = qkv.data(), a.ldq = W, a.k = qkv.data() + H * D, a.ldk = W, a.v = qkv.data() + (H + KVH) * D, a.ldv = W;
  std::vector<float> out(T * H * D, 1.0f), lse(H * T, 1.0f);
  auto tiles = [&](const BlockAttention& blk, bool empty = true) {
    const auto t0 = lathe::cpu::attention_block_tiles();
    lathe::cpu::attention_block_forward(blk, out.data(), H * D, lse.data());
    std::vector<float> dq(T * W, 0.0f);
    lathe::cpu::attention_block_backward(blk, out.data(), out.data(), H * D, lse.data(), dq.data(), W,
                                         dq.data() + H * D, W, dq.data() + (H + KVH) * D, W);
    if (empty) {
      for (float x : dq) EXPECT_EQ(x, 0.0f);
    }
    const auto t1 = lathe::cpu::attention_block_tiles();
    return std::make_pair(t1.forward - t0.forward, t1.backward - t0.backward);
  };
  a.q_pos = kp.data(), a.k_pos = qp.data();  // queries 0..19 against keys 100..119: the future
  EXPECT_EQ(tiles(a), std::make_pair(int64_t{0}, int64_t{0}));
  for (float x : out) EXPECT_EQ(x, 0.0f);
  for (float x : lse) EXPECT_EQ(x, -INFINITY);
  a.q_pos = qp.data(), a.k_pos = kp.data(), a.q_doc = doc.data();  // every query's document starts at 100
  EXPECT_EQ(tiles(a), std::make_pair(int64_t{0}, int64_t{0}));
  a.q_doc = nullptr;  // plain causal: 2 query tiles x 2 key tiles per head, all visible
  EXPECT_EQ(tiles(a, false), std::make_pair(H * 4, H * 4));
  // merge identity
  const auto o2 = randn(T * H * D, 3);
  auto oa = o2;
  std::vector<float> la(H * T, 0.25f), lb(H * T, -INFINITY), ob(T * H * D, 7.0f);
  lathe::cpu::attention_lse_merge(oa.data(), la.data(), ob.data(), lb.data(), B, T, H, D, H * D);
  EXPECT_EQ(0, std::memcmp(oa.data(), o2.data(), oa.size() * sizeof(float)));
  for (float x : la) EXPECT_EQ(x, 0.25f);
}

// Finite differences of L = sum(dout * out) through one whole-sequence block (its own final lse).
TEST(AttentionBlock, BackwardMatchesFiniteDifferences) {
  const int64_t B = 1, T = 19, H = 2, KVH = 1, D = 4, W = (H + 2 * KVH) * D;
  auto qkv = randn(B * T * W, 21, 0.8f);
  const auto dout = randn(B * T * H * D, 22);
  std::vector<int32_t> pos(T), doc(T);
  for (int64_t t = 0; t < T; ++t) pos[t] = static_cast<int32_t>(t), doc[t] = t < 7 ? 0 : 7;
  auto blk = [&](const std::vector<float>& x) {
    BlockAttention a;
    a.B = B, a.Tq = T, a.Tk = T, a.H = H, a.KVH = KVH, a.D = D;
    a.q = x.data(), a.ldq = W, a.k = x.data() + H * D, a.ldk = W, a.v = x.data() + (H + KVH) * D, a.ldv = W;
    a.q_pos = pos.data(), a.k_pos = pos.data(), a.q_doc = doc.data();
    return a;
  };
  auto loss = [&](const std::vector<float>& x) {
    std::vector<float> out(T * H * D), lse(H * T);
    lathe::cpu::attention_block_forward(blk(x), out.data(), H * D, lse.data());
    double L = 0.0;
    for (size_t i = 0; i < out.size(); ++i) L += double(out[i]) * dout[i];
    return L;
  };
  std::vector<float> out(T * H * D), lse(H * T), grad(T * W, 0.0f);
  lathe::cpu::attention_block_forward(blk(qkv), out.data(), H * D, lse.data());
  lathe::cpu::attention_block_backward(blk(qkv), out.data(), dout.data(), H * D, lse.data(), grad.data(), W,
                                       grad.data() + H * D, W, grad.data() + (H + KVH) * D, W);
  const float eps = 1e-2f;
  double worst = 0.0;
  for (size_t i = 0; i < qkv.size(); ++i) {
    const float x0 = qkv[i];
    qkv[i] = x0 + eps;
    const double lp = loss(qkv);
    qkv[i] = x0 - eps;
    const double lm = loss(qkv);
    qkv[i] = x0;
    const double fd = (lp - lm) / (2.0 * eps);
    worst = std::max(worst, std::fabs(fd - grad[i]) / std::max(1.0, std::fabs(fd)));
  }
  EXPECT_LT(worst, 5e-3);
}

TEST(AttentionBlock, BitIdenticalAcrossThreadCounts) {
  const Case c{2, 2 * 3 * 13, 4, 2, 8, 3, 10};
  const int64_t W = (c.H + 2 * c.KVH) * c.D;
  const auto qkv = randn(c.B * c.T * W, 77);
  const auto dout = randn(c.B * c.T * c.H * c.D, 78);
  const auto ds = random_docs(c.B, c.T, 10, 79);
  const int saved = omp_get_max_threads();
  omp_set_num_threads(1);
  const Whole one = blocked(c, qkv, dout, ds.data());
  omp_set_num_threads(3);
  const Whole three = blocked(c, qkv, dout, ds.data());
  omp_set_num_threads(saved);
  EXPECT_EQ(0, std::memcmp(one.out.data(), three.out.data(), one.out.size() * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(one.dqkv.data(), three.dqkv.data(), one.dqkv.size() * sizeof(float)));
}

TEST(AttentionBlock, RejectsUnorderedPositionsAndBadDocuments) {
  const int64_t T = 4, D = 4, W = 3 * D;
  const auto qkv = randn(T * W, 1);
  std::vector<int32_t> good = {0, 1, 2, 3}, unordered = {0, 2, 1, 3}, doc = {0, 0, 5, 0};
  std::vector<float> out(T * D), lse(T);
  BlockAttention a;
  a.B = 1, a.Tq = T, a.Tk = T, a.H = 1, a.KVH = 1, a.D = D;
  a.q = qkv.data(), a.ldq = W, a.k = qkv.data() + D, a.ldk = W, a.v = qkv.data() + 2 * D, a.ldv = W;
  a.q_pos = unordered.data(), a.k_pos = good.data();
  EXPECT_THROW(lathe::cpu::attention_block_forward(a, out.data(), D, lse.data()), lathe::Error);
  a.q_pos = good.data(), a.q_doc = doc.data();
  EXPECT_THROW(lathe::cpu::attention_block_forward(a, out.data(), D, lse.data()), lathe::Error);
  // document starts that decrease along the rows are no segmentation (each row sees one key run)
  std::vector<int32_t> decreasing = {0, 0, 2, 1};
  a.q_doc = decreasing.data();
  EXPECT_THROW(lathe::cpu::attention_block_forward(a, out.data(), D, lse.data()), lathe::Error);
}

}  // namespace
