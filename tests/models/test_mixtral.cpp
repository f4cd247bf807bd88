// Mixtral (issue 28): the config (MixtralConfig's class defaults, strict keys, jitter refused, the
// config.json round trip, the parameter count with every expert, FLOPs of the active ones), the
// parameter table (router and per-expert tensors laid out as the grouped kernels read them), parity
// with transformers 4.45.2's MixtralForCausalLM (torch_reference_mixtral.py: logits, loss with the
// aux loss and every gradient within 1e-5 in fp32; the oracle without the aux loss, without the
// renormalisation or with top-1 routing must fail), central finite differences of the loss at odd
// sizes, and the layouts a MoE model refuses.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "config/model_config.h"
#include "error_of.h"
#include "interop/hf_weights.h"
#include "io/safetensors.h"
#include "model_fixtures.h"
#include "models/model.h"

namespace fs = std::filesystem;
using namespace lathe;
using lathe::test::error_of;

namespace {

// mixtral-debug with weights of std 0.25: attention, RoPE and the router's choices all matter (the
// oracle prints aux loss 2.37, 1 being balanced, and router probabilities up to 0.94) while the
// router softmax is not so saturated that fp32 rounding nears the tolerance (worst gradient 2.6e-6
// here; std 0.5 gave 1e-4).
ModelConfig parity_cfg() {
  ModelConfig c = ModelConfig::preset("mixtral-debug");
  c.initializer_range = 0.25;
  return c;
}

fs::path write_case(const ModelConfig& cfg, int64_t B, int64_t T) {
  const fs::path dir = fs::temp_directory_path() / fmt::format("lathe_mixtral_parity_{}", getpid());
  model_test::fresh_dir(dir);
  auto model = model_test::perturbed_model(cfg);
  model->allocate(B, T);
  save_hf_model(*model, (dir / "model").string());
  const int64_t V = cfg.vocab_size, N = B * T;
  std::vector<int32_t> toks = model_test::random_tokens(N, V, 123), tgts = model_test::random_tokens(N, V, 456);
  io::write_safetensors((dir / "batches.safetensors").string(), {{"tokens", DType::I32, Shape{1, B, T}, toks.data()},
                                                                 {"targets", DType::I32, Shape{1, B, T}, tgts.data()}});
  std::vector<float> logits(static_cast<size_t>(N * V));
  model->forward_logits(toks.data(), B, T, logits.data());
  model->zero_grad();
  const float loss = static_cast<float>(model->forward_backward(toks.data(), tgts.data(), B, T, 1.0f / N, true) / N);
  const float aux = static_cast<float>(model->moe_aux_loss());
  io::write_safetensors((dir / "outputs.safetensors").string(), {{"logits", DType::F32, Shape{B, T, V}, logits.data()},
                                                                  {"loss", DType::F32, Shape{}, &loss},
                                                                  {"aux_loss", DType::F32, Shape{}, &aux}});
  save_hf_tensors(*model, model->grad_data(), (dir / "grads.safetensors").string());
  return dir;
}

std::string oracle(const fs::path& dir, const char* flags, int& rc) {
  std::string out;
  const std::string cmd = fmt::format("/usr/bin/python3 {}/tests/models/torch_reference_mixtral.py check {} {} 2>&1",
                                      LATHE_SOURCE_DIR, dir.string(), flags);
  model_test::run_oracle(cmd, rc, out);
  return out;
}

nlohmann::json small_config() {
  return {{"model_type", "mixtral"},   {"hidden_size", 48},      {"num_attention_heads", 4},
          {"num_key_value_heads", 2},  {"intermediate_size", 40}, {"num_hidden_layers", 2},
          {"vocab_size", 96},          {"num_local_experts", 5},  {"num_experts_per_tok", 2}};
}

}  // namespace

