// Mixture of experts in the model body (issue 28): the Mixtral family's builder (transformers 4.45.2
// MixtralForCausalLM: Mistral attention, and in every layer a sparse MoE block in place of the MLP)
// and the body's MoE block, forward and backward, on the kernels of kernels/cpu/moe.cpp.
//
// The block of layer l: res2 = res1 + moe(ln2), with the router's softmax -> top-k -> renormalise,
// dropless (every token reaches its k experts). The load-balancing loss spans the pass's layers and
// tokens as transformers' load_balancing_loss_func over the concatenated router logits: the
// statistics accumulate over the layers' forwards (moe_begin_pass at the embedding), head_loss
// forms the loss and its weight, and each layer's backward adds its router-logit gradient.
//
// Loss convention (one micro-batch of n trained targets, grad_scale = 1 / (targets of the global
// batch)): the training pass's loss sum gains n x coef x aux, so that the trainer's mean is
// transformers' `loss + router_aux_loss_coef * aux_loss` for one micro-batch and the token-weighted
// mean of the micro-batches' aux losses over several (or several data-parallel ranks). Evaluation
// passes (no backward) return the language-model loss alone (perplexity stays the LM's).
//
// Where it runs: host memory, fp32, one process or data parallel (ZeRO 1/2: the expert gradients
// are ordinary slices of the flat buffer). check_moe_support refuses the rest naming the key.
#include <fmt/format.h>

#include <algorithm>

#include "kernels/cpu/ops.h"
#include "models/model.h"
#include "models/moe_arch.h"

