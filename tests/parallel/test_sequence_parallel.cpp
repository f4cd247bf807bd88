// Sequence parallelism (tensor parallelism with the residual stream sharded along its rows) on the
// in-process thread communicator, against two oracles:
//  * the single-process model with the same global weights: losses over 5 SGD steps within 1e-5
//    relative and the gathered gradients of the last step within 1e-5 (the row-parallel GEMMs sum
//    their K dimension in tp pieces, and norm-weight gradients are summed per rank: rounding only);
//  * tensor parallelism without it: bit-identical losses, gradients and weights. The reductions
//    sum the same partial products in the same rank order (a reduce-scatter's rows are the
//    all-reduce's), every row-wise kernel sees the same rows, and a shard config sums its
//    norm-weight gradients in tp row chunks whether the chunks live on one rank or on tp ranks.
// Also: the recompute modes and bf16 under sequence parallelism, a forward-only pass whose B*T
// does not divide by tp (padded rows), the smaller activation arena, and the errors.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <map>
#include <mutex>
#include <string>

#include "core/error.h"
#include "dist/comm.h"
#include "models/memory.h"
#include "models/model.h"
#include "models/tp_mappings.h"
#include "parallel/tensor_parallel.h"
#include "tp_fixtures.h"

using namespace lathe;
using namespace lathe::parallel;
using namespace lathe::tp_test;

