#include "config/model_config.h"

#include <algorithm>
#include <cmath>
#include <set>

#include "config/hf_reader.h"
#include "config/recipe.h"  // closest_match
#include "core/checked.h"
#include "core/error.h"
#include "io/json.h"
#include "io/json_fields.h"

namespace lathe {

namespace {

using json = nlohmann::json;
using hf_config::Reader;
using hf_config::value_str;

const std::vector<std::string> kModelTypes = {"gpt2", "llama",    "qwen2",  "mistral", "qwen3",
                                              "phi3", "gpt_neox", "gemma2", "mixtral", "olmo2",
                                              "qwen2_moe"};

// Keys of every PretrainedConfig that never change the forward math.
const std::vector<std::string> kCommonKeys = {"model_type",
                                              "architectures",
                                              "torch_dtype",
                                              "dtype",
                                              "transformers_version",
                                              "use_cache",
                                              "_name_or_path",
                                              "vocab_size",
                                              "bos_token_id",
                                              "eos_token_id",
                                              "pad_token_id",
                                              "sep_token_id",
                                              "decoder_start_token_id",
                                              "tie_word_embeddings",
                                              "initializer_range",
                                              "id2label",
                                              "label2id",
                                              "return_dict",
                                              "output_hidden_states",
                                              "output_attentions",
                                              "torchscript",
                                              "pruned_heads",
                                              "tokenizer_class",
                                              "prefix",
                                              "task_specific_params",
                                              "problem_type",
                                              "finetuning_task",
                                              "chunk_size_feed_forward",
                                              "is_encoder_decoder",
                                              "is_decoder",
                                              "add_cross_attention",
                                              "tie_encoder_decoder",
                                              "use_return_dict",
                                              "_attn_implementation",
                                              "attn_implementation"};

const std::vector<std::string> kGpt2Keys = {
    "n_positions", "n_ctx", "n_embd", "n_layer", "n_head", "n_inner", "activation_function", "layer_norm_epsilon",
    "resid_pdrop", "embd_pdrop", "attn_pdrop", "summary_type", "summary_use_proj", "summary_activation",
    "summary_proj_to_labels", "summary_first_dropout", "scale_attn_weights", "scale_attn_by_inverse_layer_idx",
    "reorder_and_upcast_attn",
    // HF attribute_map aliases
    "hidden_size", "num_hidden_layers", "num_attention_heads", "max_position_embeddings"};

const std::vector<std::string> kLlamaKeys = {"hidden_size",
                                             "intermediate_size",
                                             "num_hidden_layers",
                                             "num_attention_heads",
                                             "num_key_value_heads",
                                             "head_dim",
                                             "hidden_act",
                                             "max_position_embeddings",
                                             "rms_norm_eps",
                                             "rope_theta",
                                             "rope_scaling",
                                             "rope_parameters",
                                             "attention_bias",
                                             "mlp_bias",
                                             "attention_dropout",
                                             "pretraining_tp",
                                             "partial_rotary_factor",
                                             "original_max_position_embeddings"};
// transformers 4.45 GPTNeoXConfig.
const std::vector<std::string> kGptNeoxKeys = {"hidden_size",        "intermediate_size",
                                               "num_hidden_layers",  "num_attention_heads",
                                               "hidden_act",         "rotary_pct",
                                               "rotary_emb_base",    "partial_rotary_factor",
                                               "rope_theta",         "rope_scaling",
                                               "attention_dropout",  "hidden_dropout",
                                               "classifier_dropout", "max_position_embeddings",
                                               "layer_norm_eps",     "use_parallel_residual",
                                               "attention_bias"};
const std::vector<std::string> kQwen2Extra = {"use_sliding_window", "sliding_window", "max_window_layers",
                                              "layer_types"};
const std::vector<std::string> kMistralExtra = {"sliding_window", "layer_types"};
// Qwen3Config: Qwen2's sliding-window keys (attention_bias, head_dim are llama keys).
const std::vector<std::string> kQwen3Extra = {"use_sliding_window", "sliding_window", "max_window_layers",
                                              "layer_types"};
// Phi3Config 4.45 (original_max_position_embeddings is in kLlamaKeys already).
const std::vector<std::string> kPhi3Extra = {"sliding_window", "resid_pdrop", "embd_pdrop"};

const std::vector<std::string> kDropoutKeys = {"resid_pdrop",           "embd_pdrop",        "attn_pdrop",
                                               "summary_first_dropout", "attention_dropout", "hidden_dropout"};

std::string family_of(const std::string& mt) { return mt == "gpt2" || mt == "gpt_neox" ? mt : "llama"; }

}  // namespace

std::vector<std::string> ModelConfig::known_keys(std::string_view model_type) {
  std::vector<std::string> keys = kCommonKeys;
  if (model_type == "gpt2") {
    keys.insert(keys.end(), kGpt2Keys.begin(), kGpt2Keys.end());
  } else if (model_type == "gpt_neox") {
    keys.insert(keys.end(), kGptNeoxKeys.begin(), kGptNeoxKeys.end());
  } else if (model_type == "gemma2") {
    keys.insert(keys.end(), gemma2_keys().begin(), gemma2_keys().end());
  } else if (model_type == "mixtral") {  // config/mixtral_config.cpp
    keys.insert(keys.end(), mixtral_keys().begin(), mixtral_keys().end());
  } else if (model_type == "qwen2_moe") {  // config/qwen2_moe_config.cpp
    keys.insert(keys.end(), qwen2_moe_keys().begin(), qwen2_moe_keys().end());
  } else {
    keys.insert(keys.end(), kLlamaKeys.begin(), kLlamaKeys.end());
    if (model_type == "qwen2") keys.insert(keys.end(), kQwen2Extra.begin(), kQwen2Extra.end());
    if (model_type == "mistral") keys.insert(keys.end(), kMistralExtra.begin(), kMistralExtra.end());
    if (model_type == "qwen3") keys.insert(keys.end(), kQwen3Extra.begin(), kQwen3Extra.end());
    if (model_type == "phi3") keys.insert(keys.end(), kPhi3Extra.begin(), kPhi3Extra.end());
  }
  return keys;
}

namespace {

// rope_scaling, the top-level original_max_position_embeddings (Phi-3's, read by longrope) and
// partial_rotary_factor (config/rope_scaling.h).
void read_rope_scaling(const Reader& r, ModelConfig& c, bool mistral, std::string_view key_prefix) {
  if (r.has("rope_scaling")) {
    c.rope_scaling = RopeScaling::from_json(r.j["rope_scaling"], r.source, key_prefix);
    if (mistral && c.rope_scaling.active())
      r.fail("rope_scaling",
             "transformers 4.45's mistral ignores rope_scaling (its rotary class is plain RoPE), so "
             "a scaled mistral would not load as trained; use model_type llama, or null");
  }
  if (r.has("original_max_position_embeddings"))
    c.rope_scaling.config_original_max_position_embeddings =
        r.f.integer(r.j["original_max_position_embeddings"], "original_max_position_embeddings", 1, kMaxPositions);
  if (r.has("partial_rotary_factor")) {
    c.partial_rotary_factor = r.get_double("partial_rotary_factor");
    if (mistral && c.partial_rotary_factor != 1.0)
      r.fail("partial_rotary_factor",
             "transformers 4.45's mistral ignores it (it rotates the whole head); use "
             "model_type llama, or remove the key");
  }
}

// Keys lathe does not read: refused when strict (a recipe), else listed with the reason (a
// config.json); keys that would change the math if set (cross attention, dropout) are refused.
void check_unread_keys(const Reader& r, ModelConfig& c, bool strict_unknown) {
  const json& j = r.j;
  const std::string_view source = r.source, key_prefix = r.prefix;
  const auto known = ModelConfig::known_keys(c.model_type);
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (std::find(known.begin(), known.end(), it.key()) != known.end()) continue;
    if (strict_unknown) {
      std::string near = closest_match(it.key(), known);
      throw_error("{}: unknown key '{}{}' for model_type {}{}", source, key_prefix, value_str(it.key()), c.model_type,
                  near.empty() ? std::string() : fmt::format(" (did you mean '{}{}'?)", key_prefix, near));
    }
    c.ignored_keys.push_back(it.key());
    c.ignored_reasons.push_back(fmt::format("not a field lathe's {} config reads", c.model_type));
  }
  // Keys that would change the math if set: reject rather than silently compute something else.
  r.require_bool("add_cross_attention", false, "lathe trains decoder-only models");
  r.require_bool("is_encoder_decoder", false, "lathe trains decoder-only models");
  for (const auto& k : kDropoutKeys) {
    if (!r.has(k)) continue;
    double p = r.get_double(k);
    if (p < 0 || p >= 1) r.fail(k, fmt::format("dropout probability {} outside [0, 1)", p));
    if (strict_unknown && p != 0)
      r.fail(k, fmt::format("{} is not supported: lathe does not implement dropout (set 0 or remove)", p));
    if (p != 0) {  // a config.json: the weights still load; training runs without dropout
      c.ignored_keys.push_back(k);
      c.ignored_reasons.push_back(fmt::format("{}: lathe trains without dropout", p));
    }
  }
}

// transformers v5's `rope_parameters`: rope_theta, partial_rotary_factor and the rope_scaling keys
// in one object ({"rope_type": "llama3", "rope_theta": 500000, "factor": 8, ...}). Read into the
// same fields as the 4.45 keys (and written back in the 4.45 form); a value given both ways must agree.
void read_rope_parameters(const Reader& r, ModelConfig& c, bool mistral, std::string_view key_prefix) {
  const json& rp = r.j["rope_parameters"];
  if (!rp.is_object()) r.fail("rope_parameters", fmt::format("expected an object, got '{}'", value_str(rp)));
  json scaling = rp;
  if (const auto it = rp.find("rope_theta"); it != rp.end()) {
    const double t = r.f.number(*it, "rope_parameters.rope_theta", 0.0, true);
    if (r.has("rope_theta") && t != c.rope_theta)
      r.fail("rope_parameters.rope_theta", fmt::format("{} conflicts with rope_theta = {}", t, c.rope_theta));
    c.rope_theta = t;
    scaling.erase("rope_theta");
  }
  if (const auto it = rp.find("partial_rotary_factor"); it != rp.end()) {
    const double f = r.f.number(*it, "rope_parameters.partial_rotary_factor", 0.0, true);
    if (r.has("partial_rotary_factor") && f != c.partial_rotary_factor)
      r.fail("rope_parameters.partial_rotary_factor",
             fmt::format("{} conflicts with partial_rotary_factor = {}", f, c.partial_rotary_factor));
    if (mistral && f != 1.0)
      r.fail("rope_parameters.partial_rotary_factor",
             "transformers' mistral rotates the whole head; use model_type llama, or remove the key");
    c.partial_rotary_factor = f;
    scaling.erase("partial_rotary_factor");
  }
  if (scaling.empty()) return;  // only rope_theta: plain RoPE
  RopeScaling s = RopeScaling::from_json(scaling, r.source, key_prefix, "rope_parameters");
  if (!s.active()) return;
  if (mistral)
    r.fail("rope_parameters.rope_type", fmt::format("'{}': transformers 4.45's mistral computes plain RoPE only; use "
                                                    "model_type llama, or rope_type default",
                                                    s.type));
  s.config_original_max_position_embeddings = c.rope_scaling.config_original_max_position_embeddings;
  if (c.rope_scaling.active()) {
    RopeScaling a = c.rope_scaling, b = s;
    a.old_type_key = b.old_type_key = false;
    if (!(a == b))
      r.fail("rope_parameters", fmt::format("{} conflicts with rope_scaling {} (give one of them)",
                                            io::json_excerpt(scaling), io::json_excerpt(c.rope_scaling.to_json())));
    return;
  }
  c.rope_scaling = s;
}

// GPTNeoXConfig (transformers 4.45) fields and class defaults (vocab_size, token ids and
// initializer_range are read by the caller).
void read_gpt_neox(const Reader& r, ModelConfig& c) {
  const json& j = r.j;
  if (!r.has("vocab_size")) c.vocab_size = 50432;
  c.hidden_size = r.has_size("hidden_size") ? r.get_int("hidden_size") : 6144;
  c.num_hidden_layers = r.has_size("num_hidden_layers") ? r.get_int("num_hidden_layers") : 44;
  c.num_attention_heads = r.has_size("num_attention_heads") ? r.get_int("num_attention_heads") : 64;
  c.num_key_value_heads = c.num_attention_heads;
  c.intermediate_size = r.has_size("intermediate_size") ? r.get_int("intermediate_size") : 24576;
  c.max_position_embeddings = r.has_size("max_position_embeddings") ? r.get_int("max_position_embeddings") : 2048;
  c.norm_eps = r.has("layer_norm_eps") ? r.get_double("layer_norm_eps") : 1e-5;
  if (!j.contains("bos_token_id")) c.bos_token_id = 0;
  if (!j.contains("eos_token_id")) c.eos_token_id = 2;
  c.tie_word_embeddings = r.has("tie_word_embeddings") ? r.get_bool("tie_word_embeddings") : false;
  if (c.tie_word_embeddings)
    r.fail("tie_word_embeddings",
           "true is not supported for gpt_neox (embed_out is its own tensor; HF's "
           "GPTNeoXForCausalLM does not tie it either)");
  // hidden_act: "gelu" is the exact (erf) GELU, gelu_new / gelu_pytorch_tanh the tanh one.
  const std::string act = r.has("hidden_act") ? r.get_string("hidden_act") : "gelu";
  if (act != "gelu" && act != "gelu_new" && act != "gelu_pytorch_tanh")
    r.fail("hidden_act", fmt::format("'{}' is not supported for gpt_neox (gelu: exact; gelu_new or "
                                     "gelu_pytorch_tanh: tanh approximation)",
                                     act));
  c.hidden_act = act == "gelu" ? "gelu" : "gelu_new";
  c.parallel_residual = r.has("use_parallel_residual") ? r.get_bool("use_parallel_residual") : true;
  c.attention_bias = r.has("attention_bias") ? r.get_bool("attention_bias") : true;
  // rotary_pct / rotary_emb_base are the config's own names; transformers also saves them as
  // partial_rotary_factor / rope_theta (the same values): either spelling, equal when both given.
  auto alias = [&](const char* name, const char* other, double dflt) {
    double v = r.has(name) ? r.get_double(name) : dflt;
    if (r.has(other)) {
      const double o = r.get_double(other);
      if (r.has(name) && o != v)
        r.fail(other,
               fmt::format("{} conflicts with {} = {} (transformers uses {}); give one of them", o, name, v, name));
      v = o;
    }
    return v;
  };
  c.partial_rotary_factor = alias("rotary_pct", "partial_rotary_factor", 0.25);
  c.rope_theta = alias("rotary_emb_base", "rope_theta", 10000.0);
  // transformers 4.45's GPTNeoXRotaryEmbedding is LlamaRotaryEmbedding (ROPE_INIT_FUNCTIONS over the
  // rotary_pct dims): every rope_scaling type reads as the llama family's.
  if (r.has("rope_scaling")) c.rope_scaling = RopeScaling::from_json(j["rope_scaling"], r.source, r.prefix);
}

}  // namespace

