// Gemma 2 (transformers 4.45.2 Gemma2Config / Gemma2ForCausalLM): the config.json fields, their class
// defaults, strict checks and the config.json lathe writes back. The body it selects (sandwich
// norms, (1 + w) RMSNorm, GeGLU, embeddings x sqrt(hidden), alternating sliding-window layers) is
// models/gemma2.cpp's; the soft caps and the score scale are kernel arguments (kernels/cpu/ops.h).
#include <cmath>

#include "config/hf_reader.h"
#include "config/model_config.h"

namespace lathe {

// Gemma2Config's keys (4.45.2). hidden_act and sliding_window_size are older spellings real
// Gemma-2 config.json files still carry; transformers 4.45 reads neither (checked below).
const std::vector<std::string>& gemma2_keys() {
  static const std::vector<std::string> k = {"hidden_size",
                                             "intermediate_size",
                                             "num_hidden_layers",
                                             "num_attention_heads",
                                             "num_key_value_heads",
                                             "head_dim",
                                             "hidden_activation",
                                             "hidden_act",
                                             "max_position_embeddings",
                                             "rms_norm_eps",
                                             "rope_theta",
                                             "rope_scaling",
                                             "attention_bias",
                                             "attention_dropout",
                                             "query_pre_attn_scalar",
                                             "sliding_window",
                                             "sliding_window_size",
                                             "final_logit_softcapping",
                                             "attn_logit_softcapping",
                                             "cache_implementation"};
  return k;
}

void read_gemma2(const hf_config::Reader& r, ModelConfig& c) {
  using hf_config::value_str;
  const auto& j = r.j;
  if (!r.has("vocab_size")) c.vocab_size = 256000;
  c.hidden_size = r.has_size("hidden_size") ? r.get_int("hidden_size") : 3072;
  c.intermediate_size = r.has_size("intermediate_size") ? r.get_int("intermediate_size") : 24576;
  c.num_hidden_layers = r.has_size("num_hidden_layers") ? r.get_int("num_hidden_layers") : 28;
  c.num_attention_heads = r.has_size("num_attention_heads") ? r.get_int("num_attention_heads") : 16;
  c.num_key_value_heads = r.has_size("num_key_value_heads") ? r.get_int("num_key_value_heads") : 16;
  // Gemma2Config always has a head_dim (default 256, not hidden / heads).
  c.explicit_head_dim = r.has_size("head_dim") ? r.get_int("head_dim") : 256;
  if (c.explicit_head_dim <= 0) r.fail("head_dim", fmt::format("{} must be > 0", c.explicit_head_dim));
  c.max_position_embeddings = r.has_size("max_position_embeddings") ? r.get_int("max_position_embeddings") : 8192;
  c.norm_eps = r.has("rms_norm_eps") ? r.get_double("rms_norm_eps") : 1e-6;
  c.rope_theta = r.has("rope_theta") ? r.get_double("rope_theta") : 10000.0;
  if (!j.contains("pad_token_id")) c.pad_token_id = 0;
  if (!j.contains("eos_token_id")) c.eos_token_id = 1;
  if (!j.contains("bos_token_id")) c.bos_token_id = 2;
  c.tie_word_embeddings = r.has("tie_word_embeddings") ? r.get_bool("tie_word_embeddings") : true;
  if (!c.tie_word_embeddings)
    r.fail("tie_word_embeddings",
           "false is not supported for gemma2 (Gemma2ForCausalLM's lm_head is the embedding; lathe ties it)");
  const std::string act = r.has("hidden_activation") ? r.get_string("hidden_activation") : "gelu_pytorch_tanh";
  if (act != "gelu_pytorch_tanh" && act != "gelu_new")
    r.fail("hidden_activation", fmt::format("'{}' is not supported for gemma2 (gelu_pytorch_tanh: GeGLU with the "
                                            "tanh GELU)",
                                            act));
  c.hidden_act = "gelu_pytorch_tanh";
  // Gemma2MLP reads hidden_activation only; a hidden_act naming another function would be ignored
  // by transformers too, but it says the file's author meant something else: refuse it.
  if (r.has("hidden_act")) {
    const std::string old = r.get_string("hidden_act");
    if (old != "gelu_pytorch_tanh" && old != "gelu_new")
      r.fail("hidden_act", fmt::format("'{}' differs from the GeGLU's tanh GELU (transformers 4.45's Gemma2 reads "
                                       "hidden_activation only); remove it or give gelu_pytorch_tanh",
                                       old));
  }
  if (r.has("attention_bias") && r.get_bool("attention_bias"))
    r.fail("attention_bias", "true is not supported for gemma2 (no q/k/v/o biases)");
  if (r.has("rope_scaling") && !j["rope_scaling"].is_null())
    r.fail("rope_scaling", "transformers 4.45's Gemma2 ignores rope_scaling (plain RoPE); give null or remove it");
  c.query_pre_attn_scalar = r.has("query_pre_attn_scalar") ? r.get_double("query_pre_attn_scalar") : 224.0;
  if (!(c.query_pre_attn_scalar > 0) || !std::isfinite(c.query_pre_attn_scalar))
    r.fail("query_pre_attn_scalar",
           fmt::format("{} must be a finite number > 0 (scores are scaled by 1/sqrt(it))", c.query_pre_attn_scalar));
  // Soft caps: null means none (transformers: `if config.attn_logit_softcapping is not None`).
  auto cap = [&](const char* k, double dflt) {
    if (!j.contains(k)) return dflt;
    if (j[k].is_null()) return 0.0;
    const double v = r.get_double(k);
    if (!(v > 0) || !std::isfinite(v))
      r.fail(k, fmt::format("{} must be a finite number > 0, or null for no capping", v));
    return v;
  };
  c.attn_logit_softcapping = cap("attn_logit_softcapping", 50.0);
  c.final_logit_softcapping = cap("final_logit_softcapping", 30.0);
  // Gemma2Attention: layers with an even index slide (`not bool(layer_idx % 2)`), the others are full.
  c.sliding_window = r.has("sliding_window") ? r.get_int("sliding_window") : 4096;
  if (c.sliding_window <= 0 || c.sliding_window > kMaxPositions)
    r.fail("sliding_window",
           fmt::format("{} must be in [1, {}] (gemma2's even layers always slide)", c.sliding_window, kMaxPositions));
  if (r.has("sliding_window_size") && r.get_int("sliding_window_size") != c.sliding_window)
    r.fail("sliding_window_size", fmt::format("{} differs from sliding_window = {}; transformers 4.45 reads "
                                              "sliding_window only: make them equal or remove sliding_window_size",
                                              r.get_int("sliding_window_size"), c.sliding_window));
  if (c.num_hidden_layers >= 1 && c.num_hidden_layers <= kMaxLayers) {
    c.sliding_layers.assign(static_cast<size_t>(c.num_hidden_layers), 0);
    for (int64_t l = 0; l < c.num_hidden_layers; l += 2) c.sliding_layers[static_cast<size_t>(l)] = 1;
  }
  if (r.has("cache_implementation") && r.get_string("cache_implementation") != "hybrid")
    r.fail("cache_implementation",
           fmt::format("'{}' is not supported (gemma2's is 'hybrid'; it does not change the trained model)",
                       value_str(j["cache_implementation"])));
}

void gemma2_to_hf_json(const ModelConfig& c, nlohmann::json& j) {
  j["architectures"] = {"Gemma2ForCausalLM"};
  j["hidden_size"] = c.hidden_size;
  j["intermediate_size"] = c.intermediate_size;
  j["num_hidden_layers"] = c.num_hidden_layers;
  j["num_attention_heads"] = c.num_attention_heads;
  j["num_key_value_heads"] = c.num_key_value_heads;
  j["head_dim"] = c.head_dim();
  j["hidden_activation"] = "gelu_pytorch_tanh";
  j["max_position_embeddings"] = c.max_position_embeddings;
  j["rms_norm_eps"] = c.norm_eps;
  j["rope_theta"] = c.rope_theta;
  j["attention_bias"] = false;
  j["attention_dropout"] = 0.0;
  j["query_pre_attn_scalar"] = c.query_pre_attn_scalar;
  j["sliding_window"] = c.sliding_window;
  j["attn_logit_softcapping"] = c.attn_logit_softcapping > 0 ? nlohmann::json(c.attn_logit_softcapping) : nullptr;
  j["final_logit_softcapping"] = c.final_logit_softcapping > 0 ? nlohmann::json(c.final_logit_softcapping) : nullptr;
  j["cache_implementation"] = "hybrid";
}

}  // namespace lathe
