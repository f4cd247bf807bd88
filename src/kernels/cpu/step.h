// The CPU backend's training-step ops (kernels/step_ops.h), over host buffers: the one
// implementation of optim/'s AdamW, LAMB and gradient norm (optim/ calls these), registered as
// cpu_backend().step_ops(). OpenMP over the chunks of step_ops.h; results do not depend on the
// thread count.
#pragma once
#include "kernels/step_ops.h"

namespace lathe::cpu {

// AdamW with exactly torch.optim.AdamW's (foreach=False) arithmetic, fp32 state:
//   p *= 1 - lr*wd                       (decoupled decay, ranges with decay=true only)
//   m  = beta1*m + (1-beta1)*g
//   v  = beta2*v + (1-beta2)*g*g
//   p -= lr/(1-beta1^t) * m / (sqrt(v)/sqrt(1-beta2^t) + eps)
// The scalar factors are computed in double and rounded to float once, as torch does with Python
// scalars applied to float tensors.
void adamw_step(float* params, const float* grads, float* m, float* v, std::span<const StepRange> ranges,
                const StepHyper& hyper, double lr, int64_t step, float grad_scale);

// LAMB (You et al. 2019), as NVIDIA apex FusedLAMB computes it (adam_w_mode, grad_averaging, no
// global grad-norm pre-scaling), per parameter tensor (one range, or one tensor id under a gather):
//   m = beta1*m + (1-beta1)*g;  v = beta2*v + (1-beta2)*g*g
//   u = (m/(1-beta1^t)) / (sqrt(v/(1-beta2^t)) + eps) + wd*p        (wd only if decay)
//   trust = ||p|| / ||u||   (1 if either norm is 0)
//   p -= lr * trust * u
// Unlike apex (which uses trust = 1 for tensors without weight decay unless use_nvlamb), the trust
// ratio applies to every tensor. Norms are accumulated in double per chunk and summed in chunk
// order. With a gather every range needs a tensor id (throws naming the range otherwise).
void lamb_step(float* params, const float* grads, float* m, float* v, std::span<const StepRange> ranges,
               const StepHyper& hyper, double lr, int64_t step, float grad_scale, const StepChunkSumsGather& gather);

void grad_sq_chunk_sums(const float* grads, size_t n, double* out);
double global_grad_norm(const float* grads, size_t n);
bool has_non_finite(const float* x, size_t n);
void scale_inplace(float* x, size_t n, float s);

// The table of the functions above (device_index: -1).
const StepOps& step_ops();

}  // namespace lathe::cpu
