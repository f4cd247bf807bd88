#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <vector>

#include "config/model_config.h"
#include "error_of.h"
#include "model_fixtures.h"
#include "models/memory.h"
#include "models/model.h"

using namespace lathe;

namespace {
std::unique_ptr<Model> dummy_builder(const ModelConfig& c) { return build_gpt2(c); }

using lathe::test::error_of;
}  // namespace

TEST(ModelRegistry, DuplicateNameNamesBothRegistrants) {
  ModelRegistry r;
  r.add("gpt2", dummy_builder, "first.cpp");
  std::string msg = error_of([&] { r.add("gpt2", dummy_builder, "second.cpp"); });
  EXPECT_NE(msg.find("gpt2"), std::string::npos) << msg;
  EXPECT_NE(msg.find("first.cpp"), std::string::npos) << msg;
  EXPECT_NE(msg.find("second.cpp"), std::string::npos) << msg;
}

TEST(ModelRegistry, BuiltinsAndUnknownType) {
  auto names = model_registry().names();
  for (const char* t : {"gpt2", "llama", "qwen2", "mistral", "gpt_neox"})
    EXPECT_NE(std::find(names.begin(), names.end(), t), names.end()) << t;
  ModelConfig c = ModelConfig::preset("gpt2-debug");
  c.model_type = "bert";
  std::string msg = error_of([&] { model_registry().build(c); });
  EXPECT_NE(msg.find("'bert'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("llama"), std::string::npos) << msg;  // lists the known ones
}

TEST(ModelRegistry, EveryFamilyBuildsItsDebugPreset) {
  for (const char* p :
       {"gpt2-debug", "llama-debug", "qwen2-debug", "mistral-debug", "gpt-neox-debug", "gemma2-debug",
        "olmo2-debug"}) {
    ModelConfig c = ModelConfig::preset(p);
    auto m = build_model(c);
    EXPECT_EQ(static_cast<int64_t>(m->num_params()), c.num_parameters()) << p;
  }
}

// ------------------------------------------------------ sizes from untrusted configs (issue 14)

TEST(ModelMemory, EstimateMatchesWhatTheModelAllocates) {
  for (const char* p :
       {"gpt2-debug", "llama-debug", "qwen2-debug", "mistral-debug", "gpt-neox-debug", "gemma2-debug",
        "olmo2-debug"}) {
    ModelConfig c = ModelConfig::preset(p);
    for (auto [B, T] : {std::pair<int64_t, int64_t>{1, 1}, {2, 7}, {3, 128}}) {
      auto m = build_model(c);
      m->allocate(B, T);
      const MemoryEstimate e = estimate_memory(c, B, T, 2);
      EXPECT_EQ(e.num_params, static_cast<int64_t>(m->num_params())) << p;
      EXPECT_EQ(e.param_bytes, static_cast<int64_t>(m->num_params()) * 4) << p;
      EXPECT_EQ(e.optimizer_bytes, 2 * e.param_bytes) << p;
      EXPECT_EQ(e.activation_bytes, static_cast<int64_t>(m->activation_bytes())) << p << " " << B << "x" << T;
      EXPECT_NE(e.breakdown().find("activations (batch"), std::string::npos) << e.breakdown();
    }
  }
}

// Explicit head_dim (model_fixtures.h: hidden 96, 4 heads of 32, 2 KV heads, MLP 192, V 96, 2
// layers, untied): parameters and the attention buffers counted by hand, with the q/o width
// 4 x 32 = 128, not hidden 96.
TEST(ModelMemory, ExplicitHeadDimSizes) {
  const ModelConfig c = model_test::mistral_head_dim_config();
  const int64_t C = 96, HD = 128, KVD = 64, F = 192, V = 96, L = 2;
  const int64_t layer = 2 * C + C * HD + 2 * C * KVD + HD * C + 3 * C * F;
  EXPECT_EQ(c.num_parameters(), 2 * V * C + L * layer + C);
  const int64_t B = 2, T = 7, N = B * T;
  const MemoryEstimate e = estimate_memory(c, B, T, 2);
  EXPECT_EQ(e.num_params, c.num_parameters());
  auto m = build_model(c);
  EXPECT_EQ(static_cast<int64_t>(m->num_params()), c.num_parameters());
  EXPECT_EQ(m->params().at("model.layers.0.self_attn.q_proj.weight").numel(), HD * C);
  EXPECT_EQ(m->params().at("model.layers.1.self_attn.o_proj.weight").numel(), C * HD);
  m->allocate(B, T);
  EXPECT_EQ(e.activation_bytes, static_cast<int64_t>(m->activation_bytes()));
  auto count = [&](const std::string& label) -> int64_t {
    for (const ActivationEntry& a : m->activation_plan().entries)
      if (a.label() == label) return a.count;
    return -1;
  };
  EXPECT_EQ(count("layers.0.qkv"), N * (HD + 2 * KVD));
  EXPECT_EQ(count("layers.1.att"), N * HD);
  EXPECT_EQ(count("datt"), N * HD);
  EXPECT_EQ(count("layers.0.res1"), N * C);
  EXPECT_EQ(count("rope_cos"), T * 32 / 2);
  EXPECT_DOUBLE_EQ(m->flops_per_token(T), 6.0 * static_cast<double>(c.num_parameters()) + 12.0 * L * HD * T);
}

// Sliding layers count the keys in their window, not T (issue 25: FLOPs and MFU of windowed
// models). Layers 0 and 2 slide with window 3 at T = 7; layer 1 is full: keys 3 + 7 + 3 = 13.
TEST(ModelMemory, FlopsCountWindowKeysOfSlidingLayers) {
  ModelConfig c = model_test::mistral_head_dim_config();
  c.num_hidden_layers = 3;
  c.sliding_window = 3;
  c.sliding_layers = {1, 0, 1};
  const int64_t HD = 128, T = 7;
  EXPECT_DOUBLE_EQ(c.attention_keys_over_layers(T), 13.0);
  EXPECT_DOUBLE_EQ(c.attention_keys_over_layers(2), 6.0);  // a window >= T is full attention
  auto m = build_model(c);
  const double expected = 6.0 * static_cast<double>(c.num_parameters()) + 12.0 * HD * 13.0;
  EXPECT_DOUBLE_EQ(m->flops_per_token(T), expected);
  c.sliding_layers.clear();  // every layer slides
  EXPECT_DOUBLE_EQ(c.attention_keys_over_layers(T), 9.0);
}

// The arena used to be sized as the sum of the unrounded sizes + 4096 floats of slack while each
// slice was rounded up to 16 floats: with many layers and an odd token count the slices outgrew
// it ("internal: activation arena overflow"). It is now sized by the same walk that cuts it.
TEST(ModelMemory, ArenaFitsManyLayersAndOddTokenCounts) {
  ModelConfig c = ModelConfig::preset("llama-debug");
  c.num_hidden_layers = 120;
  auto m = build_model(c);
  EXPECT_NO_THROW(m->allocate(1, 7));
  std::vector<int32_t> tok(7, 3), tgt(7, 4);
  EXPECT_TRUE(std::isfinite(m->forward_backward(tok.data(), tgt.data(), 1, 7, 1.0f / 7, true)));
}

TEST(ModelMemory, RefusedBeforeAllocationWithTheFields) {
  ModelConfig c = ModelConfig::preset("gpt2-debug");
  c.num_hidden_layers = 60000;
  c.hidden_size = 4096;
  c.num_attention_heads = c.num_key_value_heads = 32;
  c.intermediate_size = 16384;
  const std::string msg = error_of([&] { build_model(c); });
  for (const char* s : {"n_layer = 60000", "n_embd = 4096", "needs params", "TB", "reduce"})
    EXPECT_NE(msg.find(s), std::string::npos) << msg;
  // Activations: a batch far beyond the machine is refused by allocate() with the batch named.
  auto m = build_model(ModelConfig::preset("gpt2-debug"));
  const std::string act = error_of([&] { m->allocate(int64_t{1} << 40, 128); });
  EXPECT_NE(act.find("batch"), std::string::npos) << act;
  EXPECT_EQ(m->max_batch(), 0);  // nothing was allocated
  // Products beyond 64 bits are refused, not wrapped.
  EXPECT_NE(error_of([&] { (void)estimate_memory(ModelConfig::preset("gpt2-124m"), INT64_MAX / 2, 1024, 2); }), "");
  ModelConfig maxed = ModelConfig::preset("llama-debug");
  maxed.vocab_size = kMaxVocabSize;
  maxed.hidden_size = kMaxHiddenSize;
  maxed.num_attention_heads = maxed.num_key_value_heads = 8;
  maxed.num_hidden_layers = kMaxLayers;
  maxed.intermediate_size = kMaxIntermediateSize;
  EXPECT_NE(error_of([&] { (void)estimate_memory(maxed, 0, 0, 2); }).find("overflows"), std::string::npos);
  EXPECT_NE(error_of([&] { build_model(maxed); }), "");
}

TEST(ModelMemory, ParamTableOffsetsAreChecked) {
  ParamTable t;
  t.add("a", {int64_t{1} << 40, int64_t{1} << 20}, Init::Zeros, 0, ShardRule::Replicated, false);
  EXPECT_NE(error_of([&] {
              t.add("b", {int64_t{1} << 40, int64_t{1} << 30}, Init::Zeros, 0, ShardRule::Replicated, false);
            }),
            "");
  EXPECT_NE(error_of([&] { t.add("c", {-1, 5}, Init::Zeros, 0, ShardRule::Replicated, false); }), "");
  EXPECT_EQ(t.total(), size_t{1} << 60);
}

TEST(ModelMemory, MachineMemoryIsKnown) {
  const MachineMemory mm = machine_memory();
  EXPECT_GT(mm.bytes, 0);
  EXPECT_FALSE(mm.source.empty());
}
