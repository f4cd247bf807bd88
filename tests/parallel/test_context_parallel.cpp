// Context-parallel attention (parallel/context_parallel.h, issue 27) on the thread communicator:
// at context 1-4, ring and all-gather, causal / documents / sliding window, GQA and odd chunk
// lengths, every rank's rows of out, lse and dqkv equal the one-rank attention_forward /
// attention_backward over the whole sequence (fp32 tolerance: different kernels); two runs of one
// layout give the same bits; ring and all-gather give the same bits for out, lse and dQ always and
// for dK, dV at context 2 (at 3 and 4 they sum the ranks' dK/dV in other orders: fp32 tolerance).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "../kernels/reference_ops.h"
#include "dist/comm.h"
#include "kernels/cpu/ops.h"
#include "parallel/context_parallel.h"

namespace {

using namespace lathe;
using parallel::ContextImpl;

using lathe::test::randn;
using lathe::test::random_docs;

struct Case {
  int N;
  int64_t B, T, H, KVH, D;
  int64_t max_doc = 0, window = 0;
};

struct Result {
  std::vector<float> out, lse, dqkv;  // whole-sequence layout
};

struct Inputs {
  std::vector<float> qkv, dout;
  std::vector<int32_t> ds;
  const int32_t* docs() const { return ds.empty() ? nullptr : ds.data(); }
};

Inputs make_inputs(const Case& c) {
  const uint32_t seed = static_cast<uint32_t>(c.N * 1000 + c.T * 3 + c.max_doc + c.window * 7 + c.H);
  Inputs in;
  in.qkv = randn(c.B * c.T * (c.H + 2 * c.KVH) * c.D, seed);
  in.dout = randn(c.B * c.T * c.H * c.D, seed + 1);
  if (c.max_doc > 0) in.ds = random_docs(c.B, c.T, c.max_doc, seed + 2);
  return in;
}

Result one_rank(const Case& c, const Inputs& in) {
  Result r;
  r.out.assign(c.B * c.T * c.H * c.D, NAN);
  r.lse.assign(c.B * c.H * c.T, NAN);
  r.dqkv.assign(in.qkv.size(), NAN);
  std::vector<float> scratch(cpu::attention_scratch_floats(c.T, c.D));
  cpu::attention_forward(r.out.data(), r.lse.data(), in.qkv.data(), c.B, c.T, c.H, c.KVH, c.D, scratch.data(),
                         in.docs(), c.window);
  cpu::attention_backward(r.dqkv.data(), in.dout.data(), in.qkv.data(), r.out.data(), r.lse.data(), c.B, c.T, c.H,
                          c.KVH, c.D, scratch.data(), in.docs(), c.window);
  return r;
}

// Every context rank on its own thread; each writes its rows of the whole-sequence result.
Result context(const Case& c, const Inputs& in, ContextImpl impl, int64_t alloc_B = 0) {
  const int64_t W = (c.H + 2 * c.KVH) * c.D, HD = c.H * c.D;
  Result r;
  r.out.assign(c.B * c.T * HD, NAN);
  r.lse.assign(c.B * c.H * c.T, NAN);
  r.dqkv.assign(in.qkv.size(), NAN);
  dist::run_threads(c.N, [&](dist::Communicator& g) {
    parallel::ContextAttention ca(g, impl, {std::max(c.B, alloc_B), c.T, c.H, c.KVH, c.D});
    const auto& rows = ca.rows();
    const int64_t Tl = ca.local_rows();
    std::vector<float> qkv(c.B * Tl * W), dout(c.B * Tl * HD), out(c.B * Tl * HD), lse(c.B * c.H * Tl),
        dqkv(c.B * Tl * W);
    std::vector<int32_t> qdoc(c.B * Tl);
    for (int64_t b = 0; b < c.B; ++b)
      for (int64_t i = 0; i < Tl; ++i) {
        const int64_t t = rows[i];
        std::copy_n(in.qkv.begin() + (b * c.T + t) * W, W, qkv.begin() + (b * Tl + i) * W);
        std::copy_n(in.dout.begin() + (b * c.T + t) * HD, HD, dout.begin() + (b * Tl + i) * HD);
        if (in.docs()) qdoc[b * Tl + i] = in.ds[b * c.T + t];
      }
    const int32_t* qd = in.docs() ? qdoc.data() : nullptr;
    ca.forward(out.data(), lse.data(), qkv.data(), qd, c.B, c.window);
    ca.backward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), qd, c.B, c.window);
    for (int64_t b = 0; b < c.B; ++b)
      for (int64_t i = 0; i < Tl; ++i) {
        const int64_t t = rows[i];
        std::copy_n(out.begin() + (b * Tl + i) * HD, HD, r.out.begin() + (b * c.T + t) * HD);
        std::copy_n(dqkv.begin() + (b * Tl + i) * W, W, r.dqkv.begin() + (b * c.T + t) * W);
        for (int64_t h = 0; h < c.H; ++h) r.lse[(b * c.H + h) * c.T + t] = lse[(b * c.H + h) * Tl + i];
      }
  });
  return r;
}

