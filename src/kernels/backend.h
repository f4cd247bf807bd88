// The kernel backend seam: a Backend owns a kind of memory (alloc/free/memset/copy/synchronize),
// one op table per compute dtype it implements, and one table of training-step ops (the optimizer
// update, gradient norm, non-finite check and scale over fp32 buffers: kernels/step_ops.h). The model body calls
// kernels only through an `Ops` table, so a bf16 path and a CUDA backend plug in as new tables without touching the
// body.
//
// One table per (backend, compute dtype), as ggml's backend vtables: `Ops` is a struct of function
// pointers with the operations of kernels/cpu/ops.h (same argument order, same gradient conventions,
// read that file for the math and the shapes) plus their scratch sizes, so no caller needs to know
// a backend's thread count. The CPU fp32 table is the reference implementation; others are checked
// against the same double references (tests/kernels/test_backend_ops.cpp).
//
// Element types in a table's signatures say which buffers follow its compute dtype:
//  * `void*` / `const void*` buffers hold elements of the table's dtype: activations, activation
//    gradients, and the weight operands of GEMMs and the embedding (a bf16 table reads bf16 copies
//    of the fp32 master weights).
//  * `float*` buffers are fp32 in every table: norm statistics (mean, rstd), attention's lse, the
//    losses, parameter gradients (dweight, dbias, dwte, ...: they accumulate into the fp32 gradient
//    buffer), biases and norm weights, the RoPE tables.
//  * `scratch` is untyped backend memory of at least the size the table's *_scratch_bytes returns.
// Every pointer is in the backend's memory (on the CPU backend: host memory).
#pragma once
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/dtype.h"
#include "kernels/step_ops.h"

namespace lathe {

// The vocabulary split of tensor parallelism (parallel/tensor_parallel.h) as the lm-head loss sees
// it: this rank's w holds rows [vocab_begin, vocab_begin + V) of a vocabulary of global_V rows, and
// all_reduce combines per-row statistics across the group. Passed as a nullable pointer: nullptr is
// the whole vocabulary on one rank.
struct VocabParallel {
  int64_t vocab_begin = 0;
  int64_t global_V = 0;
  // In place over `count` doubles in the backend's memory, across the vocab-parallel group: the
  // element-wise maximum when `max`, else the sum (in rank order, src/dist/comm.h). Called in the
  // same order on every rank (collective). A plain function pointer and its context: the model has
  // no communicator (tensor_parallel.cpp installs both through StepHooks::tp.vocab).
  void (*all_reduce)(void* ctx, double* buf, int64_t count, bool max) = nullptr;
  void* ctx = nullptr;
};

struct Ops {
  // Which table this is (errors and test names): backend name ("cpu") and compute dtype.
  const char* backend = "";
  DType dtype = DType::F32;

  // ---- matmul: out[M,N] = inp[M,K] @ weight[N,K]^T (+ bias[N]) ---------------------------------
  void (*matmul_forward)(void* out, const void* inp, const void* weight, const float* bias, int64_t M, int64_t K,
                         int64_t N, bool accumulate) = nullptr;
  void (*matmul_backward)(void* dinp, float* dweight, float* dbias, const void* dout, const void* inp,
                          const void* weight, int64_t M, int64_t K, int64_t N, bool accumulate_dinp) = nullptr;
  // The GELU MLP's up-projection fused: pre[M,N] = inp[M,K] @ weight[N,K]^T (+ bias[N]) and
  // out[M,N] = gelu(pre), both "=" in the table's dtype; backward is gelu_backward(pre) then
  // matmul_backward, as for the unfused pair. The CPU tables run exactly that pair
  // (matmul_forward, gelu_forward: the same bits); CUDA uses cuBLASLt's GELU_AUX_BIAS epilogue, whose
  // GELU reads the fp32 accumulator (the unrounded pre) where the shape allows (kernels/cuda/matmul.cu).
  void (*matmul_bias_gelu_forward)(void* out, void* pre, const void* inp, const void* weight, const float* bias,
                                   int64_t M, int64_t K, int64_t N) = nullptr;

