// ZeRO 3 (parallel/param_gather.h, parallel/dist_optimizer.h) on the in-process thread communicator:
//   * ParamGather's order of gathers, waits and releases over a pass for prefetch depth 0/1/2, the
//     weights each block reads complete when it runs, pages outside the shard handed back;
//   * whole models (gpt2-debug: tied embedding; llama-debug) trained for a few steps at DP = 2, 3 with
//     ZeRO 3 against ZeRO 0: losses, gradient norms and weights BIT-identical with one micro-batch,
//     for AdamW and LAMB and every prefetch depth; with grad accumulation (a reduce-scatter per
//     micro-batch: a different summation order) within fp32 rounding of the ZeRO 0 run.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "config/model_config.h"
#include "core/dtype.h"
#include "core/error.h"
#include "dist/comm.h"
#include "models/model.h"
#include "optim/clip.h"
#include "optim/optimizer.h"
#include "parallel/dist_optimizer.h"
#include "parallel/param_gather.h"

using namespace lathe;
using parallel::ParamGather;

namespace {

using Ev = ParamGather::Event;
using Op = ParamGather::Op;

// A page-aligned buffer (ParamGather madvises whole pages of it).
struct Pages {
  explicit Pages(size_t n) : n(n) {
    p = static_cast<float*>(std::aligned_alloc(4096, (n * sizeof(float) + 4095) / 4096 * 4096));
  }
  ~Pages() { std::free(p); }
  float* p;
  size_t n;
};

float value_of(size_t i) { return static_cast<float>(i % 1000) * 0.25f + 1.0f; }

// 4 blocks (embedding, 2 layers, head) of a 40000-element buffer; the head reads the embedding's
// first tensor too (a tied wte).
std::vector<ParamGather::Ranges> toy_blocks() {
  return {{{0, 8000}, {8000, 9000}}, {{9000, 19000}}, {{19000, 30000}}, {{30000, 40000}, {0, 8000}}};
}

std::vector<Ev> run_toy_pass(int prefetch, int ranks, size_t* released) {
  std::vector<Ev> events;
  dist::run_threads(ranks, [&](dist::Communicator& c) {
    const auto blocks = toy_blocks();
    const size_t P = 40000;
    Pages buf(P);
    parallel::FlatShards shards(P, c.size(), 1024);
    for (size_t i = 0; i < P; ++i)  // this rank's shard holds the values, the rest garbage
      buf.p[i] = i >= shards.begin(c.rank()) && i < shards.end(c.rank()) ? value_of(i) : -7.0f;
    ParamGather g(c, buf.p, shards, blocks, prefetch);
    g.record_events = true;
    auto use = [&](int64_t block, bool bwd) {
      g.before_block(block, bwd);
      for (const auto& [b, e] : blocks[static_cast<size_t>(block)])
        for (size_t i = b; i < e; ++i)
          ASSERT_EQ(buf.p[i], value_of(i)) << "block " << block << " element " << i << " rank " << c.rank();
    };
    for (int pass = 0; pass < 2; ++pass) {  // the second pass gathers into released pages
      for (int64_t b = 0; b < 4; ++b) use(b, false);
      for (int64_t b = 2; b >= 0; --b) use(b, true);
      g.end_pass();
    }
    for (size_t i = shards.begin(c.rank()); i < shards.end(c.rank()); ++i) ASSERT_EQ(buf.p[i], value_of(i));
    g.gather_whole();
    for (size_t i = 0; i < P; ++i) ASSERT_EQ(buf.p[i], value_of(i)) << "gather_whole, element " << i;
    if (c.rank() == 0) {
      events.assign(g.events().begin(), g.events().begin() + static_cast<long>(g.events().size() / 2));
      *released = g.released_bytes();
    }
  });
  return events;
}

Ev I(int64_t b, bool bwd) { return {Op::Issue, b, bwd}; }
Ev W(int64_t b, bool bwd) { return {Op::Wait, b, bwd}; }
Ev R(int64_t b, bool bwd) { return {Op::Release, b, bwd}; }

std::string show(const std::vector<Ev>& ev) {
  std::string s;
  for (const Ev& e : ev)
    s += fmt::format("{}{}{} ", e.op == Op::Issue ? 'I' : e.op == Op::Wait ? 'W' : 'R', e.block, e.backward ? 'b' : 'f');
  return s;
}

TEST(ParamGather, NoPrefetchGathersEachBlockWhenItRunsAndReleasesItAfter) {
  size_t released = 0;
  const std::vector<Ev> want = {I(0, 0), W(0, 0), R(0, 0), I(1, 0), W(1, 0), R(1, 0), I(2, 0), W(2, 0),
                                R(2, 0), I(3, 0), W(3, 0), R(3, 0), I(2, 1), W(2, 1), R(2, 1), I(1, 1),
                                W(1, 1), R(1, 1), I(0, 1), W(0, 1), R(0, 1)};
  const auto got = run_toy_pass(0, 2, &released);
  EXPECT_EQ(got, want) << show(got);
  EXPECT_GT(released, 0u);
}

TEST(ParamGather, PrefetchOneIssuesTheNextBlockBeforeTheCurrentRuns) {
  size_t released = 0;
  const std::vector<Ev> want = {I(0, 0), W(0, 0), I(1, 0), R(0, 0), W(1, 0), I(2, 0), R(1, 0), W(2, 0),
                                I(3, 0), R(2, 0), W(3, 0), I(2, 1), R(3, 0), W(2, 1), I(1, 1), R(2, 1),
                                W(1, 1), I(0, 1), R(1, 1), W(0, 1), R(0, 1)};
  const auto got = run_toy_pass(1, 3, &released);
  EXPECT_EQ(got, want) << show(got);
}

TEST(ParamGather, PrefetchTwoKeepsAtMostThreeBlocksGathered) {
  size_t released = 0;
  const auto got = run_toy_pass(2, 2, &released);
  // Every position issued before the one two ahead of it is waited for; never more than 3 gathered.
  int live = 0, most = 0;
  for (const Ev& e : got) {
    live += e.op == Op::Issue ? 1 : e.op == Op::Release ? -1 : 0;
    most = std::max(most, live);
  }
  EXPECT_EQ(most, 3) << show(got);
  EXPECT_EQ(live, 0) << show(got);
  const std::vector<Ev> head = {I(0, 0), W(0, 0), I(1, 0), I(2, 0), R(0, 0), W(1, 0), I(3, 0)};
  EXPECT_EQ(std::vector<Ev>(got.begin(), got.begin() + 7), head) << show(got);
}

// Pipeline actions (pipeline_executor.h): a pass over a span of blocks gathers only those, in the
// span's direction, with the prefetch kept inside it; a block outside the span is refused.
TEST(ParamGather, SpanGathersOnlyItsBlocksAndPrefetchStaysInside) {
  std::vector<Ev> events;
  dist::run_threads(2, [&](dist::Communicator& c) {
    const auto blocks = toy_blocks();
    const size_t P = 40000;
    Pages buf(P);
    parallel::FlatShards shards(P, c.size(), 1024);
    for (size_t i = 0; i < P; ++i)
      buf.p[i] = i >= shards.begin(c.rank()) && i < shards.end(c.rank()) ? value_of(i) : -7.0f;
    ParamGather g(c, buf.p, shards, blocks, 2);
    g.record_events = true;
    auto use = [&](int64_t block, bool bwd) {
      g.before_block(block, bwd);
      for (const auto& [b, e] : blocks[static_cast<size_t>(block)])
        for (size_t i = b; i < e; ++i) ASSERT_EQ(buf.p[i], value_of(i)) << "block " << block << " element " << i;
    };
    for (int mb = 0; mb < 2; ++mb) {  // two micro-batches' forward actions, then their backward
      g.begin_span(1, 2, false);
      use(1, false);
      use(2, false);
      g.end_pass();
    }
    g.begin_span(0, 2, true);
    use(2, true);
    use(1, true);
    use(0, true);
    g.end_pass();
    g.begin_span(1, 2, false);
    EXPECT_THROW(g.before_block(3, false), Error);  // the head is outside this action's span
    g.end_pass();
    EXPECT_THROW(g.begin_span(1, 3, true), Error);  // the head has no backward position
    if (c.rank() == 0) events = g.events();
  });
  const std::vector<Ev> want = {I(1, 0), W(1, 0), I(2, 0), R(1, 0), W(2, 0), R(2, 0),  // micro-batch 0
                                I(1, 0), W(1, 0), I(2, 0), R(1, 0), W(2, 0), R(2, 0),  // micro-batch 1
                                I(2, 1), W(2, 1), I(1, 1), I(0, 1), R(2, 1), W(1, 1), R(1, 1), W(0, 1), R(0, 1)};
  // The refused before_block issued nothing; its span ended empty.
  EXPECT_EQ(events, want) << show(events);
}

// ---- whole models ----

struct TrainRun {
  std::vector<double> losses, norms;
  std::vector<float> weights;   // rank 0's after the last step (whole)
  std::vector<float> reduced;   // the first step's reduced gradient, whole (gathered from the shards)
  std::vector<double> abs_sum;  // with `abs_sums`: sum over ranks and micro-batches of |gradient| (step 1)
  size_t released = 0;          // ZeRO 3: weight bytes handed back on rank 0
  bool zeros_outside = false;   // ZeRO 3: a released weight read as 0 after a step (not resident)
  size_t grads_kept = 0;        // nonzero gradients outside rank 0's shard after a micro-batch but the last
};

struct TrainSetup {
  const char* preset = "gpt2-debug";
  int dp = 2, zero = 0, prefetch = 1, accum = 1, steps = 3;
  const char* optimizer = "adamw";
  bool abs_sums = false;
  int shard_group = 0;
  Recompute recompute = Recompute::None;
};

TrainRun train(const TrainSetup& s) {
  TrainRun out;
  constexpr int64_t B = 2, T = 16;
  dist::run_threads(s.dp, [&](dist::Communicator& c) {
    auto model = build_model(ModelConfig::preset(s.preset));
    model->init_weights(11);
    model->allocate(B, T, 0, s.recompute);
    const size_t P = model->num_params();
    std::vector<optim::ParamRange> ranges;
    for (const ParamSpec& sp : model->params().specs())
      ranges.push_back({sp.offset, static_cast<size_t>(sp.numel()), sp.decay, static_cast<int64_t>(ranges.size())});
    parallel::DistOptimizerConfig dc;
    dc.optim.name = s.optimizer;
    dc.zero = s.zero;
    dc.bucket_elems = 5000;
    dc.shard_group = s.shard_group;
    parallel::DistOptimizer opt(
        parallel::FlatState{&model->backend(), model->backend_param_data(), model->backend_grad_data(), P}, c, dc,
        ranges);
    opt.set_param_blocks(model->param_ranges_by_block(), s.prefetch);
    EXPECT_EQ(opt.gathers(), s.zero == 3 && s.dp > 1);
    model->hooks().grads_ready = [&](size_t b, size_t e) { opt.grads_ready(b, e); };
    if (opt.gathers()) model->hooks().before_block = [&](int64_t b, bool bwd) { opt.before_block(b, bwd); };
    const int64_t V = model->config().vocab_size;
    std::vector<int32_t> tok(static_cast<size_t>(B * T)), tgt(tok.size());
    for (int step = 1; step <= s.steps; ++step) {
      opt.zero_grads();
      double loss = 0;
      const float scale = 1.0f / static_cast<float>(B * T * s.accum * s.dp);
      for (int m = 0; m < s.accum; ++m) {
        for (size_t i = 0; i < tok.size(); ++i) {
          const size_t k = i + tok.size() * static_cast<size_t>(m + s.accum * (c.rank() + 7 * step));
          tok[i] = static_cast<int32_t>((k * 2654435761u) % static_cast<size_t>(V));
          tgt[i] = static_cast<int32_t>((k * 40503u + 17) % static_cast<size_t>(V));
        }
        if (s.abs_sums && step == 1) {  // this micro-batch's gradient alone, on a copy of the model
          auto copy = build_model(ModelConfig::preset(s.preset));
          copy->allocate(B, T);
          std::memcpy(copy->param_data(), model->param_data(), P * sizeof(float));
          copy->forward_backward(tok.data(), tgt.data(), B, T, scale, true);
          if (out.abs_sum.empty() && c.rank() == 0) out.abs_sum.assign(P, 0.0);
          std::vector<double> mine(P);
          for (size_t i = 0; i < P; ++i) mine[i] = std::fabs(copy->grad_data()[i]);
          c.all_reduce(mine.data(), P, DType::F64);
          if (c.rank() == 0)
            for (size_t i = 0; i < P; ++i) out.abs_sum[i] += mine[i];
        }
        opt.set_last_backward(m + 1 == s.accum);
        opt.begin_micro_batch();
        loss += model->forward_backward(tok.data(), tgt.data(), B, T, scale, true);
        opt.end_micro_batch(m + 1 == s.accum);
        if (m + 1 < s.accum && c.rank() == 0)  // reduce-scattered already: only the shard's sum is kept
          for (size_t i = opt.shards().end(0); i < P; ++i) out.grads_kept += model->grad_data()[i] != 0.0f;
      }
      opt.set_last_backward(false);
      opt.reduce_grads();
      c.all_reduce(&loss, 1, DType::F64);
      const double norm = opt.grad_norm();
      if (step == 1) {  // the reduced gradient, whole: the shards gathered (ZeRO 0: the buffer itself)
        std::vector<float> whole(P);
        if (s.zero == 0) {
          std::memcpy(whole.data(), model->grad_data(), P * sizeof(float));
        } else {
          const size_t b = opt.state_begin();
          c.all_gather(model->grad_data() + b, whole.data(), opt.shards().sizes(), DType::F32);
        }
        if (c.rank() == 0) out.reduced = whole;
      }
      opt.step(1e-2, step, optim::clip_coefficient(norm, 1.0));
      if (c.rank() == 0) out.losses.push_back(loss), out.norms.push_back(norm);
    }
    if (opt.gathers() && c.rank() == 0) {
      out.released = opt.param_gather()->released_bytes();
      // rank 0's weight shard is the front (hybrid: its replicas' gradient shards): look behind it
      const int per = s.shard_group ? s.dp / s.shard_group : 1;
      const size_t se = opt.shards().end(per - 1);
      for (size_t i = se + 4096; i < P && !out.zeros_outside; ++i) out.zeros_outside = model->param_data()[i] == 0.0f;
    }
    opt.gather_whole();
    if (c.rank() == 0) out.weights.assign(model->param_data(), model->param_data() + P);
  });
  return out;
}

void expect_identical(const TrainRun& a, const TrainRun& b, const std::string& what) {
  ASSERT_EQ(a.losses.size(), b.losses.size());
  for (size_t i = 0; i < a.losses.size(); ++i) {
    EXPECT_EQ(a.losses[i], b.losses[i]) << what << ": loss of step " << i + 1;
    EXPECT_EQ(a.norms[i], b.norms[i]) << what << ": grad norm of step " << i + 1;
  }
  ASSERT_EQ(a.weights.size(), b.weights.size());
  EXPECT_EQ(0, std::memcmp(a.weights.data(), b.weights.data(), a.weights.size() * sizeof(float)))
      << what << ": weights differ";
}

struct ModelCase {
  const char* preset;
  int dp;
  const char* optimizer;
  int prefetch;
  int shard_group = 0;  // hybrid sharding (0: all data ranks)
};

class Zero3Models : public ::testing::TestWithParam<ModelCase> {};

TEST_P(Zero3Models, BitIdenticalToZero0) {
  const ModelCase mc = GetParam();
  TrainSetup s{mc.preset, mc.dp, 0, mc.prefetch, 1, 3, mc.optimizer};
  s.shard_group = mc.shard_group;
  const TrainRun ref = train(s);
  s.zero = 3;
  const TrainRun z3 = train(s);
  expect_identical(ref, z3,
                   fmt::format("{} dp {} {} prefetch {} shard group {}", mc.preset, mc.dp, mc.optimizer, mc.prefetch,
                               mc.shard_group));
  EXPECT_GT(z3.released, 0u) << "no weight page was handed back";
  EXPECT_TRUE(z3.zeros_outside) << "the weights outside rank 0's shard stayed resident after the pass";
}

INSTANTIATE_TEST_SUITE_P(Layouts, Zero3Models,
                         ::testing::Values(ModelCase{"gpt2-debug", 2, "adamw", 1}, ModelCase{"gpt2-debug", 3, "lamb", 1},
                                           ModelCase{"llama-debug", 2, "lamb", 0},
                                           ModelCase{"llama-debug", 3, "adamw", 2},
                                           ModelCase{"gpt2-debug", 2, "adamw", 0},
                                           ModelCase{"gpt2-debug", 2, "adamw", 2},
                                           // hybrid sharding: weights over 2 ranks, gradients/moments over 4
                                           ModelCase{"gpt2-debug", 4, "adamw", 1, 2},
                                           ModelCase{"llama-debug", 4, "lamb", 2, 2},
                                           ModelCase{"llama-debug", 6, "adamw", 1, 3}),
                         [](const ::testing::TestParamInfo<ModelCase>& i) {
                           return fmt::format("{}_dp{}_{}_prefetch{}{}", std::string(i.param.preset).substr(0, 4),
                                              i.param.dp, i.param.optimizer, i.param.prefetch,
                                              i.param.shard_group ? fmt::format("_shard{}", i.param.shard_group) : "");
                         });

// Full recompute re-runs a layer's forward inside its backward: on the weights gathered for the backward.
TEST(Zero3Recompute, FullRecomputeBitIdenticalToZero0) {
  for (const char* preset : {"gpt2-debug", "llama-debug"}) {
    TrainSetup s{preset, 2, 0, 1, 1, 3, "adamw"};
    s.recompute = Recompute::Full;
    const TrainRun ref = train(s);
    s.zero = 3;
    expect_identical(ref, train(s), fmt::format("{} recompute full", preset));
  }
}

// With grad accumulation ZeRO 3 reduce-scatters each micro-batch (no rank keeps a whole gradient
// buffer across micro-batches): sum over ranks, then over micro-batches, where ZeRO 0 sums each
// rank's micro-batches first. The reduced gradients of the first step differ only by that
// reassociation of the K = N x M fp32 terms g[r][m]: recursive summation of K terms errs by at most
// (K - 1) u sum|g| (u = 2^-24), so two orders differ by at most 2 (K - 1) u sum|g| per element
// (sum|g| measured: each micro-batch's gradient computed alone on a copy of the model).
TEST(Zero3Accumulation, PerMicroBatchReductionWithinFp32RoundingOfZero0) {
  for (int dp : {2, 3}) {
    TrainSetup s{"gpt2-debug", dp, 0, 1, 3, 2, "adamw", true};
    const TrainRun ref = train(s);
    s.zero = 3;
    const TrainRun z3 = train(s);
    ASSERT_EQ(ref.reduced.size(), z3.reduced.size());
    ASSERT_EQ(ref.abs_sum.size(), z3.reduced.size());
    const double K = dp * s.accum, u = std::ldexp(1.0, -24);
    size_t differ = 0;
    for (size_t i = 0; i < ref.reduced.size(); ++i) {
      const double a = ref.reduced[i], b = z3.reduced[i];
      differ += a != b;
      ASSERT_LE(std::fabs(a - b), 2 * (K - 1) * u * ref.abs_sum[i]) << "element " << i << " dp " << dp;
    }
    EXPECT_GT(differ, 0u) << "the orders should differ somewhere (else this test proves nothing)";
    EXPECT_EQ(z3.grads_kept, 0u) << "gradients outside the shard kept across micro-batches";
    EXPECT_GT(ref.grads_kept, 0u);  // ZeRO 0 accumulates the whole buffer
    EXPECT_EQ(ref.losses[0], z3.losses[0]);  // the first step's forward reads the same weights
    for (size_t i = 1; i < ref.losses.size(); ++i)
      EXPECT_NEAR(ref.losses[i], z3.losses[i], 1e-4 * std::fabs(ref.losses[i])) << "step " << i + 1;
  }
}

// bf16/fp16 compute (ParamGather::ComputeCopy): when a block's gather is waited for, its compute
// copy is converted from the gathered fp32 weights, so every block runs on the rounding of exactly
// the owners' values; the copy's pages outside the shard are handed back with the weights'.
TEST(ParamGather, ComputeCopyConvertedPerGatheredBlockAndReleased) {
  for (int prefetch : {0, 1, 2}) {
    dist::run_threads(2, [&](dist::Communicator& c) {
      const auto blocks = toy_blocks();
      const size_t P = 40000;
      Pages buf(P);
      auto* copy = static_cast<uint16_t*>(std::aligned_alloc(4096, (P * 2 + 4095) / 4096 * 4096));
      parallel::FlatShards shards(P, c.size(), 1024);
      for (size_t i = 0; i < P; ++i) {
        const bool mine = i >= shards.begin(c.rank()) && i < shards.end(c.rank());
        buf.p[i] = mine ? value_of(i) : -7.0f;
        copy[i] = mine ? fp32_to_bf16(value_of(i)) : 0x7fc0;  // garbage outside the shard
      }
      ParamGather g(c, buf.p, shards, blocks, prefetch);
      size_t converted = 0;
      g.set_compute_copy({copy, 2, [&](size_t b, size_t e) {
                            for (size_t i = b; i < e; ++i) copy[i] = fp32_to_bf16(buf.p[i]);
                            converted += e - b;
                          }, DType::F32, {}});
      for (int64_t b = 0; b < 4; ++b) {
        g.before_block(b, false);
        for (const auto& [lo, hi] : blocks[static_cast<size_t>(b)])
          for (size_t i = lo; i < hi; ++i)
            ASSERT_EQ(copy[i], fp32_to_bf16(value_of(i))) << "block " << b << " element " << i << " pf " << prefetch;
      }
      for (int64_t b = 2; b >= 0; --b) g.before_block(b, true);
      g.end_pass();
      EXPECT_GE(converted, P);  // every block, each time it was gathered
      // Pages outside the shard went back: the copy reads zeros there (but at the edges).
      size_t zeros = 0;
      for (size_t i = 0; i < P; ++i) zeros += copy[i] == 0;
      EXPECT_GT(zeros, P / 4) << "rank " << c.rank() << " pf " << prefetch;
      EXPECT_GT(g.released_bytes(), 0u);
      std::free(copy);
    });
  }
}

// Gathers in the compute dtype (FSDP2's mixed precision): the compute-only ranges move as bf16
// from the owners' copies (the rounding of their fp32 shard), the rest as fp32 and converted. The
// copy reads the same bits as after an fp32 gather, the fp32 masters of the bf16 ranges outside the
// shard are not gathered, and the bytes received are about half (exactly: 4 per fp32 element, 2 per
// bf16 element of the other rank's part).
TEST(ParamGather, ComputeDtypeGathersMoveHalfTheBytesForTheSameBits) {
  for (int prefetch : {0, 2}) {
    size_t bytes[2] = {0, 0};
    for (int low : {0, 1}) {
      dist::run_threads(2, [&](dist::Communicator& c) {
        const auto blocks = toy_blocks();
        const size_t P = 40000;
        Pages buf(P);
        auto* copy = static_cast<uint16_t*>(std::aligned_alloc(4096, (P * 2 + 4095) / 4096 * 4096));
        parallel::FlatShards shards(P, c.size(), 1024);
        const size_t b0 = shards.begin(c.rank()), e0 = shards.end(c.rank());
        for (size_t i = 0; i < P; ++i) {
          const bool mine = i >= b0 && i < e0;
          buf.p[i] = mine ? value_of(i) : -7.0f;
          copy[i] = mine ? fp32_to_bf16(value_of(i)) : 0x7fc0;
        }
        ParamGather g(c, buf.p, shards, blocks, prefetch);
        // "Norms" stay fp32: [8000, 9000) of the embedding block, [30000, 30500) of the head, and two
        // of layer 2's ([20400, 20600) across the shards' edge): one range or several, packed.
        const ParamGather::Ranges gemm = {{0, 8000}, {9000, 20400}, {20600, 25000}, {25100, 30000}, {30500, 40000}};
        size_t converted = 0;
        ParamGather::ComputeCopy cc{copy, 2, [&](size_t b, size_t e) {
                                      for (size_t i = b; i < e; ++i) copy[i] = fp32_to_bf16(buf.p[i]);
                                      converted += e - b;
                                    }, DType::F32, {}};
        if (low) {
          cc.dtype = DType::BF16;
          cc.compute_only.assign(blocks.size(), gemm);
        }
        g.set_compute_copy(std::move(cc));
        auto check_block = [&](int64_t b) {
          for (const auto& [lo, hi] : blocks[static_cast<size_t>(b)])
            for (size_t i = lo; i < hi; ++i) {
              ASSERT_EQ(copy[i], fp32_to_bf16(value_of(i))) << "block " << b << " element " << i;
              const bool norm = (i >= 8000 && i < 9000) || (i >= 30000 && i < 30500) || (i >= 20400 && i < 20600) ||
                                (i >= 25000 && i < 25100);
              if (norm || !low) {
                ASSERT_EQ(buf.p[i], value_of(i)) << "block " << b << " fp32 element " << i;
              }
              if (low && !norm && (i < b0 || i >= e0)) {  // the fp32 master outside the shard: not moved
                ASSERT_NE(buf.p[i], value_of(i)) << "gathered as fp32: " << i;
              }
            }
        };
        for (int64_t b = 0; b < 4; ++b) {
          g.before_block(b, false);
          check_block(b);
        }
        for (int64_t b = 2; b >= 0; --b) {
          g.before_block(b, true);
          check_block(b);
        }
        g.end_pass();
        if (low) {
          EXPECT_EQ(converted, size_t{3100});  // only the fp32 "norms" converted (5 visits)
        }
        EXPECT_EQ(shards.begin(1), size_t{20480});     // the packed pair straddles the edge
        if (c.rank() == 0) bytes[low] = g.gathered_bytes();
        std::free(copy);
      });
    }
    EXPECT_GT(bytes[0], 0u);
    const double ratio = static_cast<double>(bytes[1]) / static_cast<double>(bytes[0]);
    EXPECT_GT(ratio, 0.5) << "prefetch " << prefetch;
    EXPECT_LT(ratio, 0.55) << "prefetch " << prefetch << ": bf16 gathers move about half the bytes";
  }
}

// Shard-only startup (train/session.cpp): init_weights(seed, begin, end) gives exactly the values
// the whole init gives [begin, end) (each tensor's stream advanced past the elements before the
// range), writes nothing outside it, and a model built with touch_parameters false reads zeros.
TEST(Zero3Init, ShardInitIsTheWholeInitsRange) {
  for (const char* preset : {"gpt2-debug", "llama-debug"}) {
    auto whole = build_model(ModelConfig::preset(preset));
    whole->init_weights(11);
    const size_t P = whole->num_params();
    for (int ranks : {2, 3, 5}) {
      for (int r = 0; r < ranks; ++r) {
        const auto [b, e] = parallel::DistOptimizer::weight_shard_of(P, r, ranks, 0);
        ComputeSpec spec;
        spec.touch_parameters = false;
        auto part = build_model(ModelConfig::preset(preset), spec);
        part->init_weights(11, b, e);
        const float* w = whole->param_data();
        const float* p = part->param_data();
        size_t bad = 0, outside = 0;
        for (size_t i = 0; i < P; ++i) {
          if (i >= b && i < e)
            bad += std::memcmp(&w[i], &p[i], sizeof(float)) != 0;
          else
            outside += p[i] != 0.0f;
        }
        EXPECT_EQ(bad, 0u) << preset << " rank " << r << " of " << ranks << " [" << b << ", " << e << ")";
        EXPECT_EQ(outside, 0u) << preset << " rank " << r << " of " << ranks;
      }
    }
    // An odd range straddling tensors, inside a tensor, and empty.
    for (auto [b, e] : {std::pair<size_t, size_t>{7, P - 5}, {P / 3 + 1, P / 3 + 2}, {5, 5}}) {
      auto part = build_model(ModelConfig::preset(preset));
      part->init_weights(11, b, e);
      EXPECT_EQ(std::memcmp(whole->param_data() + b, part->param_data() + b, (e - b) * sizeof(float)), 0)
          << preset << " [" << b << ", " << e << ")";
    }
  }
}

}  // namespace
