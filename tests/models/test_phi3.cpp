// Phi-3 (model_type phi3: Phi-3 / 3.5 / Phi-4) against transformers 4.45.2's Phi3ForCausalLM, the
// oracle (tests/models/hf_rope_reference.py `model`: fp32, eager attention, use_cache=False):
//  * Parity: lathe's HF export (fused self_attn.qkv_proj = [q; k; v], mlp.gate_up_proj =
//    [gate; up]) loaded by transformers: logits, loss and every gradient within 1e-5 of
//    max|torch| per tensor, q/k rows scaled to std ~0.4 so attention and RoPE matter, for
//    (a) plain RoPE (untied and tied), (b) longrope with short factors (T <= original 16) and with
//    long factors (T = 24 > 16: Phi3LongRoPEScaledRotaryEmbedding picks by the pass length), and
//    (c) sliding_window 5 over 20 tokens (6 keys: flash-attn's window_size=(5, 5), the only 4.45
//    path that applies it; the oracle gets that mask), also with longrope. The tokens hold the pad
//    id (nn.Embedding padding_idx: its row gets no gradient from lookups; tied: from the head only).
//  * Negative: lathe with gate|up swapped, or the window one key narrower (mistral's semantics),
//    fails the same oracle.
//  * KV cache decoding equals the full forward (window and long factors).
//  * Config: Phi-3 config.json import (su -> longrope, defaults), round trip, refusals.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>

#include "config/model_config.h"
#include "config/rope_scaling.h"
#include "error_of.h"
#include "interop/hf_weights.h"
#include "io/safetensors.h"
#include "model_fixtures.h"
#include "models/kv_cache.h"

namespace fs = std::filesystem;
using namespace lathe;
using namespace lathe::model_test;
using json = nlohmann::json;
using lathe::test::error_of;

