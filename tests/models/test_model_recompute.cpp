// Activation recompute (issue 9): `selective` and `full` keep fewer activations and recompute the
// rest in backward with the same kernels on the same inputs, so every loss, every gradient, the
// StepHooks calls and a few AdamW steps must be BIT-identical to `none` -- for every family, fp32
// and bf16, at 1 and 2 threads. And the arena must be what the plan and the memory estimate say.
#include <gtest/gtest.h>
#include <omp.h>

#include <cctype>
#include <cstring>
#include <functional>
#include <ostream>
#include <string>
#include <tuple>
#include <vector>

#include "config/model_config.h"
#include "core/error.h"
#include "core/rng.h"
#include "error_of.h"
#include "models/memory.h"
#include "models/model.h"
#include "optim/optimizer.h"

using namespace lathe;

namespace {

using lathe::test::error_of;

ModelConfig family(const std::string& name) {
  if (name == "llama_untied_bias") {  // lm_head and q|k|v biases too
    ModelConfig c = ModelConfig::preset("llama-debug");
    c.tie_word_embeddings = false;
    c.attention_bias = true;
    return c;
  }
  return ModelConfig::preset(name);  // llama-debug: 4 query heads, 2 kv heads (GQA)
}

std::unique_ptr<Model> make(const ModelConfig& cfg, DType dt, int64_t B, int64_t T, Recompute rc) {
  auto m = build_model(cfg, ComputeSpec{nullptr, dt});
  m->init_weights(42);
  // Biases and norm weights perturbed, so that their gradients are not trivially equal.
  Rng prng(7);
  for (const ParamSpec& s : m->params().specs())
    if (s.init != Init::Normal)
      for (int64_t i = 0; i < s.numel(); ++i) m->param_data()[s.offset + i] += 0.1f * prng.normal();
  m->refresh_compute_weights();
  m->allocate(B, T, 2, rc);
  return m;
}

std::vector<int32_t> random_tokens(int64_t n, int64_t V, uint64_t seed) {
  Rng rng(seed);
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (auto& x : t) x = static_cast<int32_t>(rng.below(static_cast<uint64_t>(V)));
  return t;
}

bool bits_equal(const float* a, const float* b, size_t n) { return std::memcmp(a, b, n * sizeof(float)) == 0; }

// First index where two float arrays differ in their bits, for the failure message.
std::string first_difference(const Model& m, const float* a, const float* b) {
  for (const ParamSpec& s : m.params().specs())
    for (int64_t i = 0; i < s.numel(); ++i)
      if (std::memcmp(a + s.offset + i, b + s.offset + i, sizeof(float)) != 0)
        return s.name + "[" + std::to_string(i) + "]: " + std::to_string(a[s.offset + i]) + " vs " +
               std::to_string(b[s.offset + i]);
  return "none";
}

// Everything the hooks see, in order: ("b", block, backward) and ("g", begin, end).
struct HookLog {
  std::vector<std::tuple<char, int64_t, int64_t>> events;
  StepHooks hooks() {
    StepHooks h;
    h.before_block = [this](int64_t block, bool backward) { events.emplace_back('b', block, backward ? 1 : 0); };
    h.grads_ready = [this](size_t b, size_t e) {
      events.emplace_back('g', static_cast<int64_t>(b), static_cast<int64_t>(e));
    };
    return h;
  }
};

// What one run produces: per-step losses (two micro-batches each, accumulated), gradients of the
// first step, eval loss and logits, parameters after the AdamW steps, and the hook log of step 1.
struct PassResult {
  std::vector<double> losses;
  std::vector<float> grads0, logits, params;
  double eval_loss = 0;
  HookLog log;
};

PassResult run(const ModelConfig& cfg, DType dt, Recompute rc, int steps) {
  const int64_t B = 2, T = 16, micro = 2;
  auto m = make(cfg, dt, B, T, rc);
  EXPECT_EQ(m->recompute(), rc);
  PassResult r;
  m->set_hooks(r.log.hooks());
  optim::OptimConfig oc;
  oc.weight_decay = 0.1;
  auto opt = optim::make_optimizer(oc, m->num_params());
  std::vector<optim::ParamRange> ranges;
  for (const ParamSpec& s : m->params().specs()) ranges.push_back({s.offset, static_cast<size_t>(s.numel()), s.decay});
  const size_t P = m->num_params();
  for (int s = 0; s < steps; ++s) {
    m->zero_grad();
    double loss = 0;
    for (int k = 0; k < micro; ++k) {
      auto in = random_tokens(B * T, cfg.vocab_size, 100 + 10 * s + k);
      auto tg = random_tokens(B * T, cfg.vocab_size, 200 + 10 * s + k);
      tg[3] = -1;  // an ignored target
      loss += m->forward_backward(in.data(), tg.data(), B, T, 1.0f / (micro * B * T), true);
      if (s == 0 && k == 0) m->set_hooks({});  // the log holds one pass
    }
    r.losses.push_back(loss);
    if (s == 0) r.grads0.assign(m->grad_data(), m->grad_data() + P);
    opt->step(m->param_data(), m->grad_data(), ranges, 1e-3, s + 1, 1.0f);
    m->refresh_compute_weights();
  }
  // Forward only (evaluation) and logits at a shorter length than allocated.
  auto in = random_tokens(B * T, cfg.vocab_size, 7), tg = random_tokens(B * T, cfg.vocab_size, 8);
  r.eval_loss = m->forward_backward(in.data(), tg.data(), B, T, 1.0f, false);
  r.logits.resize(static_cast<size_t>(B * (T - 3) * cfg.vocab_size));
  m->forward_logits(in.data(), B, T - 3, r.logits.data());
  r.params.assign(m->param_data(), m->param_data() + P);
  return r;
}

struct Case {
  std::string family;
  DType dtype;
  int threads;
};
std::string case_label(const Case& c) {
  return c.family + "_" + (c.dtype == DType::F32 ? "fp32" : "bf16") + "_t" + std::to_string(c.threads);
}
void PrintTo(const Case& c, std::ostream* os) { *os << case_label(c); }

class RecomputeExact : public ::testing::TestWithParam<Case> {};

TEST_P(RecomputeExact, LossesGradientsHooksAndAdamWStepsAreBitIdenticalToNone) {
  const Case& c = GetParam();
  const int saved = omp_get_max_threads();
  omp_set_num_threads(c.threads);
  const ModelConfig cfg = family(c.family);
  const PassResult none = run(cfg, c.dtype, Recompute::None, 3);
  auto ref = build_model(cfg, ComputeSpec{nullptr, c.dtype});  // for parameter names in messages
  for (Recompute rc : {Recompute::Selective, Recompute::Full}) {
    SCOPED_TRACE(recompute_name(rc));
    const PassResult r = run(cfg, c.dtype, rc, 3);
    ASSERT_EQ(r.losses.size(), none.losses.size());
    for (size_t s = 0; s < r.losses.size(); ++s) EXPECT_EQ(r.losses[s], none.losses[s]) << "step " << s;
    EXPECT_TRUE(bits_equal(r.grads0.data(), none.grads0.data(), none.grads0.size()))
        << "first gradient difference: " << first_difference(*ref, r.grads0.data(), none.grads0.data());
    EXPECT_TRUE(bits_equal(r.params.data(), none.params.data(), none.params.size()))
        << "first parameter difference after AdamW: " << first_difference(*ref, r.params.data(), none.params.data());
    EXPECT_EQ(r.eval_loss, none.eval_loss);
    EXPECT_TRUE(bits_equal(r.logits.data(), none.logits.data(), none.logits.size()));
    EXPECT_EQ(r.log.events, none.log.events) << "StepHooks calls differ";
  }
  EXPECT_FALSE(none.log.events.empty());
  omp_set_num_threads(saved);
}

std::vector<Case> cases() {
  std::vector<Case> v;
  for (const char* f : {"gpt2-debug", "llama-debug", "qwen2-debug", "llama_untied_bias", "qwen3-debug"})
    for (DType dt : {DType::F32, DType::BF16})
      for (int t : {1, 2}) v.push_back({f, dt, t});
  return v;
}

std::string sanitized(std::string s) {
  for (char& ch : s)
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  return s;
}

INSTANTIATE_TEST_SUITE_P(Families, RecomputeExact, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<Case>& i) { return sanitized(case_label(i.param)); });

