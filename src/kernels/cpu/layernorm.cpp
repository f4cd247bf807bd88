// LayerNorm as torch.nn.LayerNorm: biased variance, eps inside the square root.
//   forward:  out[N,C] = (inp - mean) * rstd * weight + bias; mean[N], rstd[N] saved for backward.
//   backward: dinp[N,C] += ..., dweight[C] += sum_n dout * xhat, dbias[C] += sum_n dout.
// One template per kernel for every storage type (kernels/cpu/storage.h): 16-bit rows are widened
// to fp32, the statistics, parameter gradients and the dinp sum are fp32, outputs rounded once.
//
// The parameter-gradient sums over rows go to reduction_parts() partials (fixed contiguous row
// ranges, core/parallel.h) in the caller's scratch, then are combined in part order, so the result
// depends on the number of parts, not on how many threads share them.
#include <omp.h>

#include <cmath>

#include "core/parallel.h"
#include "kernels/cpu/op_slots.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/storage.h"

namespace lathe::cpu {

namespace {

// o[C] = (x - mean) * rstd * weight (+ bias); *mean, *rstd of x. Two passes (mean, then centred
// sum of squares): no cancellation, and both vectorise. omp simd reduction lets the compiler
// reassociate the float sums; the order is still fixed for a given build.
inline void layernorm_row(float* __restrict o, float* mean, float* rstd, const float* __restrict x, const float* weight,
                          const float* bias, int64_t C, float eps) {
  const float inv_c = 1.0f / static_cast<float>(C);
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t c = 0; c < C; ++c) s += x[c];
  const float m = s * inv_c;
  float v = 0.0f;
#pragma omp simd reduction(+ : v)
  for (int64_t c = 0; c < C; ++c) {
    const float d = x[c] - m;
    v += d * d;
  }
  const float r = 1.0f / std::sqrt(v * inv_c + eps);
  if (bias != nullptr) {
    for (int64_t c = 0; c < C; ++c) o[c] = (x[c] - m) * r * weight[c] + bias[c];
  } else {
    for (int64_t c = 0; c < C; ++c) o[c] = (x[c] - m) * r * weight[c];
  }
  *mean = m;
  *rstd = r;
}

// Below this many elements one thread does the work (the sums are the same either way: the parts
// decide them). The 16-bit tables, which also widen and round, fork later.
template <class S>
constexpr int64_t kParallelMin = S::kFp32 ? 1 << 14 : 1 << 15;

// Scratch: per reduction part 2C partial parameter gradients, then (16-bit storage) per thread 3C
// widened rows (x, dout, dinp); scratch_slots() covers both counts.
template <class S>
size_t scratch_floats(int64_t C) {
  return static_cast<size_t>((S::kFp32 ? 2 : 5) * C * scratch_slots());
}
template <class S>
size_t scratch_bytes(int64_t C) {
  return scratch_floats<S>(C) * sizeof(float);
}

template <class S>
void forward(void* out_v, float* mean, float* rstd, const void* inp_v, const float* weight, const float* bias,
             int64_t N, int64_t C, float eps) {
  const auto* inp = as<S>(inp_v);
  auto* out = as<S>(out_v);
#pragma omp parallel if (N * C >= kParallelMin<S>)
  {
    float* x = work_row<S>(0, static_cast<size_t>(C));
    float* o = work_row<S>(1, static_cast<size_t>(C));
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      float* on = out_row<S>(o, out + n * C);
      layernorm_row(on, mean + n, rstd + n, read_row<S>(x, inp + n * C, C), weight, bias, C, eps);
      write_row<S>(out + n * C, on, C);
    }
  }
}

template <class S>
void backward(void* dinp_v, float* dweight, float* dbias, const void* dout_v, const void* inp_v, const float* weight,
              const float* mean, const float* rstd, int64_t N, int64_t C, void* scratch_v) {
  const float inv_c = 1.0f / static_cast<float>(C);
  float* scratch = static_cast<float*>(scratch_v);
  const int64_t parts = reduction_parts(), slots = scratch_slots();
  const auto *dout = as<S>(dout_v), *inp = as<S>(inp_v);
  auto* dinp = as<S>(dinp_v);
#pragma omp parallel if (N * C >= kParallelMin<S>)
  {
    // The widened rows of a 16-bit table (unused by F32, whose rows are read in place).
    float* rows = S::kFp32 ? scratch : scratch + slots * 2 * C + omp_get_thread_num() * 3 * C;
    // Part p sums rows [N p / parts, N (p + 1) / parts) into scratch[p][0:C] (dweight) and
    // scratch[p][C:2C] (dbias), whichever thread runs it.
#pragma omp for schedule(static)
    for (int64_t p = 0; p < parts; ++p) {
      float* __restrict pw = scratch + p * 2 * C;
      float* __restrict pb = pw + C;
      for (int64_t c = 0; c < 2 * C; ++c) pw[c] = 0.0f;
      const int64_t n0 = N * p / parts, n1 = N * (p + 1) / parts;
      for (int64_t n = n0; n < n1; ++n) {
        const float* __restrict x = read_row<S>(rows, inp + n * C, C);
        const float* __restrict g = read_row<S>(rows + C, dout + n * C, C);
        float* __restrict dx = update_row<S>(rows + 2 * C, dinp + n * C, C);
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
        write_row<S>(dinp + n * C, dx, C);
      }
    }  // implicit barrier: every partial is complete
    // Combine the partials in part order; threads split the columns.
#pragma omp for schedule(static)
    for (int64_t c = 0; c < C; ++c) {
      float sw = 0.0f, sb = 0.0f;
      for (int64_t p = 0; p < parts; ++p) {
        sw += scratch[p * 2 * C + c];
        sb += scratch[p * 2 * C + C + c];
      }
      dweight[c] += sw;
      if (dbias != nullptr) dbias[c] += sb;
    }
  }
}

}  // namespace

size_t layernorm_scratch_floats(int64_t C) { return scratch_floats<F32>(C); }

void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight, const float* bias,
                       int64_t N, int64_t C, float eps) {
  forward<F32>(out, mean, rstd, inp, weight, bias, N, C, eps);
}

void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                        const float* weight, const float* mean, const float* rstd, int64_t N, int64_t C,
                        float* scratch) {
  backward<F32>(dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C, scratch);
}

template <class S>
void add_layernorm(Ops& o) {
  o.layernorm_forward = forward<S>;
  o.layernorm_backward = backward<S>;
  o.layernorm_scratch_bytes = scratch_bytes<S>;
}
LATHE_CPU_ADD_SLOTS(add_layernorm)

}  // namespace lathe::cpu
