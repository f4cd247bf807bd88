// Helpers of the cudak2 kernels (attention.cu, lm_head_loss.cu, optimizer.cu) on top of common.cuh:
// errors with run-time formatted messages, launch checks naming the kernel's purpose, element
// loads / stores through the table's element type, and fixed-order block reductions.
#pragma once
// fmt (through core/error.h) turns its constexpr off under nvcc (__NVCC__) but keeps some plain
// constexpr functions that call the now non-constexpr ones, which g++ rejects in C++20 in nvcc's
// host pass; with constexpr on, nvcc compiles fmt. This header comes first in every cudak2 .cu
// file so that the setting precedes any include of fmt.
#ifndef FMT_USE_CONSTEXPR
#define FMT_USE_CONSTEXPR 1
#endif
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <sstream>
#include <string>
#include <utility>

#include "core/error.h"
#include "kernels/cuda/common.cuh"

namespace lathe::cuda {

// Errors with run-time format strings: each "{}" of `f` is replaced by the next argument, streamed;
// thrown as lathe::Error (as throw_error does).
inline void format_into(std::ostringstream& os, const char* f) { os << f; }
template <typename A, typename... Rest>
void format_into(std::ostringstream& os, const char* f, A&& a, Rest&&... rest) {
  const char* p = std::strstr(f, "{}");
  if (p == nullptr) {
    os << f;
    return;
  }
  os.write(f, p - f);
  os << a;
  format_into(os, p + 2, std::forward<Rest>(rest)...);
}
template <typename... A>
[[noreturn]] void fail(const char* f, A&&... a) {
  std::ostringstream os;
  format_into(os, f, std::forward<A>(a)...);
  throw Error(os.str());
}
#define LATHE_CU_CHECK(cond, ...)                  \
  do {                                             \
    if (!(cond)) ::lathe::cuda::fail(__VA_ARGS__); \
  } while (0)

// After a kernel launch: a bad configuration (grid, shared memory) is reported at once.
inline void check_launch(const char* what) {
  const cudaError_t e = cudaPeekAtLastError();
  if (e != cudaSuccess) fail("CUDA kernel launch failed in {}: {}", what, cudaGetErrorString(e));
}

template <class T>
__device__ __forceinline__ float load_f(const T* p) {
  return to_f(*p);
}
template <class T>
__device__ __forceinline__ void store_f(T* p, float v) {
  *p = from_f<T>(v);
}

// Block-wide reductions in a fixed order (warp butterflies, then every warp over the warp results):
// the same inputs always give the same bits, and every thread gets the result. `red` holds one
// value per warp.
template <int kThreadsT>
__device__ __forceinline__ float block_max(float v, float* red) {
#pragma unroll
  for (int off = 16; off >= 1; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
  constexpr int kWarps = kThreadsT / 32;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  __syncthreads();  // `red` may still be read by a previous reduction
  if (lane == 0) red[warp] = v;
  __syncthreads();
  v = lane < kWarps ? red[lane] : -INFINITY;
#pragma unroll
  for (int off = 16; off >= 1; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}
template <int kThreadsT>
__device__ __forceinline__ double block_sum(double v, double* red) {
#pragma unroll
  for (int off = 16; off >= 1; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  constexpr int kWarps = kThreadsT / 32;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  v = lane < kWarps ? red[lane] : 0.0;
#pragma unroll
  for (int off = 16; off >= 1; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

}  // namespace lathe::cuda
