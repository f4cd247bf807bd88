// Qwen2-MoE (issue 28; transformers 4.45.2 Qwen2MoeForCausalLM): the family's builder (Qwen2
// attention with q/k/v biases; in every layer Qwen2MoeSparseMoeBlock) and the block's shared expert
// (Arch::moe_shared_width), forward and backward. The routed part is models/moe_layer.cpp's; this
// file adds, per layer l, on the block's input x = ln2 [N, C]:
//   y  = down(silu(gate(x)) * up(x))     [N, C]   the shared SwiGLU expert, width Fs
//   s  = sigmoid(x . g)                  [N]      shared_expert_gate, g [1, C]
//   out += s * y                                  (out: the routed output, before the residual add)
// The expert runs on moe_experts_forward / moe_experts_backward as one expert owning all N rows.
// Backward, from dout = d(res2) [N, C]:
//   dy = s * dout;  dz = <dout, y> * s (1 - s);  dg += sum_n dz[n] x[n];  dx += dz g + expert's dx.
#include <fmt/format.h>

#include <cmath>

#include "kernels/cpu/ops.h"
#include "models/model.h"
#include "models/moe_arch.h"

namespace lathe {

std::unique_ptr<Model> build_qwen2_moe(const ModelConfig& cfg, const ComputeSpec& compute) {
  LATHE_CHECK(cfg.moe() && cfg.shared_expert_intermediate_size > 0,
              "model: qwen2_moe needs num_experts >= 1 and shared_expert_intermediate_size >= 1 (got {}, {})",
              cfg.num_local_experts, cfg.shared_expert_intermediate_size);
  const int64_t C = cfg.hidden_size, V = cfg.vocab_size, F = cfg.intermediate_size, L = cfg.num_hidden_layers,
                H = cfg.num_attention_heads, KV = cfg.num_key_value_heads, D = cfg.head_dim(),
                E = cfg.num_local_experts, Fs = cfg.shared_expert_intermediate_size;
  const float std = static_cast<float>(cfg.initializer_range);
  ParamTable t;
  t.add("model.embed_tokens.weight", {V, C}, Init::Normal, std, ShardRule::Vocab, true).as(Role::Wte);
  for (int64_t i = 0; i < L; ++i) {
    auto n = [&](const std::string& s) { return fmt::format("model.layers.{}.{}", i, s); };
    t.add(n("input_layernorm.weight"), {C}, Init::Ones, 0, ShardRule::Replicated, false).as(Role::Ln1W, i);
    t.add(n("self_attn.q_proj.weight"), {H * D, C}, Init::Normal, std, ShardRule::Column, true).as(Role::QkvW, i);
    t.add(n("self_attn.k_proj.weight"), {KV * D, C}, Init::Normal, std, ShardRule::Column, true).as(Role::Continues, i);
    t.add(n("self_attn.v_proj.weight"), {KV * D, C}, Init::Normal, std, ShardRule::Column, true).as(Role::Continues, i);
    t.add(n("self_attn.q_proj.bias"), {H * D}, Init::Zeros, 0, ShardRule::Column, false).as(Role::QkvB, i);
    t.add(n("self_attn.k_proj.bias"), {KV * D}, Init::Zeros, 0, ShardRule::Column, false).as(Role::Continues, i);
    t.add(n("self_attn.v_proj.bias"), {KV * D}, Init::Zeros, 0, ShardRule::Column, false).as(Role::Continues, i);
    t.add(n("self_attn.o_proj.weight"), {C, H * D}, Init::Normal, std, ShardRule::Row, true).as(Role::OW, i);
    t.add(n("post_attention_layernorm.weight"), {C}, Init::Ones, 0, ShardRule::Replicated, false).as(Role::Ln2W, i);
    // The router, the routed experts (gate_proj of experts 0..E-1 one after another, then up_proj,
    // then down_proj: [E, F, C], [E, F, C], [E, C, F] in the flat buffer as the grouped kernels
    // read them), then the shared expert and its gate.
    t.add(n("mlp.gate.weight"), {E, C}, Init::Normal, std, ShardRule::Replicated, true).as(Role::RouterW, i);
    const std::pair<const char*, Role> mats[] = {
        {"gate_proj", Role::ExpertW1}, {"up_proj", Role::ExpertW3}, {"down_proj", Role::ExpertW2}};
    for (const auto& [m, role] : mats)
      for (int64_t e = 0; e < E; ++e) {
        const bool down = role == Role::ExpertW2;
        t.add(n(fmt::format("mlp.experts.{}.{}.weight", e, m)), down ? Shape{C, F} : Shape{F, C}, Init::Normal, std,
              ShardRule::Replicated, true)
            .as(e == 0 ? role : Role::Continues, i);
      }
    t.add(n("mlp.shared_expert.gate_proj.weight"), {Fs, C}, Init::Normal, std, ShardRule::Replicated, true)
        .as(Role::SharedW1, i);
    t.add(n("mlp.shared_expert.up_proj.weight"), {Fs, C}, Init::Normal, std, ShardRule::Replicated, true)
        .as(Role::SharedW3, i);
    t.add(n("mlp.shared_expert.down_proj.weight"), {C, Fs}, Init::Normal, std, ShardRule::Replicated, true)
        .as(Role::SharedW2, i);
    t.add(n("mlp.shared_expert_gate.weight"), {1, C}, Init::Normal, std, ShardRule::Replicated, true)
        .as(Role::SharedGateW, i);
  }
  t.add("model.norm.weight", {C}, Init::Ones, 0, ShardRule::Replicated, false).as(Role::LnfW);
  if (!cfg.tie_word_embeddings)
    t.add("lm_head.weight", {V, C}, Init::Normal, std, ShardRule::Vocab, true).as(Role::LmHead);

  const Arch arch = moe_llama_arch(cfg, E, /*qkv_bias=*/true, /*shared_width=*/Fs);
  return std::make_unique<Model>(cfg, arch, std::move(t), compute);
}

bool Model::moe_shared_role(Role r) {
  return r == Role::SharedW1 || r == Role::SharedW3 || r == Role::SharedW2 || r == Role::SharedGateW;
}

float** Model::moe_shared_slot(Role r, LayerPtrs* lp, bool shared, bool* needed) {
  *needed = shared;
  if (!lp) return nullptr;
  switch (r) {
    case Role::SharedW1:
      return &lp->sh_w1;
    case Role::SharedW3:
      return &lp->sh_w3;
    case Role::SharedW2:
      return &lp->sh_w2;
    case Role::SharedGateW:
      return &lp->sh_gate_w;
    default:
      return nullptr;
  }
}

void Model::moe_shared_forward(int64_t l, int64_t N, float* out) {
  const LayerPtrs& w = p_.layers[static_cast<size_t>(l)];
  LayerActs& a = la_[static_cast<size_t>(l)];
  const int64_t C = cfg_.hidden_size, Fs = arch_.moe_shared_width;
  const auto* x = static_cast<const float*>(a.ln2);
  const int32_t offsets[2] = {0, static_cast<int32_t>(N)};  // one expert owning every row
  cpu::moe_experts_forward(a.sh_y, a.sh_gate, a.sh_up, a.sh_act, x, w.sh_w1, w.sh_w3, w.sh_w2, offsets, 1, C, Fs);
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* xr = x + n * C;
    float z = 0.0f;
    for (int64_t c = 0; c < C; ++c) z += xr[c] * w.sh_gate_w[c];
    const float s = 1.0f / (1.0f + std::exp(-z));
    a.sh_sig[n] = s;
    const float* yr = a.sh_y + n * C;
    float* o = out + n * C;
    for (int64_t c = 0; c < C; ++c) o[c] += s * yr[c];
  }
}