  // ---- token + learned position embedding -----------------------------------------------------
  // positions [B, T] (nullptr: position t): the wpe row of each token (documents restart at 0).
  // wte holds vocabulary rows [vocab_begin, vocab_begin + vocab_rows) ([vocab_rows, C]; the whole
  // table: 0, V): a token outside them contributes a zero row in forward (out = wpe row, or 0
  // without wpe) and no gradient in backward (vocab-parallel embedding: the partial outputs of the
  // shards are summed across the group by the caller, and wpe is passed to one shard only).
  void (*embedding_forward)(void* out, const int32_t* tokens, const void* wte, const void* wpe, int64_t B, int64_t T,
                            int64_t C, const int32_t* positions, int64_t vocab_begin, int64_t vocab_rows) = nullptr;
  void (*embedding_backward)(float* dwte, float* dwpe, const void* dout, const int32_t* tokens, int64_t B, int64_t T,
                             int64_t C, const int32_t* positions, int64_t vocab_begin, int64_t vocab_rows) = nullptr;

  // ---- LayerNorm / RMSNorm -------------------------------------------------------------------
  void (*layernorm_forward)(void* out, float* mean, float* rstd, const void* inp, const float* weight,
                            const float* bias, int64_t N, int64_t C, float eps) = nullptr;
  void (*layernorm_backward)(void* dinp, float* dweight, float* dbias, const void* dout, const void* inp,
                             const float* weight, const float* mean, const float* rstd, int64_t N, int64_t C,
                             void* scratch) = nullptr;
  size_t (*layernorm_scratch_bytes)(int64_t C) = nullptr;
  void (*rmsnorm_forward)(void* out, float* rstd, const void* inp, const float* weight, int64_t N, int64_t C,
                          float eps) = nullptr;
  void (*rmsnorm_backward)(void* dinp, float* dweight, const void* dout, const void* inp, const float* weight,
                           const float* rstd, int64_t N, int64_t C, void* scratch) = nullptr;
  size_t (*rmsnorm_scratch_bytes)(int64_t C) = nullptr;
  // Per-head RMSNorm in place (Qwen3's q_norm / k_norm; kernels/cpu/rmsnorm.cpp states it): rows of
  // D elements, row (n, h) of N tokens x `heads` at x + n * stride + h * D (elements of the compute
  // dtype). Forward copies each row to saved[(n * heads + h) * D] (backward's input) and normalises
  // it in place (rstd[N * heads]); backward overwrites the rows' d(out) with d(in), dweight[D] +=.
  void (*head_rmsnorm_forward)(void* x, void* saved, float* rstd, const float* weight, int64_t N, int64_t heads,
                               int64_t D, int64_t stride, float eps) = nullptr;
  void (*head_rmsnorm_backward)(void* dx, float* dweight, const void* saved, const float* weight, const float* rstd,
                                int64_t N, int64_t heads, int64_t D, int64_t stride, void* scratch) = nullptr;
  size_t (*head_rmsnorm_scratch_bytes)(int64_t D) = nullptr;

  // ---- pointwise -------------------------------------------------------------------------------
  void (*gelu_forward)(void* out, const void* inp, int64_t n) = nullptr;
  void (*gelu_backward)(void* dinp, const void* inp, const void* dout, int64_t n) = nullptr;
  // Exact GELU x * Phi(x) (erf; HF "gelu", GPT-NeoX): the same contract as gelu_forward/backward.
  void (*gelu_erf_forward)(void* out, const void* inp, int64_t n) = nullptr;
  void (*gelu_erf_backward)(void* dinp, const void* inp, const void* dout, int64_t n) = nullptr;
  void (*swiglu_forward)(void* out, const void* inp, int64_t N, int64_t F) = nullptr;
  void (*swiglu_backward)(void* dinp, const void* inp, const void* dout, int64_t N, int64_t F) = nullptr;
  // GeGLU (Gemma 2): gelu_tanh(gate) * up on the same gate|up layout, the same contract as swiglu.
  void (*geglu_forward)(void* out, const void* inp, int64_t N, int64_t F) = nullptr;
  void (*geglu_backward)(void* dinp, const void* inp, const void* dout, int64_t N, int64_t F) = nullptr;
  void (*residual_forward)(void* out, const void* a, const void* b, int64_t n) = nullptr;
  // out[N, C] += bias[C] (bias fp32): the bias of a row-parallel GEMM, added once after the
  // tensor-parallel reduction of the partial products (src/parallel/tensor_parallel.h).
  void (*bias_add)(void* out, const float* bias, int64_t N, int64_t C) = nullptr;
  // x[n] = x[n] * s in place: the product in fp32, rounded once to the table's dtype (gemma2's
  // embedding scale sqrt(hidden) and its gradient; the caller rounds s to the dtype as HF does).
  void (*scale_forward)(void* x, float s, int64_t n) = nullptr;
  // out[n] = offset + w[n] in fp32 (gemma2's (1 + w) RMSNorm weights, formed where w lives).
  void (*offset_weights)(float* out, const float* w, float offset, int64_t n) = nullptr;