namespace {

std::vector<Family> families() { return base_families(); }

constexpr int64_t kB = 2, kT = 12;  // N = 24 rows: 12 per rank at tp 2, 6 at tp 4
constexpr int kSteps = 5;
constexpr float kLr = 0.05f;

Batch batch(const ModelConfig& cfg, int step, int64_t T = kT) { return random_batch(cfg, step, kB, T); }

// What one run gives: the loss of every step (every rank's), and the gradients of the last step and
// the final weights as global flat buffers (gathered from the shards).
struct Trace {
  std::vector<std::vector<double>> losses;  // [rank][step]
  std::vector<float> grads, weights;
};

Trace run_single(const ModelConfig& cfg, DType dt = DType::F32) {
  auto m = build_model(cfg, ComputeSpec{nullptr, dt});
  perturbed_init(*m);
  m->allocate(kB, kT);
  Trace t;
  t.losses.resize(1);
  for (int s = 0; s < kSteps; ++s) {
    t.losses[0].push_back(sgd_step(*m, batch(cfg, s), kB, kT, kLr));
  }
  t.grads.assign(m->grad_data(), m->grad_data() + m->num_params());
  t.weights.assign(m->param_data(), m->param_data() + m->num_params());
  return t;
}

Trace run_parallel(const ModelConfig& cfg, int tp, bool sequence, Recompute rc = Recompute::None,
                   DType dt = DType::F32) {
  auto global = build_model(cfg);
  perturbed_init(*global);
  const ParamTable& gt = global->params();
  Trace t;
  t.losses.resize(static_cast<size_t>(tp));
  std::mutex mu;
  dist::run_threads(tp, [&](dist::Communicator& comm) {
    const int r = comm.rank();
    auto m = attached_shard(*global, comm, r, tp, sequence, ComputeSpec{nullptr, dt});
    m->allocate(kB, kT, 0, rc);
    std::vector<double> losses;
    for (int s = 0; s < kSteps; ++s) losses.push_back(sgd_step(*m, batch(cfg, s), kB, kT, kLr));
    std::vector<float> g(gt.total()), w(gt.total());
    gather_global(comm, gt, m->params(), m->grad_data(), g.data());
    gather_global(comm, gt, m->params(), m->param_data(), w.data());
    std::lock_guard<std::mutex> lock(mu);
    t.losses[static_cast<size_t>(r)] = std::move(losses);
    if (r == 0) {
      t.grads = std::move(g);
      t.weights = std::move(w);
    }
  });
  return t;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

}  // namespace

TEST(SequenceParallel, MatchesOneProcessAndTensorParallelBitForBit) {
  for (const Family& f : families()) {
    const Trace one = run_single(f.cfg);
    for (int tp : f.degrees) {
      SCOPED_TRACE(fmt::format("{} tp={}", f.name, tp));
      const Trace sp = run_parallel(f.cfg, tp, true);
      const Trace tpo = run_parallel(f.cfg, tp, false);
      ASSERT_EQ(sp.grads.size(), one.grads.size());
      ASSERT_EQ(tpo.grads.size(), one.grads.size());
      ASSERT_EQ(sp.losses[0].size(), static_cast<size_t>(kSteps));
      ASSERT_EQ(tpo.losses[0].size(), static_cast<size_t>(kSteps));
      for (int s = 0; s < kSteps; ++s) {
        const double ref = one.losses[0][static_cast<size_t>(s)];
        for (int r = 0; r < tp; ++r)  // every rank computes the whole loss, bit for bit the same
          EXPECT_EQ(sp.losses[static_cast<size_t>(r)][static_cast<size_t>(s)], sp.losses[0][static_cast<size_t>(s)]);
        EXPECT_NEAR(sp.losses[0][static_cast<size_t>(s)], ref, 1e-5 * std::abs(ref)) << "step " << s;
        EXPECT_EQ(sp.losses[0][static_cast<size_t>(s)], tpo.losses[0][static_cast<size_t>(s)]) << "step " << s;
      }
      const auto whole = build_model(f.cfg);
      for (const ParamSpec& s : whole->params().specs()) {
        const double e = rel_err(sp.grads.data() + s.offset, one.grads.data() + s.offset, s.numel());
        EXPECT_LT(e, 1e-5) << s.name;
      }
      EXPECT_TRUE(same_bits(sp.grads, tpo.grads)) << "gradients of TP+SP differ from TP";
      EXPECT_TRUE(same_bits(sp.weights, tpo.weights)) << "weights after 5 steps of TP+SP differ from TP";
    }
  }
}

TEST(SequenceParallel, RecomputeModesAreBitIdentical) {
  // Recompute under sequence parallelism re-runs the norms on the rank's rows and gathers again:
  // the same values, so the same bits as keeping everything.
  for (const char* preset : {"gpt2-debug", "llama-debug"}) {
    const ModelConfig cfg = ModelConfig::preset(preset);
    const Trace none = run_parallel(cfg, 2, true);
    for (Recompute rc : {Recompute::Selective, Recompute::Full}) {
      const Trace t = run_parallel(cfg, 2, true, rc);
      EXPECT_EQ(t.losses[0], none.losses[0]) << preset << " " << recompute_name(rc);
      EXPECT_TRUE(same_bits(t.grads, none.grads)) << preset << " " << recompute_name(rc);
    }
  }
}

TEST(SequenceParallel, Bf16MatchesTensorParallelBitForBit) {
  // 16-bit rows are reduce-scattered in fp32 and rounded once, as the all-reduce does.
  const ModelConfig cfg = ModelConfig::preset("llama-debug");
  const Trace sp = run_parallel(cfg, 2, true, Recompute::None, DType::BF16);
  const Trace tpo = run_parallel(cfg, 2, false, Recompute::None, DType::BF16);
  const Trace one = run_single(cfg, DType::BF16);
  EXPECT_EQ(sp.losses[0], tpo.losses[0]);
  EXPECT_TRUE(same_bits(sp.grads, tpo.grads));
  // Against one process in bf16: tp + 1 roundings of the row-parallel outputs instead of one.
  for (int s = 0; s < kSteps; ++s)
    EXPECT_NEAR(sp.losses[0][static_cast<size_t>(s)], one.losses[0][static_cast<size_t>(s)],
                1e-2 * std::abs(one.losses[0][static_cast<size_t>(s)]));
}

TEST(SequenceParallel, ForwardOnlyPassOfRowsThatDoNotSplitIsPadded) {
  // Evaluation and multiple-choice scoring run passes of any B x T: with 2 ranks and B*T = 2*7 + ...
  // odd, the stream is padded to tp*S rows (zeros), so the logits still match one process; a
  // backward pass of such a shape is an error naming B, T and the degree.
  const ModelConfig cfg = ModelConfig::preset("gpt2-debug");
  auto global = build_model(cfg);
  perturbed_init(*global);
  const int64_t B = 1, T = 7;
  const Batch b = batch(cfg, 0, T);
  global->allocate(kB, kT);
  std::vector<float> ref(static_cast<size_t>(B * T * cfg.vocab_size));
  global->forward_logits(b.tokens.data(), B, T, ref.data());
  std::vector<std::vector<float>> got(2);
  std::vector<std::string> errors(2);
  dist::run_threads(2, [&](dist::Communicator& comm) {
    const int r = comm.rank();
    auto m = attached_shard(*global, comm, r, 2, true);
    m->allocate(kB, kT);
    std::vector<float> logits(ref.size());
    m->forward_logits(b.tokens.data(), B, T, logits.data());
    got[static_cast<size_t>(r)] = std::move(logits);
    try {
      m->forward_backward(b.tokens.data(), b.targets.data(), B, T, 1.0f, true);
    } catch (const Error& e) {
      errors[static_cast<size_t>(r)] = e.what();
    }
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_LT(rel_err(got[static_cast<size_t>(r)].data(), ref.data(), static_cast<int64_t>(ref.size())), 1e-5);
    const std::string& e = errors[static_cast<size_t>(r)];
    EXPECT_NE(e.find("batch 1 x seq_len 7"), std::string::npos) << e;
    EXPECT_NE(e.find("parallel.tensor = 2"), std::string::npos) << e;
  }
}

TEST(SequenceParallel, ActivationArenaHoldsTheRanksRows) {
  // The stream's buffers hold N / tp rows; what is per head / MLP column is unchanged; one gathered
  // [N, C] buffer is added. The memory estimate of the shard config is the arena's size.
  for (const Family& f : families()) {
    const ModelConfig sc = shard_config(f.cfg, 2);
    const TensorShard tps = tensor_shard(f.cfg, 2), sps = tensor_shard(f.cfg, 2, true);
    const int64_t B = 4, T = 32, N = B * T, C = f.cfg.hidden_size;
    const ActivationPlan a = Model::plan_activations(sc, B, T, {}, Recompute::None, tps),
                         s = Model::plan_activations(sc, B, T, {}, Recompute::None, sps);
    auto count = [](const ActivationPlan& p, const std::string& label) -> int64_t {
      for (const ActivationEntry& e : p.entries)
        if (e.label() == label) return e.count;
      return -1;
    };
    // olmo2 has no pre-norms: its first norm output is the attention's post norm input.
    const std::string norm = f.cfg.post_norm ? "layers.0.attn_out" : "layers.0.ln1";
    for (const std::string& name : {norm, std::string("layers.1.res1"), std::string("layers.1.res2"),
                                    std::string("emb"), std::string("dres")}) {
      EXPECT_EQ(count(a, name), N * C) << f.name << " " << name;
      EXPECT_EQ(count(s, name), N / 2 * C) << f.name << " " << name;
    }
    EXPECT_EQ(count(s, norm + "_rstd"), N / 2) << f.name;
    EXPECT_EQ(count(s, "layers.0.qkv"), count(a, "layers.0.qkv")) << f.name;
    EXPECT_EQ(count(s, "gathered"), N * C) << f.name;
    EXPECT_EQ(count(a, "gathered"), -1) << f.name;
    EXPECT_LT(s.bytes, a.bytes) << f.name;
    const MemoryEstimate e = estimate_memory(sc, B, T, 2, 1, DType::F32, Recompute::None, sps);
    EXPECT_EQ(e.activation_bytes, static_cast<int64_t>(s.bytes)) << f.name;
    EXPECT_EQ(e.sequence_saving_bytes, static_cast<int64_t>(a.bytes - s.bytes)) << f.name;
    EXPECT_NE(e.breakdown().find(fmt::format("sequence parallel over 2 saves {}) {}", format_bytes(a.bytes - s.bytes),
                                             format_bytes(static_cast<int64_t>(s.bytes)))),
              std::string::npos)
        << e.breakdown();
    EXPECT_EQ(estimate_memory(sc, B, T, 2, 1, DType::F32, Recompute::None, tps).sequence_saving_bytes, 0) << f.name;
    auto m = build_shard_model(f.cfg, 2, true, 0);
    m->allocate(B, T);
    EXPECT_EQ(m->activation_bytes(), s.bytes) << f.name;
  }
}

TEST(SequenceParallel, ErrorsNameTheSetting) {
  const ModelConfig cfg = ModelConfig::preset("gpt2-debug");
  try {
    tensor_shard(cfg, 1, true);
    FAIL() << "sequence parallelism without tensor parallelism accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("parallel.sequence"), std::string::npos) << e.what();
  }
  // A sequence-parallel shard run without the row hooks (attach_tensor_parallel not called).
  auto m = build_shard_model(cfg, 2, true, 0);
  m->init_weights(1);
  m->allocate(kB, kT);
  const Batch b = batch(cfg, 0);
  try {
    m->forward_backward(b.tokens.data(), b.targets.data(), kB, kT, 1.0f, true);
    FAIL() << "a sequence-parallel pass without hooks ran";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("attach_tensor_parallel"), std::string::npos) << e.what();
  }
}

// The collectives a training pass calls, counted per kind, follow the region pairs of
// models/tp_mappings.h (L layers; a tensor-parallel shard's vocabulary is always split):
//  * without sequence parallelism, all-reduces: reduce_from_tensor_region forward after the 2L
//    row-parallel GEMMs and the embedding, copy_to_tensor_region backward on the 2L column-parallel
//    input gradients and the head's (4L + 2);
//  * with it, no all-reduce; all-gathers: gather_from_sequence_region forward before the 2L
//    column-parallel GEMMs and the lm head, again before their 2L weight gradients, and
//    reduce_scatter_to_sequence_region backward before the 2L row-parallel GEMMs' backward and the
//    embedding's (6L + 2); reduce-scatters: the forwards of reduce_scatter_to_sequence_region (2L + 1)
//    and the backwards of gather_from_sequence_region (2L + 1); no split (the vocabulary is split);
//    the norm weights' fp32 all-reduce for the 2L layer norms and the final norm (2L + 1).
TEST(SequenceParallel, EveryRegionsCollectivesRunOncePerDirection) {
  const ModelConfig cfg = ModelConfig::preset("gpt2-debug");
  const int64_t L = cfg.num_hidden_layers;
  auto global = build_model(cfg);
  perturbed_init(*global);
  for (bool sequence : {false, true}) {
    std::vector<std::map<std::string, int64_t>> counts(2);
    dist::run_threads(2, [&](dist::Communicator& comm) {
      auto m = attached_shard(*global, comm, comm.rank(), 2, sequence);
      m->allocate(kB, kT);
      std::map<std::string, int64_t>& n = counts[static_cast<size_t>(comm.rank())];
      TpCollectives& c = m->hooks().tp.comm;
      auto wrap = [&n](auto& fn, const char* name) {
        if (!fn) return;
        fn = [inner = fn, &n, name](auto... args) {
          ++n[name];
          inner(args...);
        };
      };
      wrap(c.all_reduce, "all_reduce");
      wrap(c.all_gather_rows, "all_gather_rows");
      wrap(c.reduce_scatter_rows, "reduce_scatter_rows");
      wrap(c.split_rows, "split_rows");
      wrap(c.all_reduce_f32, "all_reduce_f32");
      wrap(c.gather_vocab, "gather_vocab");
      const Batch b = batch(cfg, 0);
      m->forward_backward(b.tokens.data(), b.targets.data(), kB, kT, 1.0f / (kB * kT), true);
    });
    const std::map<std::string, int64_t> want = sequence
                                                    ? std::map<std::string, int64_t>{{"all_gather_rows", 6 * L + 2},
                                                                                     {"reduce_scatter_rows", 4 * L + 2},
                                                                                     {"all_reduce_f32", 2 * L + 1}}
                                                    : std::map<std::string, int64_t>{{"all_reduce", 4 * L + 2}};
    EXPECT_EQ(counts[0], want) << "sequence " << sequence;
    EXPECT_EQ(counts[1], want) << "sequence " << sequence;
  }
}
