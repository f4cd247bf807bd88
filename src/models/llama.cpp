// Llama family (HF LlamaForCausalLM; qwen2, mistral and phi3 map here): RMSNorm, rotary positions
// (rotate_half), SwiGLU MLP, grouped-query attention, optional q/k/v(/o) biases, optional tied
// lm_head, optional per-head q/k RMSNorm (qwen3). q/k/v and gate/up are separate HF tensors but adjacent in the flat
// buffer, so each pair/triple runs as one GEMM: [q;k;v] is a [(H+2KV)*D, C] weight, [gate;up] a [2F, C] one.
#include <fmt/format.h>

#include "models/model.h"

namespace lathe {

std::unique_ptr<Model> build_llama(const ModelConfig& cfg, const ComputeSpec& compute) {
  const int64_t C = cfg.hidden_size, V = cfg.vocab_size, F = cfg.intermediate_size, L = cfg.num_hidden_layers,
                H = cfg.num_attention_heads, KV = cfg.num_key_value_heads, D = cfg.head_dim();
  const float std = static_cast<float>(cfg.initializer_range);
  const bool qkv_bias = cfg.attention_bias || cfg.model_type == "qwen2";
  const bool o_bias = cfg.attention_bias && cfg.model_type != "qwen2";
  const bool phi3 = cfg.model_type == "phi3";
  ParamTable t;
  t.add("model.embed_tokens.weight", {V, C}, Init::Normal, std, ShardRule::Vocab, true).as(Role::Wte);
  for (int64_t i = 0; i < L; ++i) {
    auto n = [&](const char* s) { return fmt::format("model.layers.{}.{}", i, s); };
    t.add(n("input_layernorm.weight"), {C}, Init::Ones, 0, ShardRule::Replicated, false).as(Role::Ln1W, i);
    // q, k, v weights then q, k, v biases: each triple contiguous. phi3 stores the same rows as
    // one tensor, qkv_proj = [q; k; v] (Phi3Attention slices q | k | v off its output).
    if (phi3) {
      t.add(n("self_attn.qkv_proj.weight"), {(H + 2 * KV) * D, C}, Init::Normal, std, ShardRule::Column, true)
          .as(Role::QkvW, i)
          .in_sections({H, KV, KV});  // tensor parallel: q, k, v heads split on their own
    } else {
      t.add(n("self_attn.q_proj.weight"), {H * D, C}, Init::Normal, std, ShardRule::Column, true).as(Role::QkvW, i);
      t.add(n("self_attn.k_proj.weight"), {KV * D, C}, Init::Normal, std, ShardRule::Column, true)
          .as(Role::Continues, i);
      t.add(n("self_attn.v_proj.weight"), {KV * D, C}, Init::Normal, std, ShardRule::Column, true)
          .as(Role::Continues, i);
    }
    if (qkv_bias) {
      t.add(n("self_attn.q_proj.bias"), {H * D}, Init::Zeros, 0, ShardRule::Column, false).as(Role::QkvB, i);
      t.add(n("self_attn.k_proj.bias"), {KV * D}, Init::Zeros, 0, ShardRule::Column, false).as(Role::Continues, i);
      t.add(n("self_attn.v_proj.bias"), {KV * D}, Init::Zeros, 0, ShardRule::Column, false).as(Role::Continues, i);
    }
    if (cfg.qk_norm) {  // Qwen3: per-head RMSNorm weights of q and k, replicated over tensor ranks
      t.add(n("self_attn.q_norm.weight"), {D}, Init::Ones, 0, ShardRule::Replicated, false).as(Role::QNormW, i);
      t.add(n("self_attn.k_norm.weight"), {D}, Init::Ones, 0, ShardRule::Replicated, false).as(Role::KNormW, i);
    }
    t.add(n("self_attn.o_proj.weight"), {C, H * D}, Init::Normal, std, ShardRule::Row, true).as(Role::OW, i);
    if (o_bias) t.add(n("self_attn.o_proj.bias"), {C}, Init::Zeros, 0, ShardRule::Replicated, false).as(Role::OB, i);
    t.add(n("post_attention_layernorm.weight"), {C}, Init::Ones, 0, ShardRule::Replicated, false).as(Role::Ln2W, i);
    if (phi3) {  // gate_up_proj = [gate; up] (Phi3MLP: gate, up = chunk(2))
      t.add(n("mlp.gate_up_proj.weight"), {2 * F, C}, Init::Normal, std, ShardRule::Column, true)
          .as(Role::FcW, i)
          .in_sections(2);
    } else {
      t.add(n("mlp.gate_proj.weight"), {F, C}, Init::Normal, std, ShardRule::Column, true).as(Role::FcW, i);
      t.add(n("mlp.up_proj.weight"), {F, C}, Init::Normal, std, ShardRule::Column, true).as(Role::Continues, i);
    }
    t.add(n("mlp.down_proj.weight"), {C, F}, Init::Normal, std, ShardRule::Row, true).as(Role::ProjW, i);
  }
  t.add("model.norm.weight", {C}, Init::Ones, 0, ShardRule::Replicated, false).as(Role::LnfW);
  if (!cfg.tie_word_embeddings)
    t.add("lm_head.weight", {V, C}, Init::Normal, std, ShardRule::Vocab, true).as(Role::LmHead);

  Arch arch;
  arch.layernorm = false;
  arch.learned_pos = false;
  arch.gelu_mlp = false;
  arch.qkv_bias = qkv_bias;
  arch.o_bias = o_bias;
  arch.mlp_bias = false;
  arch.tied_lm_head = cfg.tie_word_embeddings;
  arch.qk_norm = cfg.qk_norm;
  return std::make_unique<Model>(cfg, arch, std::move(t), compute);
}

}  // namespace lathe