  // ---- rotary position embedding (tables fp32 [T, rot/2]) ---------------------------------------
  // rope_tables: inv_freq is host memory [half] (config/rope_scaling.h computes it; the CUDA slot
  // copies it to the device), tables = cos/sin(float(t) * inv_freq) x attention_factor.
  // rope_forward/backward rotate the first `rot` of the D dims of each head (rot = D: all).
  // positions [B, T] (nullptr: position t): the table row of each token.
  void (*rope_tables)(float* cos_table, float* sin_table, int64_t T, int64_t half, const float* inv_freq,
                      float attention_factor) = nullptr;
  void (*rope_forward)(void* x, const float* cos_table, const float* sin_table, int64_t B, int64_t T, int64_t n_heads,
                       int64_t D, int64_t rot, int64_t row_stride, const int32_t* positions) = nullptr;
  void (*rope_backward)(void* dx, const float* cos_table, const float* sin_table, int64_t B, int64_t T, int64_t n_heads,
                        int64_t D, int64_t rot, int64_t row_stride, const int32_t* positions) = nullptr;

  // ---- causal grouped-query attention ----------------------------------------------------------
  // doc_start [B, T] (nullptr: plain causal): token t attends to keys [doc_start[b,t], t] only
  // (documents packed in a sample; kernels/cpu/ops.h states the contract). window > 0: sliding
  // window, token t also sees only keys j > t - window (0 = none; >= T is none too).
  // scale: the score scale (0 = 1/sqrt(D)); softcap > 0: scores capped to softcap * tanh(s / softcap)
  // before the softmax (Gemma 2; 0 = none).
  void (*attention_forward)(void* out, float* lse, const void* qkv, int64_t B, int64_t T, int64_t H, int64_t KVH,
                            int64_t D, void* scratch, const int32_t* doc_start, int64_t window, float scale,
                            float softcap) = nullptr;
  void (*attention_backward)(void* dqkv, const void* dout, const void* qkv, const void* out, const float* lse,
                             int64_t B, int64_t T, int64_t H, int64_t KVH, int64_t D, void* scratch,
                             const int32_t* doc_start, int64_t window, float scale, float softcap) = nullptr;
  size_t (*attention_scratch_bytes)(int64_t T, int64_t D) = nullptr;

  // ---- lm head + softmax + cross-entropy, chunked over rows ------------------------------------
  // vp == nullptr: w is the whole [V, C] output embedding (kernels/cpu/ops.h states the math).
  // vp != nullptr (vocab parallel): w[V, C] holds rows [vp->vocab_begin, +V) of vp->global_V; targets
  // are global ids in [0, global_V) (or < 0: ignored). Per chunk: local logits [R, V], the row max
  // all-reduced (max), then the sum of exp(logit - max) and the target logit (from the shard that
  // holds it, 0 elsewhere) all-reduced (sum), so losses (and the returned sum) are the whole
  // vocabulary's, the same on every rank. dw gets this shard's rows; dx receives this shard's
  // PARTIAL input gradient (dlogits_local @ w): the caller sums dx across the group.
  // softcap > 0 (Gemma 2's final_logit_softcapping): every logit l becomes softcap * tanh(l / softcap)
  // before the softmax and the loss, and dlogits are multiplied by 1 - tanh^2 (0 = none).
  double (*lm_head_loss)(float* losses, void* dx, float* dw, const void* x, const void* w, const int32_t* targets,
                         int64_t N, int64_t C, int64_t V, float grad_scale, bool backward, void* scratch,
                         int64_t chunk_rows, const VocabParallel* vp, float softcap) = nullptr;
  size_t (*lm_head_loss_scratch_bytes)(int64_t chunk_rows, int64_t V) = nullptr;

