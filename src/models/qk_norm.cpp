// The q / k norms between the q|k|v GEMM and RoPE, forward and backward: Qwen3's per-head RMSNorm
// (Arch::qk_norm, weights [D] replicated over tensor ranks) and OLMo 2's RMSNorm over each token's
// whole q and k projections (Arch::qk_norm_full; its tensor-parallel form is models/olmo2.cpp's).
#include "models/model.h"

namespace lathe {

void Model::qk_norm_forward(int64_t l, int64_t N) {
  const int64_t H = cfg_.num_attention_heads, KV = cfg_.num_key_value_heads, D = cfg_.head_dim(), Q = (H + 2 * KV) * D;
  const float eps = static_cast<float>(cfg_.norm_eps);
  const LayerPtrs& w = p_.layers[static_cast<size_t>(l)];
  LayerActs& a = la_[static_cast<size_t>(l)];
  if (arch_.qk_norm_full && shard_.parts > 1) {  // olmo2, this rank's heads (models/olmo2.cpp)
    const int64_t tp = shard_.parts;
    qk_norm_full_tp_forward(a.qkv, a.qk_saved, a.qk_rstd, w.q_norm_w, N, H * D, tp * H * D, Q);
    qk_norm_full_tp_forward(act_at(a.qkv, H * D), act_at(a.qk_saved, N * H * D), a.qk_rstd + N, w.k_norm_w, N, KV * D,
                            tp * KV * D, Q);
    return;
  }
  if (arch_.qk_norm_full) {  // olmo2: one row of H*D (q) and one of KV*D (k) per token
    ops_->head_rmsnorm_forward(a.qkv, a.qk_saved, a.qk_rstd, w.q_norm_w, N, 1, H * D, Q, eps);
    ops_->head_rmsnorm_forward(act_at(a.qkv, H * D), act_at(a.qk_saved, N * H * D), a.qk_rstd + N, w.k_norm_w, N, 1,
                               KV * D, Q, eps);
    return;
  }
  ops_->head_rmsnorm_forward(a.qkv, a.qk_saved, a.qk_rstd, w.q_norm_w, N, H, D, Q, eps);
  ops_->head_rmsnorm_forward(act_at(a.qkv, H * D), act_at(a.qk_saved, N * H * D), a.qk_rstd + N * H, w.k_norm_w, N, KV,
                             D, Q, eps);
}

void Model::qk_norm_backward(int64_t l, int64_t N) {
  const int64_t H = cfg_.num_attention_heads, KV = cfg_.num_key_value_heads, D = cfg_.head_dim(), Q = (H + 2 * KV) * D;
  const LayerPtrs& w = p_.layers[static_cast<size_t>(l)];
  const LayerPtrs& gw = g_.layers[static_cast<size_t>(l)];
  LayerActs& a = la_[static_cast<size_t>(l)];
  if (arch_.qk_norm_full && shard_.parts > 1) {  // olmo2, this rank's heads (models/olmo2.cpp)
    const int64_t tp = shard_.parts;
    qk_norm_full_tp_backward(dqkv_, gw.q_norm_w, a.qk_saved, w.q_norm_w, a.qk_rstd, N, H * D, tp * H * D, Q);
    qk_norm_full_tp_backward(act_at(dqkv_, H * D), gw.k_norm_w, act_at(a.qk_saved, N * H * D), w.k_norm_w,
                             a.qk_rstd + N, N, KV * D, tp * KV * D, Q);
    return;
  }
  if (arch_.qk_norm_full) {  // olmo2, one process
    ops_->head_rmsnorm_backward(dqkv_, gw.q_norm_w, a.qk_saved, w.q_norm_w, a.qk_rstd, N, 1, H * D, Q, scratch_);
    ops_->head_rmsnorm_backward(act_at(dqkv_, H * D), gw.k_norm_w, act_at(a.qk_saved, N * H * D), w.k_norm_w,
                                a.qk_rstd + N, N, 1, KV * D, Q, scratch_);
    return;
  }
  // Tensor parallel: this rank's heads give a partial sum of the replicated weights' gradients,
  // summed over the group (rank order) before it is added once; whole: straight into the gradients.
  const bool tp = hooks_.tp.tensor_parallel();
  LATHE_CHECK(!tp || backend_->device() == DeviceKind::Host,
              "tensor parallelism with q/k norms (qwen3) runs on host memory only for now (the {} backend's model is "
              "in device memory); set parallel.tensor: 1",
              backend_->name());
  LATHE_CHECK(!tp || hooks_.tp.comm.all_reduce_f32 != nullptr,
              "model: q/k norms under tensor parallelism need StepHooks::tp.comm.all_reduce_f32 "
              "(parallel::attach_tensor_parallel installs it)");
  if (tp) norm_acc_.assign(static_cast<size_t>(2 * D), 0.0f);
  float* dq = tp ? norm_acc_.data() : gw.q_norm_w;
  float* dk = tp ? norm_acc_.data() + D : gw.k_norm_w;
  ops_->head_rmsnorm_backward(dqkv_, dq, a.qk_saved, w.q_norm_w, a.qk_rstd, N, H, D, Q, scratch_);
  ops_->head_rmsnorm_backward(act_at(dqkv_, H * D), dk, act_at(a.qk_saved, N * H * D), w.k_norm_w, a.qk_rstd + N * H, N,
                              KV, D, Q, scratch_);
  if (!tp) return;
  hooks_.tp.comm.all_reduce_f32(norm_acc_.data(), 2 * D);
  for (int64_t c = 0; c < D; ++c) {
    gw.q_norm_w[c] += norm_acc_[static_cast<size_t>(c)];
    gw.k_norm_w[c] += norm_acc_[static_cast<size_t>(D + c)];
  }
}

}  // namespace lathe
