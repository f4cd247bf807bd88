// GPT-NeoX / Pythia (HF GPTNeoXForCausalLM): LayerNorms with biases, rotary positions on the first
// rotary_pct of each head (rotate_half, as llama), exact (erf) GELU MLP with biases, attention
// biases (attention_bias), an untied embed_out, and the parallel residual x + attn(ln1(x)) +
// mlp(ln2(x)) when use_parallel_residual. HF's query_key_value rows are interleaved per head
// ([H][q, k, v][D]); the table holds them as lathe's q|k|v ([3][H][D]) and the HF interop permutes
// them (interop/hf_weights.cpp's name table), so the body runs it as any fused q|k|v.
#include <fmt/format.h>

#include <cmath>

#include "models/model.h"

namespace lathe {

std::unique_ptr<Model> build_gpt_neox(const ModelConfig& cfg, const ComputeSpec& compute) {
  LATHE_CHECK(cfg.num_key_value_heads == cfg.num_attention_heads,
              "model: gpt_neox has no grouped-query attention (num_key_value_heads {} != num_attention_heads {})",
              cfg.num_key_value_heads, cfg.num_attention_heads);
  LATHE_CHECK(!cfg.tie_word_embeddings, "model: gpt_neox's embed_out is never tied to embed_in");
  // HD = H * D is C, except in a tensor-parallel shard's config (this rank's heads only).
  const int64_t C = cfg.hidden_size, V = cfg.vocab_size, F = cfg.intermediate_size, L = cfg.num_hidden_layers,
                HD = cfg.num_attention_heads * cfg.head_dim();
  const float std = static_cast<float>(cfg.initializer_range);
  const bool bias = cfg.attention_bias;
  ParamTable t;
  t.add("gpt_neox.embed_in.weight", {V, C}, Init::Normal, std, ShardRule::Vocab, true).as(Role::Wte);
  for (int64_t i = 0; i < L; ++i) {
    auto n = [&](const char* s) { return fmt::format("gpt_neox.layers.{}.{}", i, s); };
    t.add(n("input_layernorm.weight"), {C}, Init::Ones, 0, ShardRule::Replicated, false).as(Role::Ln1W, i);
    t.add(n("input_layernorm.bias"), {C}, Init::Zeros, 0, ShardRule::Replicated, false).as(Role::Ln1B, i);
    // q|k|v in lathe's order (see above): three sections for tensor parallelism.
    t.add(n("attention.query_key_value.weight"), {3 * HD, C}, Init::Normal, std, ShardRule::Column, true)
        .as(Role::QkvW, i)
        .in_sections(3);
    if (bias)
      t.add(n("attention.query_key_value.bias"), {3 * HD}, Init::Zeros, 0, ShardRule::Column, false)
          .as(Role::QkvB, i)
          .in_sections(3);
    t.add(n("attention.dense.weight"), {C, HD}, Init::Normal, std, ShardRule::Row, true).as(Role::OW, i);
    if (bias) t.add(n("attention.dense.bias"), {C}, Init::Zeros, 0, ShardRule::Replicated, false).as(Role::OB, i);
    t.add(n("post_attention_layernorm.weight"), {C}, Init::Ones, 0, ShardRule::Replicated, false).as(Role::Ln2W, i);
    t.add(n("post_attention_layernorm.bias"), {C}, Init::Zeros, 0, ShardRule::Replicated, false).as(Role::Ln2B, i);
    t.add(n("mlp.dense_h_to_4h.weight"), {F, C}, Init::Normal, std, ShardRule::Column, true).as(Role::FcW, i);
    t.add(n("mlp.dense_h_to_4h.bias"), {F}, Init::Zeros, 0, ShardRule::Column, false).as(Role::FcB, i);
    t.add(n("mlp.dense_4h_to_h.weight"), {C, F}, Init::Normal, std, ShardRule::Row, true).as(Role::ProjW, i);
    t.add(n("mlp.dense_4h_to_h.bias"), {C}, Init::Zeros, 0, ShardRule::Replicated, false).as(Role::ProjB, i);
  }
  t.add("gpt_neox.final_layer_norm.weight", {C}, Init::Ones, 0, ShardRule::Replicated, false).as(Role::LnfW);
  t.add("gpt_neox.final_layer_norm.bias", {C}, Init::Zeros, 0, ShardRule::Replicated, false).as(Role::LnfB);
  t.add("embed_out.weight", {V, C}, Init::Normal, std, ShardRule::Vocab, true).as(Role::LmHead);

  Arch arch;
  arch.layernorm = true;
  arch.learned_pos = false;
  arch.gelu_mlp = true;
  arch.qkv_bias = bias;
  arch.o_bias = bias;
  arch.mlp_bias = true;
  arch.tied_lm_head = false;
  arch.parallel_residual = cfg.parallel_residual;
  arch.gelu_exact = cfg.gelu_exact();
  return std::make_unique<Model>(cfg, arch, std::move(t), compute);
}

}  // namespace lathe
