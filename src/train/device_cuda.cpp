// The CUDA facts the trainer reports (train/device_select.h: current_gpu_info). On CUDA builds
// CMakeLists.txt compiles this file with LATHE_HAVE_CUDA and the CUDA headers; elsewhere it is the
// stub at the end (no GPU).
#include "train/device_select.h"

#ifdef LATHE_HAVE_CUDA
#include <cuda_runtime.h>

#if __has_include("kernels/cuda/runtime.h")
#include "kernels/cuda/runtime.h"
#define LATHE_CUDA_RUNTIME_DEVICE 1
#endif

namespace lathe {

std::optional<GpuInfo> current_gpu_info() {
  int dev = 0;
#ifdef LATHE_CUDA_RUNTIME_DEVICE
  if (!cuda::unavailable_reason().empty()) return std::nullopt;
  dev = cuda::device();  // the backend's GPU of this process
#else
  if (cudaGetDevice(&dev) != cudaSuccess) return std::nullopt;
#endif
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, dev) != cudaSuccess) return std::nullopt;
  GpuInfo g;
  g.name = prop.name;
  g.cc_major = prop.major;
  g.cc_minor = prop.minor;
  g.sm_count = prop.multiProcessorCount;
  // cudaDeviceProp::clockRate is gone in CUDA 13: the attribute (kHz) instead.
  if (cudaDeviceGetAttribute(&g.clock_khz, cudaDevAttrClockRate, dev) != cudaSuccess) g.clock_khz = 0;
  return g;
}

}  // namespace lathe

#else

namespace lathe {
// A build without CUDA sees no GPU.
std::optional<GpuInfo> current_gpu_info() { return std::nullopt; }
}  // namespace lathe

#endif