ModelConfig ModelConfig::from_hf_json(const json& j, std::string_view source, bool strict_unknown) {
  return from_hf_json(j, source, "", strict_unknown);
}

ModelConfig ModelConfig::from_hf_json(const json& j, std::string_view source, std::string_view key_prefix,
                                      bool strict_unknown) {
  if (!j.is_object())
    throw_error("{}: model config must be a JSON object, got {} '{}'", source, io::json_type_name(j),
                io::json_excerpt(j));
  Reader r{j, source, key_prefix};
  ModelConfig c;
  if (!j.contains("model_type"))
    throw_error(
        "{}: {}model_type is missing (one of gpt2, llama, qwen2, mistral, qwen3, phi3, gpt_neox, gemma2, "
        "mixtral, olmo2, qwen2_moe)",
        source, key_prefix);
  c.model_type = r.get_string("model_type");
  if (std::find(kModelTypes.begin(), kModelTypes.end(), c.model_type) == kModelTypes.end())
    r.fail("model_type", fmt::format("'{}' is not supported (supported: gpt2, llama, qwen2, mistral, qwen3, phi3, "
                                     "gpt_neox, gemma2, mixtral, olmo2, qwen2_moe)",
                                     c.model_type));
  c.family = family_of(c.model_type);

  check_unread_keys(r, c, strict_unknown);

  if (r.has_size("vocab_size")) c.vocab_size = r.get_int("vocab_size");
  if (r.has("initializer_range")) c.initializer_range = r.get_double("initializer_range");
  for (auto [k, dst] : {std::pair{"bos_token_id", &c.bos_token_id}, std::pair{"eos_token_id", &c.eos_token_id},
                        std::pair{"pad_token_id", &c.pad_token_id}})
    if (j.contains(k)) *dst = r.get_token(k);
  if (j.contains("eos_token_id") && j["eos_token_id"].is_array() && j["eos_token_id"].size() > 1)
    for (const json& id : j["eos_token_id"]) c.eos_token_ids.push_back(id.get<int64_t>());  // integers: get_token

  if (c.is_gpt2()) {
    // GPT2Config class defaults.
    c.vocab_size = r.has("vocab_size") ? c.vocab_size : 50257;
    c.max_position_embeddings = 1024;
    c.hidden_size = 768;
    c.num_hidden_layers = 12;
    c.num_attention_heads = 12;
    // HF's default <|endoftext|> id only exists in the GPT-2 vocabulary; a smaller (e.g. byte)
    // vocabulary gets no default rather than an out-of-range id.
    if (!j.contains("bos_token_id") && c.vocab_size > 50256) c.bos_token_id = 50256;
    if (!j.contains("eos_token_id") && c.vocab_size > 50256) c.eos_token_id = 50256;
    r.int_alias({"n_positions", "max_position_embeddings"}, &c.max_position_embeddings);
    // Old configs carry n_ctx (same value as n_positions; transformers ignores it).
    if (r.has("n_ctx") && r.get_int("n_ctx") != c.max_position_embeddings)
      r.fail("n_ctx", fmt::format("{} differs from n_positions = {}; lathe uses n_positions (remove n_ctx or make "
                                  "them equal)",
                                  r.get_int("n_ctx"), c.max_position_embeddings));
    r.int_alias({"n_embd", "hidden_size"}, &c.hidden_size);
    r.int_alias({"n_layer", "num_hidden_layers"}, &c.num_hidden_layers);
    r.int_alias({"n_head", "num_attention_heads"}, &c.num_attention_heads);
    c.num_key_value_heads = c.num_attention_heads;
    c.intermediate_size =
        r.has("n_inner") ? r.get_int("n_inner") : checked_mul(4, c.hidden_size, fmt::format("{}: 4 x n_embd", source));
    c.norm_eps = r.has("layer_norm_epsilon") ? r.get_double("layer_norm_epsilon") : 1e-5;
    std::string act = r.has("activation_function") ? r.get_string("activation_function") : "gelu_new";
    if (act != "gelu_new" && act != "gelu_pytorch_tanh")
      r.fail("activation_function",
             fmt::format("'{}' is not supported (gelu_new or gelu_pytorch_tanh, both tanh-GELU)", act));
    c.hidden_act = "gelu_new";
    r.require_bool("scale_attn_weights", true, "lathe always scales scores by 1/sqrt(head_dim)");
    r.require_bool("scale_attn_by_inverse_layer_idx", false, "the extra 1/(layer+1) scaling is not implemented");
    r.require_bool("reorder_and_upcast_attn", false, "not implemented");
    c.tie_word_embeddings = true;
    r.require_bool("tie_word_embeddings", true, "GPT-2's lm_head is always tied to wte in lathe");
    c.attention_bias = false;
    c.rope_theta = 10000.0;
  } else if (c.is_gpt_neox()) {
    read_gpt_neox(r, c);
  } else if (c.model_type == "gemma2") {
    read_gemma2(r, c);
  } else if (c.model_type == "mixtral") {  // config/mixtral_config.cpp
    read_mixtral(r, c);
  } else if (c.model_type == "qwen2_moe") {  // config/qwen2_moe_config.cpp
    read_qwen2_moe(r, c);
  } else {
    // LlamaConfig / Qwen2Config / MistralConfig / Qwen3Config / Phi3Config class defaults.
    const bool qwen3 = c.model_type == "qwen3", qwen = c.model_type == "qwen2" || qwen3,
               mistral = c.model_type == "mistral", phi3 = c.model_type == "phi3";
    c.qk_norm = qwen3;
    if (!r.has("vocab_size")) c.vocab_size = qwen ? 151936 : phi3 ? 32064 : 32000;
    c.hidden_size = r.has_size("hidden_size") ? r.get_int("hidden_size") : phi3 ? 3072 : 4096;
    c.intermediate_size = r.has_size("intermediate_size") ? r.get_int("intermediate_size")
                          : phi3                          ? 8192
                          : qwen                          ? 22016
                          : mistral                       ? 14336
                                                          : 11008;
    c.num_hidden_layers = r.has_size("num_hidden_layers") ? r.get_int("num_hidden_layers") : 32;
    c.num_attention_heads = r.has_size("num_attention_heads") ? r.get_int("num_attention_heads") : 32;
    c.num_key_value_heads = r.has("num_key_value_heads") ? r.get_int("num_key_value_heads")
                            : mistral                    ? 8
                                                         : c.num_attention_heads;
    c.max_position_embeddings = r.has_size("max_position_embeddings") ? r.get_int("max_position_embeddings")
                                : qwen                                ? 32768
                                : mistral                             ? 131072
                                : phi3                                ? 4096
                                                                      : 2048;
    c.norm_eps = r.has("rms_norm_eps") ? r.get_double("rms_norm_eps") : phi3 ? 1e-5 : 1e-6;
    c.rope_theta = r.has("rope_theta") ? r.get_double("rope_theta") : 10000.0;
    if (!j.contains("bos_token_id") && !qwen) c.bos_token_id = 1;
    if (!j.contains("eos_token_id") && !qwen) c.eos_token_id = phi3 ? 32000 : 2;
    if (!j.contains("pad_token_id") && phi3) c.pad_token_id = 32000;
    c.tie_word_embeddings = r.has("tie_word_embeddings") ? r.get_bool("tie_word_embeddings") : false;
    std::string act = r.has("hidden_act") ? r.get_string("hidden_act") : "silu";
    if (act != "silu" && act != "swish")
      r.fail("hidden_act", fmt::format("'{}' is not supported for {} (only silu)", act, c.model_type));
    c.hidden_act = "silu";
    // transformers 4.45: LlamaConfig and MistralConfig take head_dim (MistralConfig reads 0 as absent:
    // `head_dim or hidden_size // num_attention_heads`); Qwen2Config has none in 4.45 but later
    // releases read it as llama does. validate() checks it (> 0, even).
    if (phi3) {
      read_phi3(r, c);
    } else if (r.has("head_dim") && !(mistral && r.get_int("head_dim") == 0)) {
      c.explicit_head_dim = r.get_int("head_dim");
      if (c.explicit_head_dim <= 0)
        r.fail("head_dim",
               fmt::format("{} must be > 0 (or absent: hidden_size / num_attention_heads)", c.explicit_head_dim));
    } else if (qwen3) {
      c.explicit_head_dim = 128;  // Qwen3Config's default head_dim (not hidden_size / heads)
    }
    if (!phi3) read_rope_scaling(r, c, mistral, key_prefix);
    if (r.has("rope_parameters")) read_rope_parameters(r, c, mistral, key_prefix);
    if (r.has("mlp_bias") && r.get_bool("mlp_bias"))
      r.fail("mlp_bias", "true is not supported (MLP without biases only)");
    if (qwen) {
      if (qwen3) {  // Qwen3Attention: q/k/v/o biases all follow attention_bias (default false)
        c.attention_bias = r.has("attention_bias") && r.get_bool("attention_bias");
      } else {
        // Qwen2 always has q/k/v biases; there is no switch in its config class.
        if (r.has("attention_bias") && !r.get_bool("attention_bias"))
          r.fail("attention_bias", "qwen2 always has q/k/v biases; false is not supported");
        c.attention_bias = true;
      }
      bool use_sw = r.has("use_sliding_window") && r.get_bool("use_sliding_window");
      if (use_sw) {
        if (!r.has("sliding_window")) r.fail("sliding_window", "missing while use_sliding_window is true");
        c.sliding_window = r.get_int("sliding_window");
      }
      // Layers l >= max_window_layers use the window (Qwen2Config default 28): transformers 4.45.2
      // Qwen2FlashAttention2 (`self.layer_idx >= self.config.max_window_layers`) and the layer_types
      // later Qwen2Config derives from it. (4.45.2's eager and sdpa Qwen2 ignore the window.)
      const int64_t mwl = r.has("max_window_layers") ? r.get_int("max_window_layers") : 28;
      if (mwl < 0) r.fail("max_window_layers", fmt::format("{} must be >= 0", mwl));
      // (A layer count out of range is left to validate(), before anything is sized by it.)
      if (c.sliding_window > 0 && mwl > 0 && c.num_hidden_layers >= 0 && c.num_hidden_layers <= kMaxLayers) {
        c.sliding_layers.assign(static_cast<size_t>(std::max<int64_t>(c.num_hidden_layers, 0)), 0);
        for (int64_t l = mwl; l < c.num_hidden_layers; ++l) c.sliding_layers[static_cast<size_t>(l)] = 1;
      }
    } else if (phi3) {
      // read_phi3: no biases, sliding_window.
    } else if (mistral) {
      if (r.has("attention_bias") && r.get_bool("attention_bias"))
        r.fail("attention_bias", "mistral has no attention biases; true is not supported");
      c.attention_bias = false;
      // Absent means the class default 4096; null means full attention.
      c.sliding_window = !j.contains("sliding_window")   ? 4096
                         : j["sliding_window"].is_null() ? 0
                                                         : r.get_int("sliding_window");
    } else {
      c.attention_bias = r.has("attention_bias") && r.get_bool("attention_bias");
    }
    if (r.has("layer_types")) {
      const json& lt = j["layer_types"];
      if (!lt.is_array()) r.fail("layer_types", fmt::format("expected a list, got '{}'", value_str(lt)));
      if (static_cast<int64_t>(lt.size()) != c.num_hidden_layers)
        r.fail("layer_types", fmt::format("has {} entries for {} layers (num_hidden_layers): give one per layer",
                                          lt.size(), c.num_hidden_layers));
      // layer_types decides which layers slide (over max_window_layers, as in later transformers).
      c.sliding_layers.clear();
      for (const auto& t : lt) {
        if (t == "full_attention" || (t == "sliding_attention" && c.sliding_window > 0)) {
          c.sliding_layers.push_back(t == "sliding_attention" ? 1 : 0);
          continue;
        }
        r.fail("layer_types", fmt::format("entry {} is not supported (full_attention, or sliding_attention with a "
                                          "sliding_window)",
                                          io::json_excerpt(t)));
      }
    }
    // One kind only: every layer slides (empty list) or none does (no window).
    if (!c.sliding_layers.empty()) {
      const auto n = std::count(c.sliding_layers.begin(), c.sliding_layers.end(), uint8_t{1});
      if (n == 0) c.sliding_window = 0;
      if (n == 0 || n == static_cast<std::ptrdiff_t>(c.sliding_layers.size())) c.sliding_layers.clear();
    }
  }
  if (c.model_type == "olmo2") read_olmo2(r, c);  // config/olmo2_config.cpp
  if (r.has("pretraining_tp")) (void)r.get_int("pretraining_tp");
  if (r.has("initializer_range") && c.initializer_range <= 0)
    r.fail("initializer_range", fmt::format("{} must be > 0", c.initializer_range));
  c.validate(source, key_prefix);
  return c;
}

