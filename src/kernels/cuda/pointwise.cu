// Pointwise kernels (kernels/cuda/ops.h), mirroring kernels/cpu/pointwise.cpp: GELU (tanh
// approximation), SwiGLU on a fused gate|up row, residual add, bias add. fp32 math on widened
// elements, each output rounded once. Grid-stride loops (launch.h grid_1d); dinp may alias dout
// and out may alias a (each element is read before it is written, by the same thread).
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace lathe::cuda {

namespace {

constexpr float kGeluS = 0.7978845608028654f;  // sqrt(2/pi)
constexpr float kGeluA = 0.044715f;

__device__ __forceinline__ float sigmoidf_(float x) { return 1.0f / (1.0f + expf(-x)); }
// x * sigmoid(2u) == 0.5 x (1 + tanh(u)): the CPU kernels' form (kernels/cpu/pointwise_math.h).
__device__ __forceinline__ float gelu_f(float x) {
  const float u = kGeluS * (x + kGeluA * x * x * x);
  return x * sigmoidf_(2.0f * u);
}
__device__ __forceinline__ float gelu_grad_f(float x, float d) {
  const float u = kGeluS * (x + kGeluA * x * x * x);
  const float du = kGeluS * (1.0f + 3.0f * kGeluA * x * x);
  const float sg = sigmoidf_(2.0f * u);
  return d * (sg + 2.0f * x * sg * (1.0f - sg) * du);
}

// Exact GELU (erf): x * Phi(x), the CPU kernels' erfc form (kernels/cpu/pointwise_math.h).
__device__ __forceinline__ float gelu_erf_f(float x) { return 0.5f * x * erfcf(-x * 0.70710678118654752f); }
__device__ __forceinline__ float gelu_erf_grad_f(float x, float d) {
  const float cdf = 0.5f * erfcf(-x * 0.70710678118654752f);
  return d * (cdf + x * 0.39894228040143268f * expf(-0.5f * x * x));
}
template <class T>
__global__ void gelu_erf_forward_kernel(T* out, const T* inp, int64_t n) {
  LATHE_GRID_LOOP(i, n) out[i] = from_f<T>(gelu_erf_f(to_f(inp[i])));
}
template <class T>
__global__ void gelu_erf_backward_kernel(T* dinp, const T* inp, const T* dout, int64_t n) {
  LATHE_GRID_LOOP(i, n) dinp[i] = from_f<T>(gelu_erf_grad_f(to_f(inp[i]), to_f(dout[i])));
}
template <class T>
__global__ void gelu_forward_kernel(T* out, const T* inp, int64_t n) {
  LATHE_GRID_LOOP(i, n) out[i] = from_f<T>(gelu_f(to_f(inp[i])));
}
template <class T>
__global__ void gelu_backward_kernel(T* dinp, const T* inp, const T* dout, int64_t n) {
  LATHE_GRID_LOOP(i, n) dinp[i] = from_f<T>(gelu_grad_f(to_f(inp[i]), to_f(dout[i])));
}
// inp[N, 2F]: gate columns [0, F), up columns [F, 2F); out[N, F] = silu(gate) * up.
template <class T>
__global__ void swiglu_forward_kernel(T* out, const T* inp, int64_t N, int64_t F) {
  LATHE_GRID_LOOP(i, N * F) {
    const int64_t n = i / F, f = i - n * F;
    const float g = to_f(inp[n * 2 * F + f]), u = to_f(inp[n * 2 * F + F + f]);
    out[i] = from_f<T>(g * sigmoidf_(g) * u);
  }
}
template <class T>
__global__ void swiglu_backward_kernel(T* dinp, const T* inp, const T* dout, int64_t N, int64_t F) {
  LATHE_GRID_LOOP(i, N * F) {
    const int64_t n = i / F, f = i - n * F;
    const float g = to_f(inp[n * 2 * F + f]), u = to_f(inp[n * 2 * F + F + f]), d = to_f(dout[i]);
    const float sg = sigmoidf_(g);
    dinp[n * 2 * F + F + f] = from_f<T>(d * g * sg);
    dinp[n * 2 * F + f] = from_f<T>(d * u * sg * (1.0f + g * (1.0f - sg)));
  }
}
// GeGLU (Gemma 2): out = gelu_tanh(gate) * up on the same layout.
template <class T>
__global__ void geglu_forward_kernel(T* out, const T* inp, int64_t N, int64_t F) {
  LATHE_GRID_LOOP(i, N * F) {
    const int64_t n = i / F, f = i - n * F;
    const float g = to_f(inp[n * 2 * F + f]), u = to_f(inp[n * 2 * F + F + f]);
    out[i] = from_f<T>(gelu_f(g) * u);
  }
}
template <class T>
__global__ void geglu_backward_kernel(T* dinp, const T* inp, const T* dout, int64_t N, int64_t F) {
  LATHE_GRID_LOOP(i, N * F) {
    const int64_t n = i / F, f = i - n * F;
    const float g = to_f(inp[n * 2 * F + f]), u = to_f(inp[n * 2 * F + F + f]), d = to_f(dout[i]);
    dinp[n * 2 * F + F + f] = from_f<T>(d * gelu_f(g));
    dinp[n * 2 * F + f] = from_f<T>(gelu_grad_f(g, d * u));
  }
}
template <class T>
__global__ void residual_kernel(T* out, const T* a, const T* b, int64_t n) {
  LATHE_GRID_LOOP(i, n) out[i] = from_f<T>(to_f(a[i]) + to_f(b[i]));
}
template <class T>
__global__ void bias_add_kernel(T* out, const float* bias, int64_t N, int64_t C) {
  LATHE_GRID_LOOP(i, N * C) out[i] = from_f<T>(to_f(out[i]) + bias[i % C]);
}

template <class T>
__global__ void scale_kernel(T* x, float s, int64_t n) {
  LATHE_GRID_LOOP(i, n) x[i] = from_f<T>(to_f(x[i]) * s);
}
__global__ void offset_weights_kernel(float* out, const float* w, float offset, int64_t n) {
  LATHE_GRID_LOOP(i, n) out[i] = offset + w[i];
}

template <DType D>
using E = typename Elem<D>::T;

}  // namespace

template <DType D>
void gelu_forward(void* out, const void* inp, int64_t n) {
  if (n <= 0) return;
  gelu_forward_kernel<<<blocks(n), kThreads, 0, stream()>>>(static_cast<E<D>*>(out), static_cast<const E<D>*>(inp), n);
  LATHE_CUDA_LAUNCHED(gelu_forward_kernel);
}
template <DType D>
void gelu_backward(void* dinp, const void* inp, const void* dout, int64_t n) {
  if (n <= 0) return;
  gelu_backward_kernel<<<blocks(n), kThreads, 0, stream()>>>(static_cast<E<D>*>(dinp), static_cast<const E<D>*>(inp),
                                                             static_cast<const E<D>*>(dout), n);
  LATHE_CUDA_LAUNCHED(gelu_backward_kernel);
}
template <DType D>
void gelu_erf_forward(void* out, const void* inp, int64_t n) {
  if (n <= 0) return;
  gelu_erf_forward_kernel<<<blocks(n), kThreads, 0, stream()>>>(static_cast<E<D>*>(out), static_cast<const E<D>*>(inp),
                                                                n);
  LATHE_CUDA_LAUNCHED(gelu_erf_forward_kernel);
}
template <DType D>
void gelu_erf_backward(void* dinp, const void* inp, const void* dout, int64_t n) {
  if (n <= 0) return;
  gelu_erf_backward_kernel<<<blocks(n), kThreads, 0, stream()>>>(
      static_cast<E<D>*>(dinp), static_cast<const E<D>*>(inp), static_cast<const E<D>*>(dout), n);
  LATHE_CUDA_LAUNCHED(gelu_erf_backward_kernel);
}
template <DType D>
void swiglu_forward(void* out, const void* inp, int64_t N, int64_t F) {
  if (N * F <= 0) return;
  swiglu_forward_kernel<<<blocks(N * F), kThreads, 0, stream()>>>(static_cast<E<D>*>(out),
                                                                  static_cast<const E<D>*>(inp), N, F);
  LATHE_CUDA_LAUNCHED(swiglu_forward_kernel);
}
template <DType D>
void swiglu_backward(void* dinp, const void* inp, const void* dout, int64_t N, int64_t F) {
  if (N * F <= 0) return;
  swiglu_backward_kernel<<<blocks(N * F), kThreads, 0, stream()>>>(
      static_cast<E<D>*>(dinp), static_cast<const E<D>*>(inp), static_cast<const E<D>*>(dout), N, F);
  LATHE_CUDA_LAUNCHED(swiglu_backward_kernel);
}
template <DType D>
void geglu_forward(void* out, const void* inp, int64_t N, int64_t F) {
  if (N * F <= 0) return;
  geglu_forward_kernel<<<blocks(N * F), kThreads, 0, stream()>>>(static_cast<E<D>*>(out), static_cast<const E<D>*>(inp),
                                                                 N, F);
  LATHE_CUDA_LAUNCHED(geglu_forward_kernel);
}
template <DType D>
void geglu_backward(void* dinp, const void* inp, const void* dout, int64_t N, int64_t F) {
  if (N * F <= 0) return;
  geglu_backward_kernel<<<blocks(N * F), kThreads, 0, stream()>>>(
      static_cast<E<D>*>(dinp), static_cast<const E<D>*>(inp), static_cast<const E<D>*>(dout), N, F);
  LATHE_CUDA_LAUNCHED(geglu_backward_kernel);
}
template <DType D>
void residual_forward(void* out, const void* a, const void* b, int64_t n) {
  if (n <= 0) return;
  residual_kernel<<<blocks(n), kThreads, 0, stream()>>>(static_cast<E<D>*>(out), static_cast<const E<D>*>(a),
                                                        static_cast<const E<D>*>(b), n);
  LATHE_CUDA_LAUNCHED(residual_kernel);
}
template <DType D>
void bias_add(void* out, const float* bias, int64_t N, int64_t C) {
  if (N * C <= 0) return;
  bias_add_kernel<<<blocks(N * C), kThreads, 0, stream()>>>(static_cast<E<D>*>(out), bias, N, C);
  LATHE_CUDA_LAUNCHED(bias_add_kernel);
}

template <DType D>
void scale_forward(void* x, float s, int64_t n) {
  if (n <= 0) return;
  scale_kernel<<<blocks(n), kThreads, 0, stream()>>>(static_cast<E<D>*>(x), s, n);
  LATHE_CUDA_LAUNCHED(scale_kernel);
}
void offset_weights(float* out, const float* w, float offset, int64_t n) {
  if (n <= 0) return;
  offset_weights_kernel<<<blocks(n), kThreads, 0, stream()>>>(out, w, offset, n);
  LATHE_CUDA_LAUNCHED(offset_weights_kernel);
}

LATHE_CUDA_INSTANTIATE(gelu_forward, (void*, const void*, int64_t))
LATHE_CUDA_INSTANTIATE(gelu_backward, (void*, const void*, const void*, int64_t))
LATHE_CUDA_INSTANTIATE(gelu_erf_forward, (void*, const void*, int64_t))
LATHE_CUDA_INSTANTIATE(gelu_erf_backward, (void*, const void*, const void*, int64_t))
LATHE_CUDA_INSTANTIATE(swiglu_forward, (void*, const void*, int64_t, int64_t))
LATHE_CUDA_INSTANTIATE(swiglu_backward, (void*, const void*, const void*, int64_t, int64_t))
LATHE_CUDA_INSTANTIATE(geglu_forward, (void*, const void*, int64_t, int64_t))
LATHE_CUDA_INSTANTIATE(geglu_backward, (void*, const void*, const void*, int64_t, int64_t))
LATHE_CUDA_INSTANTIATE(residual_forward, (void*, const void*, const void*, int64_t))
LATHE_CUDA_INSTANTIATE(bias_add, (void*, const float*, int64_t, int64_t))
LATHE_CUDA_INSTANTIATE(scale_forward, (void*, float, int64_t))

}  // namespace lathe::cuda
