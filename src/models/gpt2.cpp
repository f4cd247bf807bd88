// GPT-2 (HF GPT2LMHeadModel): learned positions, pre-LayerNorm with biases, GELU(tanh) MLP,
// lm_head tied to wte. Tensor names are the HF state-dict names; HF's Conv1D weights are [in, out]
// and are kept here as [out, in] (marked hf_transposed, transposed on import/export).
#include <fmt/format.h>

#include <cmath>

#include "models/model.h"

namespace lathe {

std::unique_ptr<Model> build_gpt2(const ModelConfig& cfg, const ComputeSpec& compute) {
  LATHE_CHECK(cfg.num_key_value_heads == cfg.num_attention_heads,
              "model: gpt2 has no grouped-query attention (num_key_value_heads {} != n_head {})",
              cfg.num_key_value_heads, cfg.num_attention_heads);
  // HD = H * D is C, except in a tensor-parallel shard's config (this rank's heads only).
  const int64_t C = cfg.hidden_size, V = cfg.vocab_size, P = cfg.max_position_embeddings, F = cfg.intermediate_size,
                L = cfg.num_hidden_layers, HD = cfg.num_attention_heads * cfg.head_dim();
  const float std = static_cast<float>(cfg.initializer_range);
  // GPT-2 scales the init of the projections that write into the residual stream by 1/sqrt(2L).
  const float proj_std = std / std::sqrt(2.0f * static_cast<float>(L));
  ParamTable t;
  t.add("transformer.wte.weight", {V, C}, Init::Normal, std, ShardRule::Vocab, true).as(Role::Wte);
  t.add("transformer.wpe.weight", {P, C}, Init::Normal, std, ShardRule::Replicated, true).as(Role::Wpe);
  for (int64_t i = 0; i < L; ++i) {
    auto n = [&](const char* s) { return fmt::format("transformer.h.{}.{}", i, s); };
    t.add(n("ln_1.weight"), {C}, Init::Ones, 0, ShardRule::Replicated, false).as(Role::Ln1W, i);
    t.add(n("ln_1.bias"), {C}, Init::Zeros, 0, ShardRule::Replicated, false).as(Role::Ln1B, i);
    // c_attn is q|k|v fused along its rows: three sections for tensor parallelism.
    t.add(n("attn.c_attn.weight"), {3 * HD, C}, Init::Normal, std, ShardRule::Column, true, true)
        .as(Role::QkvW, i)
        .in_sections(3);
    t.add(n("attn.c_attn.bias"), {3 * HD}, Init::Zeros, 0, ShardRule::Column, false).as(Role::QkvB, i).in_sections(3);
    t.add(n("attn.c_proj.weight"), {C, HD}, Init::Normal, proj_std, ShardRule::Row, true, true).as(Role::OW, i);
    t.add(n("attn.c_proj.bias"), {C}, Init::Zeros, 0, ShardRule::Replicated, false).as(Role::OB, i);
    t.add(n("ln_2.weight"), {C}, Init::Ones, 0, ShardRule::Replicated, false).as(Role::Ln2W, i);
    t.add(n("ln_2.bias"), {C}, Init::Zeros, 0, ShardRule::Replicated, false).as(Role::Ln2B, i);
    t.add(n("mlp.c_fc.weight"), {F, C}, Init::Normal, std, ShardRule::Column, true, true).as(Role::FcW, i);
    t.add(n("mlp.c_fc.bias"), {F}, Init::Zeros, 0, ShardRule::Column, false).as(Role::FcB, i);
    t.add(n("mlp.c_proj.weight"), {C, F}, Init::Normal, proj_std, ShardRule::Row, true, true).as(Role::ProjW, i);
    t.add(n("mlp.c_proj.bias"), {C}, Init::Zeros, 0, ShardRule::Replicated, false).as(Role::ProjB, i);
  }
  t.add("transformer.ln_f.weight", {C}, Init::Ones, 0, ShardRule::Replicated, false).as(Role::LnfW);
  t.add("transformer.ln_f.bias", {C}, Init::Zeros, 0, ShardRule::Replicated, false).as(Role::LnfB);

  Arch arch;  // defaults are GPT-2
  return std::make_unique<Model>(cfg, arch, std::move(t), compute);
}

}  // namespace lathe
