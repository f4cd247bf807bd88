// RoPE scaling and partial rotary (config/rope_scaling.h) against transformers 4.45.2, the oracle
// (tests/models/hf_rope_reference.py):
//  * InvFreq: rope_frequencies() (inv_freq and the cos/sin attention factor) against
//    ROPE_INIT_FUNCTIONS for every type at odd sizes (head_dim 10, 14, 22: half 5, 7, 11), dynamic
//    below and beyond max_position_embeddings, longrope short and long; plain RoPE bit for bit.
//  * Parity: a llama with each rope_scaling type (dynamic at seq_len > max_position_embeddings)
//    and a qwen2 with yarn, fp32, q/k projections scaled to std ~0.4 so RoPE matters: logits, loss
//    and every gradient within 1e-5 of max|torch| per tensor, transformers' own
//    LlamaForCausalLM / Qwen2ForCausalLM loading lathe's config.json.
//  * Partial rotary (partial_rotary_factor 0.6 of head_dim 10: 6 rotated dims): transformers 4.45's
//    llama computes cos/sin of the rotated width but applies them to the whole head (a shape
//    error), so the oracle is the same transformers model with apply_rotary_pos_emb replaced by
//    GPT-NeoX's partial rotation (rotate q[..., :rot], pass q[..., rot:] through).
//  * KV cache: decoding equals the full forward over the cache's length, scaled kinds included
//    (dynamic beyond max_position_embeddings), and partial rotary.
//  * Config: config.json round trip, recipe-style strict parsing, refusals naming key and fix.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>

#include "config/model_config.h"
#include "config/rope_scaling.h"
#include "core/rng.h"
#include "error_of.h"
#include "interop/hf_weights.h"
#include "io/safetensors.h"
#include "models/kv_cache.h"
#include "models/model.h"

namespace fs = std::filesystem;
using namespace lathe;
using json = nlohmann::json;
using lathe::test::error_of;

namespace {

// A small llama (head_dim 10: half 5) whose config.json carries `rope`.
ModelConfig cfg_with(const std::string& type, const json& rope_scaling, int64_t P = 32, double theta = 500.0,
                     int64_t C = 40, int64_t H = 4) {
  json j = {{"model_type", type},
            {"vocab_size", 64},
            {"hidden_size", C},
            {"intermediate_size", 56},
            {"num_hidden_layers", 2},
            {"num_attention_heads", H},
            {"num_key_value_heads", H % 2 == 0 ? 2 : H},
            {"max_position_embeddings", P},
            {"rope_theta", theta},
            {"rms_norm_eps", 1e-5},
            {"tie_word_embeddings", false},
            {"rope_scaling", rope_scaling}};
  return ModelConfig::from_hf_json(j, "test");
}

json longrope(int64_t n, double factor) {
  json s = json::array(), l = json::array();
  for (int64_t i = 0; i < n; ++i) {
    s.push_back(1.0 + 0.25 * static_cast<double>(i));
    l.push_back(1.5 + 1.75 * static_cast<double>(i));
  }
  return {{"rope_type", "longrope"}, {"short_factor", s}, {"long_factor", l}, {"factor", factor}};
}

struct Case {
  std::string name;
  ModelConfig cfg;
  int64_t T;
};

std::vector<Case> parity_cases() {
  std::vector<Case> c;
  c.push_back({"linear", cfg_with("llama", {{"type", "linear"}, {"factor", 2.5}}), 24});
  c.push_back({"dynamic", cfg_with("llama", {{"rope_type", "dynamic"}, {"factor", 3.0}}, 16), 29});
  c.push_back({"yarn", cfg_with("llama", {{"rope_type", "yarn"}, {"factor", 4.0}, {"beta_fast", 16.0}}, 64, 50.0), 24});
  c.push_back({"llama3",
               cfg_with("llama",
                        {{"rope_type", "llama3"},
                         {"factor", 4.0},
                         {"low_freq_factor", 1.0},
                         {"high_freq_factor", 4.0},
                         {"original_max_position_embeddings", 16}},
                        64),
               24});
  c.push_back({"longrope", cfg_with("llama", longrope(5, 4.0), 32), 24});
  c.push_back({"qwen2_yarn", cfg_with("qwen2", {{"type", "yarn"}, {"factor", 2.0}, {"attention_factor", 1.3}}, 32), 20});
  ModelConfig pr = cfg_with("llama", nullptr);
  pr.partial_rotary_factor = 0.6;  // 6 of 10 dims
  pr.validate("test");
  c.push_back({"partial_rotary", pr, 20});
  ModelConfig pry = cfg_with("llama", {{"rope_type", "yarn"}, {"factor", 4.0}}, 64, 50.0);
  pry.partial_rotary_factor = 0.6;
  pry.validate("test");
  c.push_back({"partial_rotary_yarn", pry, 20});
  return c;
}

// init_weights, then q/k projections scaled to std ~0.4 (RoPE then moves the attention), norms
// and biases perturbed.
std::unique_ptr<Model> make_model(const ModelConfig& cfg, int64_t B, int64_t T) {
  auto m = build_model(cfg);
  m->init_weights(42);
  Rng prng(7);
  for (const ParamSpec& s : m->params().specs()) {
    float* p = m->param_data() + s.offset;
    if (s.init != Init::Normal) {
      for (int64_t i = 0; i < s.numel(); ++i) p[i] += 0.1f * prng.normal();
    } else if (s.name.find("q_proj.weight") != std::string::npos || s.name.find("k_proj.weight") != std::string::npos) {
      for (int64_t i = 0; i < s.numel(); ++i) p[i] *= 20.0f;
    }
  }
  m->refresh_compute_weights();
  m->allocate(B, T);
  return m;
}

std::string run_reference(const std::string& mode, const std::string& path) {
  const std::string cmd =
      fmt::format("/usr/bin/python3 {}/tests/models/hf_rope_reference.py {} {} 2>&1", LATHE_SOURCE_DIR, mode, path);
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return "popen failed";
  std::string out;
  char buf[4096];
  while (fgets(buf, sizeof buf, p)) out += buf;
  const int rc = pclose(p);
  std::cout << out;
  return rc == 0 ? "" : (out.empty() ? "exit code " + std::to_string(rc) : out);
}

}  // namespace

