// RMSNorm as HF LlamaRMSNorm: out = weight * (x * rsqrt(mean(x^2) + eps)).
//   forward:  out[N,C], rstd[N] saved for backward.
//   backward: with xhat = x * rstd and dxhat = dout * weight,
//             dinp[N,C] += rstd * (dxhat - xhat * mean(dxhat * xhat)),  dweight[C] += sum_n dout * xhat.
// One template per kernel for every storage type (kernels/cpu/storage.h), as layernorm.cpp.
// Parameter-gradient partials per reduction part (core/parallel.h) in the caller's scratch,
// combined in part order: the sums depend on the number of parts, not on the thread count.
#include <omp.h>

#include <algorithm>
#include <cmath>

#include "core/parallel.h"
#include "kernels/cpu/op_slots.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/storage.h"

namespace lathe::cpu {

namespace {

// o[C] = weight * (x * rstd) (HF's order), *rstd = 1 / sqrt(mean(x^2) + eps).
inline void rmsnorm_row(float* __restrict o, float* rstd, const float* __restrict x, const float* weight, int64_t C,
                        float eps) {
  const float inv_c = 1.0f / static_cast<float>(C);
  float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
  for (int64_t c = 0; c < C; ++c) ss += x[c] * x[c];
  const float r = 1.0f / std::sqrt(ss * inv_c + eps);
  for (int64_t c = 0; c < C; ++c) o[c] = weight[c] * (x[c] * r);
  *rstd = r;
}

// As layernorm.cpp: one thread below this many elements; the 16-bit tables fork later.
template <class S>
constexpr int64_t kParallelMin = S::kFp32 ? 1 << 14 : 1 << 15;

// Scratch: per reduction part C partial dweight, then (16-bit storage) per thread 3C widened rows;
// scratch_slots() covers both counts.
template <class S>
size_t scratch_floats(int64_t C) {
  return static_cast<size_t>((S::kFp32 ? 1 : 4) * C * scratch_slots());
}
template <class S>
size_t scratch_bytes(int64_t C) {
  return scratch_floats<S>(C) * sizeof(float);
}

// dweight[c] += the parts' partials (scratch[p][c], p < parts) summed in part order; called inside
// a parallel region, whose threads split the columns.
inline void add_parts(float* dweight, const float* scratch, int64_t parts, int64_t C) {
#pragma omp for schedule(static)
  for (int64_t c = 0; c < C; ++c) {
    float sw = 0.0f;
    for (int64_t p = 0; p < parts; ++p) sw += scratch[p * C + c];
    dweight[c] += sw;
  }
}

template <class S>
void forward(void* out_v, float* rstd, const void* inp_v, const float* weight, int64_t N, int64_t C, float eps) {
  const auto* inp = as<S>(inp_v);
  auto* out = as<S>(out_v);
#pragma omp parallel if (N * C >= kParallelMin <S>)
  {
    float* x = work_row<S>(0, static_cast<size_t>(C));
    float* o = work_row<S>(1, static_cast<size_t>(C));
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      float* on = out_row<S>(o, out + n * C);
      rmsnorm_row(on, rstd + n, read_row<S>(x, inp + n * C, C), weight, C, eps);
      write_row<S>(out + n * C, on, C);
    }
  }
}

template <class S>
void backward(void* dinp_v, float* dweight, const void* dout_v, const void* inp_v, const float* weight,
              const float* rstd, int64_t N, int64_t C, void* scratch_v) {
  const float inv_c = 1.0f / static_cast<float>(C);
  float* scratch = static_cast<float*>(scratch_v);
  const int64_t parts = reduction_parts(), slots = scratch_slots();
  const auto *dout = as<S>(dout_v), *inp = as<S>(inp_v);
  auto* dinp = as<S>(dinp_v);
#pragma omp parallel if (N * C >= kParallelMin <S>)
  {
    // The widened rows of a 16-bit table (unused by F32, whose rows are read in place).
    float* rows = S::kFp32 ? scratch : scratch + slots * C + omp_get_thread_num() * 3 * C;
    // Part p sums rows [N p / parts, N (p + 1) / parts) into scratch[p][0:C], whichever thread runs it.
#pragma omp for schedule(static)
    for (int64_t p = 0; p < parts; ++p) {
      float* __restrict pw = scratch + p * C;
      for (int64_t c = 0; c < C; ++c) pw[c] = 0.0f;
      const int64_t n0 = N * p / parts, n1 = N * (p + 1) / parts;
      for (int64_t n = n0; n < n1; ++n) {
        const float* __restrict x = read_row<S>(rows, inp + n * C, C);
        const float* __restrict g = read_row<S>(rows + C, dout + n * C, C);
        float* __restrict dx = update_row<S>(rows + 2 * C, dinp + n * C, C);
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
        write_row<S>(dinp + n * C, dx, C);
      }
    }  // implicit barrier: every partial is complete
    add_parts(dweight, scratch, parts, C);
  }
}

// Per-head RMSNorm (Qwen3's q_norm / k_norm: each head's D features normalised, one weight[D]
// shared by the heads), in place on rows that are not contiguous: row (n, h), n < N tokens,
// h < heads, is at x + n * stride + h * D (the q or k block of a fused qkv row). The arithmetic of
// each row is rmsnorm_row's.
//   forward:  saved[(n * heads + h) * D, +D) = the row (backward's x), then row = weight * xhat.
//   backward: the rows hold d(out) and are overwritten with d(in); dweight[D] += sum dout * xhat.
template <class S>
void head_forward(void* x_v, void* saved_v, float* rstd, const float* weight, int64_t N, int64_t heads, int64_t D,
                  int64_t stride, float eps) {
  auto* x = as<S>(x_v);
  auto* saved = as<S>(saved_v);
  const int64_t rows = N * heads;
#pragma omp parallel if (rows * D >= kParallelMin <S>)
  {
    float* xw = thread_rows(0, static_cast<size_t>(D));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      typename S::T* row = x + (r / heads) * stride + (r % heads) * D;
      std::copy(row, row + D, saved + r * D);
      // fp32: the row is read from its saved copy and written in place; 16-bit: widened first.
      const float* xf = read_row<S>(xw, saved + r * D, D);
      float* o = out_row<S>(thread_rows(1, static_cast<size_t>(D)), row);
      rmsnorm_row(o, rstd + r, xf, weight, D, eps);
      write_row<S>(row, o, D);
    }
  }
}

