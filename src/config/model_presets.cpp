// The presets of ModelConfig::preset (config/model_config.h lists them): small shapes for tests and
// benchmarks, and GPT-2 124M. Each is validated.
#include <fmt/format.h>

#include "config/hf_reader.h"
#include "config/model_config.h"
#include "config/recipe.h"  // closest_match
#include "core/error.h"

namespace lathe {

namespace {

ModelConfig make_gpt2(int64_t L, int64_t C, int64_t H, int64_t V, int64_t P) {
  ModelConfig c;
  c.model_type = c.family = "gpt2";
  c.vocab_size = V;
  c.hidden_size = C;
  c.num_hidden_layers = L;
  c.num_attention_heads = c.num_key_value_heads = H;
  c.intermediate_size = 4 * C;
  c.max_position_embeddings = P;
  c.norm_eps = 1e-5;
  c.tie_word_embeddings = true;
  c.hidden_act = "gelu_new";
  return c;
}

ModelConfig make_llama(const char* type, int64_t L, int64_t C, int64_t H, int64_t KV, int64_t I, int64_t V, int64_t P) {
  ModelConfig c;
  c.model_type = type;
  c.family = "llama";
  c.vocab_size = V;
  c.hidden_size = C;
  c.num_hidden_layers = L;
  c.num_attention_heads = H;
  c.num_key_value_heads = KV;
  c.intermediate_size = I;
  c.max_position_embeddings = P;
  c.norm_eps = 1e-5;
  c.rope_theta = 10000.0;
  c.tie_word_embeddings = false;
  c.hidden_act = "silu";
  return c;
}

}  // namespace

std::vector<std::string> ModelConfig::preset_names() {
  return {"gpt2-debug",        "gpt2-124m",   "gpt2-small-bench", "llama-debug",    "qwen2-debug", "mistral-debug",
          "llama-small-bench", "qwen3-debug", "phi3-debug",       "gpt-neox-debug", "gemma2-debug",
          "mixtral-debug", "olmo2-debug", "qwen2-moe-debug"};
}

ModelConfig ModelConfig::preset(std::string_view name) {
  ModelConfig c;
  if (name == "gpt2-debug") {
    c = make_gpt2(2, 48, 4, 96, 128);
  } else if (name == "gpt2-124m") {
    c = make_gpt2(12, 768, 12, 50257, 1024);
    c.bos_token_id = c.eos_token_id = 50256;
  } else if (name == "gpt2-small-bench") {
    c = make_gpt2(4, 256, 4, 50257, 1024);
    c.bos_token_id = c.eos_token_id = 50256;
  } else if (name == "llama-debug") {
    c = make_llama("llama", 2, 48, 4, 2, 96, 96, 128);
  } else if (name == "qwen2-debug") {
    c = make_llama("qwen2", 2, 48, 4, 2, 96, 96, 128);
    c.attention_bias = true;
    c.tie_word_embeddings = true;
    c.rope_theta = 1000000.0;
  } else if (name == "mistral-debug") {
    c = make_llama("mistral", 2, 48, 4, 2, 96, 96, 128);
  } else if (name == "qwen3-debug") {
    c = make_llama("qwen3", 2, 48, 4, 2, 96, 96, 128);
    c.explicit_head_dim = 16;  // 4 heads of 16 = 64 wide, hidden 48: head_dim != hidden / heads
    c.qk_norm = true;
    c.tie_word_embeddings = true;
    c.rope_theta = 1000000.0;
    c.norm_eps = 1e-6;
  } else if (name == "phi3-debug") {
    // Phi-3 shape in small: longrope with original_max_position_embeddings 32 < max 128 (long
    // factors for passes longer than 32 tokens), sliding_window 23 (24 keys, see layer_window).
    c = make_llama("phi3", 2, 48, 4, 2, 96, 96, 128);
    c.rope_scaling.type = "longrope";
    c.rope_scaling.old_type_key = true;
    c.rope_scaling.config_original_max_position_embeddings = 32;
    c.rope_scaling.short_factor = {1.0, 1.25, 1.5, 2.0, 2.5, 3.0};
    c.rope_scaling.long_factor = {1.0, 2.0, 4.0, 6.0, 9.0, 12.0};
    c.sliding_window = 23;
    c.bos_token_id = 1;
    c.eos_token_id = c.pad_token_id = 95;
  } else if (name == "llama-small-bench") {
    c = make_llama("llama", 4, 256, 4, 2, 688, 32000, 1024);
  } else if (name == "gpt-neox-debug") {
    // Pythia's shape at odd-ish sizes: 3 heads of 16 (4 rotated dims), MLP 100 wide, vocab 101.
    c = make_llama("gpt_neox", 3, 48, 3, 3, 100, 101, 128);
    c.family = "gpt_neox";
    c.hidden_act = "gelu";
    c.partial_rotary_factor = 0.25;
    c.parallel_residual = true;
    c.attention_bias = true;
    c.bos_token_id = 0;
    c.eos_token_id = 2;
  } else if (name == "gemma2-debug") {
    // Gemma 2's shape in small: 3 layers (sliding window 5 on layers 0 and 2), 4 heads of 16 (64
    // wide, hidden 48) over 2 kv heads, scores scaled by 1/sqrt(20), soft caps 50 / 30, tied.
    c = make_llama("gemma2", 3, 48, 4, 2, 64, 101, 128);
    c.explicit_head_dim = 16;
    c.hidden_act = "gelu_pytorch_tanh";
    c.tie_word_embeddings = true;
    c.norm_eps = 1e-6;
    c.query_pre_attn_scalar = 20.0;
    c.attn_logit_softcapping = 50.0;
    c.final_logit_softcapping = 30.0;
    c.sliding_window = 5;
    c.sliding_layers = {1, 0, 1};
    c.bos_token_id = 2;
    c.eos_token_id = 1;
    c.pad_token_id = 0;
  } else if (name == "mixtral-debug") {
    // Mixtral in small (issue 28): 2 layers, 4 heads over 2 kv heads, 5 experts of width 40, top-2,
    // the aux loss on (output_router_logits) with Mixtral's 0.02.
    c = make_llama("mixtral", 2, 48, 4, 2, 40, 96, 128);
    c.rope_theta = 1e6;
    c.num_local_experts = 5;
    c.num_experts_per_tok = 2;
    c.output_router_logits = true;
    c.router_aux_loss_coef = 0.02;
    c.bos_token_id = 1;
    c.eos_token_id = 2;
  } else if (name == "olmo2-debug") {
    // OLMo 2's shape in small (config/olmo2_config.cpp): 3 layers, 6 heads of 10 over 2 kv heads,
    // post norms only, q/k norms over the whole projection (60 and 20 wide), untied, eps 1e-6.
    c = make_olmo2_debug();
  } else if (name == "qwen2-moe-debug") {
    // Qwen2-MoE in small (config/qwen2_moe_config.cpp): 2 layers, 4 heads over 2 kv heads, q/k/v
    // biases, 6 experts of width 24 (moe_intermediate_size), top-3 without renormalisation, a shared
    // expert of width 56, the aux loss on with 0.02.
    c = make_llama("qwen2_moe", 2, 48, 4, 2, 24, 96, 128);
    c.dense_intermediate_size = 64;
    c.shared_expert_intermediate_size = 56;
    c.attention_bias = true;
    c.num_local_experts = 6;
    c.num_experts_per_tok = 3;
    c.norm_topk_prob = false;
    c.output_router_logits = true;
    c.router_aux_loss_coef = 0.02;
  } else {
    std::string list;
    for (auto& n : preset_names()) list += (list.empty() ? "" : ", ") + n;
    std::string near = closest_match(name, preset_names());
    throw_error("unknown model preset '{}'{} (presets: {})", name,
                near.empty() ? std::string() : fmt::format(" (did you mean '{}'?)", near), list);
  }
  c.validate(fmt::format("preset {}", name));
  return c;
}

}  // namespace lathe
