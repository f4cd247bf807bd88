// The one table that describes a model's parameters. Parameters, gradients and optimizer moments
// are flat fp32 buffers; every tensor is a (offset, shape) slice of them, in table order. The
// table also carries how each tensor is initialised, whether weight decay applies, how a later
// tensor-parallel wrapper would shard it, and how it maps to the Hugging Face state dict.
#pragma once
#include <cstdint>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/checked.h"
#include "core/error.h"
#include "core/tensor.h"

namespace lathe {

enum class Init : uint8_t {
  Normal,  // N(0, std)
  Zeros,
  Ones,
};

// How tensor parallelism splits a tensor (applied by src/parallel, never by model code).
enum class ShardRule : uint8_t {
  Replicated,  // norms, biases of row-parallel layers
  Column,      // split dim 0 (output features) of a [out, in] weight, or a bias of such a layer
  Row,         // split dim 1 (input features)
  Vocab,       // split dim 0 of an embedding / lm_head over the vocabulary
};

// What a tensor is to the model body. The body finds its tensors by role (and layer) in the table,
// never by name, and a required role that is missing is an error (models/transformer.cpp). Fused
// GEMMs read several adjacent tensors as one: the first carries the role (QkvW = q, or GPT-2's
// c_attn), the ones that continue it carry Role::Continues (llama's k, v, up).
enum class Role : uint8_t {
  None,
  Continues,  // adjacent continuation of the previous tensor's role (k_proj/v_proj after q_proj, up after gate)
  Wte,
  Wpe,
  Ln1W,
  Ln1B,
  QkvW,
  QkvB,
  OW,
  OB,
  Ln2W,
  Ln2B,
  FcW,  // GPT-2 c_fc; llama gate (gate|up fused)
  FcB,
  ProjW,
  ProjB,
  LnfW,
  LnfB,
  LmHead,
  QNormW,         // Qwen3's per-head q RMSNorm weight [head_dim] (Arch::qk_norm)
  KNormW,         // its k twin
  PostAttnNormW,  // Gemma 2's post_attention_layernorm: RMSNorm of the attention output (Arch::sandwich_norm)
  PostFfnNormW,   // Gemma 2's post_feedforward_layernorm: RMSNorm of the MLP output
  // ---- mixture of experts (Arch::moe_experts; models/moe_layer.cpp) ----
  RouterW,   // block_sparse_moe.gate.weight [E, C]
  ExpertW1,  // experts.0.w1 (gate) [F, C]; experts 1..E-1 continue it: [E, F, C] in the flat buffer
  ExpertW3,  // experts.0.w3 (up), continued likewise: [E, F, C]
  ExpertW2,  // experts.0.w2 (down) [C, F], continued likewise: [E, C, F]
  // ---- Qwen2-MoE's shared expert (Arch::moe_shared_width; models/moe_shared.cpp) ----
  SharedW1,     // mlp.shared_expert.gate_proj.weight [Fs, C]
  SharedW3,     // mlp.shared_expert.up_proj.weight [Fs, C]
  SharedW2,     // mlp.shared_expert.down_proj.weight [C, Fs]
  SharedGateW,  // mlp.shared_expert_gate.weight [1, C]
};
inline const char* role_name(Role r) {
  static const char* const names[] = {"none",
                                      "continues",
                                      "wte",
                                      "wpe",
                                      "ln1_w",
                                      "ln1_b",
                                      "qkv_w",
                                      "qkv_b",
                                      "o_w",
                                      "o_b",
                                      "ln2_w",
                                      "ln2_b",
                                      "fc_w",
                                      "fc_b",
                                      "proj_w",
                                      "proj_b",
                                      "lnf_w",
                                      "lnf_b",
                                      "lm_head",
                                      "q_norm_w",
                                      "k_norm_w",
                                      "post_attn_norm_w",
                                      "post_ffn_norm_w",
                                      "router_w",
                                      "expert_w1",
                                      "expert_w3",
                                      "expert_w2",
                                      "shared_w1",
                                      "shared_w3",
                                      "shared_w2",
                                      "shared_gate_w"};
  return names[static_cast<size_t>(r)];
}

struct ParamSpec {
  std::string name;   // the Hugging Face state-dict name, e.g. "model.layers.0.self_attn.q_proj.weight"
  Shape shape;        // lathe layout: linear weights are [out, in] (nn.Linear)
  size_t offset = 0;  // in floats, into the flat buffers
  Init init = Init::Normal;
  float init_std = 0.02f;
  ShardRule shard = ShardRule::Replicated;
  bool decay = false;          // AdamW/LAMB weight decay applies (matrices yes; biases, norms no)
  bool hf_transposed = false;  // HF stores it transposed (GPT-2 Conv1D keeps [in, out])
  Role role = Role::None;
  int64_t layer = -1;  // decoder layer, -1 for the embedding and the head
  // ShardRule::Column tensors that fuse several projections along dim 0 (GPT-2's c_attn holds
  // q|k|v): the number of equal sections, each split over the tensor-parallel ranks on its own, so
  // that a rank's rows are its heads of q, of k and of v (not the first third of the fused rows).
  int64_t sections = 1;
  // Unequal sections (grouped-query phi3's qkv_proj: H, KV, KV heads): each section's share of
  // dim 0 in units (rows = units[k] x rows / sum(units)); empty = `sections` equal ones.
  std::vector<int64_t> section_units{};
  int64_t numel() const { return lathe::numel(shape); }
  // t.add(...).as(Role::QkvW, i)
  ParamSpec& as(Role r, int64_t layer_index = -1) {
    role = r;
    layer = layer_index;
    return *this;
  }
  ParamSpec& in_sections(int64_t n) {
    sections = n;
    section_units.clear();
    return *this;
  }
  ParamSpec& in_sections(std::vector<int64_t> units) {
    sections = static_cast<int64_t>(units.size());
    section_units = std::move(units);
    return *this;
  }
};

class ParamTable {
 public:
  // Appends a tensor right after the previous one (so tensors added one after another are
  // contiguous: the model relies on this to run q/k/v or gate/up as one GEMM).
  ParamSpec& add(std::string name, Shape shape, Init init, float init_std, ShardRule shard, bool decay,
                 bool hf_transposed = false) {
    LATHE_CHECK(!index_.count(name), "parameter '{}' defined twice in the model's table", name);
    // Shapes come from config.json / recipes: element counts and offsets are checked, so a wrapped
    // product can never make the table disagree with the buffers sized from total().
    int64_t n = 1;
    for (int64_t d : shape) {
      LATHE_CHECK(d >= 0, "parameter '{}': negative dimension {}", name, d);
      n = checked_mul(n, d, fmt::format("parameter '{}' element count", name));
    }
    const int64_t end = checked_add(static_cast<int64_t>(total_), n, "parameter table size");
    ParamSpec p{std::move(name), std::move(shape), total_, init, init_std, shard, decay, hf_transposed};
    total_ = static_cast<size_t>(end);
    index_[p.name] = specs_.size();
    specs_.push_back(std::move(p));
    return specs_.back();
  }
  const std::vector<ParamSpec>& specs() const { return specs_; }
  const ParamSpec* find(const std::string& name) const {
    auto it = index_.find(name);
    return it == index_.end() ? nullptr : &specs_[it->second];
  }
  const ParamSpec& at(const std::string& name) const {
    const ParamSpec* p = find(name);
    LATHE_CHECK(p != nullptr, "internal: no parameter named '{}'", name);
    return *p;
  }
  size_t total() const { return total_; }

  // The flat [begin, end) runs of the tensors `pred(const ParamSpec&)` selects, in table order,
  // adjacent tensors merged into one run: what a rank owns for gradient norms and clipping
  // (parallel/), which tensors a block's backward completes (models/transformer.cpp).
  template <class Pred>
  std::vector<std::pair<size_t, size_t>> ranges(Pred pred) const {
    std::vector<std::pair<size_t, size_t>> out;
    for (const ParamSpec& s : specs_) {
      if (!pred(s)) continue;
      const size_t b = s.offset, e = s.offset + static_cast<size_t>(s.numel());
      if (!out.empty() && out.back().second == b)
        out.back().second = e;
      else
        out.push_back({b, e});
    }
    return out;
  }

 private:
  std::vector<ParamSpec> specs_;
  std::unordered_map<std::string, size_t> index_;
  size_t total_ = 0;
};

}  // namespace lathe
