// `lathe plan`'s model (parallel/plan.h): with tensor = pipeline = 1 it is exactly the memory
// estimate `lathe check --world N` prints (models/memory.h); a small case computed by hand (per-
// stage parameters, activations with micro-batches in flight, the 1F1B step time and the ring
// collectives); invalid layouts excluded with the reason; the orderings the knobs must produce.
#include <gtest/gtest.h>

#include "../models/model_fixtures.h"
#include "models/memory.h"
#include "models/model.h"
#include "parallel/plan.h"
#include "parallel/tensor_parallel.h"

using namespace lathe;
using plan::Estimate;
using plan::Job;
using plan::Layout;
using plan::Machine;

namespace {

Job job_of(const std::string& preset, int64_t world, int64_t B, int64_t T, int64_t G, DType dt = DType::F32) {
  Job j;
  // "mistral-head-dim": an explicit head_dim (q/o 4 x 32 wide, hidden 96; tests/models/model_fixtures.h)
  j.model = preset == "mistral-head-dim" ? model_test::mistral_head_dim_config()
            : preset == "gpt-neox-h2"    ? ModelConfig::preset("gpt-neox-debug")
            : preset == "olmo2-v98"      ? ModelConfig::preset("olmo2-debug")
                                         : ModelConfig::preset(preset);
  // "gpt-neox-h2": gpt-neox-debug with 2 heads of 24 and vocabulary 102 (tp=2 divides them)
  if (preset == "gpt-neox-h2") {
    j.model.num_attention_heads = j.model.num_key_value_heads = 2;
    j.model.vocab_size = 102;
  }
  // "olmo2-v98": olmo2-debug with vocabulary 98 (tp=2 splits it evenly)
  if (preset == "olmo2-v98") j.model.vocab_size = 98;
  j.world = world;
  j.micro_batch = B;
  j.seq_len = T;
  j.global_batch = G;
  j.compute = dt;
  return j;
}

Machine machine(double peak_gflops = 1, double gbps = 8e9) {
  Machine m;
  m.peak_gflops = peak_gflops;
  m.inter_gbps = m.intra_gbps = gbps;
  m.gpus_per_node = 1 << 20;
  return m;
}

}  // namespace

TEST(Plan, DataParallelMemoryIsLatheChecks) {
  for (const char* preset : {"gpt2-debug", "llama-debug", "qwen2-debug", "qwen3-debug", "olmo2-debug"})
    for (DType dt : {DType::F32, DType::BF16})
      for (Recompute rc : {Recompute::None, Recompute::Selective, Recompute::Full})
        for (int zero : {0, 1, 2}) {
          const int64_t d = 4;
          const Job j = job_of(preset, d, 3, 40, 24, dt);
          const Estimate e = plan::estimate(j, machine(), Layout{d, 1, 1, false, zero, rc});
          ASSERT_TRUE(e.reject.empty()) << e.reject;
          // What preflight (lathe check --world 4) computes: ZeRO divides the moments by data.
          const MemoryEstimate ref = estimate_memory(j.model, 3, 40, 2, zero > 0 ? d : 1, dt, rc);
          EXPECT_EQ(e.memory.params, ref.param_bytes) << preset;
          EXPECT_EQ(e.memory.grads, ref.grad_bytes);
          EXPECT_EQ(e.memory.moments, ref.optimizer_bytes);
          EXPECT_EQ(e.memory.compute_weights, ref.compute_weight_bytes);
          EXPECT_EQ(e.memory.activations, ref.activation_bytes) << preset << " " << recompute_name(rc);
          // The gradient bucket's reduction staging: the whole (small) gradient buffer here.
          EXPECT_EQ(e.memory.comm, ref.grad_bytes);
          EXPECT_EQ(e.memory.total(), ref.total_bytes() + ref.grad_bytes);
          EXPECT_EQ(e.micro_batches, 2);  // 24 samples / (3 x 4)
        }
}

