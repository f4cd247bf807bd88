// The process's CUDA state (runtime.h): device, stream, cuBLASLt handle, workspaces.
#include "kernels/cuda/runtime.h"

#include <fmt/format.h>

#include <cstdlib>
#include <cstring>
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
  // Staged uploads (runtime.h): created on the first one.
  struct Staging {
    void* host = nullptr;  // pinned
    size_t bytes = 0;
    cudaEvent_t done = nullptr;  // recorded on copy_stream after this buffer's copy
    uint64_t ticket = 0;         // the upload that used it last (0: none)
  };
  cudaStream_t copy_stream = nullptr;
  cudaEvent_t issued = nullptr;  // recorded on `stream` at each upload: the copy waits for it
  Staging ring[kStagingSlots];
  uint64_t next_ticket = 1;
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

uint64_t stage_upload(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return 0;
  State& s = ready();
  std::lock_guard<std::mutex> lock(s.mu);
  if (!s.copy_stream) {
    LATHE_CUDA_CHECK(cudaStreamCreateWithFlags(&s.copy_stream, cudaStreamNonBlocking));
    LATHE_CUDA_CHECK(cudaEventCreateWithFlags(&s.issued, cudaEventDisableTiming));
    for (State::Staging& b : s.ring) LATHE_CUDA_CHECK(cudaEventCreateWithFlags(&b.done, cudaEventDisableTiming));
  }
  const uint64_t ticket = s.next_ticket++;
  State::Staging& b = s.ring[ticket % kStagingSlots];
  // The copy out of this pinned buffer kStagingSlots uploads ago must be done before it is refilled.
  if (b.ticket) LATHE_CUDA_CHECK(cudaEventSynchronize(b.done));
  if (bytes > b.bytes) {
    if (b.host) LATHE_CUDA_CHECK(cudaFreeHost(b.host));
    b.host = nullptr;
    b.bytes = 0;
    const size_t grown = (bytes + 4095) / 4096 * 4096;
    LATHE_CUDA_CHECK(cudaMallocHost(&b.host, grown));
    b.bytes = grown;
  }
  std::memcpy(b.host, src, bytes);
  // After the work issued so far (it may still read dst's previous contents), concurrent with later work.
  LATHE_CUDA_CHECK(cudaEventRecord(s.issued, s.stream));
  LATHE_CUDA_CHECK(cudaStreamWaitEvent(s.copy_stream, s.issued, 0));
  LATHE_CUDA_CHECK(cudaMemcpyAsync(dst, b.host, bytes, cudaMemcpyHostToDevice, s.copy_stream));
  LATHE_CUDA_CHECK(cudaEventRecord(b.done, s.copy_stream));
  b.ticket = ticket;
  return ticket;
}

void wait_staged(uint64_t ticket) {
  if (ticket == 0) return;
  State& s = ready();
  std::lock_guard<std::mutex> lock(s.mu);
  const State::Staging& b = s.ring[ticket % kStagingSlots];
  // A buffer reused since: its old copy was waited for on the host before the reuse (done).
  if (b.ticket != ticket) return;
  LATHE_CUDA_CHECK(cudaStreamWaitEvent(s.stream, b.done, 0));
}

void synchronize_uploads() {
  State& s = ready();
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.copy_stream) LATHE_CUDA_CHECK(cudaStreamSynchronize(s.copy_stream));
}

std::string device_description() {
  cudaDeviceProp p{};
  LATHE_CUDA_CHECK(cudaGetDeviceProperties(&p, device()));
  return fmt::format("{} (sm_{}{}, {:.1f} GiB)", p.name, p.major, p.minor,
                     static_cast<double>(p.totalGlobalMem) / (1024.0 * 1024.0 * 1024.0));
}

}  // namespace lathe::cuda
