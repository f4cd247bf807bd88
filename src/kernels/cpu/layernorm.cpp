// LayerNorm as torch.nn.LayerNorm: biased variance, eps inside the square root.
//   forward:  out[N,C] = (inp - mean) * rstd * weight + bias; mean[N], rstd[N] saved for backward.
//   backward: dinp[N,C] += ..., dweight[C] += sum_n dout * xhat, dbias[C] += sum_n dout.
//
// Rows are split among threads in fixed contiguous ranges. The parameter-gradient sums over rows
// go to per-thread partials in the caller's scratch, then are combined in thread order, so the
// result is deterministic for a fixed thread count.
#include <omp.h>

#include <cmath>

#include "kernels/cpu/norm_rows.h"
#include "kernels/cpu/ops.h"

namespace lathe::cpu {

namespace {
constexpr int64_t kParallelMin = 1 << 14;
}  // namespace

size_t layernorm_scratch_floats(int64_t C) { return static_cast<size_t>(2 * C * omp_get_max_threads()); }

void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight, const float* bias,
                       int64_t N, int64_t C, float eps) {
#pragma omp parallel for schedule(static) if (N * C >= kParallelMin)
  for (int64_t n = 0; n < N; ++n) layernorm_row(out + n * C, mean + n, rstd + n, inp + n * C, weight, bias, C, eps);
}

void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                        const float* weight, const float* mean, const float* rstd, int64_t N, int64_t C,
                        float* scratch) {
  const float inv_c = 1.0f / static_cast<float>(C);
#pragma omp parallel if (N * C >= kParallelMin)
  {
    const int64_t nt = omp_get_num_threads(), tid = omp_get_thread_num();
    // scratch[tid][0:C] = partial dweight, scratch[tid][C:2C] = partial dbias.
    float* __restrict pw = scratch + tid * 2 * C;
    float* __restrict pb = pw + C;
    for (int64_t c = 0; c < 2 * C; ++c) pw[c] = 0.0f;
    const int64_t n0 = N * tid / nt, n1 = N * (tid + 1) / nt;
    for (int64_t n = n0; n < n1; ++n) {
      const float* __restrict x = inp + n * C;
      const float* __restrict g = dout + n * C;
      float* __restrict dx = dinp + n * C;
      const float m = mean[n], r = rstd[n];
      // dxhat = g * w;  dx = r * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat))
      float sum_dxhat = 0.0f, sum_dxhat_xhat = 0.0f;
#pragma omp simd reduction(+ : sum_dxhat, sum_dxhat_xhat)
      for (int64_t c = 0; c < C; ++c) {
        const float xhat = (x[c] - m) * r;
        const float dxhat = g[c] * weight[c];
        sum_dxhat += dxhat;
        sum_dxhat_xhat += dxhat * xhat;
        pw[c] += g[c] * xhat;
        pb[c] += g[c];
      }
      const float a = sum_dxhat * inv_c, b = sum_dxhat_xhat * inv_c;
      for (int64_t c = 0; c < C; ++c) {
        const float xhat = (x[c] - m) * r;
        dx[c] += (g[c] * weight[c] - a - xhat * b) * r;
      }
    }
#pragma omp barrier
    // Combine partials in thread order; threads split the columns.
    const int64_t c0 = C * tid / nt, c1 = C * (tid + 1) / nt;
    for (int64_t c = c0; c < c1; ++c) {
      float sw = 0.0f, sb = 0.0f;
      for (int64_t t = 0; t < nt; ++t) {
        sw += scratch[t * 2 * C + c];
        sb += scratch[t * 2 * C + C + c];
      }
      dweight[c] += sw;
      if (dbias != nullptr) dbias[c] += sb;
    }
  }
}

}  // namespace lathe::cpu
