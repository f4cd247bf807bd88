// Qwen3 (Arch::qk_norm: per-head RMSNorm of q and k before RoPE, explicit head_dim): the config
// (qwen3 model_type, defaults, config.json round trip, parameter count), the parameter table, parity
// with a PyTorch reference of the published architecture (torch_reference_qwen3.py: logits, loss and
// every gradient within 1e-5 of a float64 reference; the same reference without q_norm must fail),
// the activation arena under each recompute mode, and the norms in the ONNX graph.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "config/model_config.h"
#include "error_of.h"
#include "interop/hf_weights.h"
#include "interop/onnx_export.h"
#include "io/safetensors.h"
#include "model_fixtures.h"
#include "models/memory.h"
#include "models/model.h"

namespace fs = std::filesystem;
using namespace lathe;
using lathe::test::error_of;

namespace {

// qwen3-debug with weights of std 0.3 (q/k of that scale: attention, RoPE and the norms matter).
ModelConfig qwen3_cfg() {
  ModelConfig c = ModelConfig::preset("qwen3-debug");
  c.initializer_range = 0.3;
  return c;
}

// Writes what torch_reference_qwen3.py `check` reads; returns the directory.
fs::path write_case(const ModelConfig& cfg, int64_t B, int64_t T) {
  const fs::path dir = fs::temp_directory_path() / fmt::format("lathe_qwen3_parity_{}", getpid());
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
  io::write_safetensors((dir / "outputs.safetensors").string(),
                        {{"logits", DType::F32, Shape{B, T, V}, logits.data()}, {"loss", DType::F32, Shape{}, &loss}});
  save_hf_tensors(*model, model->grad_data(), (dir / "grads.safetensors").string());
  return dir;
}

std::string oracle(const fs::path& dir, const char* flags, int& rc) {
  std::string out;
  const std::string cmd = fmt::format("/usr/bin/python3 {}/tests/models/torch_reference_qwen3.py check {} {} 2>&1",
                                      LATHE_SOURCE_DIR, dir.string(), flags);
  model_test::run_oracle(cmd, rc, out);
  return out;
}

}  // namespace

TEST(Qwen3Config, PresetRoundTripsThroughConfigJson) {
  const ModelConfig c = ModelConfig::preset("qwen3-debug");
  EXPECT_TRUE(c.qk_norm);
  EXPECT_EQ(c.head_dim(), 16);
  EXPECT_NE(c.num_attention_heads * c.head_dim(), c.hidden_size);
  const nlohmann::json j = c.to_hf_json();
  EXPECT_EQ(j["model_type"], "qwen3");
  EXPECT_EQ(j["architectures"][0], "Qwen3ForCausalLM");
  EXPECT_EQ(j["head_dim"], 16);
  EXPECT_EQ(j["attention_bias"], false);
  EXPECT_EQ(j["use_sliding_window"], false);
  const ModelConfig back = ModelConfig::from_hf_json(j, "qwen3 config.json", true);
  EXPECT_TRUE(back == c);
  EXPECT_TRUE(back.qk_norm);
  // llama of the same shape: no q/k norms, 2 x head_dim parameters fewer per layer.
  ModelConfig llama = c;
  llama.model_type = "llama";
  llama.qk_norm = false;
  EXPECT_FALSE(llama == c);
  EXPECT_EQ(c.num_parameters() - llama.num_parameters(), 2 * 16 * c.num_hidden_layers);
  EXPECT_EQ(static_cast<int64_t>(build_model(c)->num_params()), c.num_parameters());
}

