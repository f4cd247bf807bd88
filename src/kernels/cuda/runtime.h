// The CUDA runtime state of a process, shared by the CUDA backend (backend_cuda.cpp), its kernels
// (kernels/cuda/*.cu) and the CUDA parts of other areas (NCCL, device-resident training):
//  * one GPU per process, chosen on first use from the launcher's local rank (launch.h),
//  * one stream on it: every kernel, memset and copy of the backend is issued on stream(), so work
//    is ordered without device-wide synchronisation; Backend::synchronize waits for it,
//  * one cuBLASLt handle and its workspace (kCublasLtWorkspaceBytes), used by the GEMMs,
//  * device workspaces that kernels without a scratch argument grow once and then reuse
//    (workspace(slot, bytes)), and a pinned host staging buffer (pinned_staging) for overlapped
//    host <-> device copies of data and checkpoints.
// Errors name the failing call and the CUDA error string (lathe::Error).
#pragma once
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace lathe::cuda {

// Throws lathe::Error with `message` (for .cu files, which cannot include fmt: nvcc's C++20
// front end rejects fmt 9's consteval format strings).
[[noreturn]] void fail(const std::string& message);
#define LATHE_CUDA_REQUIRE(cond, message)      \
  do {                                         \
    if (!(cond)) ::lathe::cuda::fail(message); \
  } while (0)

[[noreturn]] void throw_cuda(cudaError_t e, const char* call, const char* file, int line);
[[noreturn]] void throw_cublas(cublasStatus_t s, const char* call, const char* file, int line);

#define LATHE_CUDA_CHECK(call)                                                                                 \
  do {                                                                                                         \
    const cudaError_t lathe_cuda_err_ = (call);                                                                \
    if (lathe_cuda_err_ != cudaSuccess) ::lathe::cuda::throw_cuda(lathe_cuda_err_, #call, __FILE__, __LINE__); \
  } while (0)
#define LATHE_CUBLAS_CHECK(call)                                                \
  do {                                                                          \
    const cublasStatus_t lathe_cublas_st_ = (call);                             \
    if (lathe_cublas_st_ != CUBLAS_STATUS_SUCCESS)                              \
      ::lathe::cuda::throw_cublas(lathe_cublas_st_, #call, __FILE__, __LINE__); \
  } while (0)
// After a kernel launch: a bad configuration is reported at once, naming the kernel.
#define LATHE_CUDA_LAUNCHED(kernel_name) LATHE_CUDA_CHECK(cudaPeekAtLastError() /* kernel_name */)

// Why no GPU can be used here ("" when one can): the cudaGetDeviceCount error or "no CUDA device".
std::string unavailable_reason();
// The device of this process (selected and made current on the first call; throws when none).
int device();
// Makes device() current on the calling thread (threads other than the first one start on device 0).
void bind_thread();
cudaStream_t stream();
cublasLtHandle_t cublaslt();
void* cublaslt_workspace();  // kCublasLtWorkspaceBytes of device memory
// A device buffer of at least `bytes` for internal use by one kernel family (slot < kSlots),
// allocated the first time and grown (never shrunk) when a call needs more; stream-ordered reuse.
constexpr int kSlots = 8;
enum Slot : int {
  kSlotColSum = 0,
  kSlotEmbedding = 1,
  kSlotAttention = 2,
  kSlotLoss = 3,
  kSlotOptim = 4,
  kSlotCudnn = 5,  // cuDNN SDPA workspaces (attention_cudnn.cpp)
  kSlotRope = 6    // rope_tables' inv_freq copied from the host
};
void* workspace(int slot, size_t bytes);
// A pinned (page-locked) host buffer of at least `bytes`, grown when needed; for staging copies.
// The caller orders its use against stream() (the buffer is shared by the process).
void* pinned_staging(size_t bytes);
// Staged uploads of per-pass inputs (Backend::stage_upload / wait_staged, kernels/backend.h): a
// second (copy) stream and a ring of kStagingSlots pinned host buffers, each with an event recorded
// after its copy. An upload memcpys into the next ring buffer (after a host wait on that buffer's
// previous copy, issued kStagingSlots uploads earlier and normally long done), makes the copy stream
// wait for the work issued so far on stream(), copies, and records the buffer's event; wait_staged
// makes stream() wait on that event. Ticket 0: nothing to wait for.
constexpr int kStagingSlots = 8;
uint64_t stage_upload(void* dst, const void* src, size_t bytes);
void wait_staged(uint64_t ticket);
// Waits on the host for every staged upload issued so far (Backend::synchronize).
void synchronize_uploads();
// Human-readable name and memory of device(): "NVIDIA H200 (sm_90, 139.8 GiB)".
std::string device_description();

}  // namespace lathe::cuda
