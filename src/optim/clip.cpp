#include "optim/clip.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "optim/chunks.h"

namespace lathe::optim {

void grad_sq_chunk_sums(const float* grads, size_t n, double* out) {
  const int64_t nchunks = static_cast<int64_t>((n + kChunk - 1) / kChunk);
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < nchunks; ++c) {
    const size_t b = static_cast<size_t>(c) * kChunk, e = std::min(b + kChunk, n);
    double s = 0.0;
#pragma omp simd reduction(+ : s)
    for (size_t i = b; i < e; ++i) s += static_cast<double>(grads[i]) * grads[i];
    out[static_cast<size_t>(c)] = s;
  }
}

double norm_from_chunk_sums(const double* sums, size_t nchunks) {
  double total = 0.0;
  for (size_t c = 0; c < nchunks; ++c) total += sums[c];
  return std::sqrt(total);
}

double global_grad_norm(const float* grads, size_t n) {
  std::vector<double> partial((n + kChunk - 1) / kChunk);
  grad_sq_chunk_sums(grads, n, partial.data());
  return norm_from_chunk_sums(partial.data(), partial.size());
}

float clip_coefficient(double norm, double max_norm) {
  if (max_norm > 0.0 && std::isfinite(norm) && norm > max_norm) return static_cast<float>(max_norm / (norm + 1e-6));
  return 1.0f;
}

double clip_grad_norm(float* grads, size_t n, double max_norm) {
  const double norm = global_grad_norm(grads, n);
  if (max_norm > 0.0 && std::isfinite(norm) && norm > max_norm) {
    const float scale = clip_coefficient(norm, max_norm);
    const int64_t nn = static_cast<int64_t>(n);
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < nn; ++i) grads[i] *= scale;
  }
  return norm;
}

}  // namespace lathe::optim
