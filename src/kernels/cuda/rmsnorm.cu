// RMSNorm forward/backward (kernels/cuda/ops.h), mirroring kernels/cpu/rmsnorm.cpp (HF
// LlamaRMSNorm: out = weight * (x * rstd), rstd = 1 / sqrt(mean(x^2) + eps)). Launch structure and
// determinism as layernorm.cu: one warp per row forward; backward partial dweight rows per warp
// (scratch [P, C]), summed in order by the second kernel.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace lathe::cuda {

namespace {

template <class T>
__global__ void rmsnorm_forward_kernel(T* __restrict__ out, float* __restrict__ rstd, const T* __restrict__ inp,
                                       const float* __restrict__ weight, int64_t N, int64_t C, float eps) {
  const int lane = threadIdx.x % kWarp;
  const float inv_c = 1.0f / static_cast<float>(C);
  for (int64_t n = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp; n < N;
       n += static_cast<int64_t>(gridDim.x) * kWarpsPerBlock) {
    const T* x = inp + n * C;
    float ss = 0.0f;
    for (int64_t c = lane; c < C; c += kWarp) {
      const float v = to_f(x[c]);
      ss += v * v;
    }
    const float r = 1.0f / sqrtf(warp_sum(ss) * inv_c + eps);
    T* o = out + n * C;
    for (int64_t c = lane; c < C; c += kWarp) o[c] = from_f<T>(weight[c] * (to_f(x[c]) * r));
    if (lane == 0) rstd[n] = r;
  }
}

template <class T>
__global__ void rmsnorm_backward_kernel(T* dinp, float* __restrict__ partial, const T* __restrict__ dout,
                                        const T* __restrict__ inp, const float* __restrict__ weight,
                                        const float* __restrict__ rstd, int64_t N, int64_t C, int64_t P) {
  const int lane = threadIdx.x % kWarp;
  const int64_t w = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp;
  if (w >= P) return;
  const float inv_c = 1.0f / static_cast<float>(C);
  float* pw = partial + w * C;
  for (int64_t c = lane; c < C; c += kWarp) pw[c] = 0.0f;
  for (int64_t n = w; n < N; n += P) {
    const T* x = inp + n * C;
    const T* g = dout + n * C;
    const float r = rstd[n];
    float s = 0.0f;
    for (int64_t c = lane; c < C; c += kWarp) {
      const float xhat = to_f(x[c]) * r;
      const float gc = to_f(g[c]);
      s += gc * weight[c] * xhat;
      pw[c] += gc * xhat;
    }
    const float b = warp_sum(s) * inv_c;
    T* dx = dinp + n * C;
    for (int64_t c = lane; c < C; c += kWarp) {
      const float xc = to_f(x[c]);
      dx[c] = from_f<T>(to_f(dx[c]) + (to_f(g[c]) * weight[c] - xc * r * b) * r);
    }
  }
}

// Per-head RMSNorm in place (kernels/cpu/rmsnorm.cpp: head_forward / head_backward): row r = (n, h)
// at x + n * stride + h * D; one warp per row, as above.
__device__ inline int64_t head_row(int64_t r, int64_t heads, int64_t D, int64_t stride) {
  return (r / heads) * stride + (r % heads) * D;
}

template <class T>
__global__ void head_rmsnorm_forward_kernel(T* __restrict__ x, T* __restrict__ saved, float* __restrict__ rstd,
                                            const float* __restrict__ weight, int64_t rows, int64_t heads, int64_t D,
                                            int64_t stride, float eps) {
  const int lane = threadIdx.x % kWarp;
  const float inv_d = 1.0f / static_cast<float>(D);
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp; r < rows;
       r += static_cast<int64_t>(gridDim.x) * kWarpsPerBlock) {
    T* row = x + head_row(r, heads, D, stride);
    T* keep = saved + r * D;
    float ss = 0.0f;
    for (int64_t c = lane; c < D; c += kWarp) {
      keep[c] = row[c];
      const float v = to_f(row[c]);
      ss += v * v;
    }
    const float rs = 1.0f / sqrtf(warp_sum(ss) * inv_d + eps);
    for (int64_t c = lane; c < D; c += kWarp) row[c] = from_f<T>(weight[c] * (to_f(keep[c]) * rs));
    if (lane == 0) rstd[r] = rs;
  }
}