// The arena: what each mode keeps per layer, the shared set, and the estimate equal to the arena.
TEST(RecomputePlan, KeepsWhatEachModeSaysAndTheEstimateIsTheArena) {
  for (const char* preset : {"gpt2-debug", "llama-debug"})
    for (DType dt : {DType::F32, DType::BF16}) {
      SCOPED_TRACE(std::string(preset) + (dt == DType::F32 ? " fp32" : " bf16"));
      const ModelConfig cfg = ModelConfig::preset(preset);
      const int64_t B = 3, T = 17, L = cfg.num_hidden_layers;
      size_t bytes[3] = {};
      for (Recompute rc : {Recompute::None, Recompute::Selective, Recompute::Full}) {
        SCOPED_TRACE(recompute_name(rc));
        auto m = build_model(cfg, ComputeSpec{nullptr, dt});
        m->allocate(B, T, 2, rc);
        const ActivationPlan& plan = m->activation_plan();
        EXPECT_EQ(plan.recompute, rc);
        EXPECT_EQ(plan.bytes, m->activation_bytes());
        const MemoryEstimate e = estimate_memory(cfg, B, T, 2, 1, dt, rc);
        EXPECT_EQ(e.activation_bytes, static_cast<int64_t>(m->activation_bytes()));
        EXPECT_EQ(Model::plan_activations(cfg, B, T, ComputeSpec{nullptr, dt}, rc).bytes, plan.bytes);
        if (dt == DType::F32) {
          EXPECT_EQ(Model::activation_floats(cfg, B, T, rc) * 4, static_cast<int64_t>(plan.bytes));
        }
        // Per layer: none keeps all 13 buffers, selective all but ln1, ln2, act, full only res2.
        std::vector<std::string> layer0, shared;
        int64_t per_layer = 0;
        size_t end = 0;
        for (const ActivationEntry& en : plan.entries) {
          EXPECT_EQ(en.offset % 64, 0u) << en.label();
          EXPECT_GE(en.offset, end) << en.label() << " overlaps the previous entry";
          end = en.offset + static_cast<size_t>(en.count) * dtype_size(en.dtype);
          per_layer += en.layer >= 0;
          if (en.layer == 0) layer0.push_back(en.name);
          if (std::string(en.name).rfind("shared.", 0) == 0) shared.push_back(en.name);
        }
        EXPECT_LE(end, plan.bytes);
        const std::vector<std::string> all = {"ln1", "ln1_mean", "ln1_rstd", "qkv", "att", "lse", "res1",
                                              "ln2", "ln2_mean", "ln2_rstd", "fc",  "act", "res2"};
        if (rc == Recompute::None) {
          EXPECT_EQ(layer0, all);
          EXPECT_TRUE(shared.empty());
        } else if (rc == Recompute::Selective) {
          EXPECT_EQ(layer0, (std::vector<std::string>{"ln1_mean", "ln1_rstd", "qkv", "att", "lse", "res1", "ln2_mean",
                                                      "ln2_rstd", "fc", "res2"}));
          EXPECT_EQ(shared, (std::vector<std::string>{"shared.ln", "shared.act"}));
        } else {
          EXPECT_EQ(layer0, std::vector<std::string>{"res2"});
          std::vector<std::string> want;
          for (const std::string& n : all)
            if (n != "res2") want.push_back("shared." + n);
          EXPECT_EQ(shared, want);
        }
        EXPECT_EQ(per_layer, static_cast<int64_t>(layer0.size()) * L);
        bytes[static_cast<int>(rc)] = plan.bytes;
        // The breakdown names a recompute mode other than none.
        const std::string bd = e.breakdown();
        EXPECT_EQ(bd.find("recompute") != std::string::npos, rc != Recompute::None) << bd;
      }
      EXPECT_LT(bytes[1], bytes[0]);
      EXPECT_LT(bytes[2], bytes[1]);
    }
}

