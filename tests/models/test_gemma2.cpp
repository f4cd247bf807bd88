// Gemma 2 (issue 25): the config (gemma2 model_type, Gemma2Config's class defaults, strict keys,
// config.json round trip, the alternating sliding layers, the parameter count), and parity with
// transformers 4.45.2's Gemma2ForCausalLM (torch_reference_gemma2.py: logits, loss and every gradient
// within 1e-5 in fp32) on a model whose attention soft cap, final soft cap, score scale and sliding
// window all bind; the oracle with any of them removed must fail. Recompute modes give the same bits.
#include <fmt/format.h>
#include <gtest/gtest.h>

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

// gemma2-debug with caps that bind at weights of std 0.4 (scores of size ~10 against the attention
// cap 5, logits of size ~5 against the final cap 3), window 4 < T on layers 0 and 2.
ModelConfig parity_cfg() {
  ModelConfig c = ModelConfig::preset("gemma2-debug");
  c.initializer_range = 0.4;
  c.attn_logit_softcapping = 5.0;
  c.final_logit_softcapping = 3.0;
  c.sliding_window = 4;
  return c;
}

fs::path write_case(const ModelConfig& cfg, int64_t B, int64_t T) {
  const fs::path dir = fs::temp_directory_path() / fmt::format("lathe_gemma2_parity_{}", getpid());
  model_test::fresh_dir(dir);
  auto model = model_test::perturbed_model(cfg);
  model->allocate(B, T);
  save_hf_model(*model, (dir / "model").string());
  const int64_t V = cfg.vocab_size, N = B * T;
  std::vector<int32_t> toks = model_test::random_tokens(N, V, 123), tgts = model_test::random_tokens(N, V, 456);
  toks[3] = 0;  // the pad token: its embedding row gets no gradient from the lookup (padding_idx)
  io::write_safetensors((dir / "batches.safetensors").string(), {{"tokens", DType::I32, Shape{1, B, T}, toks.data()},
                                                                 {"targets", DType::I32, Shape{1, B, T}, tgts.data()}});
  std::vector<float> logits(static_cast<size_t>(N * V));
  model->forward_logits(toks.data(), B, T, logits.data());
  model->zero_grad();
  const float loss = static_cast<float>(model->forward_backward(toks.data(), tgts.data(), B, T, 1.0f / N, true) / N);
  io::write_safetensors((dir / "outputs.safetensors").string(),
                        {{"logits", DType::F32, Shape{B, T, V}, logits.data()}, {"loss", DType::F32, Shape{}, &loss}});
  save_hf_tensors(*model, model->grad_data(), (dir / "grads.safetensors").string());
  return dir;
}

std::string oracle(const fs::path& dir, const char* flags, int& rc) {
  std::string out;
  const std::string cmd = fmt::format("/usr/bin/python3 {}/tests/models/torch_reference_gemma2.py check {} {} 2>&1",
                                      LATHE_SOURCE_DIR, dir.string(), flags);
  model_test::run_oracle(cmd, rc, out);
  return out;
}

nlohmann::json small_config() {
  return {{"model_type", "gemma2"}, {"hidden_size", 48},       {"num_attention_heads", 4}, {"num_key_value_heads", 2},
          {"head_dim", 16},         {"intermediate_size", 64}, {"num_hidden_layers", 3},   {"vocab_size", 101}};
}

}  // namespace

TEST(Gemma2Config, PresetRoundTripsThroughConfigJson) {
  const ModelConfig c = ModelConfig::preset("gemma2-debug");
  const nlohmann::json j = c.to_hf_json();
  EXPECT_EQ(j["model_type"], "gemma2");
  EXPECT_EQ(j["architectures"][0], "Gemma2ForCausalLM");
  EXPECT_EQ(j["head_dim"], 16);
  EXPECT_EQ(j["query_pre_attn_scalar"], 20.0);
  EXPECT_EQ(j["attn_logit_softcapping"], 50.0);
  EXPECT_EQ(j["final_logit_softcapping"], 30.0);
  EXPECT_EQ(j["sliding_window"], 5);
  EXPECT_EQ(j["hidden_activation"], "gelu_pytorch_tanh");
  const ModelConfig back = ModelConfig::from_hf_json(j, "gemma2 config.json", true);
  EXPECT_TRUE(back == c);
  EXPECT_EQ(back.layer_window(0), 5);
  EXPECT_EQ(back.layer_window(1), 0);
  EXPECT_EQ(back.layer_window(2), 5);
  // Four norms per layer: two C-sized weights more than llama's shape.
  EXPECT_EQ(static_cast<int64_t>(build_model(c)->num_params()), c.num_parameters());
}