template <class T>
__global__ void head_rmsnorm_backward_kernel(T* dx, float* __restrict__ partial, const T* __restrict__ saved,
                                             const float* __restrict__ weight, const float* __restrict__ rstd,
                                             int64_t rows, int64_t heads, int64_t D, int64_t stride, int64_t P) {
  const int lane = threadIdx.x % kWarp;
  const int64_t w = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp;
  if (w >= P) return;
  const float inv_d = 1.0f / static_cast<float>(D);
  float* pw = partial + w * D;
  for (int64_t c = lane; c < D; c += kWarp) pw[c] = 0.0f;
  for (int64_t r = w; r < rows; r += P) {
    T* row = dx + head_row(r, heads, D, stride);
    const T* x = saved + r * D;
    const float rs = rstd[r];
    float s = 0.0f;
    for (int64_t c = lane; c < D; c += kWarp) {
      const float xhat = to_f(x[c]) * rs;
      const float gc = to_f(row[c]);
      s += gc * weight[c] * xhat;
      pw[c] += gc * xhat;
    }
    const float b = warp_sum(s) * inv_d;  // every lane has read its elements of the row before any writes
    for (int64_t c = lane; c < D; c += kWarp) row[c] = from_f<T>((to_f(row[c]) * weight[c] - to_f(x[c]) * rs * b) * rs);
  }
}

}  // namespace

template <DType D>
void head_rmsnorm_forward(void* x, void* saved, float* rstd, const float* weight, int64_t N, int64_t heads, int64_t Dh,
                          int64_t stride, float eps) {
  if (N <= 0 || heads <= 0 || Dh <= 0) return;
  using T = typename Elem<D>::T;
  head_rmsnorm_forward_kernel<<<row_blocks(N * heads), kWarpsPerBlock * kWarp, 0, stream()>>>(
      static_cast<T*>(x), static_cast<T*>(saved), rstd, weight, N * heads, heads, Dh, stride, eps);
  LATHE_CUDA_LAUNCHED(head_rmsnorm_forward_kernel);
}

template <DType D>
void head_rmsnorm_backward(void* dx, float* dweight, const void* saved, const float* weight, const float* rstd,
                           int64_t N, int64_t heads, int64_t Dh, int64_t stride, void* scratch) {
  if (N <= 0 || heads <= 0 || Dh <= 0) return;
  using T = typename Elem<D>::T;
  const int64_t P = norm_partials(N * heads);
  float* partial = static_cast<float*>(scratch);
  head_rmsnorm_backward_kernel<<<row_blocks(P), kWarpsPerBlock * kWarp, 0, stream()>>>(
      static_cast<T*>(dx), partial, static_cast<const T*>(saved), weight, rstd, N * heads, heads, Dh, stride, P);
  LATHE_CUDA_LAUNCHED(head_rmsnorm_backward_kernel);
  norm_partials_sum_kernel<><<<blocks(Dh), kThreads, 0, stream()>>>(dweight, nullptr, partial, Dh, P, Dh);
  LATHE_CUDA_LAUNCHED(norm_partials_sum_kernel);
}

LATHE_CUDA_INSTANTIATE(head_rmsnorm_forward,
                       (void*, void*, float*, const float*, int64_t, int64_t, int64_t, int64_t, float))
LATHE_CUDA_INSTANTIATE(head_rmsnorm_backward, (void*, float*, const void*, const float*, const float*, int64_t, int64_t,
                                               int64_t, int64_t, void*))

template <DType D>
void rmsnorm_forward(void* out, float* rstd, const void* inp, const float* weight, int64_t N, int64_t C, float eps) {
  if (N <= 0 || C <= 0) return;
  using T = typename Elem<D>::T;
  rmsnorm_forward_kernel<<<row_blocks(N), kWarpsPerBlock * kWarp, 0, stream()>>>(
      static_cast<T*>(out), rstd, static_cast<const T*>(inp), weight, N, C, eps);
  LATHE_CUDA_LAUNCHED(rmsnorm_forward_kernel);
}

template <DType D>
void rmsnorm_backward(void* dinp, float* dweight, const void* dout, const void* inp, const float* weight,
                      const float* rstd, int64_t N, int64_t C, void* scratch) {
  if (N <= 0 || C <= 0) return;
  using T = typename Elem<D>::T;
  const int64_t P = norm_partials(N);
  float* partial = static_cast<float*>(scratch);
  rmsnorm_backward_kernel<<<row_blocks(P), kWarpsPerBlock * kWarp, 0, stream()>>>(
      static_cast<T*>(dinp), partial, static_cast<const T*>(dout), static_cast<const T*>(inp), weight, rstd, N, C, P);
  LATHE_CUDA_LAUNCHED(rmsnorm_backward_kernel);
  norm_partials_sum_kernel<><<<blocks(C), kThreads, 0, stream()>>>(dweight, nullptr, partial, C, P, C);
  LATHE_CUDA_LAUNCHED(norm_partials_sum_kernel);
}

LATHE_CUDA_INSTANTIATE(rmsnorm_forward, (void*, float*, const void*, const float*, int64_t, int64_t, float))
LATHE_CUDA_INSTANTIATE(rmsnorm_backward,
                       (void*, float*, const void*, const void*, const float*, const float*, int64_t, int64_t, void*))

}  // namespace lathe::cuda
