// `lathe plan` with context parallelism (issue 27; parallel/plan.h): a context-c layout's memory per
// rank is what preflight (lathe check --world) counts for it (activations of T / c rows with RoPE
// tables of T positions, ZeRO moments over data x context) plus ContextAttention's buffers; its
// compute per rank falls by c; the ring's and the all-gather's K/V bytes per layer are the hand-
// computed ones; data x context share the gradient reduction; enumerate lists the context degrees;
// what runs refuse with context is rejected with the reason.
#include <gtest/gtest.h>

#include <algorithm>

#include "models/memory.h"
#include "models/tensor_shard.h"
#include "parallel/plan.h"

using namespace lathe;
using plan::Estimate;
using plan::Job;
using plan::Layout;
using plan::Machine;

namespace {

Job job_of(const char* preset, int64_t world, int64_t B, int64_t T, int64_t G, DType dt = DType::F32) {
  Job j;
  j.model = ModelConfig::preset(preset);
  j.model.max_position_embeddings = std::max<int64_t>(j.model.max_position_embeddings, T);
  j.world = world;
  j.micro_batch = B;
  j.seq_len = T;
  j.global_batch = G;
  j.compute = dt;
  return j;
}

Machine machine() {
  Machine m;
  m.peak_gflops = 1;
  m.inter_gbps = m.intra_gbps = 8;  // 1e9 bytes/s
  m.gpus_per_node = 1 << 20;
  return m;
}

Layout ctx(int64_t d, int64_t c, int zero = 0, Recompute rc = Recompute::None, int64_t t = 1) {
  Layout l;
  l.data = d;
  l.tensor = t;
  l.context = c;
  l.zero = zero;
  l.recompute = rc;
  return l;
}

// One rank's K|V rows of a micro-batch in fp32: B x T / c x 2 KVH x D x 4 bytes.
int64_t kv_bytes(const Job& j, int64_t c, int64_t t = 1) {
  return j.micro_batch * (j.seq_len / c) * 2 * (j.model.num_key_value_heads / t) * j.model.head_dim() * 4;
}

}  // namespace

TEST(PlanContext, MemoryIsLatheChecksPlusTheRingBuffers) {
  for (const char* preset : {"llama-debug", "gpt2-debug"})
    for (DType dt : {DType::F32, DType::BF16})
      for (Recompute rc : {Recompute::None, Recompute::Full})
        for (int zero : {0, 1}) {
          const int64_t d = 2, c = 2, B = 3, T = 64;
          Job j = job_of(preset, d * c, B, T, 12, dt);
          for (bool ag : {false, true}) {
            j.context_allgather = ag;
            const Estimate e = plan::estimate(j, machine(), ctx(d, c, zero, rc));
            ASSERT_TRUE(e.reject.empty()) << e.reject;
            // preflight.cpp check_rank_memory: T / c rows, RoPE tables of T, ZeRO over data x context.
            TensorShard sh;
            sh.context_T = T;
            const MemoryEstimate ref = estimate_memory(j.model, B, T / c, 2, zero > 0 ? d * c : 1, dt, rc, sh);
            EXPECT_EQ(e.memory.params, ref.param_bytes) << preset;
            EXPECT_EQ(e.memory.moments, ref.optimizer_bytes);
            EXPECT_EQ(e.memory.activations, ref.activation_bytes) << preset << " " << recompute_name(rc);
            // comm: the gradient bucket's staging (the whole small gradient buffer) + the context buffers
            const int64_t H = j.model.num_attention_heads, KVH = j.model.num_key_value_heads, D = j.model.head_dim();
            const int64_t rows = B * T / c, kv = kv_bytes(j, c);
            int64_t buffers = (ag ? 2 * c * kv : 5 * kv) + rows * H * (D + 1) * 4;
            if (dt != DType::F32) buffers += 2 * rows * (H + 2 * KVH) * D * 4 + 2 * rows * H * D * 4;
            EXPECT_EQ(e.memory.comm, ref.grad_bytes + buffers) << preset << (ag ? " allgather" : " ring");
            EXPECT_EQ(e.micro_batches, 2);  // 12 samples / (3 x data 2): context ranks share samples
          }
        }
}

TEST(PlanContext, ActivationsAndComputeFallWithTheContextDegree) {
  const int64_t T = 512;
  int64_t act1 = 0;
  double compute1 = 0;
  for (int64_t c : {1, 2, 4}) {
    const Job j = job_of("llama-debug", c, 1, T, 4);
    const Estimate e = plan::estimate(j, machine(), ctx(1, c));
    ASSERT_TRUE(e.reject.empty()) << e.reject;
    if (c == 1) {
      act1 = e.memory.activations;
      compute1 = e.compute_s;
      EXPECT_EQ(e.cp_s, 0.0);
      EXPECT_EQ(e.cp_bytes_fwd, 0);
      continue;
    }
    // The rows' buffers fall by c; the RoPE tables of T positions and the head's scratch do not.
    EXPECT_LT(e.memory.activations, act1 * 0.75 / (c / 2)) << c;
    EXPECT_GT(e.memory.activations, act1 / c) << c;
    EXPECT_NEAR(e.compute_s, compute1 / c, 1e-9 * compute1) << c;
    EXPECT_GT(e.cp_s, 0.0);
  }
}