namespace {

// A small phi3 (head_dim 10: 5 frequencies), GQA 4 / 2.
json phi3_json(const json& rope_scaling, const json& window, bool tied = false) {
  return {{"model_type", "phi3"},
          {"architectures", {"Phi3ForCausalLM"}},
          {"vocab_size", 64},
          {"hidden_size", 40},
          {"intermediate_size", 56},
          {"num_hidden_layers", 2},
          {"num_attention_heads", 4},
          {"num_key_value_heads", 2},
          {"max_position_embeddings", 64},
          {"original_max_position_embeddings", 16},
          {"rope_theta", 500.0},
          {"rms_norm_eps", 1e-5},
          {"tie_word_embeddings", tied},
          {"resid_pdrop", 0.0},
          {"embd_pdrop", 0.0},
          {"attention_dropout", 0.0},
          {"hidden_act", "silu"},
          {"pad_token_id", 63},
          {"rope_scaling", rope_scaling},
          {"sliding_window", window}};
}

json longrope(const char* type = "longrope") {
  return {{"type", type}, {"short_factor", {1.0, 1.25, 1.5, 2.0, 2.5}}, {"long_factor", {1.5, 3.0, 5.0, 8.0, 12.0}}};
}

// Phi-4-mini's partial rotary: 0.6 of head_dim 10 -> the first 6 dims rotate (3 frequencies).
json partial(json j) {
  j["partial_rotary_factor"] = 0.6;
  return j;
}
json longrope3() { return {{"type", "longrope"}, {"short_factor", {1.0, 1.5, 2.0}}, {"long_factor", {2.0, 4.0, 9.0}}}; }

struct Case {
  std::string name;
  ModelConfig cfg;
  int64_t T;
};

std::vector<Case> cases() {
  auto cfg = [](const json& j) { return ModelConfig::from_hf_json(j, "test"); };
  return {
      {"plain", cfg(phi3_json(nullptr, nullptr)), 20},
      {"plain_tied", cfg(phi3_json(nullptr, nullptr, true)), 20},
      {"longrope_short", cfg(phi3_json(longrope(), nullptr)), 14},
      {"longrope_long", cfg(phi3_json(longrope("su"), nullptr)), 24},
      {"window", cfg(phi3_json(nullptr, 5)), 20},
      {"window_longrope", cfg(phi3_json(longrope(), 5)), 24},
      {"partial", cfg(partial(phi3_json(nullptr, nullptr))), 20},
      {"partial_longrope_long", cfg(partial(phi3_json(longrope3(), nullptr))), 24},
  };
}

// Deterministic init; the q and k rows of qkv_proj (the first (H + KV) x D) scaled by 20 (std 0.02
// -> 0.4), so that scores, RoPE and the window move the output.
std::unique_ptr<Model> make_model(const ModelConfig& cfg) {
  auto m = perturbed_model(cfg);
  const int64_t qk_rows = (cfg.num_attention_heads + cfg.num_key_value_heads) * cfg.head_dim();
  for (const ParamSpec& s : m->params().specs())
    if (s.name.find("qkv_proj.weight") != std::string::npos)
      for (int64_t i = 0; i < qk_rows * cfg.hidden_size; ++i) m->param_data()[s.offset + i] *= 20.0f;
  m->refresh_compute_weights();
  return m;
}

// Swaps the gate and up halves of every gate_up_proj in the model's parameters.
void swap_gate_up(Model& m) {
  for (const ParamSpec& s : m.params().specs())
    if (s.name.find("gate_up_proj.weight") != std::string::npos) {
      float* p = m.param_data() + s.offset;
      std::swap_ranges(p, p + s.numel() / 2, p + s.numel() / 2);
    }
  m.refresh_compute_weights();
}

std::string run_oracle(const std::string& dir, const std::string& env = "") {
  const std::string cmd =
      fmt::format("{} /usr/bin/python3 {}/tests/models/hf_rope_reference.py model {} 2>&1", env, LATHE_SOURCE_DIR, dir);
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return "popen failed";
  std::string out;
  char buf[4096];
  while (fgets(buf, sizeof buf, p)) out += buf;
  const int rc = pclose(p);
  std::cout << out;
  return rc == 0 ? "" : (out.empty() ? "exit code " + std::to_string(rc) : out);
}

// Exports `hf_model` (the weights transformers loads), then runs `lathe_model` (the same weights,
// or a broken copy) forward and backward and writes its outputs for the oracle.
std::string compare(const Case& c, Model& hf_model, Model& lathe_model, const std::string& tag,
                    const std::string& env = "") {
  const int64_t B = 2, T = c.T, N = B * T, V = c.cfg.vocab_size;
  const fs::path dir = fs::temp_directory_path() / fmt::format("lathe_phi3_{}_{}_{}", c.name, tag, getpid());
  fs::remove_all(dir);
  fs::create_directories(dir);
  save_hf_model(hf_model, (dir / "model").string());
  lathe_model.allocate(B, T);
  Rng rng(123);
  std::vector<int32_t> toks(static_cast<size_t>(N)), tgts(toks.size());
  for (auto& t : toks) t = static_cast<int32_t>(rng.below(V));
  for (auto& t : tgts) t = static_cast<int32_t>(rng.below(V));
  // The pad token (Phi3Model's nn.Embedding padding_idx: no gradient into its row from lookups).
  toks[3] = toks[T + 5] = static_cast<int32_t>(c.cfg.pad_token_id);
  std::vector<float> logits(static_cast<size_t>(N * V));
  lathe_model.forward_logits(toks.data(), B, T, logits.data());
  lathe_model.zero_grad();
  const float loss =
      static_cast<float>(lathe_model.forward_backward(toks.data(), tgts.data(), B, T, 1.0f / N, true) / N);
  io::write_safetensors((dir / "outputs.safetensors").string(), {{"tokens", DType::I32, Shape{B, T}, toks.data()},
                                                                 {"targets", DType::I32, Shape{B, T}, tgts.data()},
                                                                 {"logits", DType::F32, Shape{B, T, V}, logits.data()},
                                                                 {"loss", DType::F32, Shape{}, &loss}});
  save_hf_tensors(lathe_model, lathe_model.grad_data(), (dir / "grads.safetensors").string());
  const std::string err = run_oracle(dir.string(), env);
  fs::remove_all(dir);
  return err;
}

}  // namespace

