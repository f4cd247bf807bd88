// ModelConfig: parsing real HF config.json texts (as published for gpt2, Llama-2-7b, Qwen2.5-0.5B,
// Mistral-7B-v0.1; field list in shared/reference/hf-model-configs.md), round trips, unsupported
// keys and validation errors. Expected values are read off the JSON texts below.
#include <gtest/gtest.h>

#include <limits>

#include "config/model_config.h"
#include "core/error.h"

using namespace lathe;
using json = nlohmann::json;

namespace {

const char* kGpt2 = R"({
  "activation_function": "gelu_new", "architectures": ["GPT2LMHeadModel"], "attn_pdrop": 0.1,
  "bos_token_id": 50256, "embd_pdrop": 0.1, "eos_token_id": 50256, "initializer_range": 0.02,
  "layer_norm_epsilon": 1e-05, "model_type": "gpt2", "n_ctx": 1024, "n_embd": 768, "n_head": 12,
  "n_layer": 12, "n_positions": 1024, "resid_pdrop": 0.1, "summary_activation": null,
  "summary_first_dropout": 0.1, "summary_proj_to_labels": true, "summary_type": "cls_index",
  "summary_use_proj": true, "task_specific_params": {"text-generation": {"do_sample": true, "max_length": 50}},
  "vocab_size": 50257})";

const char* kLlama = R"({
  "architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
  "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 11008, "max_position_embeddings": 4096,
  "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
  "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": null, "tie_word_embeddings": false,
  "torch_dtype": "float16", "transformers_version": "4.31.0.dev0", "use_cache": true, "vocab_size": 32000})";

const char* kQwen2 = R"({
  "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
  "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02,
  "intermediate_size": 4864, "max_position_embeddings": 32768, "max_window_layers": 24, "model_type": "qwen2",
  "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
  "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": true, "torch_dtype": "bfloat16",
  "transformers_version": "4.40.1", "use_cache": true, "use_sliding_window": false, "vocab_size": 151936})";

const char* kMistral = R"({
  "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
  "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 32768,
  "model_type": "mistral", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
  "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096, "tie_word_embeddings": false,
  "torch_dtype": "bfloat16", "transformers_version": "4.34.0.dev0", "use_cache": true, "vocab_size": 32000})";

// Parse `text` after replacing/adding `key` = `value`; expect an error whose message contains all subs.
void expect_error(const char* text, const std::string& key, const json& value, std::vector<std::string> subs,
                  bool strict = false) {
  json j = json::parse(text);
  j[key] = value;
  try {
    ModelConfig::from_hf_json(j, "cfg.json", strict);
    FAIL() << "no error for " << key << " = " << value.dump();
  } catch (const Error& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("cfg.json"), std::string::npos) << m;
    for (auto& s : subs) EXPECT_NE(m.find(s), std::string::npos) << "message: " << m << "\nmissing: " << s;
  }
}

}  // namespace

TEST(ModelConfig, ParseGpt2) {
  auto c = ModelConfig::from_hf_json(json::parse(kGpt2), "gpt2/config.json");
  EXPECT_EQ(c.model_type, "gpt2");
  EXPECT_EQ(c.family, "gpt2");
  EXPECT_EQ(c.vocab_size, 50257);
  EXPECT_EQ(c.hidden_size, 768);
  EXPECT_EQ(c.num_hidden_layers, 12);
  EXPECT_EQ(c.num_attention_heads, 12);
  EXPECT_EQ(c.num_key_value_heads, 12);
  EXPECT_EQ(c.intermediate_size, 4 * 768);  // n_inner absent
  EXPECT_EQ(c.max_position_embeddings, 1024);
  EXPECT_DOUBLE_EQ(c.norm_eps, 1e-5);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_EQ(c.hidden_act, "gelu_new");
  EXPECT_EQ(c.bos_token_id, 50256);
  EXPECT_EQ(c.eos_token_id, 50256);
  EXPECT_EQ(c.pad_token_id, -1);
  EXPECT_EQ(c.head_dim(), 64);
  // HF's gpt2 config.json trains with dropout 0.1: lathe has none, and says so once (not silently).
  for (const std::string& k : c.ignored_keys) EXPECT_NE(k.find("drop"), std::string::npos) << k;
  EXPECT_NE(c.ignored_note().find("resid_pdrop (0.1: lathe trains without dropout)"), std::string::npos)
      << c.ignored_note();
  // GPT-2 small: 124,439,808 parameters (reference §5: 137,022,720 minus 12 mask buffers of 1024^2).
  EXPECT_EQ(c.num_parameters(), 137022720 - 12 * 1048576);
  EXPECT_EQ(c, ModelConfig::preset("gpt2-124m"));
}