void expect_close(const std::vector<float>& got, const std::vector<float>& want, double rtol, const std::string& what) {
  ASSERT_EQ(got.size(), want.size());
  double scale = 1.0, worst = 0.0;
  for (float w : want) scale = std::max(scale, std::fabs(static_cast<double>(w)));
  size_t bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::fabs(static_cast<double>(got[i]) - want[i]);
    if (!(err <= rtol * scale)) ++bad;
    worst = std::isnan(got[i]) ? INFINITY : std::max(worst, err);
  }
  EXPECT_EQ(bad, 0u) << what << ": worst abs err " << worst;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// dq columns (the H query heads of every row) of a dqkv buffer.
std::vector<float> dq_part(const Case& c, const std::vector<float>& dqkv) {
  const int64_t W = (c.H + 2 * c.KVH) * c.D;
  std::vector<float> q;
  for (int64_t n = 0; n < c.B * c.T; ++n) q.insert(q.end(), dqkv.begin() + n * W, dqkv.begin() + n * W + c.H * c.D);
  return q;
}

std::string name(const Case& c, const char* impl) {
  return std::string(impl) + " N=" + std::to_string(c.N) + " T=" + std::to_string(c.T) + " H=" + std::to_string(c.H) +
         "/" + std::to_string(c.KVH) + " docs<=" + std::to_string(c.max_doc) + " window=" + std::to_string(c.window);
}

void check(const Case& c) {
  const Inputs in = make_inputs(c);
  const Result ref = one_rank(c, in);
  const Result ring = context(c, in, ContextImpl::Ring), ag = context(c, in, ContextImpl::AllGather);
  for (auto [res, impl] : {std::pair{&ring, "ring"}, std::pair{&ag, "allgather"}}) {
    expect_close(res->out, ref.out, 2e-5, "out " + name(c, impl));
    expect_close(res->lse, ref.lse, 2e-5, "lse " + name(c, impl));
    expect_close(res->dqkv, ref.dqkv, 5e-5, "dqkv " + name(c, impl));
  }
  EXPECT_TRUE(same_bits(ring.out, ag.out)) << name(c, "ring vs allgather out");
  EXPECT_TRUE(same_bits(ring.lse, ag.lse)) << name(c, "ring vs allgather lse");
  EXPECT_TRUE(same_bits(dq_part(c, ring.dqkv), dq_part(c, ag.dqkv))) << name(c, "ring vs allgather dq");
  if (c.N <= 2) {
    EXPECT_TRUE(same_bits(ring.dqkv, ag.dqkv)) << name(c, "ring vs allgather dqkv");
  }
  const Result again = context(c, in, ContextImpl::Ring);
  EXPECT_TRUE(same_bits(ring.out, again.out) && same_bits(ring.dqkv, again.dqkv)) << name(c, "ring rerun");
}

TEST(ContextParallel, CausalEqualsOneRank) {
  for (int N : {1, 2, 3, 4})
    for (int64_t C : {1, 7, 16, 21})  // chunk lengths
      check({N, 2, 2 * N * C, 4, 2, 8});
}

TEST(ContextParallel, DocumentsEqualOneRank) {
  for (int N : {2, 3, 4})
    for (int64_t max_doc : {1, 5, 37, 500}) check({N, 2, 2 * N * 19, 4, 1, 16, max_doc});
}

TEST(ContextParallel, SlidingWindowEqualsOneRank) {
  for (int N : {2, 3})
    for (int64_t window : {3, 30}) check({N, 1, 2 * N * 17, 2, 2, 8, 11, window});
}

// A micro-batch smaller than the allocation (the last validation batch): the same as allocated to it.
TEST(ContextParallel, SmallerMicroBatchThanAllocated) {
  const Case c{3, 2, 2 * 3 * 11, 4, 2, 8, 9};
  const Inputs in = make_inputs(c);
  const Result ref = one_rank(c, in);
  for (ContextImpl impl : {ContextImpl::Ring, ContextImpl::AllGather}) {
    const Result got = context(c, in, impl, 5);
    expect_close(got.out, ref.out, 2e-5, name(c, "B=2 of 5 out"));
    expect_close(got.dqkv, ref.dqkv, 5e-5, name(c, "B=2 of 5 dqkv"));
    EXPECT_TRUE(same_bits(got.dqkv, context(c, in, impl).dqkv)) << name(c, "B=2 of 5 vs of 2");
  }
}

TEST(ContextParallel, HeadSize64) { check({2, 1, 2 * 2 * 40, 4, 2, 64, 50}); }

TEST(ContextParallel, SplitErrorsNameTheValues) {
  try {
    parallel::check_context_split(100, 3);
    ADD_FAILURE() << "accepted T=100 at context 3";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("parallel.context = 3"), std::string::npos) << m;
    EXPECT_NE(m.find("100"), std::string::npos) << m;
    EXPECT_NE(m.find("multiple of 6"), std::string::npos) << m;
  }
  EXPECT_THROW(parallel::parse_context_impl("ulysses"), Error);
  EXPECT_EQ(parallel::context_rows(8, 2, 0), (std::vector<int32_t>{0, 1, 6, 7}));
  EXPECT_EQ(parallel::context_rows(8, 2, 1), (std::vector<int32_t>{2, 3, 4, 5}));
}

}  // namespace