TEST(PlanContext, RingAndAllGatherBytesPerLayer) {
  for (int64_t c : {2, 4})
    for (int64_t t : {1, 2}) {
      Job j = job_of("llama-debug", 2 * c * t, 2, 64, 4);
      const int64_t kv = kv_bytes(j, c, t);
      Layout l = ctx(2, c, 0, Recompute::None, t);
      const Estimate ring = plan::estimate(j, machine(), l);
      ASSERT_TRUE(ring.reject.empty()) << ring.reject;
      EXPECT_EQ(ring.cp_bytes_fwd, (c - 1) * kv);           // K/V passed on c - 1 times
      EXPECT_EQ(ring.cp_bytes_bwd, (c - 1) * kv + c * kv);  // again, and dK/dV c hops home
      j.context_allgather = true;
      const Estimate ag = plan::estimate(j, machine(), l);
      EXPECT_EQ(ag.cp_bytes_fwd, (c - 1) * kv);      // all-gather
      EXPECT_EQ(ag.cp_bytes_bwd, 2 * (c - 1) * kv);  // all-gather + reduce-scatter
      // The all-gather hides nothing: (c - 1) x kv / (1e9 bytes/s) per layer forward, twice backward,
      // for 2 layers and 1 micro-batch (global 4 / (micro 2 x data 2)).
      ASSERT_EQ(ag.micro_batches, 1);
      const double hop = static_cast<double>(kv) / 1e9;
      EXPECT_NEAR(ag.cp_s, 2.0 * 3 * (c - 1) * hop, 1e-12) << c;
      EXPECT_LE(ring.cp_s, 2.0 * (3 * (c - 1) + c) * hop + 1e-12);
      EXPECT_GE(ring.cp_s, 2.0 * c * hop - 1e-12);  // the dK/dV hops are never hidden
    }
}

TEST(PlanContext, GradientsReducedOverDataTimesContext) {
  const Job j = job_of("llama-debug", 4, 1, 64, 4);
  const Estimate dc = plan::estimate(j, machine(), ctx(2, 2));
  const Estimate d4 = plan::estimate(j, machine(), ctx(4, 1));
  ASSERT_TRUE(dc.reject.empty() && d4.reject.empty());
  EXPECT_DOUBLE_EQ(dc.dp_s, d4.dp_s);  // the same 4-rank ring of the same gradient bytes
  const Estimate c4 = plan::estimate(j, machine(), ctx(1, 4, 1));
  const Estimate d4z = plan::estimate(j, machine(), ctx(4, 1, 1));
  EXPECT_EQ(c4.memory.moments, d4z.memory.moments);  // ZeRO 1 shards over data x context
}

TEST(PlanContext, RefusedLayoutsNamed) {
  const Job j = job_of("llama-debug", 4, 1, 60, 4);
  EXPECT_EQ(plan::estimate(j, machine(), ctx(1, 4)).reject,
            "context 4 does not split seq_len 60 into 2 x 4 equal chunks");
  const Job k = job_of("llama-debug", 4, 1, 64, 4);
  EXPECT_EQ(plan::estimate(k, machine(), ctx(2, 2, 3)).reject,
            "ZeRO 3 with context 2: runs refuse it (parallel.zero <= 2)");
  Job r = k;
  r.model.rope_scaling.type = "dynamic";
  r.model.rope_scaling.factor = 2.0;
  EXPECT_EQ(plan::estimate(r, machine(), ctx(2, 2)).reject, "");  // chosen from the whole sequence
  // sequence parallel splits the rank's rows: micro_batch_size x seq_len / context over tensor
  Layout sp = ctx(1, 2, 0, Recompute::None, 4);
  sp.sequence = true;
  const Job g8 = job_of("gpt2-debug", 8, 1, 4, 4);  // 4 heads; 1 x 4 / 2 = 2 rows over tensor 4
  EXPECT_EQ(plan::estimate(g8, machine(), sp).reject,
            "sequence parallel: tensor 4 does not divide micro_batch_size 1 x seq_len / context 2 = 2 rows");
  const Job g8b = job_of("gpt2-debug", 8, 2, 8, 4);  // 2 x 8 / 2 = 8 rows: fine
  EXPECT_EQ(plan::estimate(g8b, machine(), sp).reject, "");
}

TEST(PlanContext, EnumerateListsContextDegrees) {
  const Job j = job_of("llama-debug", 4, 1, 64, 8);
  const std::vector<Estimate> all = plan::enumerate(j, machine());
  int64_t seen[5] = {};
  for (const Estimate& e : all) {
    EXPECT_EQ(e.layout.data * e.layout.tensor * e.layout.pipeline * e.layout.context, 4);
    if (e.reject.empty()) ++seen[e.layout.context];
    if (e.layout.context > 1) {
      EXPECT_NE(e.layout.zero, 3);
      EXPECT_NE(e.layout.name().find(" x context "), std::string::npos);
    }
  }
  EXPECT_GT(seen[1], 0);
  EXPECT_GT(seen[2], 0);
  EXPECT_GT(seen[4], 0);
  // ZeRO 1/2 with data 1 x context 2 (the moments shard over the context ranks): listed.
  EXPECT_TRUE(std::any_of(all.begin(), all.end(), [](const Estimate& e) {
    return e.layout.context == 4 && e.layout.data == 1 && e.layout.zero == 1 && e.reject.empty();
  }));
}