TEST(ModelConfig, ParseLlama) {
  auto c = ModelConfig::from_hf_json(json::parse(kLlama), "llama/config.json");
  EXPECT_EQ(c.family, "llama");
  EXPECT_EQ(c.hidden_size, 4096);
  EXPECT_EQ(c.intermediate_size, 11008);
  EXPECT_EQ(c.num_key_value_heads, 32);
  EXPECT_EQ(c.max_position_embeddings, 4096);
  EXPECT_DOUBLE_EQ(c.norm_eps, 1e-5);
  EXPECT_DOUBLE_EQ(c.rope_theta, 10000.0);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_FALSE(c.attention_bias);
  EXPECT_FALSE(c.qkv_bias());
  EXPECT_EQ(c.hidden_act, "silu");
  EXPECT_EQ(c.bos_token_id, 1);
  EXPECT_EQ(c.eos_token_id, 2);
  // Llama-2-7B: 6,738,415,616 parameters (the published count).
  EXPECT_EQ(c.num_parameters(), 6738415616LL);
}

TEST(ModelConfig, ParseQwen2) {
  auto c = ModelConfig::from_hf_json(json::parse(kQwen2), "qwen/config.json");
  EXPECT_EQ(c.model_type, "qwen2");
  EXPECT_EQ(c.family, "llama");
  EXPECT_EQ(c.hidden_size, 896);
  EXPECT_EQ(c.num_attention_heads, 14);
  EXPECT_EQ(c.num_key_value_heads, 2);
  EXPECT_EQ(c.head_dim(), 64);
  EXPECT_TRUE(c.attention_bias);
  EXPECT_TRUE(c.qkv_bias());
  EXPECT_FALSE(c.o_bias());
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_DOUBLE_EQ(c.rope_theta, 1e6);
  EXPECT_DOUBLE_EQ(c.norm_eps, 1e-6);
  EXPECT_EQ(c.sliding_window, 0);  // use_sliding_window false
  EXPECT_EQ(c.bos_token_id, 151643);
  // Qwen2.5-0.5B: 494,032,768 parameters (published).
  EXPECT_EQ(c.num_parameters(), 494032768LL);
}

TEST(ModelConfig, ParseMistral) {
  auto c = ModelConfig::from_hf_json(json::parse(kMistral), "mistral/config.json");
  EXPECT_EQ(c.model_type, "mistral");
  EXPECT_EQ(c.num_key_value_heads, 8);
  EXPECT_EQ(c.intermediate_size, 14336);
  EXPECT_EQ(c.sliding_window, 4096);
  EXPECT_FALSE(c.attention_bias);
  // Sliding-window attention runs beyond the window (issue 25): only max_position_embeddings caps.
  EXPECT_NO_THROW(c.check_seq_len(4097, "x"));
  EXPECT_NO_THROW(c.check_seq_len(32768, "x"));
  EXPECT_THROW(c.check_seq_len(32769, "x"), Error);
  EXPECT_TRUE(c.sliding_layers.empty());  // every layer slides
  EXPECT_EQ(c.layer_window(0), 4096);
  EXPECT_EQ(c.layer_window(31), 4096);
  json j = json::parse(kMistral);
  j["sliding_window"] = nullptr;
  EXPECT_EQ(ModelConfig::from_hf_json(j, "m").sliding_window, 0);
  // Mistral-7B-v0.1: 7,241,732,096 parameters (published).
  EXPECT_EQ(c.num_parameters(), 7241732096LL);
}

