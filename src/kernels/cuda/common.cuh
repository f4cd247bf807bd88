// Device-side helpers shared by the CUDA kernels (kernels/cuda/*.cu): element types of a table's
// dtype, fp32 widening / rounding, deterministic warp and block reductions, the instantiation macro.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "core/dtype.h"
#include "kernels/cuda/launch.h"
#include "kernels/cuda/runtime.h"

namespace lathe::cuda {

template <DType D>
struct Elem;
template <>
struct Elem<DType::F32> {
  using T = float;
};
template <>
struct Elem<DType::BF16> {
  using T = __nv_bfloat16;
};
template <>
struct Elem<DType::F16> {
  using T = __half;
};

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }

template <class T>
__device__ __forceinline__ T from_f(float x);
template <>
__device__ __forceinline__ float from_f<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <>
__device__ __forceinline__ __half from_f<__half>(float x) {
  return __float2half_rn(x);
}

// Sum over the 32 lanes of a warp; the xor butterfly adds the same pairs in the same order on every
// lane (a+b == b+a), so every lane holds the same bits, and the order is fixed: deterministic.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Blocks for n elements (launch.h grid_1d) as a launch argument.
inline unsigned blocks(int64_t n, int64_t threads = kThreads) { return static_cast<unsigned>(grid_1d(n, threads)); }
inline unsigned row_blocks(int64_t rows) { return static_cast<unsigned>(grid_rows(rows)); }

// Grid-stride loop over [0, n).
#define LATHE_GRID_LOOP(i, n)                                                            \
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < (n); \
       i += static_cast<int64_t>(blockDim.x) * gridDim.x)

// Second pass of the norm backwards (layernorm.cu, rmsnorm.cu): partial[P][row] holds warp w's
// dweight partial at [w][c] and (LayerNorm) its dbias partial at [w][C + c]; adds the P partials of
// each column in order: dweight[c] += sum_w partial[w][c], dbias[c] += sum_w partial[w][C + c].
// (A template so that every .cu including this header may instantiate it without a clash.)
template <int = 0>
__global__ void norm_partials_sum_kernel(float* dweight, float* dbias, const float* partial, int64_t C, int64_t P,
                                         int64_t row) {
  LATHE_GRID_LOOP(c, C) {
    float sw = 0.0f, sb = 0.0f;
    for (int64_t w = 0; w < P; ++w) {
      sw += partial[w * row + c];
      if (dbias) sb += partial[w * row + C + c];
    }
    dweight[c] += sw;
    if (dbias) dbias[c] += sb;
  }
}

// Explicit instantiation of a table entry `name` (a template on DType) for fp32, bf16 and fp16.
#define LATHE_CUDA_INSTANTIATE(name, params) \
  template void name<DType::F32> params;     \
  template void name<DType::BF16> params;    \
  template void name<DType::F16> params;

}  // namespace lathe::cuda