template <class S>
void head_backward(void* dx_v, float* dweight, const void* saved_v, const float* weight, const float* rstd, int64_t N,
                   int64_t heads, int64_t D, int64_t stride, void* scratch_v) {
  const float inv_d = 1.0f / static_cast<float>(D);
  float* scratch = static_cast<float*>(scratch_v);
  const int64_t parts = reduction_parts(), slots = scratch_slots(), rows = N * heads;
  auto* dx = as<S>(dx_v);
  const auto* saved = as<S>(saved_v);
#pragma omp parallel if (rows * D >= kParallelMin <S>)
  {
    float* work = scratch + slots * D + omp_get_thread_num() * 3 * D;  // x, dout as fp32, dx
    // Part p sums rows [rows p / parts, rows (p + 1) / parts) into scratch[p][0:D].
#pragma omp for schedule(static)
    for (int64_t p = 0; p < parts; ++p) {
      float* __restrict pw = scratch + p * D;
      for (int64_t c = 0; c < D; ++c) pw[c] = 0.0f;
      const int64_t r0 = rows * p / parts, r1 = rows * (p + 1) / parts;
      for (int64_t r = r0; r < r1; ++r) {
        typename S::T* row = dx + (r / heads) * stride + (r % heads) * D;
        const float* __restrict x = read_row<S>(work, saved + r * D, D);
        float* __restrict g = work + D;  // a copy: the row is overwritten below
        if constexpr (S::kFp32)
          std::copy(row, row + D, g);
        else
          S::to_f32(g, row, D);
        float* __restrict d = out_row<S>(work + 2 * D, row);
        const float rs = rstd[r];
        float s = 0.0f;  // sum of dxhat * xhat
#pragma omp simd reduction(+ : s)
        for (int64_t c = 0; c < D; ++c) {
          const float xhat = x[c] * rs;
          s += g[c] * weight[c] * xhat;
          pw[c] += g[c] * xhat;
        }
        const float b = s * inv_d;
        for (int64_t c = 0; c < D; ++c) d[c] = (g[c] * weight[c] - x[c] * rs * b) * rs;
        write_row<S>(row, d, D);
      }
    }  // implicit barrier
    add_parts(dweight, scratch, parts, D);
  }
}

size_t head_scratch_bytes(int64_t D) { return static_cast<size_t>(4 * D * scratch_slots()) * sizeof(float); }

}  // namespace

size_t rmsnorm_scratch_floats(int64_t C) { return scratch_floats<F32>(C); }

void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, int64_t N, int64_t C, float eps) {
  forward<F32>(out, rstd, inp, weight, N, C, eps);
}

void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp, const float* weight,
                      const float* rstd, int64_t N, int64_t C, float* scratch) {
  backward<F32>(dinp, dweight, dout, inp, weight, rstd, N, C, scratch);
}

template <class S>
void add_rmsnorm(Ops& o) {
  o.rmsnorm_forward = forward<S>;
  o.rmsnorm_backward = backward<S>;
  o.rmsnorm_scratch_bytes = scratch_bytes<S>;
  o.head_rmsnorm_forward = head_forward<S>;
  o.head_rmsnorm_backward = head_backward<S>;
  o.head_rmsnorm_scratch_bytes = head_scratch_bytes;
}
LATHE_CPU_ADD_SLOTS(add_rmsnorm)

}  // namespace lathe::cpu
