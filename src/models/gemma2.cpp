// Gemma 2 (transformers 4.45.2 Gemma2ForCausalLM): the llama body (RMSNorm, rotate_half RoPE,
// grouped-query attention, a gate|up MLP) with four norms per layer (input, post-attention,
// pre-feedforward, post-feedforward: Arch::sandwich_norm), RMSNorm scaling by (1 + w) with
// zero-initialised weights (Arch::norm_weight_offset), a GeGLU MLP with the tanh GELU (Arch::geglu),
// embeddings times sqrt(hidden_size) (Arch::embed_scale), the lm head tied to the embedding, and
// from the config: scores scaled by 1/sqrt(query_pre_attn_scalar), attention and final logit
// soft-capping (kernel arguments) and sliding windows on the even layers (ModelConfig::sliding_layers).
//
// Where this runs: any backend (the (1 + w) weights and the embedding scale are the ops table's
// offset_weights and scale_forward), one process or data / tensor / sequence / pipeline parallel ranks.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "core/dtype.h"
#include "kernels/cpu/storage.h"
#include "models/model.h"

namespace lathe {

std::unique_ptr<Model> build_gemma2(const ModelConfig& cfg, const ComputeSpec& compute) {
  LATHE_CHECK(cfg.tie_word_embeddings, "model: gemma2's lm head is the embedding (tie_word_embeddings must be true)");
  const int64_t C = cfg.hidden_size, V = cfg.vocab_size, F = cfg.intermediate_size, L = cfg.num_hidden_layers,
                H = cfg.num_attention_heads, KV = cfg.num_key_value_heads, D = cfg.head_dim();
  const float std = static_cast<float>(cfg.initializer_range);
  ParamTable t;
  t.add("model.embed_tokens.weight", {V, C}, Init::Normal, std, ShardRule::Vocab, true).as(Role::Wte);
  for (int64_t i = 0; i < L; ++i) {
    auto n = [&](const char* s) { return fmt::format("model.layers.{}.{}", i, s); };
    // Gemma2RMSNorm: weights start at 0 (the scale is 1 + w).
    t.add(n("input_layernorm.weight"), {C}, Init::Zeros, 0, ShardRule::Replicated, false).as(Role::Ln1W, i);
    t.add(n("self_attn.q_proj.weight"), {H * D, C}, Init::Normal, std, ShardRule::Column, true).as(Role::QkvW, i);
    t.add(n("self_attn.k_proj.weight"), {KV * D, C}, Init::Normal, std, ShardRule::Column, true).as(Role::Continues, i);
    t.add(n("self_attn.v_proj.weight"), {KV * D, C}, Init::Normal, std, ShardRule::Column, true).as(Role::Continues, i);
    t.add(n("self_attn.o_proj.weight"), {C, H * D}, Init::Normal, std, ShardRule::Row, true).as(Role::OW, i);
    t.add(n("post_attention_layernorm.weight"), {C}, Init::Zeros, 0, ShardRule::Replicated, false)
        .as(Role::PostAttnNormW, i);
    t.add(n("pre_feedforward_layernorm.weight"), {C}, Init::Zeros, 0, ShardRule::Replicated, false).as(Role::Ln2W, i);
    t.add(n("post_feedforward_layernorm.weight"), {C}, Init::Zeros, 0, ShardRule::Replicated, false)
        .as(Role::PostFfnNormW, i);
    t.add(n("mlp.gate_proj.weight"), {F, C}, Init::Normal, std, ShardRule::Column, true).as(Role::FcW, i);
    t.add(n("mlp.up_proj.weight"), {F, C}, Init::Normal, std, ShardRule::Column, true).as(Role::Continues, i);
    t.add(n("mlp.down_proj.weight"), {C, F}, Init::Normal, std, ShardRule::Row, true).as(Role::ProjW, i);
  }
  t.add("model.norm.weight", {C}, Init::Zeros, 0, ShardRule::Replicated, false).as(Role::LnfW);

  Arch arch;
  arch.layernorm = false;
  arch.learned_pos = false;
  arch.gelu_mlp = false;
  arch.qkv_bias = false;
  arch.o_bias = false;
  arch.mlp_bias = false;
  arch.tied_lm_head = true;
  arch.sandwich_norm = true;
  arch.norm_weight_offset = 1.0f;
  arch.geglu = true;
  arch.embed_scale = true;
  return std::make_unique<Model>(cfg, arch, std::move(t), compute);
}

const float* Model::norm_weight(const float* w, int64_t n) {
  if (arch_.norm_weight_offset == 0.0f) return w;
  if (norm_w_.size() < static_cast<size_t>(n)) norm_w_.resize(*backend_, static_cast<size_t>(n), DType::F32);
  auto* out = static_cast<float*>(norm_w_.data());
  ops_->offset_weights(out, w, arch_.norm_weight_offset, n);  // where w lives (host or device)
  return out;
}

void Model::post_norm_forward(void* out, const void* in, float* rstd, const float* w, const void* residual,
                              int64_t rows) {
  const int64_t C = cfg_.hidden_size;
  ops_->rmsnorm_forward(out, rstd, in, norm_weight(w, C), rows, C, static_cast<float>(cfg_.norm_eps));
  ops_->residual_forward(out, out, residual, rows * C);
}

void Model::post_norm_backward(float* dw, const void* dout, const void* in, const float* w, const float* rstd,
                               int64_t rows) {
  const int64_t C = cfg_.hidden_size;
  backend_->memset(dln_, 0, static_cast<size_t>(rows * C) * static_cast<size_t>(act_size_));
  norm_backward(dln_, dw, nullptr, dout, in, w, nullptr, rstd, rows);
}

// transformers: `normalizer = torch.tensor(hidden_size**0.5, dtype=hidden_states.dtype)`, then
// hidden_states * normalizer in that dtype (one rounding of the product: the ops' scale_forward).
float sqrt_hidden_in(DType dt, int64_t hidden) {
  const float root = static_cast<float>(std::sqrt(static_cast<double>(hidden)));
  if (dt == DType::F32) return root;
  LATHE_CHECK(dt == DType::BF16 || dt == DType::F16, "model: embedding scale in compute dtype {} is not implemented",
              compute_dtype_name(dt));
  uint16_t s16 = 0;
  float s = 0.0f;
  if (dt == DType::BF16) {
    cpu::Bf16::from_f32(&s16, &root, 1);
    cpu::Bf16::to_f32(&s, &s16, 1);
  } else {
    cpu::Fp16::from_f32(&s16, &root, 1);
    cpu::Fp16::to_f32(&s, &s16, 1);
  }
  return s;
}

void Model::scale_by_normalizer(void* x, int64_t n) const {
  ops_->scale_forward(x, sqrt_hidden_in(ops_->dtype, cfg_.hidden_size), n);
}

}  // namespace lathe