TEST(MixtralConfig, ClassDefaultsStrictKeysAndRoundTrip) {
  const ModelConfig c = ModelConfig::from_hf_json(small_config(), "cfg");
  EXPECT_EQ(c.family, "llama");
  EXPECT_EQ(c.num_local_experts, 5);
  EXPECT_EQ(c.num_experts_per_tok, 2);
  EXPECT_TRUE(c.norm_topk_prob);
  EXPECT_FALSE(c.output_router_logits);
  EXPECT_EQ(c.router_aux_loss_coef, 0.001);
  EXPECT_EQ(c.moe_aux_coef(), 0.0);  // transformers adds the aux loss only with output_router_logits
  EXPECT_EQ(c.rope_theta, 1e6);
  EXPECT_EQ(c.sliding_window, 0);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.bos_token_id, 1);
  EXPECT_EQ(c.eos_token_id, 2);
  const ModelConfig d = ModelConfig::from_hf_json({{"model_type", "mixtral"}}, "cfg");
  EXPECT_EQ(d.num_local_experts, 8);
  EXPECT_EQ(d.num_experts_per_tok, 2);
  EXPECT_EQ(d.intermediate_size, 14336);
  EXPECT_EQ(d.num_key_value_heads, 8);
  // Round trip through the config.json lathe writes.
  const ModelConfig p = ModelConfig::preset("mixtral-debug");
  const nlohmann::json j = p.to_hf_json();
  EXPECT_EQ(j["architectures"][0], "MixtralForCausalLM");
  EXPECT_EQ(j["num_local_experts"], 5);
  EXPECT_EQ(j["output_router_logits"], true);
  EXPECT_EQ(j["router_jitter_noise"], 0.0);
  EXPECT_TRUE(ModelConfig::from_hf_json(j, "mixtral config.json", true) == p);
  auto refused = [](const char* key, nlohmann::json v) {
    nlohmann::json j = small_config();
    j[key] = v;
    return error_of([&] { (void)ModelConfig::from_hf_json(j, "cfg"); });
  };
  EXPECT_NE(refused("router_jitter_noise", 0.01).find("router_jitter_noise"), std::string::npos);
  EXPECT_NE(refused("num_experts_per_tok", 6).find("num_experts_per_tok"), std::string::npos);
  EXPECT_NE(refused("num_local_experts", 0).find("num_local_experts"), std::string::npos);
  EXPECT_NE(refused("hidden_act", "gelu").find("hidden_act"), std::string::npos);
  EXPECT_NE(refused("head_dim", 16).find("head_dim"), std::string::npos);
  EXPECT_NE(refused("rope_scaling", nlohmann::json{{"rope_type", "linear"}, {"factor", 2.0}}).find("rope_scaling"),
            std::string::npos);
  EXPECT_NE(refused("router_aux_loss_coef", -1.0).find("router_aux_loss_coef"), std::string::npos);
  // A recipe: an unknown key is named; the MoE fields on another family are refused.
  EXPECT_NE(error_of([] {
              (void)ModelConfig::from_hf_json({{"model_type", "mixtral"}, {"num_experts", 4}}, "recipe", "model.",
                                              true);
            }).find("unknown key 'model.num_experts' for model_type mixtral"),
            std::string::npos);
  ModelConfig llama = ModelConfig::preset("llama-debug");
  llama.num_local_experts = 4;
  llama.num_experts_per_tok = 2;
  EXPECT_NE(error_of([&] { llama.validate("cfg"); }).find("mixtral field"), std::string::npos);
}