void ModelConfig::validate(std::string_view source) const { validate(source, ""); }

void ModelConfig::validate(std::string_view source, std::string_view prefix) const {
  // Name fields as the config.json of this family spells them, with the recipe prefix.
  auto hf = [&](std::string_view f) -> std::string {
    std::string p(prefix);
    if (is_gpt2()) {
      if (f == "hidden_size") return p + "n_embd";
      if (f == "num_hidden_layers") return p + "n_layer";
      if (f == "num_attention_heads") return p + "n_head";
      if (f == "max_position_embeddings") return p + "n_positions";
      if (f == "intermediate_size") return p + "n_inner";
      if (f == "norm_eps") return p + "layer_norm_epsilon";
    } else if (f == "norm_eps") {
      return p + (is_gpt_neox() ? "layer_norm_eps" : "rms_norm_eps");
    }
    return p + std::string(f);
  };
  // Bounds before anything is sized from these values (the products below, the parameter table,
  // buffers): a hostile config.json must be refused here, not by an allocation that never ends.
  auto bounded = [&](const char* field, int64_t v, int64_t hi) {
    LATHE_CHECK(v > 0, "{}: {} = {} must be > 0", source, hf(field), v);
    LATHE_CHECK(v <= hi, "{}: {} = {} exceeds lathe's maximum {} (see config/model_config.h)", source, hf(field), v,
                hi);
  };
  auto finite_positive = [&](const char* field, double v) {
    LATHE_CHECK(std::isfinite(v) && v > 0, "{}: {} = {} must be a finite number > 0", source, hf(field), v);
  };
  LATHE_CHECK(family == "gpt2" || family == "llama" || family == "gpt_neox",
              "{}: family '{}' must be gpt2, llama or gpt_neox", source, family);
  bounded("vocab_size", vocab_size, kMaxVocabSize);
  bounded("hidden_size", hidden_size, kMaxHiddenSize);
  bounded("num_hidden_layers", num_hidden_layers, kMaxLayers);
  bounded("num_attention_heads", num_attention_heads, kMaxHiddenSize);
  bounded("num_key_value_heads", num_key_value_heads, kMaxHiddenSize);
  bounded("intermediate_size", intermediate_size, kMaxIntermediateSize);
  bounded("max_position_embeddings", max_position_embeddings, kMaxPositions);
  if (explicit_head_dim != 0) {
    // gpt2's config.json has no head_dim; its tensor-parallel shard configs (heads / tp) set it.
    bounded("head_dim", explicit_head_dim, kMaxHiddenSize);
  } else {
    LATHE_CHECK(hidden_size % num_attention_heads == 0, "{}: {} = {} is not divisible by {} = {}{}", source,
                hf("hidden_size"), hidden_size, hf("num_attention_heads"), num_attention_heads,
                is_llama() ? fmt::format(" (or give {}: the width of one head)", hf("head_dim")) : std::string());
  }
  LATHE_CHECK(num_attention_heads % num_key_value_heads == 0, "{}: {} = {} is not divisible by {} = {}", source,
              hf("num_attention_heads"), num_attention_heads, hf("num_key_value_heads"), num_key_value_heads);
  if (is_gpt2() || is_gpt_neox())
    LATHE_CHECK(num_key_value_heads == num_attention_heads,
                "{}: {} has no grouped-query attention: num_key_value_heads = {} must equal {} = {}", source, family,
                num_key_value_heads, hf("num_attention_heads"), num_attention_heads);
  LATHE_CHECK(!parallel_residual || is_gpt_neox(), "{}: {}use_parallel_residual is a gpt_neox field ({} has none)",
              source, prefix, model_type);
  if (is_gpt_neox()) {  // rotary dims even (validate_rope); the head itself may be odd
    finite_positive("rope_theta", rope_theta);
    validate_rope(*this, source, prefix);
  } else if (is_llama()) {
    if (explicit_head_dim != 0)
      LATHE_CHECK(head_dim() % 2 == 0, "{}: {} = {} must be even for RoPE", source, hf("head_dim"), head_dim());
    else
      LATHE_CHECK(head_dim() % 2 == 0, "{}: head_dim = {} / {} = {} / {} = {} must be even for RoPE", source,
                  hf("hidden_size"), hf("num_attention_heads"), hidden_size, num_attention_heads, head_dim());
    finite_positive("rope_theta", rope_theta);
    validate_rope(*this, source, prefix);
  } else {
    LATHE_CHECK(!qk_norm, "{}: gpt2 has no q/k norms (qk_norm is the llama family's: model_type qwen3)", source);
    LATHE_CHECK(!rope_scaling.active() && partial_rotary_factor == 1.0,
                "{}: {}rope_scaling / partial_rotary_factor: gpt2 has learned positions, no RoPE; remove them", source,
                prefix);
  }
  finite_positive("norm_eps", norm_eps);
  finite_positive("initializer_range", initializer_range);
  // gemma2's fields (config/gemma2_config.cpp): the score scale and the two soft caps.
  const bool gemma2 = model_type == "gemma2";
  LATHE_CHECK(
      gemma2 || (query_pre_attn_scalar == 0 && attn_logit_softcapping == 0 && final_logit_softcapping == 0),
      "{}: {}query_pre_attn_scalar / attn_logit_softcapping / final_logit_softcapping are gemma2 fields ({} has "
      "none)",
      source, prefix, model_type);
  LATHE_CHECK(!gemma2 || (std::isfinite(query_pre_attn_scalar) && query_pre_attn_scalar > 0),
              "{}: {} = {} must be a finite number > 0", source, hf("query_pre_attn_scalar"), query_pre_attn_scalar);
  for (auto [name, v] : {std::pair{"attn_logit_softcapping", attn_logit_softcapping},
                         std::pair{"final_logit_softcapping", final_logit_softcapping}})
    LATHE_CHECK(std::isfinite(v) && v >= 0 && v <= 3e38, "{}: {} = {} must be a finite number >= 0 (0 / null = none)",
                source, hf(name), v);
  LATHE_CHECK(sliding_window >= 0 && sliding_window <= kMaxPositions, "{}: {} = {} must be in [0, {}] (0 = none)",
              source, hf("sliding_window"), sliding_window, kMaxPositions);
  for (auto [name, id] : {std::pair{"bos_token_id", bos_token_id}, std::pair{"eos_token_id", eos_token_id},
                          std::pair{"pad_token_id", pad_token_id}})
    LATHE_CHECK(id >= -1 && id <= INT32_MAX, "{}: {}{} = {} is out of range (0 .. {}, or -1 / null for none)", source,
                prefix, name, id, INT32_MAX);
  for (int64_t id : eos_token_ids)
    LATHE_CHECK(id >= 0 && id <= INT32_MAX, "{}: {}eos_token_id: {} in the list is out of range (0 .. {})", source,
                prefix, id, INT32_MAX);
  // Mixture of experts (config/mixtral_config.cpp): mixtral only, experts and top-k in range.
  const bool moe_family = model_type == "mixtral" || model_type == "qwen2_moe";
  LATHE_CHECK(num_local_experts == 0 || moe_family,
              "{}: {}num_local_experts is a mixtral field ({} has no mixture of experts)", source, prefix, model_type);
  LATHE_CHECK(shared_expert_intermediate_size == 0 || model_type == "qwen2_moe",
              "{}: {}shared_expert_intermediate_size is a qwen2_moe field ({} has no shared expert)", source, prefix,
              model_type);
  LATHE_CHECK(shared_expert_intermediate_size >= 0 && shared_expert_intermediate_size <= kMaxIntermediateSize,
              "{}: {} = {} must be in [0, {}]", source, hf("shared_expert_intermediate_size"),
              shared_expert_intermediate_size, kMaxIntermediateSize);
  LATHE_CHECK(!moe_family || (num_local_experts >= 1 && num_local_experts <= kMaxMoeExperts),
              "{}: {} = {} must be in [1, {}]", source, hf("num_local_experts"), num_local_experts, kMaxMoeExperts);
  LATHE_CHECK(!moe() || (num_experts_per_tok >= 1 && num_experts_per_tok <= num_local_experts),
              "{}: {} = {} must be in [1, num_local_experts = {}]", source, hf("num_experts_per_tok"),
              num_experts_per_tok, num_local_experts);
  LATHE_CHECK(std::isfinite(router_aux_loss_coef) && router_aux_loss_coef >= 0 && std::isfinite(router_z_loss_coef) &&
                  router_z_loss_coef >= 0,
              "{}: {} = {} and {} = {} must be finite numbers >= 0", source, hf("router_aux_loss_coef"),
              router_aux_loss_coef, hf("router_z_loss_coef"), router_z_loss_coef);
  // The parameter count is the largest product formed from these fields; it must fit 64 bits.
  (void)num_parameters();
}