TEST(RopeScaling, InvFreqMatchesTransformers) {
  json cases = json::array();
  auto add = [&](const ModelConfig& c, int64_t seq_len) {
    const RopeFrequencies f = rope_frequencies(c, seq_len);
    cases.push_back({{"config", c.to_hf_json()},
                     {"seq_len", seq_len},
                     {"inv_freq", f.inv_freq},
                     {"attention_factor", f.attention_factor}});
  };
  for (auto [C, H] : {std::pair<int64_t, int64_t>{40, 4}, {56, 4}, {66, 3}}) {  // head_dim 10, 14, 22
    for (double theta : {10000.0, 500000.0, 37.5}) {
      add(cfg_with("llama", nullptr, 4096, theta, C, H), 4096);
      add(cfg_with("llama", {{"rope_type", "linear"}, {"factor", 3.7}}, 4096, theta, C, H), 10);
      for (int64_t L : {100, 4096, 4097, 9999})
        add(cfg_with("llama", {{"rope_type", "dynamic"}, {"factor", 2.5}}, 4096, theta, C, H), L);
      add(cfg_with("llama", {{"rope_type", "yarn"}, {"factor", 8.0}}, 4096, theta, C, H), 10);
      add(cfg_with("llama", {{"rope_type", "yarn"}, {"factor", 3.0}, {"beta_fast", 8.0}, {"beta_slow", 2.0}}, 2048,
                   theta, C, H),
          10);
      add(cfg_with("llama", {{"rope_type", "yarn"}, {"factor", 1.0}, {"attention_factor", 0.9}}, 4096, theta, C, H),
          10);
      add(cfg_with("llama",
                   {{"rope_type", "llama3"},
                    {"factor", 8.0},
                    {"low_freq_factor", 1.0},
                    {"high_freq_factor", 4.0},
                    {"original_max_position_embeddings", 64}},
                   4096, theta, C, H),
          10);
      const int64_t half = C / H / 2;
      add(cfg_with("llama", longrope(half, 16.0), 4096, theta, C, H), 10);  // long factors
      add(cfg_with("llama", longrope(half, 1.0), 4096, theta, C, H), 10);   // short factors
      ModelConfig phi = cfg_with("llama", longrope(half, 1.0), 131072, theta, C, H);
      phi.rope_scaling.factor.reset();
      phi.rope_scaling.config_original_max_position_embeddings = 4096;  // Phi-3's top-level key
      add(phi, 10);
      ModelConfig pr = cfg_with("llama", {{"rope_type", "yarn"}, {"factor", 8.0}}, 4096, theta, C, H);
      pr.partial_rotary_factor = 0.75;
      if (pr.rotary_dim() % 2 == 0) add(pr, 10);
    }
  }
  const fs::path file = fs::temp_directory_path() / fmt::format("lathe_rope_freqs_{}.json", getpid());
  std::ofstream(file) << cases.dump();
  const std::string err = run_reference("freqs", file.string());
  EXPECT_EQ(err, "");
  if (err.empty()) fs::remove(file);
}

