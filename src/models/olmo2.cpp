// OLMo 2 (transformers Olmo2ForCausalLM, added in 4.47; the tests' oracle is
// tests/models/torch_reference_olmo2.py): the llama body (RMSNorm, rotate_half RoPE, grouped-query
// attention, a SwiGLU gate|up MLP, untied lm head by default) without pre-norms, with the attention's
// and the MLP's outputs RMSNormed before their residual adds (Arch::pre_norm false + sandwich_norm):
//   res1 = x + post_attention_layernorm(o(attn(x))),  res2 = res1 + post_feedforward_layernorm(mlp(res1)),
// and q / k RMSNormed over the whole projection before RoPE (Arch::qk_norm_full): q_norm.weight
// [H*D], k_norm.weight [KV*D], one norm per token over all heads together.
//
// Where this runs: host memory, one process or data / pipeline parallel ranks (check_olmo2_support).
// Tensor parallelism would split a token's q (k) row over ranks, so its norm needs the sum of
// squares reduced across the group; not done, refused. The kernels used (rmsnorm, head_rmsnorm
// with one "head" of H*D) exist on CUDA too, but the device path is untested, so it is refused.
#include <fmt/format.h>

#include "models/model.h"

namespace lathe {

std::unique_ptr<Model> build_olmo2(const ModelConfig& cfg, const ComputeSpec& compute) {
  LATHE_CHECK(cfg.post_norm && cfg.qk_norm_full && !cfg.attention_bias,
              "internal: an olmo2 config without post norms / whole-projection q/k norms, or with attention biases");
  const int64_t C = cfg.hidden_size, V = cfg.vocab_size, F = cfg.intermediate_size, L = cfg.num_hidden_layers,
                H = cfg.num_attention_heads, KV = cfg.num_key_value_heads, D = cfg.head_dim();
  const float std = static_cast<float>(cfg.initializer_range);
  ParamTable t;
  t.add("model.embed_tokens.weight", {V, C}, Init::Normal, std, ShardRule::Vocab, true).as(Role::Wte);
  for (int64_t i = 0; i < L; ++i) {
    auto n = [&](const char* s) { return fmt::format("model.layers.{}.{}", i, s); };
    t.add(n("self_attn.q_proj.weight"), {H * D, C}, Init::Normal, std, ShardRule::Column, true).as(Role::QkvW, i);
    t.add(n("self_attn.k_proj.weight"), {KV * D, C}, Init::Normal, std, ShardRule::Column, true).as(Role::Continues, i);
    t.add(n("self_attn.v_proj.weight"), {KV * D, C}, Init::Normal, std, ShardRule::Column, true).as(Role::Continues, i);
    // Whole-projection norms: a tensor shard would hold its heads' columns (Column), but the norm
    // itself needs every head's sum of squares (check_olmo2_support refuses tensor parallelism).
    t.add(n("self_attn.q_norm.weight"), {H * D}, Init::Ones, 0, ShardRule::Column, false).as(Role::QNormW, i);
    t.add(n("self_attn.k_norm.weight"), {KV * D}, Init::Ones, 0, ShardRule::Column, false).as(Role::KNormW, i);
    t.add(n("self_attn.o_proj.weight"), {C, H * D}, Init::Normal, std, ShardRule::Row, true).as(Role::OW, i);
    t.add(n("post_attention_layernorm.weight"), {C}, Init::Ones, 0, ShardRule::Replicated, false)
        .as(Role::PostAttnNormW, i);
    t.add(n("post_feedforward_layernorm.weight"), {C}, Init::Ones, 0, ShardRule::Replicated, false)
        .as(Role::PostFfnNormW, i);
    t.add(n("mlp.gate_proj.weight"), {F, C}, Init::Normal, std, ShardRule::Column, true).as(Role::FcW, i);
    t.add(n("mlp.up_proj.weight"), {F, C}, Init::Normal, std, ShardRule::Column, true).as(Role::Continues, i);
    t.add(n("mlp.down_proj.weight"), {C, F}, Init::Normal, std, ShardRule::Row, true).as(Role::ProjW, i);
  }
  t.add("model.norm.weight", {C}, Init::Ones, 0, ShardRule::Replicated, false).as(Role::LnfW);
  if (!cfg.tie_word_embeddings)
    t.add("lm_head.weight", {V, C}, Init::Normal, std, ShardRule::Vocab, true).as(Role::LmHead);

  Arch arch;
  arch.layernorm = false;
  arch.learned_pos = false;
  arch.gelu_mlp = false;
  arch.qkv_bias = false;
  arch.o_bias = false;
  arch.mlp_bias = false;
  arch.tied_lm_head = cfg.tie_word_embeddings;
  arch.pre_norm = false;
  arch.sandwich_norm = true;
  arch.qk_norm_full = true;
  return std::make_unique<Model>(cfg, arch, std::move(t), compute);
}

void Model::check_olmo2_support() const {
  if (arch_.pre_norm && !arch_.qk_norm_full) return;
  LATHE_CHECK(!on_device(),
              "model: {} (post norms only, whole-projection q/k norms) runs on host memory only for now (its CUDA "
              "path is untested); set device: cpu",
              cfg_.model_type);
  LATHE_CHECK(!arch_.qk_norm_full || shard_.parts <= 1,
              "model: {} under tensor parallelism ({} ranks) is not implemented: its q_norm / k_norm normalise each "
              "token's whole q and k projections, whose heads the ranks split (the sum of squares would need a "
              "reduction across the tensor group); set parallel.tensor: 1 (data and pipeline parallelism work)",
              cfg_.model_type, shard_.parts);
}

const void* Model::block_input(int64_t l, bool second) const {
  const LayerActs& a = la_[static_cast<size_t>(l)];
  if (arch_.pre_norm) return second ? a.ln2 : a.ln1;
  return second && !arch_.parallel_residual ? a.res1 : layer_input(l);
}

void Model::block_input_backward(int64_t l, bool second, int64_t S) {
  const LayerPtrs& w = p_.layers[static_cast<size_t>(l)];
  const LayerPtrs& gw = g_.layers[static_cast<size_t>(l)];
  const LayerActs& a = la_[static_cast<size_t>(l)];
  if (!arch_.pre_norm) {  // the GEMM read the stream itself: its input gradient adds straight in
    ops_->residual_forward(dres_, dres_, dln_, S * cfg_.hidden_size);
    return;
  }
  if (second)
    norm_backward(dres_, gw.ln2_w, gw.ln2_b, dln_, arch_.parallel_residual ? layer_input(l) : a.res1, w.ln2_w,
                  a.ln2_mean, a.ln2_rstd, S);
  else
    norm_backward(dres_, gw.ln1_w, gw.ln1_b, dln_, layer_input(l), w.ln1_w, a.ln1_mean, a.ln1_rstd, S);
}

}  // namespace lathe
