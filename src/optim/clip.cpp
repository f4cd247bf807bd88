// Gradient norm and clipping: the CPU step kernels (kernels/cpu/step.h), the same functions
// cpu_backend().step_ops() registers.
#include "optim/clip.h"

#include <cmath>

#include "kernels/cpu/step.h"

namespace lathe::optim {

void grad_sq_chunk_sums(const float* grads, size_t n, double* out) { cpu::grad_sq_chunk_sums(grads, n, out); }

double norm_from_chunk_sums(const double* sums, size_t nchunks) { return norm_from_step_chunk_sums(sums, nchunks); }

double global_grad_norm(const float* grads, size_t n) { return cpu::global_grad_norm(grads, n); }

float clip_coefficient(double norm, double max_norm) {
  if (max_norm > 0.0 && std::isfinite(norm) && norm > max_norm) return static_cast<float>(max_norm / (norm + 1e-6));
  return 1.0f;
}

double clip_grad_norm(float* grads, size_t n, double max_norm) {
  const double norm = global_grad_norm(grads, n);
  if (max_norm > 0.0 && std::isfinite(norm) && norm > max_norm)
    cpu::scale_inplace(grads, n, clip_coefficient(norm, max_norm));
  return norm;
}

}  // namespace lathe::optim