// Which layers use the window (issue 25): qwen2's max_window_layers (layers >= it, as transformers
// 4.45.2's Qwen2FlashAttention2; class default 28) and layer_types lists. The lists round-trip
// through to_hf_json; a list of one kind collapses to every layer / no window.
TEST(ModelConfig, PerLayerSlidingWindows) {
  json q = json::parse(kQwen2);  // 24 layers
  q["use_sliding_window"] = true;
  q["sliding_window"] = 512;
  q["max_window_layers"] = 20;
  ModelConfig c = ModelConfig::from_hf_json(q, "q");
  ASSERT_EQ(c.sliding_layers.size(), 24u);
  EXPECT_EQ(c.layer_window(19), 0);
  EXPECT_EQ(c.layer_window(20), 512);
  EXPECT_EQ(c.layer_window(23), 512);
  ModelConfig back = ModelConfig::from_hf_json(c.to_hf_json(), "back");
  EXPECT_EQ(back, c);
  EXPECT_EQ(c.to_hf_json()["max_window_layers"], 20);
  q["max_window_layers"] = 0;  // every layer
  c = ModelConfig::from_hf_json(q, "q");
  EXPECT_TRUE(c.sliding_layers.empty());
  EXPECT_EQ(c.layer_window(0), 512);
  EXPECT_EQ(ModelConfig::from_hf_json(c.to_hf_json(), "back"), c);
  q.erase("max_window_layers");  // Qwen2Config's default 28 >= 24 layers: no layer slides
  EXPECT_EQ(ModelConfig::from_hf_json(q, "q").sliding_window, 0);
  // A hostile layer count is refused by its own check, not met by a per-layer list of its size.
  q["max_window_layers"] = 1;
  q["num_hidden_layers"] = int64_t{1} << 40;
  try {
    ModelConfig::from_hf_json(q, "q");
    FAIL() << "accepted 2^40 layers";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("num_hidden_layers"), std::string::npos) << e.what();
  }

  json m = json::parse(kMistral);  // 32 layers
  m["sliding_window"] = 64;
  json lt = json::array();
  for (int l = 0; l < 32; ++l) lt.push_back(l % 4 == 3 ? "full_attention" : "sliding_attention");
  m["layer_types"] = lt;
  c = ModelConfig::from_hf_json(m, "m");
  ASSERT_EQ(c.sliding_layers.size(), 32u);
  EXPECT_EQ(c.layer_window(0), 64);
  EXPECT_EQ(c.layer_window(3), 0);
  back = ModelConfig::from_hf_json(c.to_hf_json(), "back");
  EXPECT_EQ(back, c);
  for (auto& e : lt) e = "full_attention";
  m["layer_types"] = lt;
  c = ModelConfig::from_hf_json(m, "m");
  EXPECT_EQ(c.sliding_window, 0);
  EXPECT_TRUE(c.sliding_layers.empty());
  lt.erase(lt.begin());
  m["layer_types"] = lt;
  try {
    ModelConfig::from_hf_json(m, "m");
    FAIL() << "accepted 31 layer_types for 32 layers";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("layer_types"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("31 entries for 32 layers"), std::string::npos) << e.what();
  }
}