TEST(MixtralModel, ParamTableHoldsEveryExpertContiguously) {
  const ModelConfig c = ModelConfig::preset("mixtral-debug");
  auto m = build_model(c);
  EXPECT_EQ(static_cast<int64_t>(m->num_params()), c.num_parameters());
  const int64_t C = c.hidden_size, F = c.intermediate_size, E = c.num_local_experts;
  const ParamTable& t = m->params();
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    auto name = [&](const std::string& s) { return fmt::format("model.layers.{}.block_sparse_moe.{}", l, s); };
    EXPECT_EQ(t.at(name("gate.weight")).shape, (Shape{E, C}));
    for (const char* w : {"w1", "w3", "w2"})
      for (int64_t e = 1; e < E; ++e) {  // expert e right after expert e-1: [E, F, C] / [E, C, F] flat
        const ParamSpec& prev = t.at(name(fmt::format("experts.{}.{}.weight", e - 1, w)));
        const ParamSpec& cur = t.at(name(fmt::format("experts.{}.{}.weight", e, w)));
        EXPECT_EQ(cur.offset, prev.offset + static_cast<size_t>(F * C)) << w << " expert " << e;
      }
    EXPECT_EQ(t.find(fmt::format("model.layers.{}.mlp.gate_proj.weight", l)), nullptr);
  }
  EXPECT_EQ(m->weights().layers[0].exp_w1 + E * F * C, m->weights().layers[0].exp_w3);
  // FLOPs count the k active experts of E: 6 x (params - L (E - k) 3 C F) + attention.
  const double dense = m->flops_per_token(16) - 12.0 * static_cast<double>(c.attention_width()) * 2 * 16;
  const double inactive = static_cast<double>(c.num_hidden_layers * (E - c.num_experts_per_tok) * 3 * C * F);
  EXPECT_DOUBLE_EQ(dense, 6.0 * (static_cast<double>(c.num_parameters()) - inactive));
}

// Logits, loss (with the aux loss) and every gradient against transformers' MixtralForCausalLM.
TEST(MixtralParity, MatchesTransformers) {
  const fs::path dir = write_case(parity_cfg(), 2, 11);
  int rc = 0;
  const std::string out = oracle(dir, "", rc);
  EXPECT_EQ(rc, 0) << out;
  for (const char* broken : {"--break-aux", "--break-renorm", "--break-topk"}) {
    int brc = 0;
    const std::string bout = oracle(dir, broken, brc);
    EXPECT_NE(brc, 0) << broken << " still matched:\n" << bout;
  }
  if (rc == 0) fs::remove_all(dir);
}