void ModelConfig::check_seq_len(int64_t seq_len, std::string_view source) const {
  // Dynamic NTK scaling exists to run past max_position_embeddings (its tables follow seq_len).
  LATHE_CHECK(seq_len <= max_position_embeddings || rope_scaling.type == "dynamic",
              "{}: seq_len = {} exceeds max_position_embeddings = {} of the model", source, seq_len,
              max_position_embeddings);
}

int64_t ModelConfig::num_parameters() const {
  // Checked: a hostile config would otherwise wrap the count and size buffers from it.
  const std::string what = fmt::format("parameter count of {} (n_layer {}, hidden {}, vocab {})", model_type,
                                       num_hidden_layers, hidden_size, vocab_size);
  auto mul = [&](std::initializer_list<int64_t> f) { return checked_product(f, what); };
  auto sum = [&](std::initializer_list<int64_t> f) {
    int64_t r = 0;
    for (int64_t x : f) r = checked_add(r, x, what);
    return r;
  };
  const int64_t C = hidden_size, V = vocab_size, F = intermediate_size, L = num_hidden_layers;
  if (is_gpt2()) {
    // HD = heads x head_dim: C, except in a tensor-parallel shard's config (heads / tp).
    const int64_t HD = mul({num_attention_heads, head_dim()});
    int64_t block =
        sum({mul({2, C}), mul({C, 3, HD}), mul({3, HD}), mul({HD, C}), C, mul({2, C}), mul({C, F}), F, mul({F, C}), C});
    return sum({mul({V, C}), mul({max_position_embeddings, C}), mul({L, block}), mul({2, C})});
  }
  if (is_gpt_neox()) {
    // embed_in, per layer two LayerNorms, query_key_value, dense (biases with attention_bias),
    // dense_h_to_4h and dense_4h_to_h with biases; final_layer_norm, embed_out (never tied).
    const int64_t HD = mul({num_attention_heads, head_dim()});
    int64_t block = sum({mul({4, C}), mul({C, 3, HD}), mul({HD, C}), mul({C, F}), F, mul({F, C}), C});
    if (attention_bias) block = sum({block, mul({3, HD}), C});
    return sum({mul({V, C}), mul({L, block}), mul({2, C}), tie_word_embeddings ? 0 : mul({V, C})});
  }
  const int64_t hd = head_dim(), H = num_attention_heads, KV = num_key_value_heads;
  // The MLP: gate, up, down; a mixture of experts: E of them and the router [E, C].
  int64_t mlp = moe() ? sum({mul({num_local_experts, 3, C, F}), mul({num_local_experts, C})}) : mul({3, C, F});
  // qwen2_moe: the shared expert's gate / up / down and its gate [1, C].
  if (shared_expert_intermediate_size > 0) mlp = sum({mlp, mul({3, C, shared_expert_intermediate_size}), C});
  int64_t block = sum({mul({2, C}), mul({C, H, hd}), mul({2, C, KV, hd}), mul({H, hd, C}), mlp});
  if (qkv_bias()) block = sum({block, mul({H, hd}), mul({2, KV, hd})});
  if (o_bias()) block = sum({block, C});
  if (qk_norm) block = sum({block, mul({2, hd})});                // q_norm, k_norm weights [head_dim]
  if (qk_norm_full) block = sum({block, mul({H + KV, hd})});      // olmo2: q_norm [H*hd], k_norm [KV*hd]
  if (model_type == "gemma2") block = sum({block, mul({2, C})});  // post-attention / post-feedforward norms
  return sum({mul({V, C}), mul({L, block}), C, tie_word_embeddings ? 0 : mul({V, C})});
}

