// RMSNorm as HF LlamaRMSNorm: out = weight * (x * rsqrt(mean(x^2) + eps)).
//   forward:  out[N,C], rstd[N] saved for backward.
//   backward: with xhat = x * rstd and dxhat = dout * weight,
//             dinp[N,C] += rstd * (dxhat - xhat * mean(dxhat * xhat)),  dweight[C] += sum_n dout * xhat.
// Parameter-gradient partials per thread in the caller's scratch, combined in thread order
// (deterministic for a fixed thread count).
#include <omp.h>

#include <cmath>

#include "kernels/cpu/norm_rows.h"
#include "kernels/cpu/ops.h"

namespace lathe::cpu {

namespace {
constexpr int64_t kParallelMin = 1 << 14;
}  // namespace

size_t rmsnorm_scratch_floats(int64_t C) { return static_cast<size_t>(C * omp_get_max_threads()); }

void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, int64_t N, int64_t C, float eps) {
#pragma omp parallel for schedule(static) if (N * C >= kParallelMin)
  for (int64_t n = 0; n < N; ++n) rmsnorm_row(out + n * C, rstd + n, inp + n * C, weight, C, eps);
}

void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp, const float* weight,
                      const float* rstd, int64_t N, int64_t C, float* scratch) {
  const float inv_c = 1.0f / static_cast<float>(C);
#pragma omp parallel if (N * C >= kParallelMin)
  {
    const int64_t nt = omp_get_num_threads(), tid = omp_get_thread_num();
    float* __restrict pw = scratch + tid * C;  // partial dweight of this thread
    for (int64_t c = 0; c < C; ++c) pw[c] = 0.0f;
    const int64_t n0 = N * tid / nt, n1 = N * (tid + 1) / nt;
    for (int64_t n = n0; n < n1; ++n) {
      const float* __restrict x = inp + n * C;
      const float* __restrict g = dout + n * C;
      float* __restrict dx = dinp + n * C;
      const float r = rstd[n];
      float s = 0.0f;  // sum of dxhat * xhat
#pragma omp simd reduction(+ : s)
      for (int64_t c = 0; c < C; ++c) {
        const float xhat = x[c] * r;
        s += g[c] * weight[c] * xhat;
        pw[c] += g[c] * xhat;
      }
      const float b = s * inv_c;
      for (int64_t c = 0; c < C; ++c) dx[c] += (g[c] * weight[c] - x[c] * r * b) * r;
    }
#pragma omp barrier
    const int64_t c0 = C * tid / nt, c1 = C * (tid + 1) / nt;
    for (int64_t c = c0; c < c1; ++c) {
      float sw = 0.0f;
      for (int64_t t = 0; t < nt; ++t) sw += scratch[t * C + c];
      dweight[c] += sw;
    }
  }
}

}  // namespace lathe::cpu