// ZeRO 3 (parallel/param_gather.h): the plan's weights and gradients per rank are what preflight
// (lathe check --world) computes: the 1/d shard plus the gathered blocks (prefetch 1).
TEST(Plan, Zero3MemoryIsLatheChecks) {
  for (const char* preset : {"gpt2-debug", "llama-debug"}) {
    const int64_t d = 4;
    const Job j = job_of(preset, d, 3, 40, 24);
    const Estimate e = plan::estimate(j, machine(), Layout{d, 1, 1, false, 3, Recompute::None});
    ASSERT_TRUE(e.reject.empty()) << e.reject;
    MemoryEstimate ref = estimate_memory(j.model, 3, 40, 2, d, DType::F32, Recompute::None);
    const int64_t whole = ref.param_bytes;
    shard_parameters(ref, j.model, d, 1, 0, (int64_t{25} << 20) / 4);
    EXPECT_EQ(e.memory.params, ref.param_bytes) << preset;
    EXPECT_EQ(e.memory.grads, ref.grad_bytes) << preset;
    EXPECT_EQ(ref.param_bytes, (whole / 4 + d - 1) / d * 4 + ref.gather_bytes);
    EXPECT_NE(ref.breakdown().find("1/4 shard"), std::string::npos) << ref.breakdown();
    // ZeRO 3 x pipeline: a stage's weights sharded over its data group, its gradients whole through
    // the step (reduced once after the schedule) as at ZeRO 1.
    const Estimate pp = plan::estimate(j, machine(), Layout{2, 1, 2, false, 3, Recompute::None});
    const Estimate pp1 = plan::estimate(j, machine(), Layout{2, 1, 2, false, 1, Recompute::None});
    ASSERT_TRUE(pp.reject.empty()) << pp.reject;
    EXPECT_EQ(pp.memory.grads, pp1.memory.grads) << preset;
    EXPECT_NE(pp.memory.params, pp1.memory.params) << preset;
  }
}

// bf16/fp16 under ZeRO 3: the compute copy is sharded with the weights (the shard's plus the
// gathered blocks', converted per block), in the plan as in lathe check.
TEST(Plan, Zero3Bf16ComputeCopyIsSharded) {
  for (DType dt : {DType::BF16, DType::F16}) {
    const int64_t d = 4;
    Job j = job_of("llama-debug", d, 3, 40, 24, dt);
    j.model.num_hidden_layers = 16;  // the layers outweigh the embedding and head, as in a real model
    const Estimate e = plan::estimate(j, machine(), Layout{d, 1, 1, false, 3, Recompute::None});
    ASSERT_TRUE(e.reject.empty()) << e.reject;
    MemoryEstimate ref = estimate_memory(j.model, 3, 40, 2, d, dt, Recompute::None);
    const int64_t whole_copy = ref.compute_weight_bytes;
    ASSERT_EQ(whole_copy, ref.num_params * 2);
    shard_parameters(ref, j.model, d, 1, 0, (int64_t{25} << 20) / 4);
    EXPECT_EQ(e.memory.compute_weights, ref.compute_weight_bytes);
    EXPECT_EQ(e.memory.params, ref.param_bytes);
    // 2 bytes per element of exactly the fp32 figure's elements (shard + gathered window).
    EXPECT_EQ(ref.compute_weight_bytes * 2, ref.param_bytes);
    EXPECT_LT(ref.compute_weight_bytes, whole_copy);
  }
}