TEST(ModelConfig, DefaultsAndAliases) {
  // Missing keys take the HF class defaults.
  auto g = ModelConfig::from_hf_json(json{{"model_type", "gpt2"}}, "x");
  EXPECT_EQ(g.hidden_size, 768);
  EXPECT_EQ(g.vocab_size, 50257);
  auto m = ModelConfig::from_hf_json(json{{"model_type", "mistral"}}, "x");
  EXPECT_EQ(m.num_key_value_heads, 8);
  EXPECT_EQ(m.max_position_embeddings, 131072);
  // GPT-2 aliases; conflicting spellings are an error naming both.
  auto a = ModelConfig::from_hf_json(json{{"model_type", "gpt2"},
                                          {"hidden_size", 64},
                                          {"num_attention_heads", 4},
                                          {"n_inner", 100},
                                          {"activation_function", "gelu_pytorch_tanh"}},
                                     "x");
  EXPECT_EQ(a.hidden_size, 64);
  EXPECT_EQ(a.intermediate_size, 100);
  EXPECT_EQ(a.hidden_act, "gelu_new");
  expect_error(kGpt2, "hidden_size", 512, {"hidden_size", "n_embd"});
  // eos as a list: first id.
  json l = json::parse(kLlama);
  l["eos_token_id"] = {128001, 128009};
  EXPECT_EQ(ModelConfig::from_hf_json(l, "x").eos_token_id, 128001);
  // v5 rope_parameters form.
  l = json::parse(kLlama);
  l.erase("rope_scaling");
  l["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 500000.0}};
  l.erase("rope_theta");
  EXPECT_DOUBLE_EQ(ModelConfig::from_hf_json(l, "x").rope_theta, 500000.0);
}

TEST(ModelConfig, RoundTrip) {
  for (const char* text : {kGpt2, kLlama, kQwen2, kMistral}) {
    auto c = ModelConfig::from_hf_json(json::parse(text), "a");
    json out = c.to_hf_json();
    EXPECT_EQ(out["torch_dtype"], "float32");
    EXPECT_TRUE(out["architectures"].is_array());
    auto back = ModelConfig::from_hf_json(out, "b", /*strict_unknown=*/true);
    EXPECT_EQ(back, c) << out.dump();
  }
  for (const auto& name : ModelConfig::preset_names()) {
    auto c = ModelConfig::preset(name);
    EXPECT_EQ(ModelConfig::from_hf_json(c.to_hf_json(), name, true), c) << name;
  }
  EXPECT_EQ(ModelConfig::preset("gpt2-124m").to_hf_json()["architectures"][0], "GPT2LMHeadModel");
  EXPECT_EQ(ModelConfig::preset("qwen2-debug").to_hf_json()["architectures"][0], "Qwen2ForCausalLM");
  EXPECT_EQ(ModelConfig::preset("mistral-debug").to_hf_json()["architectures"][0], "MistralForCausalLM");
  EXPECT_EQ(ModelConfig::preset("llama-debug").to_hf_json()["architectures"][0], "LlamaForCausalLM");
}

TEST(ModelConfig, UnknownKeys) {
  json j = json::parse(kLlama);
  j["some_future_key"] = 3;
  auto c = ModelConfig::from_hf_json(j, "cfg.json");
  ASSERT_EQ(c.ignored_keys.size(), 1u);
  EXPECT_EQ(c.ignored_keys[0], "some_future_key");
  expect_error(kLlama, "num_hiden_layers", 3, {"unknown key 'num_hiden_layers'", "did you mean 'num_hidden_layers'"},
               /*strict=*/true);
  expect_error(kGpt2, "n_layers", 3, {"'n_layers'", "'n_layer'"}, true);
}

TEST(ModelConfig, UnsupportedKeys) {
  expect_error(kLlama, "rope_scaling", json{{"type", "ntk"}, {"factor", 2.0}}, {"rope_scaling.type", "'ntk'"});
  expect_error(kLlama, "rope_parameters", json{{"rope_type", "ntk"}}, {"rope_parameters.rope_type", "'ntk'"});
  expect_error(kLlama, "mlp_bias", true, {"mlp_bias"});
  expect_error(kLlama, "hidden_act", "gelu", {"hidden_act", "gelu"});
  expect_error(kGpt2, "activation_function", "relu", {"activation_function", "relu"});
  expect_error(kGpt2, "activation_function", "gelu", {"activation_function"});
  expect_error(kGpt2, "scale_attn_by_inverse_layer_idx", true, {"scale_attn_by_inverse_layer_idx"});
  expect_error(kGpt2, "reorder_and_upcast_attn", true, {"reorder_and_upcast_attn"});
  expect_error(kGpt2, "scale_attn_weights", false, {"scale_attn_weights"});
  expect_error(kGpt2, "tie_word_embeddings", false, {"tie_word_embeddings"});
  expect_error(kGpt2, "n_ctx", 512, {"n_ctx", "n_positions"});
  expect_error(kQwen2, "attention_bias", false, {"attention_bias"});
  expect_error(kMistral, "attention_bias", true, {"attention_bias"});
  expect_error(kGpt2, "model_type", "bert", {"model_type", "bert"});
  expect_error(kGpt2, "add_cross_attention", true, {"add_cross_attention"});
  expect_error(kGpt2, "resid_pdrop", 0.1, {"resid_pdrop", "dropout"}, /*strict=*/true);
  // Wrong types name the key and the value.
  expect_error(kGpt2, "n_layer", "abc", {"n_layer", "expected an integer, got 'abc'"});
  expect_error(kLlama, "rms_norm_eps", "small", {"rms_norm_eps", "expected a number"});
  expect_error(kLlama, "tie_word_embeddings", 1, {"tie_word_embeddings", "true or false"});
}

// config.json head_dim (transformers 4.45 LlamaConfig / MistralConfig): q/k/v/o sized heads x
// head_dim, which need not be hidden_size (Mistral-Nemo 12B: 32 heads of 128 with hidden 5120).
TEST(ModelConfig, ExplicitHeadDim) {
  json j = json::parse(kMistral);
  j["hidden_size"] = 5120;
  j["head_dim"] = 128;
  j["intermediate_size"] = 14336;
  j["num_hidden_layers"] = 40;
  j["vocab_size"] = 131072;
  j["sliding_window"] = nullptr;
  const ModelConfig c = ModelConfig::from_hf_json(j, "nemo/config.json");
  EXPECT_EQ(c.explicit_head_dim, 128);
  EXPECT_EQ(c.head_dim(), 128);
  EXPECT_EQ(c.attention_width(), 4096);
  // Mistral-Nemo-Base-2407's published count: 12,247,782,400 parameters.
  EXPECT_EQ(c.num_parameters(), int64_t{12247782400});
  const json out = c.to_hf_json();
  EXPECT_EQ(out["head_dim"], 128);
  EXPECT_EQ(ModelConfig::from_hf_json(out, "round trip"), c);
  // Without head_dim the same config is another model (5120 / 32 = 160 per head).
  j.erase("head_dim");
  const ModelConfig d = ModelConfig::from_hf_json(j, "nemo/config.json");
  EXPECT_EQ(d.head_dim(), 160);
  EXPECT_FALSE(d == c);
  // An explicit head_dim equal to hidden / heads is the same model (transformers writes it always).
  j["head_dim"] = 160;
  EXPECT_EQ(ModelConfig::from_hf_json(j, "nemo/config.json"), d);
  EXPECT_EQ(d.to_hf_json()["head_dim"], 160);
  // Qwen3-0.6B's shape (16 heads of 128 with hidden 1024), and heads that do not divide hidden.
  json q = json::parse(kLlama);
  q["hidden_size"] = 1024;
  q["num_attention_heads"] = 16;
  q["num_key_value_heads"] = 8;
  q["head_dim"] = 128;
  EXPECT_EQ(ModelConfig::from_hf_json(q, "q.json").attention_width(), 2048);
  q["hidden_size"] = 1000;  // 1000 % 16 != 0: fine with an explicit head_dim
  EXPECT_EQ(ModelConfig::from_hf_json(q, "q.json").head_dim(), 128);
  q.erase("head_dim");
  try {
    ModelConfig::from_hf_json(q, "q.json");
    FAIL();
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("not divisible"), std::string::npos) << m;
    EXPECT_NE(m.find("head_dim"), std::string::npos) << m;  // the hint
  }
  // Odd (RoPE rotates pairs), zero, negative: refused naming head_dim. Mistral reads 0 as absent.
  expect_error(kLlama, "head_dim", 33, {"head_dim = 33", "even"});
  expect_error(kLlama, "head_dim", 0, {"head_dim", "must be > 0"});
  expect_error(kMistral, "head_dim", -4, {"head_dim", "must be > 0"});
  json m0 = json::parse(kMistral);
  m0["head_dim"] = 0;
  EXPECT_EQ(ModelConfig::from_hf_json(m0, "m.json").head_dim(), 128);
  // A recipe's model.head_dim (strict keys, "model." prefix in errors).
  json r = json::parse(kLlama);
  r["head_dim"] = 64;
  EXPECT_EQ(ModelConfig::from_hf_json(r, "recipe.yaml", "model.", true).attention_width(), 2048);
  r["head_dim"] = 7;
  try {
    ModelConfig::from_hf_json(r, "recipe.yaml", "model.", true);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("model.head_dim = 7"), std::string::npos) << e.what();
  }
}

