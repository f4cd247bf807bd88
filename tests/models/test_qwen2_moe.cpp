// Qwen2-MoE (issue 28): the config (Qwen2MoeConfig's class defaults, strict keys, the layer-choice
// keys lathe refuses, the config.json round trip, the parameter count with the shared expert), the
// parameter table (routed experts contiguous, the shared expert and its gate), parity with
// transformers 4.45.2's Qwen2MoeForCausalLM (torch_reference_qwen2_moe.py: logits, loss with the
// aux loss and every gradient within 1e-5 in fp32; the oracle without the aux loss, with the top-k
// renormalised, without the shared gate, without the shared expert or without q/k/v biases must
// fail), and central finite differences of the loss at odd sizes through the shared expert.
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

// qwen2-moe-debug with weights of std 0.25 (as test_mixtral.cpp's parity case: routing uneven, the
// shared gate's sigmoid spread over (0, 1), the router softmax not saturated).
ModelConfig parity_cfg() {
  ModelConfig c = ModelConfig::preset("qwen2-moe-debug");
  c.initializer_range = 0.25;
  return c;
}

fs::path write_case(const ModelConfig& cfg, int64_t B, int64_t T) {
  const fs::path dir = fs::temp_directory_path() / fmt::format("lathe_qwen2_moe_parity_{}", getpid());
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
  const std::string cmd = fmt::format("/usr/bin/python3 {}/tests/models/torch_reference_qwen2_moe.py check {} {} 2>&1",
                                      LATHE_SOURCE_DIR, dir.string(), flags);
  model_test::run_oracle(cmd, rc, out);
  return out;
}

nlohmann::json small_config() {
  return {{"model_type", "qwen2_moe"},
          {"hidden_size", 48},
          {"num_attention_heads", 4},
          {"num_key_value_heads", 2},
          {"intermediate_size", 64},
          {"moe_intermediate_size", 24},
          {"shared_expert_intermediate_size", 56},
          {"num_hidden_layers", 2},
          {"vocab_size", 96},
          {"num_experts", 6},
          {"num_experts_per_tok", 3}};
}

}  // namespace