  // ---- fp32 logits (evaluation, generation) -----------------------------------------------------
  // logits[M, V] (fp32 in every table) = x[M, C] @ w[V, C]^T, products accumulated in fp32.
  void (*logits_forward)(float* logits, const void* x, const void* w, int64_t M, int64_t C, int64_t V) = nullptr;
};

// Calls f(name, implemented) for every operation slot of `ops`, in declaration order.
template <typename F>
void for_each_op(const Ops& ops, F&& f);

enum class DeviceKind : uint8_t { Host, Cuda };

// What a device backend reports about the device this process computes on: the MFU peak's
// estimate (train/peak.h) and the run's startup report.
struct DeviceInfo {
  std::string name;  // "NVIDIA H200"
  int cc_major = 0, cc_minor = 0;
  int sm_count = 0;
  int clock_khz = 0;  // peak SM clock
};
std::string_view device_kind_name(DeviceKind k);

enum class CopyKind : uint8_t { HostToDevice, DeviceToHost, DeviceToDevice };

// A backend: its memory and its op tables. Backends are process-lifetime singletons.
class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string_view name() const = 0;  // "cpu", "cuda"
  virtual DeviceKind device() const = 0;
  // `bytes` of backend memory, 64-byte aligned, NOT initialised; throws lathe::Error when it cannot.
  virtual void* alloc(size_t bytes) const = 0;
  virtual void free(void* p) const = 0;
  virtual void memset(void* dst, int value, size_t bytes) const = 0;
  virtual void copy(void* dst, const void* src, size_t bytes, CopyKind kind) const = 0;
  // Waits until every operation issued on this backend has finished (a no-op on the CPU).
  virtual void synchronize() const = 0;
  // Staged host -> backend copies of per-pass inputs (token ids, targets), overlapped with compute.
  // stage_upload copies `bytes` of host `src` into host staging memory (src may be reused as soon as
  // it returns; on CUDA a ring of pinned buffers) and starts the copy into backend memory `dst` on a
  // copy stream, ordered AFTER the work issued on this backend so far (which may still read dst's
  // old contents) and concurrent with the work issued later; the host does not wait for it. It
  // returns a ticket: wait_staged(ticket) makes the work issued afterwards wait for that copy (on
  // CUDA the compute stream waits on the copy's event; the host still does not wait). Defaults (CPU,
  // the stand-in): a plain copy() and nothing to wait for.
  virtual uint64_t stage_upload(void* dst, const void* src, size_t bytes) const {
    copy(dst, src, bytes, CopyKind::HostToDevice);
    return 0;
  }
  virtual void wait_staged(uint64_t ticket) const { (void)ticket; }
  // dst[n] (BF16 or F16) = src[n] (fp32), both in this backend's memory, ordered on its stream:
  // the compute-dtype weight copies refreshed where the masters are (after every optimizer step of
  // a device-resident model). Returns false when the backend has no such conversion (the caller
  // then converts a host copy).
  virtual bool convert_from_f32(void* dst, DType dst_dtype, const float* src, int64_t n) const {
    (void)dst, (void)dst_dtype, (void)src, (void)n;
    return false;
  }
  // The op tables of this backend, complete or not (one per compute dtype).
  virtual std::vector<const Ops*> op_tables() const = 0;
  // The device's facts; std::nullopt for host backends and where no device is usable.
  virtual std::optional<DeviceInfo> device_info() const { return std::nullopt; }
  // The training-step ops of this backend (kernels/step_ops.h: optimizer update, gradient norm,
  // non-finite check, scale over fp32 buffers in its memory), or nullptr when it has none (the
  // no-CUDA stand-in).
  virtual const StepOps* step_ops() const { return nullptr; }
  // Why this backend cannot run in this process ("" when it can): e.g. the CUDA backend on a machine
  // without a GPU ("cudaGetDeviceCount: CUDA driver version is insufficient ..."). Tests skip with it.
  virtual std::string unavailable() const { return {}; }
  // The complete table of `compute` whose attention slots run cuDNN's fused SDPA (the recipe's
  // model.attention_kernel: cudnn), or nullptr with *why saying what is missing (this backend has
  // none: the CPU; a build without cuDNN; a dtype cuDNN's SDPA does not compute in).
  virtual const Ops* cudnn_attention_ops(DType compute, std::string* why) const;
};

const Backend& cpu_backend();
// A backend named "cuda" for builds without CUDA: it links everywhere, implements no dtype, and
// every memory call throws "[alloc] no CUDA implementation: ...".
const Backend& no_cuda_backend();
// The backend named "cuda" of this build: the CUDA backend (kernels/cuda, built with LATHE_CUDA=ON;
// it has op tables even where no GPU is present, see Backend::unavailable) or no_cuda_backend().
const Backend& cuda_backend();
// Every backend of this build (cpu first); backend_by_name throws naming the known ones.
const std::vector<const Backend*>& backends();
const Backend& backend_by_name(std::string_view name);