class Phi3Parity : public ::testing::TestWithParam<int> {};

TEST_P(Phi3Parity, LogitsLossGradientsMatchTransformers) {
  const Case c = cases()[static_cast<size_t>(GetParam())];
  auto m = make_model(c.cfg);
  EXPECT_EQ(compare(c, *m, *m, "ok"), "") << c.name;
}

INSTANTIATE_TEST_SUITE_P(Kinds, Phi3Parity, ::testing::Range(0, static_cast<int>(cases().size())),
                         [](const auto& info) { return cases()[static_cast<size_t>(info.param)].name; });

// The oracle tells the layouts apart: lathe computing with gate and up swapped (or transformers
// reading them swapped) is far outside the tolerance.
TEST(Phi3, SwappedGateUpFailsTheOracle) {
  const Case c = cases()[0];
  auto hf = make_model(c.cfg);
  auto broken = make_model(c.cfg);
  swap_gate_up(*broken);
  const std::string err = compare(c, *hf, *broken, "swap");
  EXPECT_NE(err.find("MISMATCH logits"), std::string::npos) << err;
}

// The window's width: transformers' flash path (S + 1 keys) is what lathe computes; the oracle with
// a window one key wider (S + 2) or narrower (S, Mistral's eager semantics) disagrees.
TEST(Phi3, WindowOffByOneFailsTheOracle) {
  const Case c = cases()[4];
  ASSERT_EQ(c.name, "window");
  EXPECT_EQ(c.cfg.layer_window(0), 6);
  auto m = make_model(c.cfg);
  for (const char* delta : {"1", "-1"}) {
    const std::string err = compare(c, *m, *m, "delta", fmt::format("PHI3_WINDOW_DELTA={}", delta));
    EXPECT_NE(err.find("MISMATCH logits"), std::string::npos) << delta << ": " << err;
  }
}

TEST(Phi3, KvCacheEqualsFullForward) {
  for (const Case& c : cases()) {
    const int64_t T = c.T + 5, V = c.cfg.vocab_size, prompt = 7;
    auto m = make_model(c.cfg);
    m->allocate(1, T);
    Rng rng(5);
    std::vector<int32_t> toks(static_cast<size_t>(T));
    for (auto& t : toks) t = static_cast<int32_t>(rng.below(V));
    std::vector<float> full(static_cast<size_t>(T * V)), got(static_cast<size_t>(V));
    m->forward_logits(toks.data(), 1, T, full.data());
    KvCache cache(*m, 1, T);
    decode_chunk(*m, cache, toks.data(), prompt, got.data());
    float worst = 0;
    for (int64_t t = prompt - 1; t < T; ++t) {
      if (t >= prompt) decode_chunk(*m, cache, toks.data() + t, 1, got.data());
      for (int64_t v = 0; v < V; ++v) worst = std::max(worst, std::fabs(got[v] - full[t * V + v]));
    }
    EXPECT_LE(worst, 1e-4f) << c.name;
  }
}