json ModelConfig::to_hf_json() const {
  json j;
  j["model_type"] = model_type;
  j["torch_dtype"] = "float32";
  j["vocab_size"] = vocab_size;
  j["initializer_range"] = initializer_range;
  j["tie_word_embeddings"] = tie_word_embeddings;
  j["use_cache"] = true;
  for (auto [k, v] : {std::pair{"bos_token_id", bos_token_id}, std::pair{"eos_token_id", eos_token_id},
                      std::pair{"pad_token_id", pad_token_id}})
    j[k] = v >= 0 ? json(v) : json(nullptr);
  if (eos_token_ids.size() > 1) j["eos_token_id"] = eos_token_ids;
  if (is_gpt2()) {
    j["architectures"] = {"GPT2LMHeadModel"};
    j["n_positions"] = max_position_embeddings;
    j["n_embd"] = hidden_size;
    j["n_layer"] = num_hidden_layers;
    j["n_head"] = num_attention_heads;
    j["n_inner"] = intermediate_size;
    j["activation_function"] = hidden_act.empty() ? "gelu_new" : hidden_act;
    j["layer_norm_epsilon"] = norm_eps;
    // lathe trains without dropout; writing 0 makes HF training from this config match.
    j["resid_pdrop"] = 0.0;
    j["embd_pdrop"] = 0.0;
    j["attn_pdrop"] = 0.0;
    j["scale_attn_weights"] = true;
    j["scale_attn_by_inverse_layer_idx"] = false;
    j["reorder_and_upcast_attn"] = false;
    return j;
  }
  if (model_type == "gemma2") {
    gemma2_to_hf_json(*this, j);
    return j;
  }
  if (model_type == "mixtral") {  // config/mixtral_config.cpp
    mixtral_to_hf_json(*this, j);
    return j;
  }
  if (model_type == "qwen2_moe") {  // config/qwen2_moe_config.cpp
    qwen2_moe_to_hf_json(*this, j);
    return j;
  }
  if (is_gpt_neox()) {
    j["architectures"] = {"GPTNeoXForCausalLM"};
    j["hidden_size"] = hidden_size;
    j["intermediate_size"] = intermediate_size;
    j["num_hidden_layers"] = num_hidden_layers;
    j["num_attention_heads"] = num_attention_heads;
    j["hidden_act"] = hidden_act.empty() ? "gelu" : hidden_act;
    j["rotary_pct"] = partial_rotary_factor;
    j["rotary_emb_base"] = rope_theta;
    j["max_position_embeddings"] = max_position_embeddings;
    j["layer_norm_eps"] = norm_eps;
    j["use_parallel_residual"] = parallel_residual;
    j["attention_bias"] = attention_bias;
    j["rope_scaling"] = rope_scaling.to_json();
    j["attention_dropout"] = 0.0;
    j["hidden_dropout"] = 0.0;
    return j;
  }
  j["architectures"] = {model_type == "qwen2"     ? "Qwen2ForCausalLM"
                        : model_type == "mistral" ? "MistralForCausalLM"
                        : model_type == "qwen3"   ? "Qwen3ForCausalLM"
                        : model_type == "phi3"    ? "Phi3ForCausalLM"
                        : model_type == "olmo2"   ? "Olmo2ForCausalLM"
                                                  : "LlamaForCausalLM"};
  j["hidden_size"] = hidden_size;
  j["intermediate_size"] = intermediate_size;
  j["num_hidden_layers"] = num_hidden_layers;
  j["num_attention_heads"] = num_attention_heads;
  j["num_key_value_heads"] = num_key_value_heads;
  // Always written, as transformers 4.45's LlamaConfig / MistralConfig save it (= hidden / heads
  // unless explicit); Qwen2Config 4.45 ignores it and derives the same value when not explicit.
  if (model_type != "phi3") j["head_dim"] = head_dim();  // Phi3Config 4.45 has none (hidden / heads)
  j["hidden_act"] = hidden_act.empty() ? "silu" : hidden_act;
  j["max_position_embeddings"] = max_position_embeddings;
  j["rms_norm_eps"] = norm_eps;
  j["rope_theta"] = rope_theta;
  j["rope_scaling"] = rope_scaling.to_json();
  if (rope_scaling.config_original_max_position_embeddings)
    j["original_max_position_embeddings"] = *rope_scaling.config_original_max_position_embeddings;
  if (partial_rotary_factor != 1.0) j["partial_rotary_factor"] = partial_rotary_factor;
  j["attention_dropout"] = 0.0;
  if (model_type == "llama" || model_type == "olmo2") {
    j["attention_bias"] = attention_bias;
    if (model_type == "olmo2") return j;  // Olmo2Config has no mlp_bias / pretraining_tp
    j["mlp_bias"] = false;
    j["pretraining_tp"] = 1;
  } else if (model_type == "qwen2" || model_type == "qwen3") {
    if (model_type == "qwen3") j["attention_bias"] = attention_bias;
    j["use_sliding_window"] = sliding_window > 0;
    j["sliding_window"] = sliding_window > 0 ? json(sliding_window) : json(nullptr);
    // The leading full-attention layers (all of them without a window).
    int64_t full = sliding_window > 0 ? 0 : num_hidden_layers;
    while (full < static_cast<int64_t>(sliding_layers.size()) && !sliding_layers[static_cast<size_t>(full)]) ++full;
    j["max_window_layers"] = full;
  } else if (model_type == "mistral") {
    j["sliding_window"] = sliding_window > 0 ? json(sliding_window) : json(nullptr);
  } else if (model_type == "phi3") {
    j["sliding_window"] = sliding_window > 0 ? json(sliding_window) : json(nullptr);
    j["resid_pdrop"] = 0.0;
    j["embd_pdrop"] = 0.0;
  }
  if (!sliding_layers.empty()) {  // which layers slide, whatever the model type's own key says
    json lt = json::array();
    for (uint8_t s : sliding_layers) lt.push_back(s ? "sliding_attention" : "full_attention");
    j["layer_types"] = lt;
  }
  return j;
}