TEST(Qwen2MoeConfig, ClassDefaultsStrictKeysAndRoundTrip) {
  const ModelConfig c = ModelConfig::from_hf_json(small_config(), "cfg");
  EXPECT_EQ(c.family, "llama");
  EXPECT_EQ(c.num_local_experts, 6);
  EXPECT_EQ(c.num_experts_per_tok, 3);
  EXPECT_EQ(c.intermediate_size, 24);  // the routed experts' width
  EXPECT_EQ(c.dense_intermediate_size, 64);
  EXPECT_EQ(c.shared_expert_intermediate_size, 56);
  EXPECT_FALSE(c.norm_topk_prob);  // Qwen2MoeConfig's default
  EXPECT_TRUE(c.attention_bias);
  EXPECT_TRUE(c.qkv_bias());
  EXPECT_FALSE(c.o_bias());
  EXPECT_FALSE(c.output_router_logits);
  EXPECT_EQ(c.router_aux_loss_coef, 0.001);
  EXPECT_EQ(c.moe_aux_coef(), 0.0);
  EXPECT_EQ(c.rope_theta, 10000.0);
  EXPECT_EQ(c.norm_eps, 1e-6);
  EXPECT_EQ(c.sliding_window, 0);
  const ModelConfig d = ModelConfig::from_hf_json({{"model_type", "qwen2_moe"}}, "cfg");
  EXPECT_EQ(d.num_local_experts, 60);
  EXPECT_EQ(d.num_experts_per_tok, 4);
  EXPECT_EQ(d.intermediate_size, 1408);
  EXPECT_EQ(d.dense_intermediate_size, 5632);
  EXPECT_EQ(d.shared_expert_intermediate_size, 5632);
  EXPECT_EQ(d.vocab_size, 151936);
  EXPECT_EQ(d.hidden_size, 2048);
  EXPECT_EQ(d.num_key_value_heads, 16);
  // The common case of the layer-choice keys is accepted.
  nlohmann::json ok = small_config();
  ok["decoder_sparse_step"] = 1;
  ok["mlp_only_layers"] = nlohmann::json::array();
  ok["use_sliding_window"] = false;
  ok["sliding_window"] = 4096;
  ok["max_window_layers"] = 28;
  EXPECT_TRUE(ModelConfig::from_hf_json(ok, "cfg") == c);
  // Round trip through the config.json lathe writes.
  const ModelConfig p = ModelConfig::preset("qwen2-moe-debug");
  const nlohmann::json j = p.to_hf_json();
  EXPECT_EQ(j["architectures"][0], "Qwen2MoeForCausalLM");
  EXPECT_EQ(j["num_experts"], 6);
  EXPECT_EQ(j["moe_intermediate_size"], 24);
  EXPECT_EQ(j["intermediate_size"], 64);
  EXPECT_EQ(j["shared_expert_intermediate_size"], 56);
  EXPECT_EQ(j["norm_topk_prob"], false);
  EXPECT_TRUE(ModelConfig::from_hf_json(j, "qwen2_moe config.json", true) == p);
  auto refused = [](const char* key, nlohmann::json v) {
    nlohmann::json j = small_config();
    j[key] = v;
    return error_of([&] { (void)ModelConfig::from_hf_json(j, "cfg"); });
  };
  EXPECT_NE(refused("decoder_sparse_step", 2).find("decoder_sparse_step"), std::string::npos);
  EXPECT_NE(refused("mlp_only_layers", nlohmann::json::array({1})).find("mlp_only_layers"), std::string::npos);
  EXPECT_NE(refused("use_sliding_window", true).find("use_sliding_window"), std::string::npos);
  EXPECT_NE(refused("num_experts_per_tok", 7).find("num_experts_per_tok"), std::string::npos);
  EXPECT_NE(refused("num_experts", 0).find("num_experts"), std::string::npos);
  EXPECT_NE(refused("shared_expert_intermediate_size", 0).find("shared_expert_intermediate_size"), std::string::npos);
  EXPECT_NE(refused("hidden_act", "gelu").find("hidden_act"), std::string::npos);
  EXPECT_NE(refused("head_dim", 16).find("head_dim"), std::string::npos);
  EXPECT_NE(refused("rope_scaling", nlohmann::json{{"rope_type", "linear"}, {"factor", 2.0}}).find("rope_scaling"),
            std::string::npos);
  EXPECT_NE(refused("router_aux_loss_coef", -1.0).find("router_aux_loss_coef"), std::string::npos);
  EXPECT_NE(error_of([] {
              (void)ModelConfig::from_hf_json({{"model_type", "qwen2_moe"}, {"num_local_experts", 4}}, "recipe",
                                              "model.", true);
            }).find("unknown key 'model.num_local_experts' for model_type qwen2_moe"),
            std::string::npos);
  ModelConfig mixtral = ModelConfig::preset("mixtral-debug");
  mixtral.shared_expert_intermediate_size = 8;
  EXPECT_NE(error_of([&] { mixtral.validate("cfg"); }).find("qwen2_moe field"), std::string::npos);
}

TEST(Qwen2MoeModel, ParamTableHoldsExpertsAndTheSharedExpert) {
  const ModelConfig c = ModelConfig::preset("qwen2-moe-debug");
  auto m = build_model(c);
  EXPECT_EQ(static_cast<int64_t>(m->num_params()), c.num_parameters());
  const int64_t C = c.hidden_size, F = c.intermediate_size, E = c.num_local_experts,
                Fs = c.shared_expert_intermediate_size;
  const ParamTable& t = m->params();
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    auto name = [&](const std::string& s) { return fmt::format("model.layers.{}.{}", l, s); };
    EXPECT_EQ(t.at(name("mlp.gate.weight")).shape, (Shape{E, C}));
    for (const char* w : {"gate_proj", "up_proj", "down_proj"})
      for (int64_t e = 1; e < E; ++e) {
        const ParamSpec& prev = t.at(name(fmt::format("mlp.experts.{}.{}.weight", e - 1, w)));
        const ParamSpec& cur = t.at(name(fmt::format("mlp.experts.{}.{}.weight", e, w)));
        EXPECT_EQ(cur.offset, prev.offset + static_cast<size_t>(F * C)) << w << " expert " << e;
      }
    EXPECT_EQ(t.at(name("mlp.shared_expert.gate_proj.weight")).shape, (Shape{Fs, C}));
    EXPECT_EQ(t.at(name("mlp.shared_expert.down_proj.weight")).shape, (Shape{C, Fs}));
    EXPECT_EQ(t.at(name("mlp.shared_expert_gate.weight")).shape, (Shape{1, C}));
    EXPECT_EQ(t.at(name("self_attn.q_proj.bias")).shape, (Shape{C}));
    EXPECT_EQ(t.find(name("self_attn.o_proj.bias")), nullptr);
  }
  // FLOPs: the shared expert is active for every token, the routed ones k of E.
  const double dense = m->flops_per_token(16) - 12.0 * static_cast<double>(c.attention_width()) * 2 * 16;
  const double inactive = static_cast<double>(c.num_hidden_layers * (E - c.num_experts_per_tok) * 3 * C * F);
  EXPECT_DOUBLE_EQ(dense, 6.0 * (static_cast<double>(c.num_parameters()) - inactive));
}