TEST(Plan, HandComputedTwoByTwo) {
  // gpt2-debug: L=2, C=48, H=4, V=96, 128 positions, tied; B=2, T=16, 8 samples -> m = 4.
  const Job j = job_of("gpt2-debug", 4, 2, 16, 8);
  const Estimate e = plan::estimate(j, machine(1, 8), Layout{1, 2, 2, false, 0, Recompute::None});
  ASSERT_TRUE(e.reject.empty()) << e.reject;
  EXPECT_EQ(e.micro_batches, 4);
  EXPECT_EQ(e.stage_layers, (std::vector<int64_t>{1, 1}));
  // A layer: 12 C^2 + 13 C = 28272 parameters; replicated over tensor ranks: 2 LayerNorms (4C) and
  // the biases of the two row-parallel projections (2C) = 288; the rest halves: 13992 + 288.
  // Stage 0: a layer + wte / 2 (2304) + wpe (6144) = 22728; stage 1: a layer + ln_f (96) + the
  // tied head's half (2304) = 16680. Stage 0 holds 2 micro-batches (1F1B: p - 0), stage 1 one.
  EXPECT_EQ(e.memory.stage, 0);
  EXPECT_EQ(e.memory.in_flight, 2);
  EXPECT_EQ(e.memory.params, 22728 * 4);
  EXPECT_EQ(e.memory.grads, 22728 * 4);
  EXPECT_EQ(e.memory.moments, 2 * 22728 * 4);
  // Activations of stage 0 (N = 32 rows, fp32): per micro-batch the layer keeps ln1, res1, ln2,
  // res2 (32 x 48 floats = 6144 B each, whole without sequence parallel) and 4 row statistics
  // (128 B each) = 25088 B, and qkv (18432), att (6144), lse (512), fc (24576), act (24576) halved
  // = 37120 B; its input (emb, 6144 B), the residual-stream gradient (dres, 6144 B) and the RoPE
  // tables (2 x 384 B) too, kept per slot: (62208 + 6144 + 6144 + 768) x 2 in flight. Once (the
  // slots share them): the gradient buffers dln (6144), dqkv, datt, dfc, dact halved (9216 + 3072
  // + 12288 + 12288), the head's lnf (6144), its two row statistics and the losses (128 B each),
  // and the kernels' scratch (from the plan: backend-dependent; the head's logits chunk holds the
  // rank's V / 2 columns, vocab parallel).
  ModelConfig rank_vocab = j.model;
  rank_vocab.vocab_size /= 2;
  const ActivationPlan ap = Model::plan_activations(rank_vocab, 2, 16);
  int64_t scratch = 0;
  for (size_t i = 0; i < ap.entries.size(); ++i)
    if (std::string_view(ap.entries[i].name) == "scratch")
      scratch = static_cast<int64_t>(ap.entries[i + 1].offset - ap.entries[i].offset);
  EXPECT_EQ(e.memory.activations,
            (62208 + 6144 + 6144 + 768) * 2 + 6144 + 9216 + 3072 + 12288 + 12288 + 6144 + 3 * 128 + scratch);
  // The copies of an activation and a gradient in flight, and the larger of the host reductions'
  // staging: a tensor all-reduce of one activation (6144 B) or the tied wte's gradient half
  // (4 x 2304 B) summed between the first and last stage.
  EXPECT_EQ(e.memory.comm, 2 * 6144 + 4 * 2304);

  // Time at 1 GFLOP/s. Per token a layer costs 6 x 28272 + 12 C T = 178848 FLOP; the rest of the
  // model (head, 6 x (wte + ln_f)) 28224. Forward = 1/3, over 32 tokens, / 2 tensor ranks:
  // stage 0 f0 = 953856 ns, stage 1 f1 = (178848 + 28224) / 3 x 16 = 1104384 ns, backward twice.
  // Collectives at 8 Gbit/s = 1 GB/s: a tensor all-reduce of 6144 B (2 x 1/2 x 6144 B) = 6144 ns,
  // 2 per layer forward, 2 backward, and one more for the vocab-parallel embedding (stage 0's
  // forward) and the head's input gradient (stage 1's backward); a pipeline message 6144 ns.
  const double ar = 6144e-9, f0 = 953856e-9 + 3 * ar, f1 = 1104384e-9 + 2 * ar;
  const double b0 = 2 * 953856e-9 + 2 * ar, b1 = 2 * 1104384e-9 + 3 * ar;
  const double msg = 6144e-9;
  // Stage 1 is the slower one and never waits after its first input: f0 + msg, then 4 x (f1 + b1)
  // (each of its gradients leaves at once, the next activation arrived long before), then the last
  // gradient's message and stage 0's last backward.
  EXPECT_NEAR(e.pipeline_s, f0 + msg + 4 * (f1 + b1) + msg + b0, 1e-12);
  EXPECT_NEAR(e.tp_s, 4 * 5 * ar, 1e-15);
  EXPECT_NEAR(e.pp_s, 2 * 4 * msg, 1e-15);
  EXPECT_EQ(e.dp_s, 0);
  EXPECT_NEAR(e.step_s, e.pipeline_s, 1e-15);
  EXPECT_NEAR(e.tokens_per_s, 8 * 16 / e.step_s, 1e-6);
  EXPECT_GT(e.bubble, 0);

  // Data parallel only: one ring all-reduce of the fp32 gradients, 2 x 1/2 x 4 x 67392 B at 1 GB/s.
  const Job j2 = job_of("gpt2-debug", 2, 2, 16, 8);
  const Estimate dp = plan::estimate(j2, machine(1, 8), Layout{2, 1, 1, false, 0, Recompute::None});
  EXPECT_EQ(j2.model.num_parameters(), 67392);
  EXPECT_NEAR(dp.dp_s, 4 * 67392e-9, 1e-15);
  EXPECT_NEAR(dp.pipeline_s, 2 * 3 * (178848 * 2 + 28224) / 3.0 * 32e-9, 1e-12);  // 2 micro-batches, no bubble
  EXPECT_EQ(dp.bubble, 0);
}

