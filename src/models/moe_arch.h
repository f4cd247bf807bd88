// The Arch of a Llama-shaped mixture-of-experts body (RMSNorm, RoPE, SwiGLU experts, no o/MLP
// biases) with the routing options read from the config: shared by build_mixtral (moe_layer.cpp)
// and build_qwen2_moe (moe_shared.cpp), which differ only in the q/k/v biases and the shared expert.
#pragma once

#include "models/model.h"

namespace lathe {

inline Arch moe_llama_arch(const ModelConfig& cfg, int64_t experts, bool qkv_bias, int64_t shared_width) {
  Arch arch;
  arch.layernorm = false;
  arch.learned_pos = false;
  arch.gelu_mlp = false;
  arch.qkv_bias = qkv_bias;
  arch.o_bias = false;
  arch.mlp_bias = false;
  arch.tied_lm_head = cfg.tie_word_embeddings;
  arch.moe_experts = experts;
  arch.moe_top_k = cfg.num_experts_per_tok;
  arch.moe_renormalize = cfg.norm_topk_prob;
  arch.moe_aux_loss_coef = static_cast<float>(cfg.moe_aux_coef());
  arch.moe_z_loss_coef = static_cast<float>(cfg.router_z_loss_coef);
  arch.moe_shared_width = shared_width;
  return arch;
}

}  // namespace lathe
