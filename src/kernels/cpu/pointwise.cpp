// Pointwise ops: GELU (tanh approximation; and exact, erf: gelu_erf_*), SwiGLU, GeGLU, residual add, bias add, scale,
// the norm weight offset; one template
// per kernel for every storage type (kernels/cpu/storage.h): 16-bit blocks and rows are widened, the fp32 formula of
// pointwise_math.h runs on them, the result is rounded once.
//
// libm's expf/tanhf do not vectorise without -ffast-math, and a scalar tanhf over the [N, 4C] MLP
// activation costs a sizeable fraction of the surrounding GEMM. exp_vec (pointwise_math.h) is a
// branch-free Cephes-style expf (Cody-Waite range reduction + degree-6 polynomial, ~2 ulp on the
// clamped range) that GCC vectorises; GELU and SiLU are written in terms of a sigmoid built on it:
//   gelu(x)  = 0.5 x (1 + tanh(u)) = x * sigmoid(2u),  u = sqrt(2/pi) (x + 0.044715 x^3)
//   gelu'(x) = sg + 2 x sg (1 - sg) u'(x),              sg = sigmoid(2u)
//   silu(g)  = g * sigmoid(g),  silu'(g) = sigmoid(g) (1 + g (1 - sigmoid(g)))
// The sigmoid form avoids the cancellation of 1 + tanh(u) for negative x.
#include <algorithm>
#include <cstdint>

#include "kernels/cpu/op_slots.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/pointwise_math.h"
#include "kernels/cpu/storage.h"

namespace lathe::cpu {

namespace {

constexpr int64_t kParallelMin = 1 << 15;
// Elements per block of the flat ops (a 16-bit block is widened on the stack).
constexpr int64_t kBlock = 1024;
// A stack block for 16-bit storage; F32 blocks are read and written in place.
template <class S>
constexpr int64_t kStackBlock = S::kFp32 ? 1 : kBlock;

// out = f(inp), element by element, over blocks of kBlock.
template <class S, bool Exact = false>
void gelu_forward_t(void* out_v, const void* inp_v, int64_t n) {
  const auto* inp = as<S>(inp_v);
  auto* out = as<S>(out_v);
  const int64_t nb = (n + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t i0 = b * kBlock, len = std::min(kBlock, n - i0);
    float xb[kStackBlock<S>], ob[kStackBlock<S>];
    const float* x = read_row<S>(xb, inp + i0, len);
    float* o = out_row<S>(ob, out + i0);
#pragma omp simd
    for (int64_t i = 0; i < len; ++i) o[i] = Exact ? gelu_erf_elem(x[i]) : gelu_elem(x[i]);
    write_row<S>(out + i0, o, len);
  }
}

// dinp = gelu'(inp) * dout; dinp may alias dout: element i is read before it is written (a 16-bit
// block is widened before it is), and the loop has no carried dependence.
template <class S, bool Exact = false>
void gelu_backward_t(void* dinp_v, const void* inp_v, const void* dout_v, int64_t n) {
  const auto *inp = as<S>(inp_v), *dout = as<S>(dout_v);
  auto* dinp = as<S>(dinp_v);
  const int64_t nb = (n + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t i0 = b * kBlock, len = std::min(kBlock, n - i0);
    float xb[kStackBlock<S>], gb[kStackBlock<S>], ob[kStackBlock<S>];
    const float* x = read_row<S>(xb, inp + i0, len);
    const float* g = read_row<S>(gb, dout + i0, len);
    float* o = out_row<S>(ob, dinp + i0);
#pragma omp simd
    for (int64_t i = 0; i < len; ++i) o[i] = Exact ? gelu_erf_grad_elem(x[i], g[i]) : gelu_grad_elem(x[i], g[i]);
    write_row<S>(dinp + i0, o, len);
  }
}

// out = a + b (out may alias a or b).
template <class S>
void residual_forward_t(void* out_v, const void* a_v, const void* b_v, int64_t n) {
  const auto *a = as<S>(a_v), *b_ = as<S>(b_v);
  auto* out = as<S>(out_v);
  const int64_t nb = (n + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t i0 = b * kBlock, len = std::min(kBlock, n - i0);
    float xb[kStackBlock<S>], yb[kStackBlock<S>], ob[kStackBlock<S>];
    const float* x = read_row<S>(xb, a + i0, len);
    const float* y = read_row<S>(yb, b_ + i0, len);
    float* o = out_row<S>(ob, out + i0);
#pragma omp simd
    for (int64_t i = 0; i < len; ++i) o[i] = x[i] + y[i];
    write_row<S>(out + i0, o, len);
  }
}

// x = x * s, rounded once (s already in the dtype's precision: the caller's).
template <class S>
void scale_forward_t(void* x_v, float s, int64_t n) {
  auto* x = as<S>(x_v);
  const int64_t nb = (n + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t i0 = b * kBlock, len = std::min(kBlock, n - i0);
    float xb[kStackBlock<S>];
    float* row = update_row<S>(xb, x + i0, len);
#pragma omp simd
    for (int64_t i = 0; i < len; ++i) row[i] *= s;
    write_row<S>(x + i0, row, len);
  }
}

// out = offset + w, fp32 in every table.
void offset_weights_f32(float* out, const float* w, float offset, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = offset + w[i];
}

// out[N, C] += bias[C].
template <class S>
void bias_add_t(void* out_v, const float* bias, int64_t N, int64_t C) {
  auto* out = as<S>(out_v);
#pragma omp parallel if (N * C >= kParallelMin)
  {
    float* buf = work_row<S>(0, static_cast<size_t>(C));
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      float* row = update_row<S>(buf, out + n * C, C);
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) row[c] += bias[c];
      write_row<S>(out + n * C, row, C);
    }
  }
}

