// Qwen2-MoE (transformers 4.45.2 Qwen2MoeConfig / Qwen2MoeForCausalLM, issue 28): the config.json
// fields, their class defaults, strict checks and the config.json lathe writes back. The body is
// Qwen2's attention (q/k/v biases) and in every layer a sparse MoE block (models/moe_layer.cpp)
// plus a gated shared expert (models/moe_shared.cpp).
//
// Lathe's fields: intermediate_size = the routed experts' width (moe_intermediate_size), so the MoE
// kernels read it as Mixtral's; dense_intermediate_size = config.json's intermediate_size (only the
// dense MLP of mlp_only_layers uses it, and those are refused: every layer is a MoE layer here).
#include <cmath>

#include "config/hf_reader.h"
#include "config/model_config.h"

namespace lathe {

// Qwen2MoeConfig's keys (4.45.2).
const std::vector<std::string>& qwen2_moe_keys() {
  static const std::vector<std::string> k = {"hidden_size",
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
                                             "use_sliding_window",
                                             "sliding_window",
                                             "max_window_layers",
                                             "attention_dropout",
                                             "decoder_sparse_step",
                                             "moe_intermediate_size",
                                             "shared_expert_intermediate_size",
                                             "num_experts_per_tok",
                                             "num_experts",
                                             "norm_topk_prob",
                                             "output_router_logits",
                                             "router_aux_loss_coef",
                                             "mlp_only_layers"};
  return k;
}

namespace {
// decoder_sparse_step and mlp_only_layers pick the layers that keep a dense MLP: lathe runs MoE in
// every layer (step 1, no MLP-only layer) and refuses any value that would make a layer dense.
void read_sparse_layers(const hf_config::Reader& r, const ModelConfig& c) {
  const auto& j = r.j;
  const int64_t step = r.has("decoder_sparse_step") ? r.get_int("decoder_sparse_step") : 1;
  if (step != 1 && c.num_hidden_layers > 1)  // layer l is sparse when (l + 1) % step == 0
    r.fail("decoder_sparse_step",
           fmt::format("{} is not supported: lathe runs a MoE block in every layer (a dense MLP in the layers between "
                       "needs per-layer MoE-or-dense, not implemented yet); set 1",
                       step));
  if (step < 1) r.fail("decoder_sparse_step", fmt::format("{} must be >= 1", step));
  if (r.has("mlp_only_layers") && !j["mlp_only_layers"].is_null()) {
    const auto& m = j["mlp_only_layers"];
    if (!m.is_array()) r.fail("mlp_only_layers", fmt::format("expected a list, got '{}'", hf_config::value_str(m)));
    for (const auto& v : m)
      if (!v.is_number_integer() || (v.get<int64_t>() >= 0 && v.get<int64_t>() < c.num_hidden_layers))
        r.fail("mlp_only_layers",
               fmt::format("{} is not supported: lathe runs a MoE block in every layer (a dense MLP of "
                           "intermediate_size in a listed layer is not implemented yet); give [] or null",
                           hf_config::value_str(m)));
  }
}
}  // namespace

void read_qwen2_moe(const hf_config::Reader& r, ModelConfig& c) {
  const auto& j = r.j;
  if (!r.has("vocab_size")) c.vocab_size = 151936;
  c.hidden_size = r.has_size("hidden_size") ? r.get_int("hidden_size") : 2048;
  c.dense_intermediate_size = r.has_size("intermediate_size") ? r.get_int("intermediate_size") : 5632;
  c.intermediate_size = r.has_size("moe_intermediate_size") ? r.get_int("moe_intermediate_size") : 1408;
  c.shared_expert_intermediate_size =
      r.has_size("shared_expert_intermediate_size") ? r.get_int("shared_expert_intermediate_size") : 5632;
  if (c.shared_expert_intermediate_size < 1)
    r.fail("shared_expert_intermediate_size",
           fmt::format("{} must be >= 1 (Qwen2MoeSparseMoeBlock always has a shared expert)",
                       c.shared_expert_intermediate_size));
  c.num_hidden_layers = r.has_size("num_hidden_layers") ? r.get_int("num_hidden_layers") : 24;
  c.num_attention_heads = r.has_size("num_attention_heads") ? r.get_int("num_attention_heads") : 16;
  c.num_key_value_heads = r.has_size("num_key_value_heads") ? r.get_int("num_key_value_heads") : 16;
  c.max_position_embeddings = r.has_size("max_position_embeddings") ? r.get_int("max_position_embeddings") : 32768;
  c.norm_eps = r.has("rms_norm_eps") ? r.get_double("rms_norm_eps") : 1e-6;
  c.rope_theta = r.has("rope_theta") ? r.get_double("rope_theta") : 10000.0;
  c.tie_word_embeddings = r.has("tie_word_embeddings") ? r.get_bool("tie_word_embeddings") : false;
  const std::string act = r.has("hidden_act") ? r.get_string("hidden_act") : "silu";
  if (act != "silu" && act != "swish")
    r.fail("hidden_act", fmt::format("'{}' is not supported for qwen2_moe (silu: SwiGLU experts)", act));
  c.hidden_act = "silu";
  // Qwen2MoeAttention 4.45.2: heads of hidden_size / num_attention_heads (no head_dim key).
  if (r.has("head_dim") && !j["head_dim"].is_null() && c.num_attention_heads > 0 &&
      r.get_int("head_dim") != c.hidden_size / c.num_attention_heads)
    r.fail("head_dim",
           fmt::format("{}: transformers 4.45's qwen2_moe always uses hidden_size / num_attention_heads = {}",
                       r.get_int("head_dim"), c.hidden_size / c.num_attention_heads));
  if (r.has("rope_scaling") && !j["rope_scaling"].is_null())
    r.fail("rope_scaling", "is not supported for qwen2_moe yet (plain RoPE only); give null or remove it");
  // 4.45.2 applies the window only in Qwen2MoeFlashAttention2 (eager and sdpa attend everywhere):
  // lathe refuses it rather than pick one of the two behaviours.
  if (r.has("use_sliding_window") && r.get_bool("use_sliding_window"))
    r.fail("use_sliding_window",
           "true is not supported for qwen2_moe (transformers 4.45 applies the window only under flash attention); "
           "set false");
  c.sliding_window = 0;
  c.attention_bias = true;  // Qwen2MoeAttention: q/k/v biases, none on o_proj
  if (!j.contains("bos_token_id")) c.bos_token_id = -1;
  if (!j.contains("eos_token_id")) c.eos_token_id = -1;
  // The experts.
  c.num_local_experts = r.has("num_experts") ? r.get_int("num_experts") : 60;
  c.num_experts_per_tok = r.has("num_experts_per_tok") ? r.get_int("num_experts_per_tok") : 4;
  if (c.num_local_experts < 1 || c.num_local_experts > kMaxMoeExperts)
    r.fail("num_experts", fmt::format("{} must be in [1, {}] (0, a dense model, is not supported for qwen2_moe)",
                                      c.num_local_experts, kMaxMoeExperts));
  if (c.num_experts_per_tok < 1 || c.num_experts_per_tok > c.num_local_experts)
    r.fail("num_experts_per_tok",
           fmt::format("{} must be in [1, num_experts = {}]", c.num_experts_per_tok, c.num_local_experts));
  read_sparse_layers(r, c);
  c.norm_topk_prob = r.has("norm_topk_prob") ? r.get_bool("norm_topk_prob") : false;
  c.output_router_logits = r.has("output_router_logits") ? r.get_bool("output_router_logits") : false;
  c.router_aux_loss_coef = r.has("router_aux_loss_coef") ? r.get_double("router_aux_loss_coef") : 0.001;
  if (!std::isfinite(c.router_aux_loss_coef) || c.router_aux_loss_coef < 0)
    r.fail("router_aux_loss_coef", fmt::format("{} must be a finite number >= 0", c.router_aux_loss_coef));
}

void qwen2_moe_to_hf_json(const ModelConfig& c, nlohmann::json& j) {
  j["architectures"] = {"Qwen2MoeForCausalLM"};
  j["hidden_size"] = c.hidden_size;
  j["intermediate_size"] = c.dense_intermediate_size > 0 ? c.dense_intermediate_size : c.intermediate_size;
  j["moe_intermediate_size"] = c.intermediate_size;
  j["shared_expert_intermediate_size"] = c.shared_expert_intermediate_size;
  j["num_hidden_layers"] = c.num_hidden_layers;
  j["num_attention_heads"] = c.num_attention_heads;
  j["num_key_value_heads"] = c.num_key_value_heads;
  j["hidden_act"] = "silu";
  j["max_position_embeddings"] = c.max_position_embeddings;
  j["rms_norm_eps"] = c.norm_eps;
  j["rope_theta"] = c.rope_theta;
  j["rope_scaling"] = nullptr;
  j["use_sliding_window"] = false;
  j["attention_dropout"] = 0.0;
  j["decoder_sparse_step"] = 1;
  j["mlp_only_layers"] = nlohmann::json::array();
  j["num_experts"] = c.num_local_experts;
  j["num_experts_per_tok"] = c.num_experts_per_tok;
  j["norm_topk_prob"] = c.norm_topk_prob;
  j["output_router_logits"] = c.output_router_logits;
  j["router_aux_loss_coef"] = c.router_aux_loss_coef;
}

}  // namespace lathe