class RopeParity : public ::testing::TestWithParam<int> {};

TEST_P(RopeParity, LogitsLossGradientsMatchTransformers) {
  const Case c = parity_cases()[static_cast<size_t>(GetParam())];
  const int64_t B = 2, T = c.T, N = B * T, V = c.cfg.vocab_size;
  const fs::path dir = fs::temp_directory_path() / fmt::format("lathe_rope_{}_{}", c.name, getpid());
  fs::remove_all(dir);
  fs::create_directories(dir);
  auto m = make_model(c.cfg, B, T);
  save_hf_model(*m, (dir / "model").string());
  Rng rng(123);
  std::vector<int32_t> toks(static_cast<size_t>(N)), tgts(toks.size());
  for (auto& t : toks) t = static_cast<int32_t>(rng.below(V));
  for (auto& t : tgts) t = static_cast<int32_t>(rng.below(V));
  std::vector<float> logits(static_cast<size_t>(N * V));
  m->forward_logits(toks.data(), B, T, logits.data());
  m->zero_grad();
  const float loss = static_cast<float>(m->forward_backward(toks.data(), tgts.data(), B, T, 1.0f / N, true) / N);
  io::write_safetensors((dir / "outputs.safetensors").string(),
                        {{"tokens", DType::I32, Shape{B, T}, toks.data()},
                         {"targets", DType::I32, Shape{B, T}, tgts.data()},
                         {"logits", DType::F32, Shape{B, T, V}, logits.data()},
                         {"loss", DType::F32, Shape{}, &loss}});
  save_hf_tensors(*m, m->grad_data(), (dir / "grads.safetensors").string());
  const std::string err = run_reference("model", dir.string());
  EXPECT_EQ(err, "") << c.name;
  if (err.empty()) fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Kinds, RopeParity, ::testing::Range(0, static_cast<int>(parity_cases().size())),
                         [](const auto& info) { return parity_cases()[static_cast<size_t>(info.param)].name; });

// Decoding with the KV cache (prompt prefill, then one token at a time) gives the logits of the
// full forward over the cache's max_seq tokens at every position, for every kind; dynamic NTK
// with max_seq beyond max_position_embeddings too (both use the frequencies of max_seq tokens).
TEST(RopeScaling, KvCacheEqualsFullForward) {
  for (const Case& c : parity_cases()) {
    const int64_t T = c.T + 5, V = c.cfg.vocab_size, prompt = 7;
    auto m = make_model(c.cfg, 1, T);
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
    std::printf("%s: kv cache vs full forward over %lld tokens: worst |logit diff| %.3g\n", c.name.c_str(),
                static_cast<long long>(T), worst);
  }
}