namespace lathe {

std::unique_ptr<Model> build_mixtral(const ModelConfig& cfg, const ComputeSpec& compute) {
  LATHE_CHECK(cfg.moe(), "model: mixtral needs num_local_experts >= 1 (got {})", cfg.num_local_experts);
  const int64_t C = cfg.hidden_size, V = cfg.vocab_size, F = cfg.intermediate_size, L = cfg.num_hidden_layers,
                H = cfg.num_attention_heads, KV = cfg.num_key_value_heads, D = cfg.head_dim(),
                E = cfg.num_local_experts;
  const float std = static_cast<float>(cfg.initializer_range);
  ParamTable t;
  t.add("model.embed_tokens.weight", {V, C}, Init::Normal, std, ShardRule::Vocab, true).as(Role::Wte);
  for (int64_t i = 0; i < L; ++i) {
    auto n = [&](const std::string& s) { return fmt::format("model.layers.{}.{}", i, s); };
    t.add(n("input_layernorm.weight"), {C}, Init::Ones, 0, ShardRule::Replicated, false).as(Role::Ln1W, i);
    t.add(n("self_attn.q_proj.weight"), {H * D, C}, Init::Normal, std, ShardRule::Column, true).as(Role::QkvW, i);
    t.add(n("self_attn.k_proj.weight"), {KV * D, C}, Init::Normal, std, ShardRule::Column, true).as(Role::Continues, i);
    t.add(n("self_attn.v_proj.weight"), {KV * D, C}, Init::Normal, std, ShardRule::Column, true).as(Role::Continues, i);
    t.add(n("self_attn.o_proj.weight"), {C, H * D}, Init::Normal, std, ShardRule::Row, true).as(Role::OW, i);
    t.add(n("post_attention_layernorm.weight"), {C}, Init::Ones, 0, ShardRule::Replicated, false).as(Role::Ln2W, i);
    // The router, then each of w1 / w3 / w2 for experts 0..E-1 one after another: the flat buffer
    // holds w1 as [E, F, C], w3 as [E, F, C] and w2 as [E, C, F] (the grouped kernels' layout) while
    // every tensor keeps its Hugging Face name. Replicated: tensor parallelism is refused for MoE.
    t.add(n("block_sparse_moe.gate.weight"), {E, C}, Init::Normal, std, ShardRule::Replicated, true)
        .as(Role::RouterW, i);
    const std::pair<const char*, Role> mats[] = {
        {"w1", Role::ExpertW1}, {"w3", Role::ExpertW3}, {"w2", Role::ExpertW2}};
    for (const auto& [m, role] : mats)
      for (int64_t e = 0; e < E; ++e) {
        const bool down = role == Role::ExpertW2;
        t.add(n(fmt::format("block_sparse_moe.experts.{}.{}.weight", e, m)), down ? Shape{C, F} : Shape{F, C},
              Init::Normal, std, ShardRule::Replicated, true)
            .as(e == 0 ? role : Role::Continues, i);
      }
  }
  t.add("model.norm.weight", {C}, Init::Ones, 0, ShardRule::Replicated, false).as(Role::LnfW);
  if (!cfg.tie_word_embeddings)
    t.add("lm_head.weight", {V, C}, Init::Normal, std, ShardRule::Vocab, true).as(Role::LmHead);

  const Arch arch = moe_llama_arch(cfg, E, /*qkv_bias=*/false, /*shared_width=*/0);
  return std::make_unique<Model>(cfg, arch, std::move(t), compute);
}

float** Model::moe_slot(Role r, LayerPtrs* lp, bool moe, bool* needed) {
  *needed = moe;
  switch (r) {
    case Role::RouterW:
      return lp ? &lp->router_w : nullptr;
    case Role::ExpertW1:
      return lp ? &lp->exp_w1 : nullptr;
    case Role::ExpertW3:
      return lp ? &lp->exp_w3 : nullptr;
    case Role::ExpertW2:
      return lp ? &lp->exp_w2 : nullptr;
    default:
      return nullptr;
  }
}

void Model::check_moe_support() const {
  if (arch_.moe_experts == 0) return;
  const std::string& mt = cfg_.model_type;
  LATHE_CHECK(!on_device(),
              "model: {} (mixture of experts) runs on the cpu only for now (its kernels are kernels/cpu/moe.cpp); set "
              "device: cpu",
              mt);
  LATHE_CHECK(ops_->dtype == DType::F32,
              "model: {} (mixture of experts) computes in fp32 only for now (kernels/cpu/moe.cpp is fp32, {} was "
              "asked for); set precision.compute: fp32",
              mt, compute_dtype_name(ops_->dtype));
  LATHE_CHECK(shard_.parts <= 1 && !hooks_.tp.tensor_parallel(),
              "model: {} (mixture of experts) has no tensor-parallel experts yet; set parallel.tensor: 1", mt);
  LATHE_CHECK(!hooks_.cp.active(),
              "model: {} (mixture of experts) does not run under context parallelism yet (the load-balancing loss "
              "spans the whole sequence); set parallel.context: 1",
              mt);
  LATHE_CHECK(arch_.embedding && arch_.head,
              "model: {} (mixture of experts) does not run as a pipeline stage yet (the load-balancing loss spans "
              "every layer of the pass); set parallel.pipeline: 1",
              mt);
  LATHE_CHECK(!arch_.sandwich_norm && !arch_.parallel_residual && !arch_.gelu_mlp && !arch_.geglu,
              "internal: the MoE block replaces a sequential pre-norm SwiGLU MLP only");
  LATHE_CHECK(arch_.moe_top_k >= 1 && arch_.moe_top_k <= arch_.moe_experts,
              "model: num_experts_per_tok = {} must be in [1, num_local_experts = {}]", arch_.moe_top_k,
              arch_.moe_experts);
}

namespace {
cpu::MoeShape moe_shape(const ModelConfig& cfg, const Arch& arch, int64_t N) {
  cpu::MoeShape s;
  s.N = N;
  s.C = cfg.hidden_size;
  s.F = cfg.intermediate_size;
  s.E = arch.moe_experts;
  s.k = arch.moe_top_k;
  s.score = cpu::MoeScore::softmax;
  s.renormalize = arch.moe_renormalize;
  return s;
}
}  // namespace

void Model::moe_begin_pass() {
  const auto E = static_cast<size_t>(arch_.moe_experts);
  moe_psum_.assign(E, 0.0);
  moe_counts_.assign(E, 0);
  moe_rows_ = 0;
  moe_z_sum_ = 0.0;
  moe_grad_weight_ = 0.0f;
}

void Model::moe_layer_forward(int64_t l, int64_t N) {
  check_moe_support();
  LATHE_CHECK(moe_psum_.size() == static_cast<size_t>(arch_.moe_experts),
              "internal: MoE layer forward before the pass's embedding forward");
  const LayerPtrs& w = p_.layers[static_cast<size_t>(l)];
  LayerActs& a = la_[static_cast<size_t>(l)];
  const cpu::MoeShape s = moe_shape(cfg_, arch_, N);
  if (hooks_.ep.active())  // experts spread over the expert group (parallel/expert_parallel.h)
    hooks_.ep.forward(static_cast<float*>(a.res2), a.moe, static_cast<const float*>(a.ln2), w.router_w, w.exp_w1,
                      w.exp_w3, w.exp_w2, s, l);
  else
    cpu::moe_forward(static_cast<float*>(a.res2), a.moe, static_cast<const float*>(a.ln2), w.router_w, w.exp_w1,
                     w.exp_w3, w.exp_w2, s);
  if (arch_.moe_shared_width > 0) moe_shared_forward(l, N, static_cast<float*>(a.res2));  // models/moe_shared.cpp
  ops_->residual_forward(a.res2, a.res2, a.res1, N * cfg_.hidden_size);
  cpu::moe_load_stats(moe_psum_.data(), moe_counts_.data(), a.moe.probs, a.moe.topk_idx, N, s.E, s.k);
  moe_rows_ += N;
  if (arch_.moe_z_loss_coef != 0.0f) moe_z_sum_ += cpu::moe_z_loss(nullptr, a.moe.logits, N, s.E, 0.0f);
}

double Model::moe_head_loss(const int32_t* targets, int64_t N, float grad_scale) {
  int64_t n = 0;
  for (int64_t i = 0; i < N; ++i) n += targets[i] >= 0 ? 1 : 0;
  moe_targets_ = n;
  if (moe_rows_ == 0) {  // no layer ran (a model of 0 layers cannot be built, but be safe)
    moe_aux_ = moe_z_ = 0.0;
    return 0.0;
  }
  moe_aux_ = cpu::moe_aux_loss(moe_psum_.data(), moe_counts_.data(), moe_rows_, arch_.moe_experts);
  moe_z_ = moe_z_sum_ / static_cast<double>(moe_rows_);
  moe_grad_weight_ = grad_scale * static_cast<float>(n);
  return static_cast<double>(n) * (static_cast<double>(arch_.moe_aux_loss_coef) * moe_aux_ +
                                   static_cast<double>(arch_.moe_z_loss_coef) * moe_z_);
}

void Model::moe_layer_backward(int64_t l, int64_t N) {
  const LayerPtrs& w = p_.layers[static_cast<size_t>(l)];
  const LayerPtrs& gw = g_.layers[static_cast<size_t>(l)];
  LayerActs& a = la_[static_cast<size_t>(l)];
  const cpu::MoeShape s = moe_shape(cfg_, arch_, N);
  // The balancing losses' router-logit gradients, weighted as head_loss weighted the losses.
  const float aux_w = moe_grad_weight_ * arch_.moe_aux_loss_coef, z_w = moe_grad_weight_ * arch_.moe_z_loss_coef;
  float* dadd = nullptr;
  if (aux_w != 0.0f || z_w != 0.0f) {
    std::fill(moe_dlogits_, moe_dlogits_ + N * s.E, 0.0f);
    if (aux_w != 0.0f)
      cpu::moe_aux_loss_backward(moe_dlogits_, a.moe.probs, moe_counts_.data(), moe_rows_, N, s.E, aux_w, s.score);
    if (z_w != 0.0f) (void)cpu::moe_z_loss(moe_dlogits_, a.moe.logits, N, s.E, z_w / static_cast<float>(moe_rows_));
    dadd = moe_dlogits_;
  }
  if (hooks_.ep.active())
    hooks_.ep.backward(static_cast<float*>(dln_), gw.router_w, gw.exp_w1, gw.exp_w3, gw.exp_w2,
                       static_cast<const float*>(dres_), dadd, a.moe, static_cast<const float*>(a.ln2), w.router_w,
                       w.exp_w1, w.exp_w3, w.exp_w2, s, moe_scratch_, l);
  else
    cpu::moe_backward(static_cast<float*>(dln_), gw.router_w, gw.exp_w1, gw.exp_w3, gw.exp_w2,
                      static_cast<const float*>(dres_), dadd, a.moe, static_cast<const float*>(a.ln2), w.router_w,
                      w.exp_w1, w.exp_w3, w.exp_w2, s, moe_scratch_);
  if (arch_.moe_shared_width > 0) moe_shared_backward(l, N);  // dln_ += (models/moe_shared.cpp)
}

}  // namespace lathe