TEST(Plan, InvalidLayoutsExcludedWithTheReason) {
  // llama-debug: 4 heads, 2 KV heads, 2 layers, vocabulary 96, intermediate 96.
  Job j = job_of("llama-debug", 4, 1, 16, 8);
  const auto all = plan::enumerate(j, machine());
  // (t, p, d) triples of 4: (1,1,4) 12 layouts (ZeRO 0..3), (1,2,2) 12, (1,4,1) 3, (2,1,2) 24 (ZeRO 0..3,
  // with and without SP), (2,2,1) 6, (4,1,1) 6; with context c (ZeRO 0..2 over data x context):
  // (t, p, c, d) = (1,1,2,2) 9, (1,1,4,1) 9, (1,2,2,1) 9, (2,1,2,1) 18.
  EXPECT_EQ(all.size(), 108u);
  bool seen_kv = false, seen_layers = false, tail_invalid = false;
  for (const auto& e : all) {
    if (e.layout.tensor == 4) {
      EXPECT_EQ(e.reject, "tensor 4 does not divide num_key_value_heads 2");
      seen_kv = true;
    } else if (e.layout.pipeline == 4) {
      EXPECT_EQ(e.reject, "pipeline 4 does not divide num_hidden_layers 2");
      seen_layers = true;
    } else {
      EXPECT_EQ(e.reject, "") << e.layout.name();
      EXPECT_FALSE(tail_invalid) << "valid layouts come first";
    }
    if (!e.reject.empty()) tail_invalid = true;
  }
  EXPECT_TRUE(seen_kv && seen_layers);
  for (size_t i = 1; i < all.size() && all[i].reject.empty(); ++i)
    EXPECT_GE(all[i - 1].tokens_per_s, all[i].tokens_per_s);

  // Fewer micro-batches than stages; a global batch data does not divide; sequence parallel with
  // a sequence the tensor degree does not divide; a vocabulary smaller than the tensor degree (one it
  // does not divide is split in uneven shards, so accepted).
  j = job_of("gpt2-debug", 2, 4, 15, 4);
  EXPECT_EQ(plan::estimate(j, machine(), Layout{1, 1, 2, false, 0, Recompute::None}).reject,
            "1 micro-batches per step (global batch 4 / micro_batch_size 4 / data 1) is fewer than pipeline 2");
  EXPECT_EQ(
      plan::estimate(job_of("gpt2-debug", 2, 3, 16, 4), machine(), Layout{2, 1, 1, false, 0, Recompute::None}).reject,
      "global batch 4 is not a multiple of micro_batch_size 3 x data 2");
  EXPECT_EQ(plan::estimate(j, machine(), Layout{1, 2, 1, true, 0, Recompute::None}).reject,
            "sequence parallel: tensor 2 does not divide seq_len 15");
  Job odd = job_of("gpt2-debug", 2, 1, 16, 4);
  odd.model.vocab_size = 97;
  EXPECT_EQ(plan::estimate(odd, machine(), Layout{1, 2, 1, false, 0, Recompute::None}).reject, "");
  odd.model.vocab_size = 1;
  EXPECT_EQ(plan::estimate(odd, machine(), Layout{1, 2, 1, false, 0, Recompute::None}).reject,
            "tensor 2 is more than vocab_size 1 (vocab-parallel embedding and head)");
}