TEST(ModelConfig, ValidateErrors) {
  expect_error(kGpt2, "n_head", 7, {"n_embd = 768", "n_head = 7", "not divisible"});
  expect_error(kLlama, "num_key_value_heads", 5, {"num_attention_heads = 32", "num_key_value_heads = 5"});
  expect_error(kLlama, "vocab_size", 0, {"vocab_size = 0"});
  expect_error(kLlama, "num_hidden_layers", -1, {"num_hidden_layers = -1"});
  expect_error(kGpt2, "layer_norm_epsilon", 0.0, {"layer_norm_epsilon"});
  // Odd head_dim under RoPE: hidden 4096 / 4096 heads... use 12 / 4 = 3.
  json j = json::parse(kLlama);
  j["hidden_size"] = 12;
  j["num_attention_heads"] = 4;
  j["num_key_value_heads"] = 4;
  try {
    ModelConfig::from_hf_json(j, "cfg.json");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("must be even"), std::string::npos) << e.what();
  }
  ModelConfig c = ModelConfig::preset("llama-debug");
  c.num_attention_heads = 5;
  EXPECT_THROW(c.validate("x"), Error);
}

TEST(ModelConfig, Presets) {
  auto names = ModelConfig::preset_names();
  EXPECT_GE(names.size(), 6u);
  for (auto& n : names) EXPECT_NO_THROW(ModelConfig::preset(n).validate(n));
  auto d = ModelConfig::preset("llama-debug");
  EXPECT_EQ(d.num_hidden_layers, 2);
  EXPECT_EQ(d.hidden_size, 48);
  EXPECT_EQ(d.num_attention_heads, 4);
  EXPECT_EQ(d.num_key_value_heads, 2);
  EXPECT_EQ(d.intermediate_size, 96);
  EXPECT_EQ(d.vocab_size, 96);
  auto b = ModelConfig::preset("gpt2-small-bench");
  EXPECT_EQ(b.num_hidden_layers, 4);
  EXPECT_EQ(b.hidden_size, 256);
  EXPECT_EQ(b.vocab_size, 50257);
  EXPECT_EQ(b.max_position_embeddings, 1024);
  try {
    ModelConfig::preset("gpt2-debgu");
    FAIL();
  } catch (const Error& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("gpt2-debgu"), std::string::npos);
    EXPECT_NE(m.find("llama-debug"), std::string::npos);  // lists the presets
    EXPECT_NE(m.find("did you mean 'gpt2-debug'"), std::string::npos) << m;
  }
}