// Short or long factors by the pass length (transformers 4.45.2 Phi3LongRoPEScaledRotaryEmbedding):
// long past original_max_position_embeddings, short up to it; the attention factor
// sqrt(1 + ln(64/16) / ln 16) either way.
TEST(Phi3, LongropePicksFactorsByPassLength) {
  const ModelConfig c = ModelConfig::from_hf_json(phi3_json(longrope(), nullptr), "t");
  const RopeFrequencies s = rope_frequencies(c, 16), l = rope_frequencies(c, 17);
  const std::vector<float> plain = rope_default_inv_freq(10, 500.0);
  EXPECT_FLOAT_EQ(s.inv_freq[4], plain[4] / 2.5f);
  EXPECT_FLOAT_EQ(l.inv_freq[4], plain[4] / 12.0f);
  EXPECT_FLOAT_EQ(s.attention_factor, static_cast<float>(std::sqrt(1 + std::log(4.0) / std::log(16.0))));
  EXPECT_EQ(s.attention_factor, l.attention_factor);
  // A model allocated for 24 tokens running 12 uses the short factors: as a model allocated for 12.
  auto a = make_model(c), b = make_model(c);
  a->allocate(1, 24);
  b->allocate(1, 12);
  std::vector<int32_t> toks(12);
  for (int i = 0; i < 12; ++i) toks[static_cast<size_t>(i)] = (5 * i + 1) % 64;
  std::vector<float> x(12 * 64), y(12 * 64);
  a->forward_logits(toks.data(), 1, 12, x.data());
  b->forward_logits(toks.data(), 1, 12, y.data());
  EXPECT_EQ(x, y);
}

TEST(Phi3, ConfigImportAndRoundTrip) {
  // Phi-3-mini-128k-instruct's config.json shape (old "su" name, top-level original 4096).
  json j = phi3_json(longrope("su"), 2047);
  j["max_position_embeddings"] = 131072;
  j["original_max_position_embeddings"] = 4096;
  j["bos_token_id"] = 1;
  j["eos_token_id"] = 32000;
  const ModelConfig c = ModelConfig::from_hf_json(j, "t");
  EXPECT_EQ(c.family, "llama");
  EXPECT_EQ(c.rope_scaling.type, "longrope");
  EXPECT_EQ(c.layer_window(1), 2048);
  EXPECT_EQ(c.pad_token_id, 63);
  const json out = c.to_hf_json();
  EXPECT_EQ(out["architectures"][0], "Phi3ForCausalLM");
  EXPECT_EQ(out["rope_scaling"].size(), 3u) << out["rope_scaling"].dump();  // Phi3Config's exact 3 keys
  EXPECT_EQ(out["rope_scaling"]["type"], "longrope");
  EXPECT_EQ(out["original_max_position_embeddings"], 4096);
  EXPECT_EQ(out["sliding_window"], 2047);
  EXPECT_FALSE(out.contains("head_dim"));
  const ModelConfig back = ModelConfig::from_hf_json(out, "round trip");
  EXPECT_TRUE(back == c) << out.dump();
  EXPECT_EQ(back.to_hf_json(), out);
  // Phi3Config defaults (absent keys).
  const ModelConfig d = ModelConfig::from_hf_json({{"model_type", "phi3"}, {"num_hidden_layers", 1}}, "t");
  EXPECT_EQ(d.vocab_size, 32064);
  EXPECT_EQ(d.hidden_size, 3072);
  EXPECT_EQ(d.intermediate_size, 8192);
  EXPECT_EQ(d.max_position_embeddings, 4096);
  EXPECT_EQ(d.rope_scaling.config_original_max_position_embeddings, 4096);
  EXPECT_EQ(d.norm_eps, 1e-5);
  EXPECT_EQ(d.eos_token_id, 32000);
  EXPECT_EQ(d.pad_token_id, 32000);
  EXPECT_EQ(d.sliding_window, 0);
  // The preset.
  const ModelConfig p = ModelConfig::preset("phi3-debug");
  EXPECT_EQ(p.layer_window(0), 24);
  EXPECT_TRUE(ModelConfig::from_hf_json(p.to_hf_json(), "preset") == p);
  auto m = build_model(p);
  EXPECT_NE(m->params().find("model.layers.0.self_attn.qkv_proj.weight"), nullptr);
  EXPECT_EQ(m->params().at("model.layers.1.mlp.gate_up_proj.weight").shape, (Shape{192, 48}));
  EXPECT_EQ(m->num_params(), p.num_parameters());
}