// out[N, F] = silu(gate) * up from inp[N, 2F] = gate | up; Gelu: gelu_tanh(gate) * up (GeGLU, Gemma 2's
// gelu_pytorch_tanh MLP), the same loop with gelu_elem as the gate's activation.
template <class S, bool Gelu = false>
void swiglu_forward_t(void* out_v, const void* inp_v, int64_t N, int64_t F) {
  const auto* inp = as<S>(inp_v);
  auto* out = as<S>(out_v);
#pragma omp parallel if (N * F >= kParallelMin)
  {
    float* xb = work_row<S>(0, static_cast<size_t>(2 * F));
    float* ob = work_row<S>(1, static_cast<size_t>(F));
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      const float* __restrict gate = read_row<S>(xb, inp + n * 2 * F, 2 * F);
      const float* __restrict up = gate + F;
      float* __restrict o = out_row<S>(ob, out + n * F);
#pragma omp simd
      for (int64_t f = 0; f < F; ++f) {
        const float g = gate[f];
        o[f] = Gelu ? gelu_elem(g) * up[f] : g * sigmoid_vec(g) * up[f];
      }
      write_row<S>(out + n * F, o, F);
    }
  }
}

// dinp[N, 2F] = (d gate | d up) from dout[N, F] (overwrites dinp). Gelu: the GeGLU's, d up = d * gelu(gate),
// d gate = gelu'(gate) * d * up.
template <class S, bool Gelu = false>
void swiglu_backward_t(void* dinp_v, const void* inp_v, const void* dout_v, int64_t N, int64_t F) {
  const auto *inp = as<S>(inp_v), *dout = as<S>(dout_v);
  auto* dinp = as<S>(dinp_v);
#pragma omp parallel if (N * F >= kParallelMin)
  {
    float* xb = work_row<S>(0, static_cast<size_t>(2 * F));
    float* gb = work_row<S>(1, static_cast<size_t>(F));
    float* db = work_row<S>(2, static_cast<size_t>(2 * F));
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      const float* __restrict gate = read_row<S>(xb, inp + n * 2 * F, 2 * F);
      const float* __restrict up = gate + F;
      const float* __restrict g_out = read_row<S>(gb, dout + n * F, F);
      float* __restrict dgate = out_row<S>(db, dinp + n * 2 * F);
      float* __restrict dup = dgate + F;
#pragma omp simd
      for (int64_t f = 0; f < F; ++f) {
        const float g = gate[f];
        const float d = g_out[f];
        if constexpr (Gelu) {
          dup[f] = d * gelu_elem(g);
          dgate[f] = gelu_grad_elem(g, d * up[f]);
        } else {
          const float sg = sigmoid_vec(g);
          dup[f] = d * g * sg;
          dgate[f] = d * up[f] * sg * (1.0f + g * (1.0f - sg));
        }
      }
      write_row<S>(dinp + n * 2 * F, dgate, 2 * F);
    }
  }
}

}  // namespace

void gelu_forward(float* out, const float* inp, int64_t n) { gelu_forward_t<F32>(out, inp, n); }
void gelu_backward(float* dinp, const float* inp, const float* dout, int64_t n) {
  gelu_backward_t<F32>(dinp, inp, dout, n);
}
void swiglu_forward(float* out, const float* inp, int64_t N, int64_t F) { swiglu_forward_t<F32>(out, inp, N, F); }
void swiglu_backward(float* dinp, const float* inp, const float* dout, int64_t N, int64_t F) {
  swiglu_backward_t<F32>(dinp, inp, dout, N, F);
}
void geglu_forward(float* out, const float* inp, int64_t N, int64_t F) { swiglu_forward_t<F32, true>(out, inp, N, F); }
void geglu_backward(float* dinp, const float* inp, const float* dout, int64_t N, int64_t F) {
  swiglu_backward_t<F32, true>(dinp, inp, dout, N, F);
}
void residual_forward(float* out, const float* a, const float* b, int64_t n) { residual_forward_t<F32>(out, a, b, n); }
void bias_add(float* out, const float* bias, int64_t N, int64_t C) { bias_add_t<F32>(out, bias, N, C); }

template <class S>
void add_pointwise(Ops& o) {
  o.gelu_forward = gelu_forward_t<S>;
  o.gelu_backward = gelu_backward_t<S>;
  o.gelu_erf_forward = gelu_forward_t<S, true>;
  o.gelu_erf_backward = gelu_backward_t<S, true>;
  o.swiglu_forward = swiglu_forward_t<S>;
  o.swiglu_backward = swiglu_backward_t<S>;
  o.geglu_forward = swiglu_forward_t<S, true>;
  o.geglu_backward = swiglu_backward_t<S, true>;
  o.residual_forward = residual_forward_t<S>;
  o.bias_add = bias_add_t<S>;
  o.scale_forward = scale_forward_t<S>;
  o.offset_weights = offset_weights_f32;
}
LATHE_CPU_ADD_SLOTS(add_pointwise)

}  // namespace lathe::cpu