// "fp32", "bf16", "fp16": the spelling of a compute dtype in recipes and messages.
std::string compute_dtype_name(DType t);

// The complete op table of (backend, compute dtype). If the backend has no table for the dtype, or
// its table lacks an op, throws lathe::Error naming the first missing op, the dtype, the backend and
// the dtypes that implement that op there: "[matmul_forward] no bf16 implementation on cpu;
// implemented: fp32".
const Ops& ops_for(const Backend& backend, DType compute);
// ops_for with the attention slots of `attention_kernel`: "lathe" (ops_for's table) or "cudnn"
// (Backend::cudnn_attention_ops). Throws naming the kernel, the backend, the dtype and the reason.
const Ops& ops_for(const Backend& backend, DType compute, std::string_view attention_kernel);
// The table of (backend, dtype) as registered (possibly partial), or nullptr.
const Ops* find_ops(const Backend& backend, DType compute);
// Every (backend, compute dtype) with a complete table.
std::vector<std::pair<const Backend*, DType>> implemented_ops();

// Owning, zero-initialised backend memory holding `count` elements of `dtype` (64-byte aligned).
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(const Backend& backend, size_t count, DType dtype) { resize(backend, count, dtype); }
  ~DeviceBuffer() { release(); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept { swap(o); }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    swap(o);
    return *this;
  }

  // touch false on a host backend: zeroed without making the pages resident (core/buffer.h's
  // zero_untouched); device memory is zeroed as always.
  void resize(const Backend& backend, size_t count, DType dtype, bool touch = true);
  void zero();
  void* data() { return ptr_; }
  const void* data() const { return ptr_; }
  size_t size() const { return count_; }
  size_t bytes() const { return count_ * dtype_size(dtype_); }
  DType dtype() const { return dtype_; }
  const Backend* backend() const { return backend_; }

 private:
  void release();
  void swap(DeviceBuffer& o) noexcept {
    std::swap(backend_, o.backend_);
    std::swap(ptr_, o.ptr_);
    std::swap(count_, o.count_);
    std::swap(dtype_, o.dtype_);
  }
  const Backend* backend_ = nullptr;
  void* ptr_ = nullptr;
  size_t count_ = 0;
  DType dtype_ = DType::F32;
};

// ---- implementation of for_each_op -------------------------------------------------------------
template <typename F>
void for_each_op(const Ops& o, F&& f) {
#define LATHE_OP(name) f(#name, o.name != nullptr)
  LATHE_OP(matmul_forward);
  LATHE_OP(matmul_backward);
  LATHE_OP(matmul_bias_gelu_forward);
  LATHE_OP(embedding_forward);
  LATHE_OP(embedding_backward);
  LATHE_OP(layernorm_forward);
  LATHE_OP(layernorm_backward);
  LATHE_OP(layernorm_scratch_bytes);
  LATHE_OP(rmsnorm_forward);
  LATHE_OP(rmsnorm_backward);
  LATHE_OP(rmsnorm_scratch_bytes);
  LATHE_OP(head_rmsnorm_forward);
  LATHE_OP(head_rmsnorm_backward);
  LATHE_OP(head_rmsnorm_scratch_bytes);
  LATHE_OP(gelu_forward);
  LATHE_OP(gelu_backward);
  LATHE_OP(gelu_erf_forward);
  LATHE_OP(gelu_erf_backward);
  LATHE_OP(swiglu_forward);
  LATHE_OP(swiglu_backward);
  LATHE_OP(geglu_forward);
  LATHE_OP(geglu_backward);
  LATHE_OP(residual_forward);
  LATHE_OP(bias_add);
  LATHE_OP(scale_forward);
  LATHE_OP(offset_weights);
  LATHE_OP(rope_tables);
  LATHE_OP(rope_forward);
  LATHE_OP(rope_backward);
  LATHE_OP(attention_forward);
  LATHE_OP(attention_backward);
  LATHE_OP(attention_scratch_bytes);
  LATHE_OP(lm_head_loss);
  LATHE_OP(lm_head_loss_scratch_bytes);
  LATHE_OP(logits_forward);
#undef LATHE_OP
}
// A slot added to Ops but not to the list above would escape the completeness check of ops_for.
static_assert(sizeof(Ops) == offsetof(Ops, matmul_forward) + 35 * sizeof(void (*)()),
              "Ops gained or lost a slot: update for_each_op");

}  // namespace lathe