TEST(Phi3, RefusalsNameKeyAndFix) {
  auto err = [](const std::function<void(json&)>& edit) {
    json j = phi3_json(longrope(), nullptr);
    edit(j);
    return error_of([&] { ModelConfig::from_hf_json(j, "config.json"); });
  };
  // partial rotary: longrope's factors count the rotated pairs (0.6 x 10 -> 3), not the head's 5.
  std::string e = err([](json& j) { j["partial_rotary_factor"] = 0.6; });
  EXPECT_NE(e.find("short_factor has 5 entries"), std::string::npos) << e;
  e = err([](json& j) { j["rope_scaling"]["factor"] = 4.0; });
  EXPECT_NE(e.find("rope_scaling.factor: is not read by transformers 4.45's phi3"), std::string::npos) << e;
  e = err([](json& j) { j["rope_scaling"]["type"] = "linear"; });
  EXPECT_NE(e.find("rope_scaling.type: 'linear' is not supported"), std::string::npos) << e;
  e = err([](json& j) { j["rope_scaling"].erase("long_factor"); });
  EXPECT_NE(e.find("rope_scaling.long_factor: missing"), std::string::npos) << e;
  e = err([](json& j) { j["head_dim"] = 16; });
  EXPECT_NE(e.find("head_dim: 16"), std::string::npos) << e;
  e = err([](json& j) { j["attention_bias"] = true; });
  EXPECT_NE(e.find("attention_bias"), std::string::npos) << e;
  e = err([](json& j) { j["rope_scaling"]["short_factor"] = {1.0, 2.0}; });
  EXPECT_NE(e.find("short_factor has 2 entries"), std::string::npos) << e;
  EXPECT_EQ(err([](json& j) { j["head_dim"] = 10; }), "");  // equal to hidden / heads: same model
  // Hostile values: each refused naming the key, no crash.
  e = err([](json& j) { j["rope_scaling"] = json::array({1, 2}); });
  EXPECT_NE(e.find("config.json: rope_scaling: expected an object or null"), std::string::npos) << e;
  e = err([](json& j) { j["rope_scaling"]["short_factor"][2] = "x"; });
  EXPECT_NE(e.find("short_factor[2]"), std::string::npos) << e;
  e = err([](json& j) { j["rope_scaling"]["type"] = 7; });
  EXPECT_NE(e.find("rope_scaling.type: missing"), std::string::npos) << e;
  e = err([](json& j) { j["sliding_window"] = -3; });
  EXPECT_NE(e.find("sliding_window"), std::string::npos) << e;
  e = err([](json& j) { j["sliding_window"] = "wide"; });
  EXPECT_NE(e.find("sliding_window"), std::string::npos) << e;
  e = err([](json& j) { j["original_max_position_embeddings"] = int64_t{1} << 40; });
  EXPECT_NE(e.find("original_max_position_embeddings"), std::string::npos) << e;
  // A recipe (strict): unknown keys get a suggestion, dropout is refused.
  json rj = phi3_json(nullptr, 5);
  rj["sliding_windw"] = 5;
  e = error_of([&] { ModelConfig::from_hf_json(rj, "r.yaml", "model.", true); });
  EXPECT_NE(e.find("did you mean 'model.sliding_window'"), std::string::npos) << e;
  rj.erase("sliding_windw");
  rj["embd_pdrop"] = 0.1;
  e = error_of([&] { ModelConfig::from_hf_json(rj, "r.yaml", "model.", true); });
  EXPECT_NE(e.find("embd_pdrop: 0.1 is not supported"), std::string::npos) << e;
  // Dropout in a config.json: loads, listed as not used.
  json j = phi3_json(nullptr, nullptr);
  j["resid_pdrop"] = 0.1;
  EXPECT_NE(ModelConfig::from_hf_json(j, "t").ignored_note().find("resid_pdrop (0.1: lathe trains without dropout)"),
            std::string::npos);
}