// Central differences of the training loss (double-summed, fp32 model) against the gradient at odd
// sizes (C 30, F 13, 7 experts top-3, 3 layers, batch 3 x 5), on the tensors where routing acts:
// router, experts, and attention before them. The router's choices are piecewise constant: an
// element whose step flips a top-k choice (a near-tie; seen as one-sided differences that disagree)
// is skipped and counted, the rest must match within fp32 differences.
TEST(MixtralModel, FiniteDifferencesAtOddSizes) {
  ModelConfig c = ModelConfig::preset("mixtral-debug");
  c.hidden_size = 30;
  c.num_attention_heads = 3;
  c.num_key_value_heads = 1;
  c.intermediate_size = 13;
  c.num_hidden_layers = 3;
  c.num_local_experts = 7;
  c.num_experts_per_tok = 3;
  c.router_aux_loss_coef = 0.5;  // large: its gradient must show
  c.router_z_loss_coef = 0.1;
  c.initializer_range = 0.3;
  c.validate("fd");
  const int64_t B = 3, T = 5, N = B * T;
  auto m = model_test::perturbed_model(c);
  m->allocate(B, T);
  const std::vector<int32_t> toks = model_test::random_tokens(N, c.vocab_size, 21),
                             tgts = model_test::random_tokens(N, c.vocab_size, 10);  // no near-tie within h
  m->zero_grad();
  (void)m->forward_backward(toks.data(), tgts.data(), B, T, 1.0f / N, true);
  EXPECT_GT(m->moe_aux_loss(), 1.0);  // >= 1, = 1 only for perfectly balanced routing
  EXPECT_GT(m->moe_z_loss(), 0.0);
  const std::vector<float> grad(m->grad_data(), m->grad_data() + m->num_params());
  auto loss = [&] {
    return m->forward_backward(toks.data(), tgts.data(), B, T, 0.0f, true) / N;  // grads unchanged at scale 0
  };
  {
    const double l0 = loss(), l1 = loss(), l2 = loss();
    ASSERT_EQ(l0, l1) << l2;
    ASSERT_EQ(l1, l2);
  }
  const double l0 = loss();
  int checked = 0, bad = 0, flips = 0;
  for (const char* name : {"model.layers.1.block_sparse_moe.gate.weight", "model.layers.0.block_sparse_moe.gate.weight",
                           "model.layers.2.block_sparse_moe.experts.4.w1.weight",
                           "model.layers.1.block_sparse_moe.experts.0.w2.weight",
                           "model.layers.0.block_sparse_moe.experts.6.w3.weight", "model.layers.1.self_attn.q_proj.weight",
                           "model.layers.0.post_attention_layernorm.weight"}) {
    const ParamSpec& s = m->params().at(name);
    for (int64_t i = 0; i < s.numel(); i += std::max<int64_t>(1, s.numel() / 6)) {
      float* p = m->param_data() + s.offset + i;
      const float keep = *p, h = 1e-3f;
      *p = keep + h;
      const double up = loss();
      *p = keep - h;
      const double down = loss();
      *p = keep;
      const double fd = (up - down) / (2.0 * h), g = grad[s.offset + static_cast<size_t>(i)];
      // A routing decision within h of a tie (a top-k choice flips) makes the loss jump: the one-sided
      // differences then disagree by the jump / h (> 1 here), not by h x the curvature (~1e-2).
      if (std::abs((up - l0) - (l0 - down)) / h > 1.0) {
        ++flips;
        continue;
      }
      ++checked;
      if (std::abs(fd - g) > 2e-3 + 2e-2 * std::abs(g)) {
        ++bad;
        ADD_FAILURE() << name << "[" << i << "]: finite difference " << fd << " vs gradient " << g;
      }
    }
  }
  EXPECT_GT(checked, 30) << flips << " elements skipped: a routing flip within the step";
  EXPECT_LE(flips, checked / 3);
  EXPECT_EQ(bad, 0);
}

// The training loss adds n x coef x aux; evaluation passes return the language-model loss alone.
TEST(MixtralModel, AuxLossJoinsTrainingLossOnly) {
  const ModelConfig c = parity_cfg();
  const int64_t B = 2, T = 7, N = B * T;
  auto m = model_test::perturbed_model(c);
  m->allocate(B, T);
  const std::vector<int32_t> toks = model_test::random_tokens(N, c.vocab_size, 3),
                             tgts = model_test::random_tokens(N, c.vocab_size, 4);
  const double eval = m->forward_backward(toks.data(), tgts.data(), B, T, 0.0f, false);
  const double train = m->forward_backward(toks.data(), tgts.data(), B, T, 1.0f / N, true);
  EXPECT_NEAR(train - eval, N * c.router_aux_loss_coef * m->moe_aux_loss(), 1e-9 * std::abs(train));
  EXPECT_GT(m->moe_aux_loss(), 1.0);
  EXPECT_EQ(m->moe_loss_targets(), N);
}

TEST(MixtralModel, RefusesWhatItDoesNotSupport) {
  const ModelConfig c = ModelConfig::preset("mixtral-debug");
  auto m = build_model(c);
  EXPECT_NE(error_of([&] { m->allocate(1, 8, 0, Recompute::Full); }).find("set recompute: none"), std::string::npos);
  EXPECT_NE(error_of([&] { (void)build_model(c, ComputeSpec{nullptr, DType::BF16}); }).find("precision.compute: fp32"),
            std::string::npos);
  TensorShard shard;
  shard.parts = 2;
  shard.global_vocab = c.vocab_size;
  m->set_tensor_shard(shard);
  EXPECT_NE(error_of([&] {
              m->allocate(1, 4);
              std::vector<int32_t> t(4, 1);
              m->forward_backward(t.data(), t.data(), 1, 4, 0.25f, true);
            }).find("parallel.tensor: 1"),
            std::string::npos);
}