TEST(Plan, KnobsMoveTheFiguresTheRightWay) {
  Job j = job_of("gpt2-124m", 8, 4, 512, 64, DType::BF16);
  j.model.vocab_size = 50304;  // padded to a multiple of 64 as Megatron / nanoGPT do, so tensor 2 divides it
  const Machine m = machine(1000, 400);
  auto est = [&](Layout l) {
    Estimate e = plan::estimate(j, m, l);
    EXPECT_TRUE(e.reject.empty()) << e.reject;
    return e;
  };
  const Estimate tp = est({4, 2, 1, false, 0, Recompute::None}), tpsp = est({4, 2, 1, true, 0, Recompute::None});
  EXPECT_LT(tpsp.memory.activations, tp.memory.activations);
  EXPECT_NEAR(tpsp.tp_s, tp.tp_s, 1e-12);  // all-gather + reduce-scatter move the all-reduce's bytes
  const Estimate z0 = est({8, 1, 1, false, 0, Recompute::None}), z1 = est({8, 1, 1, false, 1, Recompute::None});
  EXPECT_EQ(z1.memory.moments * 8, z0.memory.moments);
  const Estimate full = est({8, 1, 1, false, 0, Recompute::Full});
  EXPECT_LT(full.memory.activations, z0.memory.activations);
  EXPECT_GT(full.step_s, z0.step_s);
  // Deeper pipelines hold less per rank in parameters, but their first stage holds p micro-batches.
  const Estimate pp = est({2, 1, 4, false, 0, Recompute::None});
  EXPECT_LT(pp.memory.params, z0.memory.params);
  EXPECT_EQ(pp.memory.in_flight, std::min<int64_t>(4, pp.micro_batches));
  // At least 1F1B's (p-1)/(m+p-1); more here: the last stage also runs the 50304 x 768 head, 2.6 layers' worth
  // of FLOPs, and the others wait for it.
  EXPECT_GT(pp.bubble, 3.0 / static_cast<double>(pp.micro_batches + 3));
  // A memory budget marks layouts that do not fit.
  Machine small = m;
  small.memory_bytes = z0.memory.total() - 1;
  EXPECT_FALSE(plan::estimate(j, small, {8, 1, 1, false, 0, Recompute::None}).fits);
  EXPECT_TRUE(plan::estimate(j, small, {8, 1, 1, false, 1, Recompute::None}).fits);
}

TEST(Plan, PipelineStageActivationsAreTheStageArena) {
  // The oracle: the arena a pipeline stage actually allocates (its layers' model, one slot per
  // micro-batch the schedule holds there, as PipelineExecutor does; the slots share the transient
  // buffers). 1F1B, no tensor parallelism: equal to the byte, for the heaviest stage and the last.
  for (const char* preset : {"gpt2-debug", "llama-debug"})
    for (int64_t p : {2, 3})
      for (Recompute rc : {Recompute::None, Recompute::Selective, Recompute::Full}) {
        Job j = job_of(preset, p, 2, 16, 8);
        j.model.num_hidden_layers = 6;
        const Estimate e = plan::estimate(j, machine(), Layout{1, 1, p, false, 0, rc});
        ASSERT_TRUE(e.reject.empty()) << e.reject;
        ModelConfig stage = j.model;
        stage.num_hidden_layers = e.stage_layers[static_cast<size_t>(e.memory.stage)];
        auto m = build_model(stage);
        m->allocate(2, 16, 0, rc, e.memory.in_flight);
        EXPECT_EQ(e.memory.stage, 0) << preset;  // the most micro-batches in flight
        EXPECT_EQ(e.memory.in_flight, p) << preset;
        EXPECT_EQ(e.memory.activations, static_cast<int64_t>(m->activation_bytes()))
            << preset << " p " << p << " " << recompute_name(rc);
        // A single slot (the last stage's) is the plain arena.
        m->allocate(2, 16, 0, rc, 1);
        EXPECT_EQ(static_cast<size_t>(m->activation_bytes()),
                  Model::plan_activations(stage, 2, 16, ComputeSpec{}, rc).bytes);
      }
}