// Dynamic NTK follows transformers' max(position_ids) + 1: a 29-token pass (max_position_embeddings
// 16) of two documents whose positions restart (longest 15) keeps the plain frequencies, bit for
// bit, while the same tokens as one document get the scaled ones.
TEST(RopeScaling, DynamicFollowsDocumentPositions) {
  const int64_t T = 29, V = 64;
  ModelConfig dyn = cfg_with("llama", {{"rope_type", "dynamic"}, {"factor", 3.0}}, 16);
  auto m = make_model(dyn, 1, T);
  auto plain = make_model(cfg_with("llama", nullptr, 16), 1, T);
  std::vector<int32_t> toks(T), start(T), pos(T);
  for (int64_t t = 0; t < T; ++t) {
    toks[t] = static_cast<int32_t>((7 * t + 3) % V);
    start[t] = t < 14 ? 0 : 14;
    pos[t] = static_cast<int32_t>(t - start[t]);
  }
  std::vector<float> a(T * V), b(T * V), c(T * V);
  m->set_documents(start.data(), pos.data(), 1, T);
  plain->set_documents(start.data(), pos.data(), 1, T);
  m->forward_logits(toks.data(), 1, T, a.data());
  plain->forward_logits(toks.data(), 1, T, b.data());
  EXPECT_EQ(a, b) << "documents of <= 16 positions: plain RoPE";
  m->set_documents(nullptr, nullptr, 1, T);
  plain->set_documents(nullptr, nullptr, 1, T);
  m->forward_logits(toks.data(), 1, T, a.data());
  plain->forward_logits(toks.data(), 1, T, c.data());
  float d = 0;
  for (int64_t i = 0; i < T * V; ++i) d = std::max(d, std::fabs(a[i] - c[i]));
  EXPECT_GT(d, 1e-3f) << "one 29-token document: NTK-scaled frequencies";
}

TEST(RopeScaling, ConfigRoundTrip) {
  for (const Case& c : parity_cases()) {
    const json j = c.cfg.to_hf_json();
    const ModelConfig back = ModelConfig::from_hf_json(j, "round trip");
    EXPECT_TRUE(back == c.cfg) << c.name << ": " << j.dump();
    EXPECT_EQ(back.to_hf_json(), j) << c.name;
  }
  EXPECT_TRUE(cfg_with("llama", nullptr).to_hf_json()["rope_scaling"].is_null());
  EXPECT_FALSE(cfg_with("llama", nullptr).to_hf_json().contains("partial_rotary_factor"));
  // The old key is kept as written.
  EXPECT_EQ(cfg_with("llama", {{"type", "linear"}, {"factor", 2.0}}).to_hf_json()["rope_scaling"]["type"], "linear");
  // {"rope_type": "default"} is plain RoPE, bit for bit.
  const ModelConfig d = cfg_with("llama", {{"rope_type", "default"}});
  EXPECT_EQ(rope_frequencies(d, 10).inv_freq, rope_frequencies(cfg_with("llama", nullptr), 10).inv_freq);
}

