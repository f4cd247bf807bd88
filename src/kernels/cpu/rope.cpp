// Rotary position embedding, HF rotate_half convention (first half / second half of each head).
//
// Tables: the caller computes inv_freq in HF's fp32 steps (config/rope_scaling.cpp: plain RoPE
//   inv_freq = 1.0 / (theta ** (arange(0, D, 2).float() / D)), or a scaled kind); here
// angle = t.float() * inv_freq (HF's fp32 product) and cos/sin of that float angle are evaluated in
// double before rounding (then times the attention factor in fp32, as HF). The tables then agree with HF's to about one ulp, where an
// "exact" double angle would differ from HF by up to half an ulp of t (~1e-4 at t = 2048).
// With positions (documents restarting at 0) row (b,t) reads table row positions[b,t] instead of t.
// Partial rotary: only the first `rot` dims of each head of D rotate (pairs (i, i + rot/2)); the
// rest pass through. The rotation is one template for every storage type (kernels/cpu/storage.h): a 16-bit head is
// widened, rotated in fp32 and rounded once.
#include <cmath>

#include "kernels/cpu/op_slots.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/storage.h"

namespace lathe::cpu {

namespace {
// Rows are independent; each table keeps the threshold it had.
template <class S>
constexpr int64_t kParallelMin = S::kFp32 ? 1 << 14 : 1 << 15;
}  // namespace

void rope_tables(float* cos_table, float* sin_table, int64_t T, int64_t half, const float* inv_freq,
                 float attention_factor) {
  for (int64_t i = 0; i < half; ++i) {
    for (int64_t t = 0; t < T; ++t) {
      const float angle = static_cast<float>(t) * inv_freq[i];  // one fp32 rounding, as torch's outer()
      float c = static_cast<float>(std::cos(static_cast<double>(angle)));
      float s = static_cast<float>(std::sin(static_cast<double>(angle)));
      if (attention_factor != 1.0f) {  // transformers: cos * attention_scaling in fp32
        c *= attention_factor;
        s *= attention_factor;
      }
      cos_table[t * half + i] = c;
      sin_table[t * half + i] = s;
    }
  }
}

namespace {

// sin_table sign: forward rotates by +angle, backward (the transpose) by -angle.
template <class S, bool kForward>
void rotate(void* x_v, const float* cos_table, const float* sin_table, int64_t B, int64_t T, int64_t n_heads, int64_t D,
            int64_t rot, int64_t row_stride, const int32_t* positions) {
  const int64_t half = rot / 2;
  const int64_t rows = B * T;
  auto* x = as<S>(x_v);
#pragma omp parallel if (rows * n_heads * D >= kParallelMin<S>)
  {
    float* vb = work_row<S>(0, static_cast<size_t>(rot));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t t = positions ? positions[r] : r % T;
      const float* __restrict cs = cos_table + t * half;
      const float* __restrict sn = sin_table + t * half;
      for (int64_t h = 0; h < n_heads; ++h) {
        typename S::T* head = x + r * row_stride + h * D;
        float* __restrict x1 = update_row<S>(vb, head, 2 * half);
        float* __restrict x2 = x1 + half;
        for (int64_t i = 0; i < half; ++i) {
          const float a = x1[i], b = x2[i];
          if constexpr (kForward) {  // x1' = x1 cos - x2 sin;  x2' = x2 cos + x1 sin
            x1[i] = a * cs[i] - b * sn[i];
            x2[i] = b * cs[i] + a * sn[i];
          } else {  // the transpose: dx1 = g1 cos + g2 sin;  dx2 = g2 cos - g1 sin
            x1[i] = a * cs[i] + b * sn[i];
            x2[i] = b * cs[i] - a * sn[i];
          }
        }
        write_row<S>(head, x1, 2 * half);
      }
    }
  }
}

}  // namespace

void rope_forward(float* x, const float* cos_table, const float* sin_table, int64_t B, int64_t T, int64_t n_heads,
                  int64_t D, int64_t rot, int64_t row_stride, const int32_t* positions) {
  rotate<F32, true>(x, cos_table, sin_table, B, T, n_heads, D, rot, row_stride, positions);
}

void rope_backward(float* dx, const float* cos_table, const float* sin_table, int64_t B, int64_t T, int64_t n_heads,
                   int64_t D, int64_t rot, int64_t row_stride, const int32_t* positions) {
  rotate<F32, false>(dx, cos_table, sin_table, B, T, n_heads, D, rot, row_stride, positions);
}

template <class S>
void add_rope(Ops& o) {
  o.rope_tables = rope_tables;  // fp32 tables in every dtype
  o.rope_forward = rotate<S, true>;
  o.rope_backward = rotate<S, false>;
}
LATHE_CPU_ADD_SLOTS(add_rope)

}  // namespace lathe::cpu
