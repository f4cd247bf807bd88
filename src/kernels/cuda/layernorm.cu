// LayerNorm forward/backward (kernels/cuda/ops.h), mirroring kernels/cpu/layernorm.cpp: biased
// variance, eps inside the sqrt, two passes (mean, then centred sum of squares), fp32 statistics.
// Forward: one warp per row [C]. Backward: norm_partials(N) warps (launch.h); warp w handles rows
// w, w+P, ..., adds its rows' dinp (fp32 sum of the old value and the gradient, rounded once) and
// accumulates its dweight/dbias partials in its own scratch row [2C]; a second kernel adds the P
// rows of each column in order into dweight/dbias. No atomics: bit-reproducible.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace lathe::cuda {

namespace {

template <class T>
__global__ void layernorm_forward_kernel(T* __restrict__ out, float* __restrict__ mean, float* __restrict__ rstd,
                                         const T* __restrict__ inp, const float* __restrict__ weight,
                                         const float* __restrict__ bias, int64_t N, int64_t C, float eps) {
  const int lane = threadIdx.x % kWarp;
  const float inv_c = 1.0f / static_cast<float>(C);
  for (int64_t n = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp; n < N;
       n += static_cast<int64_t>(gridDim.x) * kWarpsPerBlock) {
    const T* x = inp + n * C;
    float s = 0.0f;
    for (int64_t c = lane; c < C; c += kWarp) s += to_f(x[c]);
    const float m = warp_sum(s) * inv_c;
    float v = 0.0f;
    for (int64_t c = lane; c < C; c += kWarp) {
      const float d = to_f(x[c]) - m;
      v += d * d;
    }
    const float r = 1.0f / sqrtf(warp_sum(v) * inv_c + eps);
    T* o = out + n * C;
    for (int64_t c = lane; c < C; c += kWarp) {
      const float y = (to_f(x[c]) - m) * r * weight[c];
      o[c] = from_f<T>(bias ? y + bias[c] : y);
    }
    if (lane == 0) {
      mean[n] = m;
      rstd[n] = r;
    }
  }
}

template <class T>
__global__ void layernorm_backward_kernel(T* dinp, float* __restrict__ partial, const T* __restrict__ dout,
                                          const T* __restrict__ inp, const float* __restrict__ weight,
                                          const float* __restrict__ mean, const float* __restrict__ rstd, int64_t N,
                                          int64_t C, int64_t P) {
  const int lane = threadIdx.x % kWarp;
  const int64_t w = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp;
  if (w >= P) return;
  const float inv_c = 1.0f / static_cast<float>(C);
  float* pw = partial + w * 2 * C;
  float* pb = pw + C;
  for (int64_t c = lane; c < 2 * C; c += kWarp) pw[c] = 0.0f;
  for (int64_t n = w; n < N; n += P) {
    const T* x = inp + n * C;
    const T* g = dout + n * C;
    const float m = mean[n], r = rstd[n];
    float s1 = 0.0f, s2 = 0.0f;
    for (int64_t c = lane; c < C; c += kWarp) {
      const float xhat = (to_f(x[c]) - m) * r;
      const float gc = to_f(g[c]);
      const float dxhat = gc * weight[c];
      s1 += dxhat;
      s2 += dxhat * xhat;
      pw[c] += gc * xhat;
      pb[c] += gc;
    }
    const float a = warp_sum(s1) * inv_c, b = warp_sum(s2) * inv_c;
    T* dx = dinp + n * C;
    for (int64_t c = lane; c < C; c += kWarp) {
      const float xhat = (to_f(x[c]) - m) * r;
      dx[c] = from_f<T>(to_f(dx[c]) + (to_f(g[c]) * weight[c] - a - xhat * b) * r);
    }
  }
}

}  // namespace

template <DType D>
void layernorm_forward(void* out, float* mean, float* rstd, const void* inp, const float* weight, const float* bias,
                       int64_t N, int64_t C, float eps) {
  if (N <= 0 || C <= 0) return;
  using T = typename Elem<D>::T;
  layernorm_forward_kernel<<<row_blocks(N), kWarpsPerBlock * kWarp, 0, stream()>>>(
      static_cast<T*>(out), mean, rstd, static_cast<const T*>(inp), weight, bias, N, C, eps);
  LATHE_CUDA_LAUNCHED(layernorm_forward_kernel);
}

template <DType D>
void layernorm_backward(void* dinp, float* dweight, float* dbias, const void* dout, const void* inp,
                        const float* weight, const float* mean, const float* rstd, int64_t N, int64_t C,
                        void* scratch) {
  if (N <= 0 || C <= 0) return;
  using T = typename Elem<D>::T;
  const int64_t P = norm_partials(N);
  float* partial = static_cast<float*>(scratch);
  layernorm_backward_kernel<<<row_blocks(P), kWarpsPerBlock * kWarp, 0, stream()>>>(
      static_cast<T*>(dinp), partial, static_cast<const T*>(dout), static_cast<const T*>(inp), weight, mean, rstd, N, C,
      P);
  LATHE_CUDA_LAUNCHED(layernorm_backward_kernel);
  norm_partials_sum_kernel<><<<blocks(C), kThreads, 0, stream()>>>(dweight, dbias, partial, C, P, 2 * C);
  LATHE_CUDA_LAUNCHED(norm_partials_sum_kernel);
}

LATHE_CUDA_INSTANTIATE(layernorm_forward,
                       (void*, float*, float*, const void*, const float*, const float*, int64_t, int64_t, float))
LATHE_CUDA_INSTANTIATE(layernorm_backward, (void*, float*, float*, const void*, const void*, const float*, const float*,
                                            const float*, int64_t, int64_t, void*))

}  // namespace lathe::cuda
