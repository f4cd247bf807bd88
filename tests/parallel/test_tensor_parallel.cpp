// Tensor parallelism against the single-process model (the oracle): the same global weights,
// scattered to tp ranks on the in-process thread communicator, must give the same loss and, once
// the ranks' shards are gathered back, the same gradients, for GPT-2 (fused c_attn in sections),
// Llama with GQA (KV heads split), Qwen2 (q/k/v biases, tied) and an untied Llama with o_proj bias
// (a row-parallel bias, added once after the reduction). Tolerance 1e-5 relative: the row-parallel
// GEMMs sum their K dimension in tp pieces instead of one, so results differ by rounding only.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <mutex>

#include "core/error.h"
#include "core/rng.h"
#include "dist/comm.h"
#include "models/model.h"
#include "parallel/tensor_parallel.h"

using namespace lathe;
using namespace lathe::parallel;

namespace {

struct Family {
  const char* name;
  ModelConfig cfg;
  std::vector<int> degrees;
};
std::vector<Family> families() {
  ModelConfig untied = ModelConfig::preset("llama-debug");
  untied.tie_word_embeddings = false;
  untied.attention_bias = true;  // q/k/v and o_proj biases
  return {{"gpt2", ModelConfig::preset("gpt2-debug"), {2, 4}},
          {"llama_gqa", ModelConfig::preset("llama-debug"), {2}},  // 4 query heads, 2 KV heads
          {"qwen2", ModelConfig::preset("qwen2-debug"), {2}},
          {"llama_untied_bias", untied, {2}}};
}

// Deterministic init, with biases and norm weights perturbed so that their use and gradients show.
void perturbed_init(Model& m) {
  m.init_weights(42);
  Rng prng(7);
  for (const ParamSpec& s : m.params().specs())
    if (s.init != Init::Normal)
      for (int64_t i = 0; i < s.numel(); ++i) m.param_data()[s.offset + i] += 0.1f * prng.normal();
  m.refresh_compute_weights();
}

double rel_err(const float* a, const float* b, int64_t n) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < n; ++i) {
    num += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    den += static_cast<double>(b[i]) * b[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

constexpr int64_t kB = 2, kT = 13;
constexpr int kSteps = 5;
constexpr float kLr = 0.05f;

struct Batch {
  std::vector<int32_t> tokens, targets;
};
Batch batch(const ModelConfig& cfg, int step) {
  Rng rng(1000 + static_cast<uint64_t>(step));
  Batch b;
  for (int64_t i = 0; i < kB * kT; ++i) {
    b.tokens.push_back(static_cast<int32_t>(rng.next_u64() % static_cast<uint64_t>(cfg.vocab_size)));
    b.targets.push_back(static_cast<int32_t>(rng.next_u64() % static_cast<uint64_t>(cfg.vocab_size)));
  }
  b.targets[3] = -1;  // an ignored target
  return b;
}

// kSteps of plain SGD; returns the loss of every step and the gradients of the last one.
struct Trace {
  std::vector<double> losses;
  std::vector<float> last_grads;
};
Trace run_single(const ModelConfig& cfg) {
  auto m = build_model(cfg);
  perturbed_init(*m);
  m->allocate(kB, kT);
  Trace t;
  for (int s = 0; s < kSteps; ++s) {
    const Batch b = batch(cfg, s);
    m->zero_grad();
    t.losses.push_back(m->forward_backward(b.tokens.data(), b.targets.data(), kB, kT, 1.0f / (kB * kT), true));
    for (size_t i = 0; i < m->num_params(); ++i) m->param_data()[i] -= kLr * m->grad_data()[i];
    m->refresh_compute_weights();
  }
  t.last_grads.assign(m->grad_data(), m->grad_data() + m->num_params());
  return t;
}

}  // namespace

TEST(TensorParallel, MatchesOneProcess) {
  for (const Family& f : families()) {
    const Trace ref = run_single(f.cfg);
    auto global = build_model(f.cfg);
    perturbed_init(*global);
    const ParamTable& gt = global->params();
    for (int tp : f.degrees) {
      SCOPED_TRACE(fmt::format("{} tp={}", f.name, tp));
      std::mutex mu;
      std::vector<std::vector<double>> losses(static_cast<size_t>(tp));
      std::vector<float> gathered(gt.total());
      std::vector<std::vector<float>> replicated_grads(static_cast<size_t>(tp));
      dist::run_threads(tp, [&](dist::Communicator& comm) {
        const int r = comm.rank();
        auto m = build_model(tensor_parallel_config(f.cfg, tp));
        scatter_shard(gt, global->param_data(), m->params(), m->param_data(), r, tp);
        m->refresh_compute_weights();
        attach_tensor_parallel(*m, comm);
        m->allocate(kB, kT);
        for (int s = 0; s < kSteps; ++s) {
          const Batch b = batch(f.cfg, s);
          m->zero_grad();
          losses[static_cast<size_t>(r)].push_back(
              m->forward_backward(b.tokens.data(), b.targets.data(), kB, kT, 1.0f / (kB * kT), true));
          for (size_t i = 0; i < m->num_params(); ++i) m->param_data()[i] -= kLr * m->grad_data()[i];
          m->refresh_compute_weights();
        }
        std::vector<float> g(gt.total());
        gather_global(comm, gt, m->params(), m->grad_data(), g.data());
        std::vector<float> rep;
        for (const ParamSpec& s : m->params().specs())
          if (s.shard != ShardRule::Column && s.shard != ShardRule::Row)
            rep.insert(rep.end(), m->grad_data() + s.offset, m->grad_data() + s.offset + s.numel());
        std::lock_guard<std::mutex> lock(mu);
        replicated_grads[static_cast<size_t>(r)] = std::move(rep);
        if (r == 0) gathered = std::move(g);
      });
      for (int s = 0; s < kSteps; ++s) {
        for (int r = 0; r < tp; ++r)  // every rank computes the whole loss, bit for bit the same
          EXPECT_EQ(losses[static_cast<size_t>(r)][static_cast<size_t>(s)], losses[0][static_cast<size_t>(s)]);
        EXPECT_NEAR(losses[0][static_cast<size_t>(s)], ref.losses[static_cast<size_t>(s)],
                    1e-5 * std::abs(ref.losses[static_cast<size_t>(s)]))
            << "step " << s;
      }
      for (int r = 1; r < tp; ++r)  // replicated tensors stay identical without any reduction
        EXPECT_EQ(replicated_grads[static_cast<size_t>(r)], replicated_grads[0]);
      for (const ParamSpec& s : gt.specs()) {
        const double e = rel_err(gathered.data() + s.offset, ref.last_grads.data() + s.offset, s.numel());
        EXPECT_LT(e, 1e-5) << s.name;
      }
    }
  }
}

TEST(TensorParallel, InitShardIsTheSliceOfTheGlobalInit) {
  for (const Family& f : families()) {
    auto global = build_model(f.cfg);
    global->init_weights(1234);
    for (int tp : f.degrees)
      for (int r = 0; r < tp; ++r) {
        auto a = build_model(tensor_parallel_config(f.cfg, tp));
        auto b = build_model(tensor_parallel_config(f.cfg, tp));
        init_shard(*a, global->params(), r, tp, 1234);
        scatter_shard(global->params(), global->param_data(), b->params(), b->param_data(), r, tp);
        EXPECT_EQ(0, std::memcmp(a->param_data(), b->param_data(), a->num_params() * sizeof(float)))
            << f.name << " tp=" << tp << " rank " << r;
      }
  }
}

TEST(TensorParallel, FusedQkvSectionsGiveEachRankItsHeads) {
  // GPT-2's c_attn [3*C, C]: rank r's rows are its heads of q, then of k, then of v.
  const ModelConfig cfg = ModelConfig::preset("gpt2-debug");  // C = 48, 4 heads of 12
  auto global = build_model(cfg);
  auto local = build_model(tensor_parallel_config(cfg, 2));
  const ParamSpec& g = global->params().at("transformer.h.0.attn.c_attn.weight");
  const ParamSpec& l = local->params().at("transformer.h.0.attn.c_attn.weight");
  const auto runs = shard_runs(g, l, 1, 2);
  ASSERT_EQ(runs.size(), 3u);
  const int64_t C = 48;
  for (int64_t k = 0; k < 3; ++k) {
    EXPECT_EQ(runs[static_cast<size_t>(k)].global, (k * C + C / 2) * C);  // second half of section k
    EXPECT_EQ(runs[static_cast<size_t>(k)].local, k * (C / 2) * C);
    EXPECT_EQ(runs[static_cast<size_t>(k)].count, (C / 2) * C);
  }
}

TEST(TensorParallel, DegreesThatDoNotDivideAreNamed) {
  const ModelConfig llama = ModelConfig::preset("llama-debug");  // 4 heads, 2 KV heads, F = 96
  try {
    tensor_parallel_config(llama, 3);
    FAIL() << "tp=3 accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("num_attention_heads = 4"), std::string::npos) << e.what();
  }
  try {
    tensor_parallel_config(llama, 4);
    FAIL() << "tp=4 accepted with 2 KV heads";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("num_key_value_heads = 2"), std::string::npos) << e.what();
  }
}

TEST(TensorParallel, ShardConfigCountsItsOwnParameters) {
  // The analytical count (memory estimates, lathe plan) equals the shard model's table.
  for (const Family& f : families())
    for (int tp : f.degrees) {
      const ModelConfig c = tensor_parallel_config(f.cfg, tp);
      EXPECT_EQ(c.num_parameters(), static_cast<int64_t>(build_model(c)->num_params())) << f.name << " tp=" << tp;
    }
}