TEST(Plan, InterleavedSchedule) {
  // gpt2-debug made 8 layers deep: pipeline 2 x 2 chunks of 2 layers; 4 micro-batches.
  Job j = job_of("gpt2-debug", 2, 2, 16, 8);
  j.model.num_hidden_layers = 8;
  const Machine m = machine(1, 8);
  const Estimate one = plan::estimate(j, m, Layout{1, 1, 2, false, 0, Recompute::None, 1});
  const Estimate two = plan::estimate(j, m, Layout{1, 1, 2, false, 0, Recompute::None, 2});
  ASSERT_TRUE(one.reject.empty() && two.reject.empty()) << one.reject << two.reject;
  EXPECT_EQ(two.stage_layers, (std::vector<int64_t>{2, 2, 2, 2}));
  // Megatron's warm-up on rank 0: (p - 1) x 2 + (v - 1) x p chunk-forwards, + 1 in the steady phase.
  EXPECT_EQ(two.memory.stage, 0);
  EXPECT_EQ(two.memory.in_flight, 5);
  EXPECT_EQ(one.memory.in_flight, 2);
  EXPECT_EQ(two.memory.params, one.memory.params);  // rank 0 holds 4 layers either way (0-3, or 0-1 and 4-5)
  EXPECT_LT(two.bubble, one.bubble);                // the point of interleaving
  EXPECT_NEAR(two.pp_s, 2 * one.pp_s, 1e-15);       // twice the messages
  // Activations: 5 chunk-micro-batches of 2 layers (+ their inputs) instead of 2 micro-batches of 4 layers.
  EXPECT_GT(two.memory.activations, one.memory.activations);
  j.global_batch = 6;  // 3 micro-batches: not a multiple of pipeline 2
  EXPECT_EQ(plan::estimate(j, m, Layout{1, 1, 2, false, 0, Recompute::None, 2}).reject,
            "interleaved schedule: 3 micro-batches per step is not a multiple of pipeline 2");
  j.model.num_hidden_layers = 6;
  j.global_batch = 8;
  EXPECT_EQ(plan::estimate(j, m, Layout{1, 1, 2, false, 0, Recompute::None, 2}).reject,
            "pipeline 2 x virtual stages 2 does not divide num_hidden_layers 6");
}

TEST(Plan, TensorParallelMatchesTheRankModel) {
  // The per-rank model the tensor-parallel code builds (parallel/tensor_parallel.h: heads, KV heads
  // and MLP width / tp) is an independent oracle for the plan's tensor split of a layer: the same
  // layer parameters exactly, and the same activation arena up to the 64-byte padding of each
  // buffer (the plan halves padded sizes, the rank model pads halved ones). Both split the
  // vocabulary tensors by rows (vocab parallel), so the parameter counts agree exactly.
  for (const char* preset :
       {"gpt2-debug", "llama-debug", "qwen2-debug", "mistral-head-dim", "qwen3-debug", "gpt-neox-h2", "olmo2-v98"})
    for (int64_t t : {2, 4}) {
      if (std::string(preset) != "gpt2-debug" && t == 4) continue;  // 2 KV heads
      const Job j = job_of(preset, t, 2, 32, 2);
      const Estimate e = plan::estimate(j, machine(), Layout{1, t, 1, false, 0, Recompute::None});
      ASSERT_TRUE(e.reject.empty()) << e.reject;
      const ModelConfig rank = parallel::shard_config(j.model, static_cast<int>(t));
      ModelConfig one = rank, two = rank;
      one.num_hidden_layers = 1;
      two.num_hidden_layers = 2;
      // Counted from the models' parameter tables (ModelConfig::num_parameters() counts GPT-2's
      // c_attn as C x 3C whatever the head count, which a shard config does not have).
      const auto n1 = static_cast<int64_t>(build_model(one)->num_params());
      const int64_t layer = static_cast<int64_t>(build_model(two)->num_params()) - n1;
      // L layers + this rank's vocabulary rows (+ wpe) + the final norm.
      EXPECT_EQ(rank.vocab_size * t, j.model.vocab_size);
      EXPECT_EQ(e.memory.params / 4, rank.num_hidden_layers * layer + (n1 - layer)) << preset << " t " << t;
      const ActivationPlan ap = Model::plan_activations(rank, 2, 32);
      const int64_t slack = 64 * static_cast<int64_t>(ap.entries.size());
      EXPECT_NEAR(static_cast<double>(e.memory.activations), static_cast<double>(ap.bytes), static_cast<double>(slack))
          << preset << " t " << t;
    }
}

