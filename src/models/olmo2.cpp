// OLMo 2 (transformers Olmo2ForCausalLM, added in 4.47; the tests' oracle is
// tests/models/torch_reference_olmo2.py): the llama body (RMSNorm, rotate_half RoPE, grouped-query
// attention, a SwiGLU gate|up MLP, untied lm head by default) without pre-norms, with the attention's
// and the MLP's outputs RMSNormed before their residual adds (Arch::pre_norm false + sandwich_norm):
//   res1 = x + post_attention_layernorm(o(attn(x))),  res2 = res1 + post_feedforward_layernorm(mlp(res1)),
// and q / k RMSNormed over the whole projection before RoPE (Arch::qk_norm_full): q_norm.weight
// [H*D], k_norm.weight [KV*D], one norm per token over all heads together.
//
// Where this runs: host memory, one process or data / tensor / sequence / pipeline parallel ranks
// (check_olmo2_support). Tensor parallelism splits a token's q (k) row over the ranks' heads, so the
// norm's sum of squares (forward) and its backward's sum of g w xhat are reduced over the group
// (qk_norm_full_tp_*). The kernels used by one process (rmsnorm, head_rmsnorm with one "head" of
// H*D) exist on CUDA too, but the device path is untested, so it is refused.
#include <fmt/format.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/cpu/storage.h"
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
    // Whole-projection norms: a tensor shard holds its heads' columns (Column); the norm's sums are
    // reduced over the group (qk_norm_full_tp_forward / backward).
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
}

namespace {

// Row i (n elements) of a host buffer of compute dtype dt, as fp32, and back.
void load_row(float* dst, const void* src, int64_t i, int64_t n, DType dt) {
  if (dt == DType::F32) {
    std::memcpy(dst, static_cast<const float*>(src) + i, static_cast<size_t>(n) * sizeof(float));
    return;
  }
  const auto* h = static_cast<const uint16_t*>(src) + i;
  if (dt == DType::BF16)
    cpu::Bf16::to_f32(dst, h, n);
  else
    cpu::Fp16::to_f32(dst, h, n);
}
void store_row(void* dst, int64_t i, const float* src, int64_t n, DType dt) {
  if (dt == DType::F32) {
    std::memcpy(static_cast<float*>(dst) + i, src, static_cast<size_t>(n) * sizeof(float));
    return;
  }
  auto* h = static_cast<uint16_t*>(dst) + i;
  if (dt == DType::BF16)
    cpu::Bf16::from_f32(h, src, n);
  else
    cpu::Fp16::from_f32(h, src, n);
}

}  // namespace

// One norm (q or k) of N tokens: this rank's W = width elements of each token at x + n * stride (the
// head_rmsnorm layout with one head), of the whole row's `full` elements over the tensor group.
void Model::qk_norm_full_tp_forward(void* x, void* saved, float* rstd, const float* w, int64_t N, int64_t W,
                                    int64_t full, int64_t stride) {
  LATHE_CHECK(hooks_.tp.tensor_parallel() && hooks_.tp.comm.all_reduce_f32 != nullptr,
              "model: a tensor-parallel shard ({} parts) with whole-projection q/k norms needs the group's "
              "StepHooks::tp.comm.all_reduce_f32 (parallel::attach_tensor_parallel installs it)",
              shard_.parts);
  const DType dt = ops_->dtype;
  LATHE_CHECK(dt == DType::F32 || dt == DType::BF16 || dt == DType::F16,
              "model: whole-projection q/k norms under tensor parallelism in compute dtype {} are not implemented",
              compute_dtype_name(dt));
  const float eps = static_cast<float>(cfg_.norm_eps), inv = 1.0f / static_cast<float>(full);
  std::vector<float> row(static_cast<size_t>(W)), ss(static_cast<size_t>(N));
  for (int64_t n = 0; n < N; ++n) {  // saved = the rows (backward's input); this rank's sums of squares
    load_row(row.data(), x, n * stride, W, dt);
    store_row(saved, n * W, row.data(), W, dt);
    float s = 0.0f;
    for (int64_t c = 0; c < W; ++c) s += row[c] * row[c];
    ss[n] = s;
  }
  hooks_.tp.comm.all_reduce_f32(ss.data(), N);  // the whole row's, in rank order
  for (int64_t n = 0; n < N; ++n) {
    const float r = 1.0f / std::sqrt(ss[n] * inv + eps);
    rstd[n] = r;
    load_row(row.data(), saved, n * W, W, dt);
    for (int64_t c = 0; c < W; ++c) row[c] = w[c] * (row[c] * r);
    store_row(x, n * stride, row.data(), W, dt);
  }
}

// Its backward: the rows of dx hold d(out) and are overwritten with d(in); dw[W] (this rank's
// columns of the weight) += sum over tokens of dout * xhat. d(in) = (g w - xhat b) r with
// b = sum over the WHOLE row of g w xhat / full: reduced over the group.
void Model::qk_norm_full_tp_backward(void* dx, float* dw, const void* saved, const float* w, const float* rstd,
                                     int64_t N, int64_t W, int64_t full, int64_t stride) {
  const DType dt = ops_->dtype;
  const float inv = 1.0f / static_cast<float>(full);
  std::vector<float> g(static_cast<size_t>(W)), x(static_cast<size_t>(W)), b(static_cast<size_t>(N));
  for (int64_t n = 0; n < N; ++n) {
    load_row(g.data(), dx, n * stride, W, dt);
    load_row(x.data(), saved, n * W, W, dt);
    float s = 0.0f;
    for (int64_t c = 0; c < W; ++c) s += g[c] * w[c] * (x[c] * rstd[n]);
    b[n] = s;
  }
  hooks_.tp.comm.all_reduce_f32(b.data(), N);
  for (int64_t n = 0; n < N; ++n) {
    load_row(g.data(), dx, n * stride, W, dt);
    load_row(x.data(), saved, n * W, W, dt);
    const float r = rstd[n], bn = b[n] * inv;
    for (int64_t c = 0; c < W; ++c) {
      const float xhat = x[c] * r;
      dw[c] += g[c] * xhat;
      g[c] = (g[c] * w[c] - xhat * bn) * r;
    }
    store_row(dx, n * stride, g.data(), W, dt);
  }
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