// ------------------------------------------------------- hostile config.json values (issue 14)

TEST(ModelConfigHostile, DimensionBounds) {
  expect_error(kGpt2, "n_layer", int64_t{1} << 31, {"n_layer = 2147483648", "exceeds lathe's maximum 65536"});
  expect_error(kLlama, "vocab_size", int64_t{1} << 40, {"vocab_size", "exceeds"});
  expect_error(kLlama, "hidden_size", int64_t{1} << 31, {"hidden_size", "exceeds"});
  expect_error(kLlama, "intermediate_size", int64_t{1} << 40, {"intermediate_size", "exceeds"});
  expect_error(kLlama, "max_position_embeddings", int64_t{1} << 40, {"max_position_embeddings", "exceeds"});
  expect_error(kMistral, "sliding_window", int64_t{1} << 40, {"sliding_window"});
  expect_error(kGpt2, "n_positions", json::parse("18446744073709551615"), {"n_positions", "does not fit"});
  // 4 * n_embd for the default n_inner, head_dim * heads: checked, not wrapped.
  json j = json::parse(kGpt2);
  j["n_embd"] = int64_t{1} << 62;
  j["n_head"] = 1;
  EXPECT_THROW(ModelConfig::from_hf_json(j, "cfg.json"), Error);
  expect_error(kLlama, "head_dim", int64_t{1} << 62, {"head_dim"});
  // Every bound at its maximum still has a parameter count within 64 bits (models/memory.h then
  // refuses it against the machine, and its byte count x 4 is checked there).
  json m = json::parse(kLlama);
  m["vocab_size"] = kMaxVocabSize;
  m["hidden_size"] = kMaxHiddenSize;
  m["num_attention_heads"] = 8;
  m["num_key_value_heads"] = 8;
  m["num_hidden_layers"] = kMaxLayers;
  m["intermediate_size"] = kMaxIntermediateSize;
  EXPECT_GT(ModelConfig::from_hf_json(m, "cfg.json").num_parameters(), int64_t{1} << 61);
}

TEST(ModelConfigHostile, NullsTokenIdsAndFloats) {
  for (const char* k : {"vocab_size", "n_embd", "n_layer", "n_head", "n_positions"})
    expect_error(kGpt2, k, nullptr, {k, "got null"});
  for (const char* k : {"hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"})
    expect_error(kLlama, k, nullptr, {k, "got null"});
  // null keeps meaning "default" where HF reads it so.
  json j = json::parse(kGpt2);
  j["n_inner"] = nullptr;
  EXPECT_EQ(ModelConfig::from_hf_json(j, "cfg.json").intermediate_size, 4 * 768);
  json l = json::parse(kLlama);
  l["num_key_value_heads"] = nullptr;
  EXPECT_EQ(ModelConfig::from_hf_json(l, "cfg.json").num_key_value_heads, 32);
  expect_error(kLlama, "eos_token_id", int64_t{1} << 40, {"eos_token_id", "out of range"});
  expect_error(kLlama, "bos_token_id", -5, {"bos_token_id", "out of range"});
  expect_error(kLlama, "eos_token_id", json::array({int64_t{1} << 33, 2}), {"eos_token_id", "out of range"});
  l = json::parse(kLlama);
  l["pad_token_id"] = -1;  // old spelling of "none"
  EXPECT_EQ(ModelConfig::from_hf_json(l, "cfg.json").pad_token_id, -1);
  // Float fields are finite (a recipe's 1e999 arrives as inf).
  expect_error(kLlama, "rms_norm_eps", std::numeric_limits<double>::infinity(), {"rms_norm_eps", "finite"});
  expect_error(kLlama, "rope_theta", std::numeric_limits<double>::infinity(), {"rope_theta", "finite"});
  expect_error(kGpt2, "initializer_range", std::numeric_limits<double>::infinity(), {"initializer_range", "finite"});
  expect_error(kLlama, "rope_parameters", json{{"rope_theta", std::numeric_limits<double>::infinity()}},
               {"rope_parameters.rope_theta", "finite"});
  ModelConfig c = ModelConfig::preset("gpt2-debug");
  c.norm_eps = std::numeric_limits<double>::quiet_NaN();
  EXPECT_THROW(c.validate("x"), Error);
}