void Model::moe_shared_backward(int64_t l, int64_t N) {
  const LayerPtrs& w = p_.layers[static_cast<size_t>(l)];
  const LayerPtrs& gw = g_.layers[static_cast<size_t>(l)];
  LayerActs& a = la_[static_cast<size_t>(l)];
  const int64_t C = cfg_.hidden_size, Fs = arch_.moe_shared_width;
  const auto* x = static_cast<const float*>(a.ln2);
  const auto* dout = static_cast<const float*>(dres_);
  auto* dx = static_cast<float*>(dln_);
  // scratch: dy [N, C], the expert's dx [N, C], dz [N], the expert backward's 2 N Fs.
  float* dy = moe_shared_scratch_;
  float* dxe = dy + N * C;
  float* dz = dxe + N * C;
  float* kscratch = dz + N;
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float s = a.sh_sig[n];
    const float* d = dout + n * C;
    const float* yr = a.sh_y + n * C;
    float ds = 0.0f;
    for (int64_t c = 0; c < C; ++c) {
      dy[n * C + c] = s * d[c];
      ds += d[c] * yr[c];
    }
    dz[n] = ds * s * (1.0f - s);
    float* dxr = dx + n * C;
    for (int64_t c = 0; c < C; ++c) dxr[c] += dz[n] * w.sh_gate_w[c];
  }
  // The gate's gradient: rows summed in order (bit-identical for any thread count).
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < C; ++c) {
    float acc = 0.0f;
    for (int64_t n = 0; n < N; ++n) acc += dz[n] * x[n * C + c];
    gw.sh_gate_w[c] += acc;
  }
  const int32_t offsets[2] = {0, static_cast<int32_t>(N)};
  cpu::moe_experts_backward(dxe, gw.sh_w1, gw.sh_w3, gw.sh_w2, dy, x, a.sh_gate, a.sh_up, a.sh_act, w.sh_w1, w.sh_w3,
                            w.sh_w2, offsets, 1, C, Fs, kscratch);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < N * C; ++i) dx[i] += dxe[i];
}

}  // namespace lathe
