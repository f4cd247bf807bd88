// The process's CUDA state (runtime.h): device, stream, cuBLASLt handle, workspaces.
#include "kernels/cuda/runtime.h"

#include <fmt/format.h>

#include <cstdlib>
#include <mutex>

#include "core/error.h"
#include "kernels/cuda/launch.h"

namespace lathe::cuda {

void fail(const std::string& message) { throw_error("{}", message); }

void throw_cuda(cudaError_t e, const char* call, const char* file, int line) {
  cudaGetLastError();  // clear a sticky launch error so that the next call reports its own
  throw_error("CUDA error in {} ({}:{}): {}: {}", call, file, line, cudaGetErrorName(e), cudaGetErrorString(e));
}

void throw_cublas(cublasStatus_t s, const char* call, const char* file, int line) {
  throw_error("cuBLASLt error in {} ({}:{}): {} ({})", call, file, line, cublasLtGetStatusName(s),
              cublasLtGetStatusString(s));
}

namespace {

struct State {
  int device = -1;
  cudaStream_t stream = nullptr;
  cublasLtHandle_t lt = nullptr;
  void* lt_workspace = nullptr;
  void* slots[kSlots] = {};
  size_t slot_bytes[kSlots] = {};
  void* pinned = nullptr;
  size_t pinned_bytes = 0;
  std::mutex mu;
};

// Never destroyed: the driver may be shutting down at static destruction, and the process's
// device memory goes with the process.
State& state() {
  static State* s = new State;
  return *s;
}

State& ready() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.device >= 0) return s;
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) throw_cuda(e, "cudaGetDeviceCount", __FILE__, __LINE__);
  const DeviceChoice c = choose_device(std::getenv("OMPI_COMM_WORLD_LOCAL_RANK"), std::getenv("LOCAL_RANK"), count);
  LATHE_CUDA_CHECK(cudaSetDevice(c.device));
  LATHE_CUDA_CHECK(cudaStreamCreateWithFlags(&s.stream, cudaStreamNonBlocking));
  LATHE_CUBLAS_CHECK(cublasLtCreate(&s.lt));
  LATHE_CUDA_CHECK(cudaMalloc(&s.lt_workspace, kCublasLtWorkspaceBytes));
  s.device = c.device;
  return s;
}

}  // namespace

std::string unavailable_reason() {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return fmt::format("cudaGetDeviceCount: {}: {}", cudaGetErrorName(e), cudaGetErrorString(e));
  }
  if (count < 1) return "cudaGetDeviceCount: no CUDA device";
  return {};
}

int device() { return ready().device; }

void bind_thread() { LATHE_CUDA_CHECK(cudaSetDevice(device())); }

cudaStream_t stream() { return ready().stream; }

cublasLtHandle_t cublaslt() { return ready().lt; }

void* cublaslt_workspace() { return ready().lt_workspace; }

void* workspace(int slot, size_t bytes) {
  LATHE_CHECK(slot >= 0 && slot < kSlots, "cuda workspace slot {} out of range", slot);
  State& s = ready();
  std::lock_guard<std::mutex> lock(s.mu);
  if (bytes > s.slot_bytes[slot]) {
    // Grown rarely (first calls of a new size): wait for the kernels that may still read the old one.
    LATHE_CUDA_CHECK(cudaStreamSynchronize(s.stream));
    if (s.slots[slot]) LATHE_CUDA_CHECK(cudaFree(s.slots[slot]));
    s.slots[slot] = nullptr;
    s.slot_bytes[slot] = 0;
    const size_t grown = (bytes + 255) / 256 * 256;
    LATHE_CUDA_CHECK(cudaMalloc(&s.slots[slot], grown));
    s.slot_bytes[slot] = grown;
  }
  return s.slots[slot];
}

void* pinned_staging(size_t bytes) {
  State& s = ready();
  std::lock_guard<std::mutex> lock(s.mu);
  if (bytes > s.pinned_bytes) {
    LATHE_CUDA_CHECK(cudaStreamSynchronize(s.stream));
    if (s.pinned) LATHE_CUDA_CHECK(cudaFreeHost(s.pinned));
    s.pinned = nullptr;
    s.pinned_bytes = 0;
    LATHE_CUDA_CHECK(cudaMallocHost(&s.pinned, bytes));
    s.pinned_bytes = bytes;
  }
  return s.pinned;
}

std::string device_description() {
  cudaDeviceProp p{};
  LATHE_CUDA_CHECK(cudaGetDeviceProperties(&p, device()));
  return fmt::format("{} (sm_{}{}, {:.1f} GiB)", p.name, p.major, p.minor,
                     static_cast<double>(p.totalGlobalMem) / (1024.0 * 1024.0 * 1024.0));
}

}  // namespace lathe::cuda
