// Mixtral (transformers 4.45.2 MixtralConfig / MixtralForCausalLM, issue 28): the config.json fields,
// their class defaults, strict checks and the config.json lathe writes back. The body (Mistral
// attention, a sparse mixture-of-experts block per layer) is models/moe_layer.cpp's.
#include <cmath>

#include "config/hf_reader.h"
#include "config/model_config.h"

namespace lathe {

// MixtralConfig's keys (4.45.2), plus lathe's router_z_loss_coef (written only when set).
const std::vector<std::string>& mixtral_keys() {
  static const std::vector<std::string> k = {
      "hidden_size",          "intermediate_size",    "num_hidden_layers",   "num_attention_heads",
      "num_key_value_heads",  "head_dim",             "hidden_act",          "max_position_embeddings",
      "rms_norm_eps",         "rope_theta",           "rope_scaling",        "sliding_window",
      "attention_dropout",    "num_experts_per_tok",  "num_local_experts",   "output_router_logits",
      "router_aux_loss_coef", "router_jitter_noise",  "router_z_loss_coef"};
  return k;
}

void read_mixtral(const hf_config::Reader& r, ModelConfig& c) {
  const auto& j = r.j;
  if (!r.has("vocab_size")) c.vocab_size = 32000;
  c.hidden_size = r.has_size("hidden_size") ? r.get_int("hidden_size") : 4096;
  c.intermediate_size = r.has_size("intermediate_size") ? r.get_int("intermediate_size") : 14336;
  c.num_hidden_layers = r.has_size("num_hidden_layers") ? r.get_int("num_hidden_layers") : 32;
  c.num_attention_heads = r.has_size("num_attention_heads") ? r.get_int("num_attention_heads") : 32;
  c.num_key_value_heads = r.has("num_key_value_heads") && !j["num_key_value_heads"].is_null()
                              ? r.get_int("num_key_value_heads")
                              : (r.has("num_key_value_heads") ? c.num_attention_heads : 8);
  c.max_position_embeddings =
      r.has_size("max_position_embeddings") ? r.get_int("max_position_embeddings") : 4096 * 32;
  c.norm_eps = r.has("rms_norm_eps") ? r.get_double("rms_norm_eps") : 1e-5;
  c.rope_theta = r.has("rope_theta") ? r.get_double("rope_theta") : 1e6;
  if (!j.contains("bos_token_id")) c.bos_token_id = 1;
  if (!j.contains("eos_token_id")) c.eos_token_id = 2;
  c.tie_word_embeddings = r.has("tie_word_embeddings") ? r.get_bool("tie_word_embeddings") : false;
  const std::string act = r.has("hidden_act") ? r.get_string("hidden_act") : "silu";
  if (act != "silu" && act != "swish")
    r.fail("hidden_act", fmt::format("'{}' is not supported for mixtral (silu: SwiGLU experts)", act));
  c.hidden_act = "silu";
  // MixtralAttention: heads of hidden_size / num_attention_heads, plain RoPE (4.45.2 reads neither
  // head_dim nor rope_scaling): refuse values that say otherwise.
  if (r.has("head_dim") && !j["head_dim"].is_null() && c.num_attention_heads > 0 &&
      r.get_int("head_dim") != c.hidden_size / c.num_attention_heads)
    r.fail("head_dim", fmt::format("{}: transformers 4.45's mixtral always uses hidden_size / num_attention_heads = {}",
                                   r.get_int("head_dim"), c.hidden_size / c.num_attention_heads));
  if (r.has("rope_scaling") && !j["rope_scaling"].is_null())
    r.fail("rope_scaling", "transformers 4.45's mixtral ignores rope_scaling (plain RoPE); give null or remove it");
  // As mistral's: null (the class default) = full attention.
  c.sliding_window = r.has("sliding_window") && !j["sliding_window"].is_null() ? r.get_int("sliding_window") : 0;
  if (c.sliding_window < 0)
    r.fail("sliding_window", fmt::format("{} must be >= 0 (or null: full attention)", c.sliding_window));
  c.attention_bias = false;
  // The experts.
  c.num_local_experts = r.has("num_local_experts") ? r.get_int("num_local_experts") : 8;
  c.num_experts_per_tok = r.has("num_experts_per_tok") ? r.get_int("num_experts_per_tok") : 2;
  if (c.num_local_experts < 1 || c.num_local_experts > kMaxMoeExperts)
    r.fail("num_local_experts", fmt::format("{} must be in [1, {}]", c.num_local_experts, kMaxMoeExperts));
  if (c.num_experts_per_tok < 1 || c.num_experts_per_tok > c.num_local_experts)
    r.fail("num_experts_per_tok",
           fmt::format("{} must be in [1, num_local_experts = {}]", c.num_experts_per_tok, c.num_local_experts));
  c.norm_topk_prob = true;  // MixtralSparseMoeBlock always renormalises the top-k weights
  c.output_router_logits = r.has("output_router_logits") ? r.get_bool("output_router_logits") : false;
  c.router_aux_loss_coef = r.has("router_aux_loss_coef") ? r.get_double("router_aux_loss_coef") : 0.001;
  if (!std::isfinite(c.router_aux_loss_coef) || c.router_aux_loss_coef < 0)
    r.fail("router_aux_loss_coef", fmt::format("{} must be a finite number >= 0", c.router_aux_loss_coef));
  c.router_z_loss_coef = r.has("router_z_loss_coef") ? r.get_double("router_z_loss_coef") : 0.0;
  if (!std::isfinite(c.router_z_loss_coef) || c.router_z_loss_coef < 0)
    r.fail("router_z_loss_coef", fmt::format("{} must be a finite number >= 0 (0 = off)", c.router_z_loss_coef));
  if (r.has("router_jitter_noise") && r.get_double("router_jitter_noise") != 0.0)
    r.fail("router_jitter_noise",
           fmt::format("{} is not supported: lathe's router has no jitter noise yet (it would multiply the router "
                       "input by uniform noise in training); set 0",
                       r.get_double("router_jitter_noise")));
}

void mixtral_to_hf_json(const ModelConfig& c, nlohmann::json& j) {
  j["architectures"] = {"MixtralForCausalLM"};
  j["hidden_size"] = c.hidden_size;
  j["intermediate_size"] = c.intermediate_size;
  j["num_hidden_layers"] = c.num_hidden_layers;
  j["num_attention_heads"] = c.num_attention_heads;
  j["num_key_value_heads"] = c.num_key_value_heads;
  j["hidden_act"] = "silu";
  j["max_position_embeddings"] = c.max_position_embeddings;
  j["rms_norm_eps"] = c.norm_eps;
  j["rope_theta"] = c.rope_theta;
  j["sliding_window"] = c.sliding_window > 0 ? nlohmann::json(c.sliding_window) : nlohmann::json(nullptr);
  j["attention_dropout"] = 0.0;
  j["num_local_experts"] = c.num_local_experts;
  j["num_experts_per_tok"] = c.num_experts_per_tok;
  j["output_router_logits"] = c.output_router_logits;
  j["router_aux_loss_coef"] = c.router_aux_loss_coef;
  j["router_jitter_noise"] = 0.0;
  if (c.router_z_loss_coef != 0.0) j["router_z_loss_coef"] = c.router_z_loss_coef;
}

}  // namespace lathe