TEST(Qwen3Config, Qwen3ConfigClassDefaults) {
  // Qwen3Config: head_dim 128 when absent (not hidden / heads), attention_bias false (then no bias
  // at all), no sliding window unless use_sliding_window, no bos/eos defaults.
  const ModelConfig c = ModelConfig::from_hf_json({{"model_type", "qwen3"},
                                                   {"hidden_size", 64},
                                                   {"num_attention_heads", 4},
                                                   {"num_key_value_heads", 2},
                                                   {"intermediate_size", 128},
                                                   {"num_hidden_layers", 1},
                                                   {"vocab_size", 100}},
                                                  "cfg");
  EXPECT_EQ(c.head_dim(), 128);
  EXPECT_TRUE(c.qk_norm);
  EXPECT_FALSE(c.attention_bias);
  EXPECT_FALSE(c.qkv_bias());
  EXPECT_EQ(c.sliding_window, 0);
  EXPECT_EQ(c.bos_token_id, -1);
  EXPECT_EQ(c.max_position_embeddings, 32768);
  // attention_bias true: q/k/v and o biases (Qwen3Attention), unlike qwen2.
  const ModelConfig b = ModelConfig::from_hf_json({{"model_type", "qwen3"},
                                                   {"hidden_size", 64},
                                                   {"num_attention_heads", 4},
                                                   {"head_dim", 16},
                                                   {"intermediate_size", 128},
                                                   {"num_hidden_layers", 1},
                                                   {"vocab_size", 100},
                                                   {"attention_bias", true}},
                                                  "cfg");
  EXPECT_TRUE(b.qkv_bias());
  EXPECT_TRUE(b.o_bias());
  EXPECT_EQ(static_cast<int64_t>(build_model(b)->num_params()), b.num_parameters());
  // A recipe key of another family is named.
  EXPECT_NE(error_of([] {
              (void)ModelConfig::from_hf_json({{"model_type", "qwen3"}, {"n_embd", 64}}, "recipe", "model.", true);
            }).find("unknown key 'model.n_embd' for model_type qwen3"),
            std::string::npos);
}

// Qwen3-0.6B's config.json (tests/fuzz/corpus): 16 heads of 128 with hidden 1024, q/k norms, tied;
// 0.6B parameters, 0.44B without the embedding, as published; nothing ignored.
TEST(Qwen3Config, Qwen3_0_6BConfigJson) {
  std::ifstream f(fs::path(LATHE_SOURCE_DIR) / "tests/fuzz/corpus/hf_config/qwen3_0_6b.json");
  const ModelConfig c = ModelConfig::from_hf_json(nlohmann::json::parse(f), "qwen3_0_6b.json");
  EXPECT_TRUE(c.qk_norm);
  EXPECT_EQ(c.head_dim(), 128);
  EXPECT_EQ(c.attention_width(), 2048);
  EXPECT_FALSE(c.qkv_bias());
  EXPECT_EQ(c.sliding_window, 0);
  EXPECT_TRUE(c.ignored_keys.empty()) << c.ignored_note();
  EXPECT_EQ(c.num_parameters(), 596049920);
  EXPECT_EQ(c.num_parameters() - c.vocab_size * c.hidden_size, 440467456);
}

TEST(Qwen3Model, TableHasTheNormsAsReplicatedNoDecayTensors) {
  auto m = build_model(ModelConfig::preset("qwen3-debug"));
  int found = 0;
  for (const ParamSpec& s : m->params().specs()) {
    if (s.role != Role::QNormW && s.role != Role::KNormW) continue;
    ++found;
    EXPECT_EQ(s.shape, (Shape{16})) << s.name;
    EXPECT_FALSE(s.decay) << s.name;
    EXPECT_EQ(s.shard, ShardRule::Replicated) << s.name;
    EXPECT_EQ(s.init, Init::Ones) << s.name;
  }
  EXPECT_EQ(found, 4);
  EXPECT_NE(m->params().find("model.layers.1.self_attn.k_norm.weight"), nullptr);
  EXPECT_TRUE(m->arch().qk_norm);
  EXPECT_FALSE(build_model(ModelConfig::preset("llama-debug"))->arch().qk_norm);
}