std::string ModelConfig::ignored_note() const {
  std::string out;
  for (size_t i = 0; i < ignored_keys.size(); ++i)
    out += fmt::format("{}{} ({})", out.empty() ? "config.json keys not used: " : ", ", ignored_keys[i],
                       i < ignored_reasons.size() ? ignored_reasons[i] : "not read");
  return out;
}

bool operator==(const ModelConfig& a, const ModelConfig& b) {
  return a.model_type == b.model_type && a.family == b.family && a.vocab_size == b.vocab_size &&
         a.hidden_size == b.hidden_size && a.num_hidden_layers == b.num_hidden_layers &&
         a.num_attention_heads == b.num_attention_heads && a.num_key_value_heads == b.num_key_value_heads &&
         a.intermediate_size == b.intermediate_size && a.max_position_embeddings == b.max_position_embeddings &&
         a.norm_eps == b.norm_eps && a.rope_theta == b.rope_theta && a.rope_scaling == b.rope_scaling &&
         a.partial_rotary_factor == b.partial_rotary_factor && a.tie_word_embeddings == b.tie_word_embeddings &&
         a.attention_bias == b.attention_bias && a.initializer_range == b.initializer_range &&
         a.hidden_act == b.hidden_act && a.bos_token_id == b.bos_token_id && a.eos_token_id == b.eos_token_id &&
         a.eos_token_ids == b.eos_token_ids && a.pad_token_id == b.pad_token_id &&
         a.sliding_window == b.sliding_window && a.sliding_layers == b.sliding_layers && a.head_dim() == b.head_dim() &&
         a.qk_norm == b.qk_norm && a.parallel_residual == b.parallel_residual &&
         a.query_pre_attn_scalar == b.query_pre_attn_scalar && a.attn_logit_softcapping == b.attn_logit_softcapping &&
         a.final_logit_softcapping == b.final_logit_softcapping && a.num_local_experts == b.num_local_experts &&
         a.num_experts_per_tok == b.num_experts_per_tok && a.norm_topk_prob == b.norm_topk_prob &&
         a.output_router_logits == b.output_router_logits && a.router_aux_loss_coef == b.router_aux_loss_coef &&
         a.router_z_loss_coef == b.router_z_loss_coef &&
         a.shared_expert_intermediate_size == b.shared_expert_intermediate_size &&
         a.dense_intermediate_size == b.dense_intermediate_size;
}

float ModelConfig::attention_scale() const {
  return query_pre_attn_scalar > 0.0 ? static_cast<float>(1.0 / std::sqrt(query_pre_attn_scalar)) : 0.0f;
}

}  // namespace lathe