TEST(RopeScaling, RefusalsNameKeyAndFix) {
  auto err = [](const std::string& type, const json& rs) { return error_of([&] { cfg_with(type, rs); }); };
  {
    std::string e = err("llama", {{"rope_type", "ntk"}, {"factor", 2.0}});
    EXPECT_NE(e.find("rope_scaling.rope_type"), std::string::npos) << e;
    EXPECT_NE(e.find("'ntk'"), std::string::npos) << e;
    e = err("llama", {{"rope_type", "llama3"}, {"factor", 8.0}});
    EXPECT_NE(e.find("rope_scaling.high_freq_factor: missing"), std::string::npos) << e;
    e = err("llama", {{"rope_type", "linear"}});
    EXPECT_NE(e.find("rope_scaling.factor: missing"), std::string::npos) << e;
    e = err("llama", {{"type", "su"}, {"short_factor", {1.0}}, {"long_factor", {1.0}}});
    EXPECT_NE(e.find("write \"longrope\""), std::string::npos) << e;
    e = err("llama", {{"rope_type", "yarn"}, {"factor", 4.0}, {"mscale", 1.0}});
    EXPECT_NE(e.find("rope_scaling.mscale: transformers reads mscale and mscale_all_dim together"), std::string::npos)
        << e;
    e = err("llama", {{"rope_type", "linear"}, {"factor", 4.0}, {"mscale", 1.0}, {"mscale_all_dim", 1.0}});
    EXPECT_NE(e.find("is read by rope_type 'yarn' only"), std::string::npos) << e;
    e = err("llama",
            {{"rope_type", "yarn"}, {"factor", 4.0}, {"mscale", 1.0}, {"mscale_all_dim", 1.0}, {"attention_factor", 1.1}});
    EXPECT_NE(e.find("rope_scaling.attention_factor: conflicts with mscale"), std::string::npos) << e;
    e = err("llama", {{"rope_type", "linear"}, {"factor", 2.0}, {"low_freq_factor", 1.0}});
    EXPECT_NE(e.find("rope_scaling.low_freq_factor: is not read by rope_type 'linear'"), std::string::npos) << e;
    e = err("llama", {{"factor", 2.0}});
    EXPECT_NE(e.find("rope_scaling.rope_type: missing"), std::string::npos) << e;
    e = err("llama", longrope(4, 2.0));  // half is 5
    EXPECT_NE(e.find("rope_scaling.short_factor has 4 entries; it needs rotated dims / 2 = 5"), std::string::npos)
        << e;
    e = err("llama", {{"rope_type", "yarn"}, {"factor", 4.0}, {"original_max_position_embeddings", 16}});
    EXPECT_NE(e.find("differs from max_position_embeddings"), std::string::npos) << e;
    e = err("mistral", {{"rope_type", "linear"}, {"factor", 2.0}});
    EXPECT_NE(e.find("mistral ignores rope_scaling"), std::string::npos) << e;
  }
  ModelConfig c = cfg_with("llama", nullptr);
  c.partial_rotary_factor = 0.5;  // 10 * 0.5 = 5 rotated dims: odd
  EXPECT_NE(error_of([&] { c.validate("t"); }).find("5 rotated dims; that must be even"), std::string::npos);
  // seq_len past max_position_embeddings: only dynamic is made for it.
  EXPECT_NE(error_of([&] { cfg_with("llama", nullptr, 16).check_seq_len(17, "t"); }).find("exceeds"),
            std::string::npos);
  EXPECT_EQ(error_of([&] { cfg_with("llama", {{"rope_type", "dynamic"}, {"factor", 2.0}}, 16).check_seq_len(17, "t"); }),
            "");
}

// DeepSeek's yarn (mscale, mscale_all_dim; transformers after 4.45): the cos/sin factor is
// get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim) with get_mscale(s, m) = 0.1 m ln s + 1,
// the frequencies are yarn's own. Checked against that formula by hand and against the same model
// given the ratio as attention_factor (which transformers 4.45, the oracle of the parity tests, reads).
TEST(RopeScaling, YarnMscaleRatioIsTheAttentionFactor) {
  const double factor = 40.0, m = 0.707, m_all = 1.0;
  const double ratio = (0.1 * m * std::log(factor) + 1.0) / (0.1 * m_all * std::log(factor) + 1.0);
  const ModelConfig ds =
      cfg_with("llama", {{"rope_type", "yarn"}, {"factor", factor}, {"mscale", m}, {"mscale_all_dim", m_all}}, 64);
  const ModelConfig af = cfg_with("llama", {{"rope_type", "yarn"}, {"factor", factor}, {"attention_factor", ratio}}, 64);
  const RopeFrequencies a = rope_frequencies(ds, 64), b = rope_frequencies(af, 64);
  EXPECT_EQ(a.inv_freq, b.inv_freq);
  EXPECT_EQ(a.attention_factor, b.attention_factor);
  EXPECT_NEAR(a.attention_factor, 0.92104, 1e-5);  // (0.0707 ln 40 + 1) / (0.1 ln 40 + 1) = 1.26081 / 1.36889
  // DeepSeek-V2-Lite's config: equal mscales, a factor of exactly 1.
  const ModelConfig lite =
      cfg_with("llama", {{"rope_type", "yarn"}, {"factor", factor}, {"mscale", 0.707}, {"mscale_all_dim", 0.707}}, 64);
  EXPECT_EQ(rope_frequencies(lite, 64).attention_factor, 1.0f);
  // written back as given (config.json round trip)
  const json out = ds.to_hf_json()["rope_scaling"];
  EXPECT_EQ(out["mscale"], m);
  EXPECT_EQ(out["mscale_all_dim"], m_all);
  EXPECT_EQ(ModelConfig::from_hf_json(ds.to_hf_json(), "x", true), ds);
}
