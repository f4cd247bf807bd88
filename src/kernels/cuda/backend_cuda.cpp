// The CUDA backend (issue 12): device memory on the process's GPU and stream (runtime.h), one op
// table per compute dtype (fp32, bf16, fp16) of the kernels of kernels/cuda/ops.h, and the step ops
// of kernels/cuda/optimizer.h. Registered
// under the name "cuda" (kernels/backend.cpp's registry) in builds with LATHE_CUDA=ON.
//
// Copies: host <-> device copies wait for the stream before returning, so callers may reuse or read
// their host buffer at once (as on the CPU backend); device -> device copies and memsets are
// stream-ordered and return at once. stage_upload / wait_staged: the pinned ring and copy stream of
// runtime.h (per-pass token ids and targets, overlapped with compute).
#include <fmt/format.h>

#include "core/error.h"
#include "kernels/backend.h"
#include "kernels/cuda/launch.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/optimizer.h"
#include "kernels/cuda/runtime.h"

namespace lathe {

namespace cuda {
namespace {

template <DType D>
Ops make_ops() {
  Ops o;
  o.backend = "cuda";
  o.dtype = D;
  o.matmul_forward = matmul_forward<D>;
  o.matmul_backward = matmul_backward<D>;
  o.matmul_bias_gelu_forward = matmul_bias_gelu_forward<D>;
  o.embedding_forward = embedding_forward<D>;
  o.embedding_backward = embedding_backward<D>;
  o.layernorm_forward = layernorm_forward<D>;
  o.layernorm_backward = layernorm_backward<D>;
  o.layernorm_scratch_bytes = layernorm_scratch_bytes;  // launch.h
  o.rmsnorm_forward = rmsnorm_forward<D>;
  o.rmsnorm_backward = rmsnorm_backward<D>;
  o.rmsnorm_scratch_bytes = rmsnorm_scratch_bytes;  // launch.h
  o.head_rmsnorm_forward = head_rmsnorm_forward<D>;
  o.head_rmsnorm_backward = head_rmsnorm_backward<D>;
  o.head_rmsnorm_scratch_bytes = rmsnorm_scratch_bytes;  // launch.h: kNormPartials x D partials
  o.gelu_forward = gelu_forward<D>;
  o.gelu_backward = gelu_backward<D>;
  o.gelu_erf_forward = gelu_erf_forward<D>;
  o.gelu_erf_backward = gelu_erf_backward<D>;
  o.swiglu_forward = swiglu_forward<D>;
  o.swiglu_backward = swiglu_backward<D>;
  o.geglu_forward = geglu_forward<D>;
  o.geglu_backward = geglu_backward<D>;
  o.residual_forward = residual_forward<D>;
  o.bias_add = bias_add<D>;
  o.scale_forward = scale_forward<D>;
  o.offset_weights = offset_weights;  // fp32 in every dtype
  o.rope_tables = rope_tables;        // fp32 tables in every dtype
  o.rope_forward = rope_forward<D>;
  o.rope_backward = rope_backward<D>;
  o.attention_forward = attention_forward<D>;
  o.attention_backward = attention_backward<D>;
  o.attention_scratch_bytes = attention_scratch_bytes;
  o.lm_head_loss = lm_head_loss<D>;
  o.lm_head_loss_scratch_bytes = lm_head_loss_scratch_bytes<D>;
  o.logits_forward = logits_forward<D>;
  return o;
}

// The bf16 / fp16 tables with cuDNN's SDPA in the attention slots (model.attention_kernel: cudnn).
template <DType D>
Ops make_cudnn_ops() {
  Ops o = make_ops<D>();
  o.attention_forward = cudnn_attention_forward<D>;
  o.attention_backward = cudnn_attention_backward<D>;
  return o;
}

const Ops& fp32_ops() {
  static const Ops t = make_ops<DType::F32>();
  return t;
}
const Ops& bf16_ops() {
  static const Ops t = make_ops<DType::BF16>();
  return t;
}
const Ops& fp16_ops() {
  static const Ops t = make_ops<DType::F16>();
  return t;
}

// The training-step ops (kernels/cuda/optimizer.h).
const StepOps& cuda_step_ops() {
  static const StepOps t = [] {
    StepOps o;
    o.backend = "cuda";
    o.adamw_step = &adamw_step;
    o.lamb_step = &lamb_step;
    o.grad_sq_chunk_sums = &grad_sq_chunk_sums;
    o.global_grad_norm = &global_grad_norm;
    o.has_non_finite = &has_non_finite;
    o.scale_inplace = &scale_inplace;
    o.device_index = [] { return cuda::device(); };
    return o;
  }();
  return t;
}

cudaMemcpyKind kind_of(CopyKind k) {
  switch (k) {
    case CopyKind::HostToDevice:
      return cudaMemcpyHostToDevice;
    case CopyKind::DeviceToHost:
      return cudaMemcpyDeviceToHost;
    case CopyKind::DeviceToDevice:
      return cudaMemcpyDeviceToDevice;
  }
  return cudaMemcpyDefault;
}

class CudaBackend final : public Backend {
 public:
  std::string_view name() const override { return "cuda"; }
  DeviceKind device() const override { return DeviceKind::Cuda; }
  void* alloc(size_t bytes) const override {
    const int dev = cuda::device();
    void* p = nullptr;
    const size_t rounded = bytes == 0 ? 256 : bytes;  // cudaMalloc aligns to 256 bytes (>= 64)
    const cudaError_t e = cudaMalloc(&p, rounded);
    if (e != cudaSuccess) {
      cudaGetLastError();
      size_t free_b = 0, total_b = 0;
      cudaMemGetInfo(&free_b, &total_b);
      throw_error(
          "cuda backend: cudaMalloc of {} bytes ({:.2f} GiB) on device {} failed: {} ({:.2f} of {:.2f} GiB free); "
          "reduce the micro-batch size or enable recompute",
          bytes, gib(bytes), dev, cudaGetErrorString(e), gib(free_b), gib(total_b));
    }
    return p;
  }
  void free(void* p) const override {
    if (p) LATHE_CUDA_CHECK(cudaFree(p));
  }
  void memset(void* dst, int value, size_t bytes) const override {
    if (bytes) LATHE_CUDA_CHECK(cudaMemsetAsync(dst, value, bytes, cuda::stream()));
  }
  void copy(void* dst, const void* src, size_t bytes, CopyKind kind) const override {
    if (!bytes) return;
    LATHE_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, kind_of(kind), cuda::stream()));
    if (kind != CopyKind::DeviceToDevice) LATHE_CUDA_CHECK(cudaStreamSynchronize(cuda::stream()));
  }
  void synchronize() const override {
    LATHE_CUDA_CHECK(cudaStreamSynchronize(cuda::stream()));
    cuda::synchronize_uploads();
  }
  uint64_t stage_upload(void* dst, const void* src, size_t bytes) const override {
    return cuda::stage_upload(dst, src, bytes);
  }
  void wait_staged(uint64_t ticket) const override { cuda::wait_staged(ticket); }
  bool convert_from_f32(void* dst, DType dst_dtype, const float* src, int64_t n) const override {
    cuda::convert(dst, dst_dtype, src, DType::F32, n);  // convert.cu, on the compute stream
    return true;
  }
  std::vector<const Ops*> op_tables() const override { return {&fp32_ops(), &bf16_ops(), &fp16_ops()}; }
  const StepOps* step_ops() const override { return &cuda_step_ops(); }
  std::string unavailable() const override { return cuda::unavailable_reason(); }
  std::optional<DeviceInfo> device_info() const override {
    if (!cuda::unavailable_reason().empty()) return std::nullopt;
    const int dev = cuda::device();  // the backend's GPU of this process
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, dev) != cudaSuccess) return std::nullopt;
    DeviceInfo g;
    g.name = prop.name;
    g.cc_major = prop.major;
    g.cc_minor = prop.minor;
    g.sm_count = prop.multiProcessorCount;
    // cudaDeviceProp::clockRate is gone in CUDA 13: the attribute (kHz) instead.
    if (cudaDeviceGetAttribute(&g.clock_khz, cudaDevAttrClockRate, dev) != cudaSuccess) g.clock_khz = 0;
    return g;
  }
  const Ops* cudnn_attention_ops(DType compute, std::string* why) const override {
    if (std::string e = cuda::cudnn_unavailable_reason(); !e.empty()) {
      *why = e;
      return nullptr;
    }
    static const Ops bf16 = make_cudnn_ops<DType::BF16>(), fp16 = make_cudnn_ops<DType::F16>();
    if (compute == DType::BF16) return &bf16;
    if (compute == DType::F16) return &fp16;
    *why = "cuDNN's SDPA computes in bf16 or fp16, not " + compute_dtype_name(compute);
    return nullptr;
  }

 private:
  static double gib(size_t b) { return static_cast<double>(b) / (1024.0 * 1024.0 * 1024.0); }
};

}  // namespace
}  // namespace cuda

const Backend& cuda_backend() {
  static const cuda::CudaBackend backend;
  return backend;
}

}  // namespace lathe