TEST(ModelConfigHostile, ValuesInMessagesAreBounded) {
  const std::string big(100000, 'x');
  json j = json::parse(kLlama);
  j["rope_scaling"] = json{{"type", big}};
  try {
    ModelConfig::from_hf_json(j, "cfg.json");
    FAIL();
  } catch (const Error& e) {
    EXPECT_LT(std::string(e.what()).size(), 1000u);
  }
  expect_error(kGpt2, "n_layer", big, {"n_layer", "expected an integer"});
  try {
    ModelConfig::from_hf_json(json::array({big}), "cfg.json");
    FAIL();
  } catch (const Error& e) {
    EXPECT_LT(std::string(e.what()).size(), 1000u);
  }
}

TEST(ModelConfigHostile, ParameterCountIsChecked) {
  // Known values stay exact (see the Parse* tests); a wrap is an error, not a small number.
  ModelConfig c = ModelConfig::preset("gpt2-124m");
  c.vocab_size = INT64_MAX / 2;
  EXPECT_THROW(c.num_parameters(), Error);
}

// transformers 4.45.2 GPTNeoXConfig(num_hidden_layers=2, hidden_size=48, num_attention_heads=3,
// intermediate_size=100, vocab_size=101, max_position_embeddings=64).save_pretrained's config.json:
// rotary_pct / rotary_emb_base are saved again as partial_rotary_factor / rope_theta.
const char* kGptNeox = R"({
  "attention_bias": true, "attention_dropout": 0.0, "bos_token_id": 0, "classifier_dropout": 0.1,
  "eos_token_id": 2, "hidden_act": "gelu", "hidden_dropout": 0.0, "hidden_size": 48, "initializer_range": 0.02,
  "intermediate_size": 100, "layer_norm_eps": 1e-05, "max_position_embeddings": 64, "model_type": "gpt_neox",
  "num_attention_heads": 3, "num_hidden_layers": 2, "partial_rotary_factor": 0.25, "rope_scaling": null,
  "rope_theta": 10000, "rotary_emb_base": 10000, "rotary_pct": 0.25, "tie_word_embeddings": false,
  "transformers_version": "4.45.2", "use_cache": true, "use_parallel_residual": true, "vocab_size": 101})";

TEST(ModelConfig, ParseGptNeox) {
  const auto c = ModelConfig::from_hf_json(json::parse(kGptNeox), "cfg.json", /*strict_unknown=*/true);
  EXPECT_EQ(c.family, "gpt_neox");
  EXPECT_TRUE(c.is_gpt_neox() && c.gelu_mlp() && c.rotary() && c.gelu_exact() && c.parallel_residual);
  EXPECT_EQ(c.head_dim(), 16);
  EXPECT_EQ(c.rotary_dim(), 4);  // int(16 * 0.25), as GPTNeoXAttention.rotary_ndims
  EXPECT_EQ(c.rope_theta, 10000.0);
  EXPECT_EQ(c.num_key_value_heads, 3);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_TRUE(c.attention_bias);
  EXPECT_EQ(c.num_parameters(), 48488);  // sum(p.numel()) of GPTNeoXForCausalLM(config)
  EXPECT_EQ(ModelConfig::from_hf_json(c.to_hf_json(), "out", true), c);
  EXPECT_EQ(c.to_hf_json()["architectures"][0], "GPTNeoXForCausalLM");
  // Class defaults: GPTNeoXConfig() with only the model_type.
  const auto d = ModelConfig::from_hf_json(json{{"model_type", "gpt_neox"}}, "cfg.json");
  EXPECT_EQ(d.vocab_size, 50432);
  EXPECT_EQ(d.hidden_size, 6144);
  EXPECT_EQ(d.partial_rotary_factor, 0.25);
  EXPECT_TRUE(d.parallel_residual && d.gelu_exact() && d.attention_bias);
  // The sequential form and the tanh GELU are read as such.
  json j = json::parse(kGptNeox);
  j["use_parallel_residual"] = false;
  j["hidden_act"] = "gelu_pytorch_tanh";
  const auto s = ModelConfig::from_hf_json(j, "cfg.json");
  EXPECT_FALSE(s.parallel_residual || s.gelu_exact());
  EXPECT_EQ(s.hidden_act, "gelu_new");
  // Refused, naming the key: other activations, conflicting aliases, an unknown rope_scaling type, tied heads,
  // odd rotary dims.
  expect_error(kGptNeox, "hidden_act", "relu", {"hidden_act", "relu", "gelu"});
  expect_error(kGptNeox, "partial_rotary_factor", 0.5, {"partial_rotary_factor", "rotary_pct"});
  expect_error(kGptNeox, "rope_theta", 500.0, {"rope_theta", "rotary_emb_base"});
  expect_error(kGptNeox, "rope_scaling", json{{"type", "ntk"}, {"factor", 2.0}}, {"rope_scaling.type", "'ntk'"});
  {  // every transformers type reads as the llama family's (GPTNeoXRotaryEmbedding is LlamaRotaryEmbedding)
    json j = json::parse(kGptNeox);
    j["rope_scaling"] = {{"type", "linear"}, {"factor", 2.0}};
    const ModelConfig c = ModelConfig::from_hf_json(j, "neox");
    EXPECT_EQ(c.rope_scaling.type, "linear");
    EXPECT_EQ(c.to_hf_json()["rope_scaling"], j["rope_scaling"]);
  }
  expect_error(kGptNeox, "tie_word_embeddings", true, {"tie_word_embeddings", "embed_out"});
  json odd = json::parse(kGptNeox);
  odd.erase("partial_rotary_factor");
  expect_error(odd.dump().c_str(), "rotary_pct", 0.2, {"partial_rotary_factor", "even"});  // 16 x 0.2 = 3 dims
  expect_error(kGptNeox, "hidden_dropout", 0.1, {"hidden_dropout", "dropout"}, /*strict=*/true);
  // use_parallel_residual is gpt_neox's alone.
  ModelConfig g = ModelConfig::preset("gpt2-debug");
  g.parallel_residual = true;
  EXPECT_THROW(g.validate("x"), Error);
}