// fp32 lathe against the float64 reference: logits, loss and every gradient (q_norm / k_norm
// included) within 1e-5. The reference without q_norm must then fail: the test sees the norm.
TEST(Qwen3Model, MatchesTorchReferenceAndDroppingTheQNormFails) {
  const fs::path dir = write_case(qwen3_cfg(), 2, 9);
  int rc = -1;
  const std::string out = oracle(dir, "", rc);
  EXPECT_EQ(rc, 0) << out;
  int broken_rc = -1;
  const std::string broken = oracle(dir, "--drop-q-norm", broken_rc);
  EXPECT_NE(broken_rc, 0) << "the reference without q_norm agreed with lathe:\n" << broken;
  EXPECT_NE(broken.find("MISMATCH"), std::string::npos) << broken;
  if (rc == 0 && broken_rc != 0) fs::remove_all(dir);
}

// The arena: the pre-norm q/k rows and their rstd per layer (none, selective), once in the shared
// set (full); the estimate is the arena; every recompute mode gives the same bits.
TEST(Qwen3Model, ArenaHoldsTheSavedRowsAndRecomputeIsBitIdentical) {
  const ModelConfig cfg = qwen3_cfg();
  const int64_t B = 2, T = 7, N = B * T, H = 4, KV = 2, D = 16;
  const auto toks = model_test::random_tokens(N, cfg.vocab_size, 5),
             tgts = model_test::random_tokens(N, cfg.vocab_size, 6);
  std::vector<float> ref_grads;
  double ref_loss = 0;
  for (Recompute rc : {Recompute::None, Recompute::Selective, Recompute::Full}) {
    SCOPED_TRACE(recompute_name(rc));
    auto m = model_test::perturbed_model(cfg);
    m->allocate(B, T, 2, rc);
    const ActivationPlan& plan = m->activation_plan();
    int saved = 0, rstd = 0;
    for (const ActivationEntry& e : plan.entries) {
      const std::string name = e.name;
      if (name == "qk_saved" || name == "shared.qk_saved") {
        ++saved;
        EXPECT_EQ(e.count, N * (H + KV) * D);
      }
      if (name == "qk_rstd" || name == "shared.qk_rstd") {
        ++rstd;
        EXPECT_EQ(e.count, N * (H + KV));
      }
    }
    const int want = rc == Recompute::Full ? 1 : static_cast<int>(cfg.num_hidden_layers);
    EXPECT_EQ(saved, want);
    EXPECT_EQ(rstd, want);
    EXPECT_EQ(estimate_memory(cfg, B, T, 2, 1, DType::F32, rc).activation_bytes,
              static_cast<int64_t>(m->activation_bytes()));
    m->zero_grad();
    const double loss = m->forward_backward(toks.data(), tgts.data(), B, T, 1.0f / N, true);
    std::vector<float> g(m->grad_data(), m->grad_data() + m->num_params());
    if (rc == Recompute::None) {
      ref_loss = loss;
      ref_grads = g;
      continue;
    }
    EXPECT_EQ(loss, ref_loss);
    EXPECT_TRUE(g == ref_grads) << "gradients differ from recompute none";
  }
  // The llama model of the same shape has neither entry.
  ModelConfig llama = cfg;
  llama.model_type = "llama";
  llama.qk_norm = false;
  for (const ActivationEntry& e : Model::plan_activations(llama, B, T).entries)
    EXPECT_EQ(std::string(e.name).find("qk_"), std::string::npos) << e.label();
}

// The ONNX graph carries the norms (onnxruntime runs it in tests/models/test_qwen3_hf.py).
TEST(Qwen3Model, OnnxGraphHoldsTheNormWeights) {
  auto m = build_model(ModelConfig::preset("qwen3-debug"));
  m->init_weights(1);
  const fs::path dir = fs::temp_directory_path() / fmt::format("lathe_qwen3_export_{}", getpid());
  model_test::fresh_dir(dir);
  (void)save_onnx(*m, (dir / "m.onnx").string(), {});
  std::ifstream f(dir / "m.onnx", std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  for (const char* name : {"model.layers.0.self_attn.q_norm.weight", "model.layers.1.self_attn.k_norm.weight"})
    EXPECT_NE(bytes.find(name), std::string::npos) << name;
  fs::remove_all(dir);
}
