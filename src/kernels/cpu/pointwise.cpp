// Pointwise ops: GELU (tanh approximation), SwiGLU, residual add.
//
// libm's expf/tanhf do not vectorise without -ffast-math, and a scalar tanhf over the [N, 4C] MLP
// activation costs a sizeable fraction of the surrounding GEMM. exp_vec below is a branch-free
// Cephes-style expf (Cody-Waite range reduction + degree-6 polynomial, ~2 ulp on the clamped
// range) that GCC vectorises; GELU and SiLU are written in terms of a sigmoid built on it:
//   gelu(x)  = 0.5 x (1 + tanh(u)) = x * sigmoid(2u),  u = sqrt(2/pi) (x + 0.044715 x^3)
//   gelu'(x) = sg + 2 x sg (1 - sg) u'(x),              sg = sigmoid(2u)
//   silu(g)  = g * sigmoid(g),  silu'(g) = sigmoid(g) (1 + g (1 - sigmoid(g)))
// The sigmoid form avoids the cancellation of 1 + tanh(u) for negative x.
#include <bit>
#include <cstdint>

#include "kernels/cpu/ops.h"
#include "kernels/cpu/pointwise_math.h"

namespace lathe::cpu {

namespace {

constexpr int64_t kParallelMin = 1 << 15;

}  // namespace

void gelu_forward(float* out, const float* inp, int64_t n) {
#pragma omp parallel for simd schedule(static) if (n >= kParallelMin)
  for (int64_t i = 0; i < n; ++i) {
    const float x = inp[i];
    const float u = kGeluS * (x + kGeluA * x * x * x);
    out[i] = x * sigmoid_vec(2.0f * u);
  }
}

void gelu_backward(float* dinp, const float* inp, const float* dout, int64_t n) {
  // dinp may alias dout: element i is read before it is written, and the loop has no carried
  // dependence, so the aliasing is harmless.
#pragma omp parallel for simd schedule(static) if (n >= kParallelMin)
  for (int64_t i = 0; i < n; ++i) {
    const float x = inp[i];
    const float u = kGeluS * (x + kGeluA * x * x * x);
    const float du = kGeluS * (1.0f + 3.0f * kGeluA * x * x);
    const float sg = sigmoid_vec(2.0f * u);
    dinp[i] = dout[i] * (sg + 2.0f * x * sg * (1.0f - sg) * du);
  }
}

void swiglu_forward(float* out, const float* inp, int64_t N, int64_t F) {
#pragma omp parallel for schedule(static) if (N * F >= kParallelMin)
  for (int64_t n = 0; n < N; ++n) {
    const float* __restrict gate = inp + n * 2 * F;
    const float* __restrict up = gate + F;
    float* __restrict o = out + n * F;
#pragma omp simd
    for (int64_t f = 0; f < F; ++f) {
      const float g = gate[f];
      o[f] = g * sigmoid_vec(g) * up[f];
    }
  }
}

void swiglu_backward(float* dinp, const float* inp, const float* dout, int64_t N, int64_t F) {
#pragma omp parallel for schedule(static) if (N * F >= kParallelMin)
  for (int64_t n = 0; n < N; ++n) {
    const float* __restrict gate = inp + n * 2 * F;
    const float* __restrict up = gate + F;
    const float* __restrict g_out = dout + n * F;
    float* __restrict dgate = dinp + n * 2 * F;
    float* __restrict dup = dgate + F;
#pragma omp simd
    for (int64_t f = 0; f < F; ++f) {
      const float g = gate[f];
      const float sg = sigmoid_vec(g);
      const float d = g_out[f];
      dup[f] = d * g * sg;
      dgate[f] = d * up[f] * sg * (1.0f + g * (1.0f - sg));
    }
  }
}

void residual_forward(float* out, const float* a, const float* b, int64_t n) {
#pragma omp parallel for simd schedule(static) if (n >= kParallelMin)
  for (int64_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
}

void bias_add(float* out, const float* bias, int64_t N, int64_t C) {
#pragma omp parallel for schedule(static) if (N * C >= kParallelMin)
  for (int64_t r = 0; r < N; ++r) {
    float* row = out + r * C;
#pragma omp simd
    for (int64_t c = 0; c < C; ++c) row[c] += bias[c];
  }
}

}  // namespace lathe::cpu