TEST(Gemma2Config, Gemma2ConfigClassDefaultsAndStrictKeys) {
  const ModelConfig c = ModelConfig::from_hf_json(small_config(), "cfg");
  EXPECT_EQ(c.head_dim(), 16);
  EXPECT_EQ(c.query_pre_attn_scalar, 224.0);
  EXPECT_EQ(c.attn_logit_softcapping, 50.0);
  EXPECT_EQ(c.final_logit_softcapping, 30.0);
  EXPECT_EQ(c.sliding_window, 4096);
  EXPECT_EQ(c.sliding_layers, (std::vector<uint8_t>{1, 0, 1}));
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_EQ(c.norm_eps, 1e-6);
  EXPECT_EQ(c.pad_token_id, 0);
  EXPECT_EQ(c.eos_token_id, 1);
  EXPECT_EQ(c.bos_token_id, 2);
  EXPECT_EQ(c.attention_scale(), static_cast<float>(1.0 / std::sqrt(224.0)));
  // null caps: none.
  nlohmann::json j = small_config();
  j["attn_logit_softcapping"] = nullptr;
  j["final_logit_softcapping"] = nullptr;
  const ModelConfig n = ModelConfig::from_hf_json(j, "cfg");
  EXPECT_EQ(n.attn_softcap(), 0.0f);
  EXPECT_EQ(n.final_softcap(), 0.0f);
  auto refused = [](const char* key, nlohmann::json v) {
    nlohmann::json j = small_config();
    j[key] = v;
    return error_of([&] { (void)ModelConfig::from_hf_json(j, "cfg"); });
  };
  EXPECT_NE(refused("tie_word_embeddings", false).find("tie_word_embeddings"), std::string::npos);
  EXPECT_NE(refused("hidden_activation", "silu").find("hidden_activation"), std::string::npos);
  EXPECT_NE(refused("hidden_act", "relu").find("hidden_act"), std::string::npos);
  EXPECT_NE(refused("attention_bias", true).find("attention_bias"), std::string::npos);
  EXPECT_NE(refused("query_pre_attn_scalar", 0).find("query_pre_attn_scalar"), std::string::npos);
  EXPECT_NE(refused("attn_logit_softcapping", -1.0).find("attn_logit_softcapping"), std::string::npos);
  EXPECT_NE(refused("sliding_window_size", 7).find("sliding_window_size"), std::string::npos);
  EXPECT_NE(refused("rope_scaling", nlohmann::json{{"rope_type", "linear"}, {"factor", 2.0}}).find("rope_scaling"),
            std::string::npos);
  // A recipe: an unknown key is named.
  EXPECT_NE(error_of([] {
              (void)ModelConfig::from_hf_json({{"model_type", "gemma2"}, {"n_embd", 64}}, "recipe", "model.", true);
            }).find("unknown key 'model.n_embd' for model_type gemma2"),
            std::string::npos);
  // The gemma2 fields on another model type are refused.
  ModelConfig llama = ModelConfig::preset("llama-debug");
  llama.attn_logit_softcapping = 5.0;
  EXPECT_NE(error_of([&] { llama.validate("cfg"); }).find("gemma2 fields"), std::string::npos);
}

// Logits, loss and every gradient against transformers' Gemma2ForCausalLM (fp32, eager).
TEST(Gemma2Parity, MatchesTransformers) {
  const fs::path dir = write_case(parity_cfg(), 2, 11);
  int rc = 0;
  const std::string out = oracle(dir, "", rc);
  EXPECT_EQ(rc, 0) << out;
  // Each feature is seen: the oracle without it is far off.
  for (const char* broken : {"--break-softcap", "--break-final", "--break-window", "--break-scale"}) {
    int brc = 0;
    const std::string bout = oracle(dir, broken, brc);
    EXPECT_NE(brc, 0) << broken << " still matched:\n" << bout;
  }
  if (rc == 0) fs::remove_all(dir);
}

// Full and selective recompute rebuild the sandwich norms' inputs: the same loss and gradients, bit
// for bit.
TEST(Gemma2Parity, RecomputeModesAreBitIdentical) {
  const ModelConfig c = parity_cfg();
  const int64_t B = 2, T = 9, N = B * T;
  const std::vector<int32_t> toks = model_test::random_tokens(N, c.vocab_size, 5),
                             tgts = model_test::random_tokens(N, c.vocab_size, 6);
  std::vector<std::vector<float>> grads;
  std::vector<double> losses;
  for (Recompute r : {Recompute::None, Recompute::Full, Recompute::Selective}) {
    auto m = model_test::perturbed_model(c);
    m->allocate(B, T, 2, r);
    m->zero_grad();
    losses.push_back(m->forward_backward(toks.data(), tgts.data(), B, T, 1.0f / N, true));
    grads.emplace_back(m->grad_data(), m->grad_data() + m->num_params());
  }
  for (size_t i = 1; i < grads.size(); ++i) {
    EXPECT_EQ(losses[i], losses[0]) << "recompute mode " << i;
    EXPECT_TRUE(grads[i] == grads[0]) << "recompute mode " << i;
  }
}
