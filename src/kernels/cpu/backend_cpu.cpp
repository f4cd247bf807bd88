// The CPU backend: host memory and the CPU op tables. The fp32 table forwards each slot to the
// kernel of kernels/cpu/ops.h with the same name and argument order (only the pointer types differ:
// the table's void* buffers are fp32 here), so results are those of the direct calls, bit for bit.
#include <cstdlib>
#include <cstring>

#include "core/error.h"
#include "kernels/cpu/op_slots.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/tables.h"

namespace lathe {

namespace cpu {
namespace {

float* f(void* p) { return static_cast<float*>(p); }
const float* f(const void* p) { return static_cast<const float*>(p); }

void matmul_forward_f32(void* out, const void* inp, const void* weight, const float* bias, int64_t M, int64_t K,
                        int64_t N, bool accumulate) {
  matmul_forward(f(out), f(inp), f(weight), bias, M, K, N, accumulate);
}
void matmul_backward_f32(void* dinp, float* dweight, float* dbias, const void* dout, const void* inp,
                         const void* weight, int64_t M, int64_t K, int64_t N, bool accumulate_dinp) {
  matmul_backward(f(dinp), dweight, dbias, f(dout), f(inp), f(weight), M, K, N, accumulate_dinp);
}
void attention_forward_f32(void* out, float* lse, const void* qkv, int64_t B, int64_t T, int64_t H, int64_t KVH,
                           int64_t D, void* scratch, const int32_t* doc_start) {
  attention_forward(f(out), lse, f(qkv), B, T, H, KVH, D, f(scratch), doc_start);
}
void attention_backward_f32(void* dqkv, const void* dout, const void* qkv, const void* out, const float* lse, int64_t B,
                            int64_t T, int64_t H, int64_t KVH, int64_t D, void* scratch, const int32_t* doc_start) {
  attention_backward(f(dqkv), f(dout), f(qkv), f(out), lse, B, T, H, KVH, D, f(scratch), doc_start);
}
size_t attention_scratch_bytes_f32(int64_t T, int64_t D) { return attention_scratch_floats(T, D) * sizeof(float); }
double lm_head_loss_f32(float* losses, void* dx, float* dw, const void* x, const void* w, const int32_t* targets,
                        int64_t N, int64_t C, int64_t V, float grad_scale, bool backward, void* scratch,
                        int64_t chunk_rows, const VocabParallel* vp) {
  if (vp != nullptr)
    return lm_head_loss_vocab_parallel(losses, f(dx), dw, f(x), f(w), targets, N, C, V, grad_scale, backward,
                                       f(scratch), chunk_rows, *vp);
  return lm_head_loss(losses, f(dx), dw, f(x), f(w), targets, N, C, V, grad_scale, backward, f(scratch), chunk_rows);
}
// The logits of one chunk: chunk_rows x V floats.
size_t lm_head_loss_scratch_bytes_f32(int64_t chunk_rows, int64_t V) {
  return static_cast<size_t>(chunk_rows) * static_cast<size_t>(V) * sizeof(float);
}

void logits_forward_f32(float* logits, const void* x, const void* w, int64_t M, int64_t C, int64_t V) {
  matmul_forward(logits, f(x), f(w), nullptr, M, C, V, false);
}

Ops make_fp32_ops() {
  Ops o;
  o.backend = "cpu";
  o.dtype = DType::F32;
  o.matmul_forward = matmul_forward_f32;
  o.matmul_backward = matmul_backward_f32;
  o.matmul_bias_gelu_forward = matmul_bias_gelu_unfused<fp32_ops>;
  add_embedding<F32>(o);
  add_layernorm<F32>(o);
  add_rmsnorm<F32>(o);
  add_pointwise<F32>(o);
  add_rope<F32>(o);
  o.attention_forward = attention_forward_f32;
  o.attention_backward = attention_backward_f32;
  o.attention_scratch_bytes = attention_scratch_bytes_f32;
  o.lm_head_loss = lm_head_loss_f32;
  o.lm_head_loss_scratch_bytes = lm_head_loss_scratch_bytes_f32;
  o.logits_forward = logits_forward_f32;
  return o;
}

}  // namespace

const Ops& fp32_ops() {
  static const Ops table = make_fp32_ops();
  return table;
}

}  // namespace cpu

namespace {

class CpuBackend final : public Backend {
 public:
  std::string_view name() const override { return "cpu"; }
  DeviceKind device() const override { return DeviceKind::Host; }
  void* alloc(size_t bytes) const override {
    const size_t rounded = (bytes + 63) / 64 * 64;  // aligned_alloc wants a multiple of the alignment
    LATHE_CHECK(rounded >= bytes, "cpu backend: allocation of {} bytes overflows", bytes);
    void* p = std::aligned_alloc(64, rounded == 0 ? 64 : rounded);
    LATHE_CHECK(p != nullptr, "out of memory allocating {} bytes", rounded);
    return p;
  }
  void free(void* p) const override { std::free(p); }
  void memset(void* dst, int value, size_t bytes) const override {
    if (bytes) std::memset(dst, value, bytes);
  }
  void copy(void* dst, const void* src, size_t bytes, CopyKind) const override {
    if (bytes) std::memcpy(dst, src, bytes);
  }
  void synchronize() const override {}
  std::vector<const Ops*> op_tables() const override { return {&cpu::fp32_ops(), &cpu::bf16_ops(), &cpu::fp16_ops()}; }
};

}  // namespace

const Backend& cpu_backend() {
  static const CpuBackend backend;
  return backend;
}

}  // namespace lathe
