// OLMo 2 (transformers Olmo2Config / Olmo2ForCausalLM, model_type "olmo2"; added in transformers
// 4.47, so the pinned 4.45.2 has no class: tests/models/torch_reference_olmo2.py is the oracle).
// The llama reader of model_config.cpp reads the shared fields (sizes, head_dim, rope_theta,
// rope_scaling, token ids); this file sets Olmo2Config's class defaults where they differ from
// LlamaConfig's, refuses what OLMo 2 does not compute, and selects the body: post norms only and q/k
// norms over the whole projection (ModelConfig::post_norm / qk_norm_full; models/olmo2.cpp).
#include "config/hf_reader.h"
#include "config/model_config.h"

namespace lathe {

void read_olmo2(const hf_config::Reader& r, ModelConfig& c) {
  const auto& j = r.j;
  // Olmo2Config: vocab 50304, rms_norm_eps 1e-5, pad 1, bos None, eos 50279, untied, kv = heads.
  if (!r.has("vocab_size")) c.vocab_size = 50304;
  if (!r.has("rms_norm_eps")) c.norm_eps = 1e-5;
  if (!j.contains("pad_token_id")) c.pad_token_id = 1;
  if (!j.contains("bos_token_id")) c.bos_token_id = -1;
  if (!j.contains("eos_token_id")) c.eos_token_id = 50279;
  // Olmo2Attention sizes o_proj, q_norm and k_norm without biases; attention_bias would add q/k/v/o
  // biases in later transformers releases, which lathe's olmo2 body does not carry.
  if (c.attention_bias)
    r.fail("attention_bias", "true is not supported for olmo2 (no q/k/v/o biases); give false or remove it");
  if (!c.sliding_layers.empty() || c.sliding_window > 0)
    r.fail("layer_types", "olmo2 has no sliding-window layers (Olmo2Attention attends to every earlier key)");
  c.post_norm = true;
  c.qk_norm_full = true;
}

ModelConfig make_olmo2_debug() {
  ModelConfig c;
  c.model_type = "olmo2";
  c.family = "llama";
  c.num_hidden_layers = 3;
  c.hidden_size = 60;
  c.num_attention_heads = 6;  // head_dim 10: q 60 wide, k 20 wide
  c.num_key_value_heads = 2;
  c.intermediate_size = 72;
  c.vocab_size = 97;
  c.max_position_embeddings = 128;
  c.norm_eps = 1e-6;
  c.rope_theta = 500000.0;
  c.tie_word_embeddings = false;
  c.hidden_act = "silu";
  c.pad_token_id = 1;
  c.eos_token_id = 96;
  c.post_norm = true;
  c.qk_norm_full = true;
  return c;
}

}  // namespace lathe