TEST(Plan, LongStepsExtendedFromShortSimulations) {
  // gpt2-124m (the last stage carries the head: uneven stage costs) with 4 x 48 micro-batches:
  // simulated step by step, and extended linearly from 2p(v+1) and 2p(v+1) + p micro-batches
  // (sim_limit 700: below 4 x 192 x v, above 4 x 20 x 3).
  Job j = job_of("gpt2-124m", 8, 1, 256, 2 * 4 * 48);
  j.model.vocab_size = 50304;
  const Machine m = machine(1000, 100);
  for (int64_t v : {1, 3})
    for (Layout l : {Layout{2, 1, 4, false, 0, Recompute::None, v}, Layout{1, 2, 4, true, 0, Recompute::Full, v}}) {
      j.global_batch = 4 * 48 * l.data;
      Job small = j;
      small.sim_limit = 700;
      const Estimate exact = plan::estimate(j, m, l), ext = plan::estimate(small, m, l);
      ASSERT_TRUE(exact.reject.empty() && ext.reject.empty()) << exact.reject << ext.reject;
      EXPECT_EQ(exact.micro_batches, 4 * 48);
      EXPECT_NEAR(ext.pipeline_s, exact.pipeline_s, 1e-9 * exact.pipeline_s) << l.name();
      EXPECT_NEAR(ext.bubble, exact.bubble, 1e-9) << l.name();
      EXPECT_EQ(ext.memory.in_flight, exact.memory.in_flight) << l.name();
      EXPECT_EQ(ext.memory.total(), exact.memory.total()) << l.name();
    }
  // A pipeline too deep to simulate is rejected, not run for hours.
  Job deep = job_of("gpt2-debug", 1024, 1, 16, 4096);
  deep.model.num_hidden_layers = 1024;
  EXPECT_EQ(plan::estimate(deep, m, Layout{1, 1, 1024, false, 0, Recompute::None, 1}).reject,
            "pipeline 1024 x virtual stages 1 is too deep for the schedule simulator (1024 x 4096 micro-batches x 1 > "
            "262144 steps)");
}

// The planner's FLOPs read the keys of sliding layers from the config alone, as the model does
// (tests/models/test_registry.cpp FlopsCountWindowKeysOfSlidingLayers): window 3 on layers 0 and 2
// at T = 7 counts 3 + 7 + 3 keys, not 3 x 7.
TEST(Plan, FlopsCountWindowKeysOfSlidingLayers) {
  ModelConfig c = model_test::mistral_head_dim_config();
  c.num_hidden_layers = 3;
  c.sliding_window = 3;
  c.sliding_layers = {1, 0, 1};
  auto m = build_model(c);
  EXPECT_DOUBLE_EQ(plan::flops_per_token(c, 7), m->flops_per_token(7));
  EXPECT_DOUBLE_EQ(plan::flops_per_token(c, 7) - plan::flops_per_token(c, 3), 12.0 * 128 * 4);  // layer 1: 7 - 3 keys
}

// Mixture of experts (issue 28): FLOPs of the active experts as the model counts them, every expert
// in the parameter (memory) figure, and only the layouts a MoE model runs (data parallel, ZeRO 0-3,
// fp32, no recompute) left unrejected.
TEST(Plan, MixtureOfExpertsFlopsAndLayouts) {
  const ModelConfig c = ModelConfig::preset("mixtral-debug");
  auto m = build_model(c);
  EXPECT_DOUBLE_EQ(plan::flops_per_token(c, 16), m->flops_per_token(16));
  EXPECT_EQ(static_cast<int64_t>(m->num_params()), c.num_parameters());
  const auto all = plan::enumerate(job_of("mixtral-debug", 2, 1, 16, 4), machine());
  int valid = 0;
  for (const auto& e : all) {
    const Layout& l = e.layout;
    const bool runs = l.tensor == 1 && l.pipeline == 1 && l.context == 1 && l.recompute == Recompute::None;
    EXPECT_EQ(e.reject.empty(), runs) << l.name() << ": " << e.reject;
    if (!runs) {
      EXPECT_NE(e.reject.find("mixture-of-experts"), std::string::npos) << l.name();
    }
    valid += runs ? 1 : 0;
  }
  EXPECT_EQ(valid, 4);  // data 2 with ZeRO 0, 1, 2, 3
}