// `none` is the layout from before recompute existed: the default arguments give it, unchanged.
TEST(RecomputePlan, DefaultIsNone) {
  const ModelConfig cfg = ModelConfig::preset("qwen2-debug");
  auto m = build_model(cfg);
  m->allocate(2, 9);
  EXPECT_EQ(m->recompute(), Recompute::None);
  EXPECT_EQ(Model::plan_activations(cfg, 2, 9).bytes, m->activation_bytes());
  EXPECT_EQ(estimate_memory(cfg, 2, 9, 2).activation_bytes, static_cast<int64_t>(m->activation_bytes()));
  // Re-allocating the same (B, T) with another mode re-plans.
  m->allocate(2, 9, 0, Recompute::Full);
  EXPECT_EQ(m->recompute(), Recompute::Full);
  EXPECT_LT(m->activation_bytes(), Model::plan_activations(cfg, 2, 9).bytes);
}

TEST(RecomputeNames, ParseAndRefuse) {
  for (Recompute rc : {Recompute::None, Recompute::Selective, Recompute::Full})
    EXPECT_EQ(parse_recompute(recompute_name(rc), "x"), rc);
  EXPECT_EQ(error_of([] { parse_recompute("Full", "recipe.yaml: training.recompute"); }),
            "recipe.yaml: training.recompute: unknown recompute mode 'Full'; use none, selective or full");
  const std::string longer = error_of([] { parse_recompute(std::string(5000, 'x'), "r"); });
  EXPECT_LT(longer.size(), 200u) << "an untrusted value is shown bounded";
}

}  // namespace