// Logits, loss (with the aux loss) and every gradient against transformers' Qwen2MoeForCausalLM.
TEST(Qwen2MoeParity, MatchesTransformers) {
  const fs::path dir = write_case(parity_cfg(), 2, 11);
  int rc = 0;
  const std::string out = oracle(dir, "", rc);
  EXPECT_EQ(rc, 0) << out;
  std::cout << out;
  for (const char* broken :
       {"--break-aux", "--break-renorm", "--break-shared-gate", "--break-shared", "--break-bias"}) {
    int brc = 0;
    const std::string bout = oracle(dir, broken, brc);
    EXPECT_NE(brc, 0) << broken << " still matched:\n" << bout;
  }
  if (rc == 0) fs::remove_all(dir);
}

// Central differences of the training loss against the gradient at odd sizes (C 30, expert width
// 13, shared width 11, 7 experts top-3 without renormalisation, 3 layers, batch 3 x 5), on the
// shared expert, its gate, the router and the q/k/v biases. Elements whose step flips a top-k
// choice are skipped and counted, as in test_mixtral.cpp.
TEST(Qwen2MoeModel, FiniteDifferencesAtOddSizes) {
  ModelConfig c = ModelConfig::preset("qwen2-moe-debug");
  c.hidden_size = 30;
  c.num_attention_heads = 3;
  c.num_key_value_heads = 1;
  c.intermediate_size = 13;
  c.shared_expert_intermediate_size = 11;
  c.num_hidden_layers = 3;
  c.num_local_experts = 7;
  c.num_experts_per_tok = 3;
  c.router_aux_loss_coef = 0.5;
  c.initializer_range = 0.3;
  c.validate("fd");
  const int64_t B = 3, T = 5, N = B * T;
  auto m = model_test::perturbed_model(c);
  m->allocate(B, T);
  const std::vector<int32_t> toks = model_test::random_tokens(N, c.vocab_size, 21),
                             tgts = model_test::random_tokens(N, c.vocab_size, 10);
  m->zero_grad();
  (void)m->forward_backward(toks.data(), tgts.data(), B, T, 1.0f / N, true);
  const std::vector<float> grad(m->grad_data(), m->grad_data() + m->num_params());
  auto loss = [&] { return m->forward_backward(toks.data(), tgts.data(), B, T, 0.0f, true) / N; };
  const double l0 = loss();
  int checked = 0, bad = 0, flips = 0;
  for (const char* name :
       {"model.layers.1.mlp.shared_expert_gate.weight", "model.layers.0.mlp.shared_expert_gate.weight",
        "model.layers.2.mlp.shared_expert.gate_proj.weight", "model.layers.1.mlp.shared_expert.up_proj.weight",
        "model.layers.0.mlp.shared_expert.down_proj.weight", "model.layers.1.mlp.gate.weight",
        "model.layers.0.self_attn.k_proj.bias", "model.layers.1.self_attn.q_proj.bias",
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
  EXPECT_GT(checked, 35) << flips << " elements skipped: a routing flip within the step";
  EXPECT_LE(flips, checked / 3);
  EXPECT_EQ(bad, 0);
}

// Where it runs: host fp32 (as every MoE model); the refusals name the key.
TEST(Qwen2MoeModel, RefusesWhatItDoesNotSupport) {
  const ModelConfig c = ModelConfig::preset("qwen2-moe-debug");
  auto m = build_model(c);
  EXPECT_NE(error_of([&] { m->allocate(1, 8, 0, Recompute::Full); }).find("set recompute: none"), std::string::npos);
  EXPECT_NE(error_of([&] {
              (void)build_model(c, ComputeSpec{nullptr, DType::BF16});
            }).find("precision.compute: fp32"),
            std::string::npos);
}