// transformers v5 folds rope_theta, partial_rotary_factor and the rope_scaling keys into one
// `rope_parameters` object (issue 25): a scaled Llama 3.1 written that way reads as the 4.45 form,
// a value given both ways must agree, and its keys are checked as rope_scaling's are.
TEST(ModelConfig, TransformersV5RopeParameters) {
  const json llama3 = {{"rope_type", "llama3"},        {"factor", 8.0},
                       {"low_freq_factor", 1.0},       {"high_freq_factor", 4.0},
                       {"original_max_position_embeddings", 8192}};
  json old = json::parse(kLlama);
  old["rope_scaling"] = llama3;
  old["rope_theta"] = 500000.0;
  old["partial_rotary_factor"] = 0.5;
  json v5 = json::parse(kLlama);
  v5.erase("rope_scaling");
  v5["rope_parameters"] = llama3;
  v5["rope_parameters"]["rope_theta"] = 500000.0;
  v5["rope_parameters"]["partial_rotary_factor"] = 0.5;
  const ModelConfig a = ModelConfig::from_hf_json(old, "old"), b = ModelConfig::from_hf_json(v5, "v5");
  EXPECT_EQ(b.rope_scaling.type, "llama3");
  EXPECT_DOUBLE_EQ(b.rope_theta, 500000.0);
  EXPECT_DOUBLE_EQ(b.partial_rotary_factor, 0.5);
  EXPECT_EQ(a, b);
  EXPECT_EQ(b.to_hf_json()["rope_scaling"], a.to_hf_json()["rope_scaling"]);  // written in the 4.45 form

  json both = v5;  // the same scaling both ways is accepted; a different one is refused
  both["rope_scaling"] = llama3;
  EXPECT_EQ(ModelConfig::from_hf_json(both, "both").rope_scaling, b.rope_scaling);
  both["rope_scaling"]["factor"] = 4.0;
  expect_error(both.dump().c_str(), "rope_theta", 500000.0, {"rope_parameters", "conflicts with rope_scaling"});
  json other = v5;
  other["partial_rotary_factor"] = 1.0;
  expect_error(other.dump().c_str(), "rope_theta", 500000.0, {"rope_parameters.partial_rotary_factor", "conflicts"});
  json bad = v5;
  bad["rope_parameters"]["mscale"] = 1.0;
  expect_error(bad.dump().c_str(), "rope_theta", 500000.0, {"rope_parameters.mscale", "DeepSeek"});
  json missing = v5;
  missing["rope_parameters"].erase("factor");
  expect_error(missing.dump().c_str(), "rope_theta", 500000.0, {"rope_parameters.factor", "missing"});
  json mistral = json::parse(kMistral);
  mistral["rope_parameters"] = {{"rope_type", "linear"}, {"factor", 2.0}};
  expect_error(mistral.dump().c_str(), "rope_theta", 10000.0, {"rope_parameters.rope_type", "mistral"});
}
