// CUDA kernels: the host entry points of every op of the CUDA op tables (backend_cuda.cpp wires them).
// Same contract as kernels/cpu/ops.h and kernels/backend.h's Ops (shapes, "=" / "+=" rules, fp32
// parameter gradients accumulated into the fp32 gradient buffer), with these CUDA specifics:
//  * every pointer is device memory (tokens, positions, targets, doc_start included);
//  * every kernel is issued on the process's stream (runtime.h) and returns without waiting;
//  * element type D of the table: DType::F32, BF16 or F16 storage for the `void*` buffers, fp32
//    math inside every kernel (16-bit values widened, each output rounded once);
//  * deterministic: no floating-point atomics; parameter gradients are reduced in two passes
//    (per-block partial sums in a fixed order, then the partials in order), so two runs of the same
//    call on the same GPU give the same bits;
//  * GEMMs run on cuBLASLt (fp32 compute; fp32 tables without TF32, so fp32 stays the reference).
// Each entry is a template on the table's dtype, explicitly instantiated for F32, BF16 and F16 in
// its .cu file; its signature is exactly its Ops slot's.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

#include "core/dtype.h"
#include "kernels/backend.h"  // VocabParallel

namespace lathe::cuda {

// ================================ cudak1: GEMMs and basic kernels ================================

// ---- matmul.cu: cuBLASLt, out[M,N] = inp[M,K] @ weight[N,K]^T (+ bias[N]) -----------------------
// Forward: bias fused as the cuBLASLt BIAS epilogue (fp32 bias); accumulate: beta = 1 (the sum is
// formed in fp32 and rounded once). Backward: dinp (= / +=) and dweight (+=, fp32 output, beta = 1)
// are GEMMs; dbias (+=) a deterministic two-pass column sum (launch.h col_sum_plan).
template <DType D>
void matmul_forward(void* out, const void* inp, const void* weight, const float* bias, int64_t M, int64_t K, int64_t N,
                    bool accumulate);
// out = gelu(pre), pre[M,N] = inp @ weight^T (+ bias): cuBLASLt's GELU_AUX(_BIAS) epilogue (matmul.cu).
template <DType D>
void matmul_bias_gelu_forward(void* out, void* pre, const void* inp, const void* weight, const float* bias, int64_t M,
                              int64_t K, int64_t N);
template <DType D>
void matmul_backward(void* dinp, float* dweight, float* dbias, const void* dout, const void* inp, const void* weight,
                     int64_t M, int64_t K, int64_t N, bool accumulate_dinp);
// Column sums: out[N] += sum over rows of x[M, N] (x of dtype D), deterministic (two passes).
template <DType D>
void col_sums_add(float* out, const void* x, int64_t M, int64_t N);
// A GEMM of the tables' layout with an fp32 output (cudak2's logits and lm head reuse it):
// out[M,N] (fp32) (= or +=) a[M,K] @ b[N,K]^T, a and b of dtype D.
template <DType D>
void gemm_nt_f32out(float* out, const void* a, const void* b, int64_t M, int64_t K, int64_t N, bool accumulate);

// ---- embedding.cu ---------------------------------------------------------------------------------
template <DType D>
void embedding_forward(void* out, const int32_t* tokens, const void* wte, const void* wpe, int64_t B, int64_t T,
                       int64_t C, const int32_t* positions, int64_t vocab_begin, int64_t vocab_rows);
// Scatter-add without atomics: (token, row) pairs are stably radix-sorted by token (CUB), and each
// run of equal tokens is summed in row order into its dwte row (dwpe with positions: the same).
template <DType D>
void embedding_backward(float* dwte, float* dwpe, const void* dout, const int32_t* tokens, int64_t B, int64_t T,
                        int64_t C, const int32_t* positions, int64_t vocab_begin, int64_t vocab_rows);

// ---- layernorm.cu / rmsnorm.cu: one warp per row; backward partials per warp (launch.h) -------
template <DType D>
void layernorm_forward(void* out, float* mean, float* rstd, const void* inp, const float* weight, const float* bias,
                       int64_t N, int64_t C, float eps);
template <DType D>
void layernorm_backward(void* dinp, float* dweight, float* dbias, const void* dout, const void* inp,
                        const float* weight, const float* mean, const float* rstd, int64_t N, int64_t C, void* scratch);
template <DType D>
void rmsnorm_forward(void* out, float* rstd, const void* inp, const float* weight, int64_t N, int64_t C, float eps);
template <DType D>
void rmsnorm_backward(void* dinp, float* dweight, const void* dout, const void* inp, const float* weight,
                      const float* rstd, int64_t N, int64_t C, void* scratch);
template <DType D>
void head_rmsnorm_forward(void* x, void* saved, float* rstd, const float* weight, int64_t N, int64_t heads, int64_t Dh,
                          int64_t stride, float eps);
template <DType D>
void head_rmsnorm_backward(void* dx, float* dweight, const void* saved, const float* weight, const float* rstd,
                           int64_t N, int64_t heads, int64_t Dh, int64_t stride, void* scratch);
// Scratch sizes: layernorm_scratch_bytes / rmsnorm_scratch_bytes of launch.h (the per-head norm's
// is rmsnorm_scratch_bytes(D).

// ---- pointwise.cu -----------------------------------------------------------------------------------
template <DType D>
void gelu_forward(void* out, const void* inp, int64_t n);
template <DType D>
void gelu_backward(void* dinp, const void* inp, const void* dout, int64_t n);
template <DType D>
void gelu_erf_forward(void* out, const void* inp, int64_t n);
template <DType D>
void gelu_erf_backward(void* dinp, const void* inp, const void* dout, int64_t n);
template <DType D>
void swiglu_forward(void* out, const void* inp, int64_t N, int64_t F);
template <DType D>
void swiglu_backward(void* dinp, const void* inp, const void* dout, int64_t N, int64_t F);
template <DType D>
void geglu_forward(void* out, const void* inp, int64_t N, int64_t F);  // Gemma 2: gelu_tanh(gate) * up
template <DType D>
void geglu_backward(void* dinp, const void* inp, const void* dout, int64_t N, int64_t F);
template <DType D>
void residual_forward(void* out, const void* a, const void* b, int64_t n);
template <DType D>
void bias_add(void* out, const float* bias, int64_t N, int64_t C);
template <DType D>
void scale_forward(void* x, float s, int64_t n);  // x *= s, one rounding (gemma2's embedding scale)
void offset_weights(float* out, const float* w, float offset, int64_t n);  // fp32 offset + w (gemma2's 1 + w)

// ---- rope.cu -------------------------------------------------------------------------------------
// Tables computed on the device from a host inv_freq [half] with the CPU kernel's roundings (fp32
// product t * inv_freq, cos/sin of that float angle in double, x attention_factor in fp32).
void rope_tables(float* cos_table, float* sin_table, int64_t T, int64_t half, const float* inv_freq,
                 float attention_factor);
template <DType D>
void rope_forward(void* x, const float* cos_table, const float* sin_table, int64_t B, int64_t T, int64_t n_heads,
                  int64_t Dh, int64_t rot, int64_t row_stride, const int32_t* positions);
template <DType D>
void rope_backward(void* dx, const float* cos_table, const float* sin_table, int64_t B, int64_t T, int64_t n_heads,
                   int64_t Dh, int64_t rot, int64_t row_stride, const int32_t* positions);

// ---- convert.cu: element conversions (fp32 master weights -> bf16/fp16 copies, and back) ----------
// dst[n] (dst_dtype) = src[n] (src_dtype), round to nearest even; F32, BF16, F16 in any pair.
void convert(void* dst, DType dst_dtype, const void* src, DType src_dtype, int64_t n);

// ============================ cudak2: attention, loss, logits, optimizer ===========================
// Signatures and contracts are the op-table slots' (kernels/cpu/ops.h states the math); templates on
// the table's dtype, instantiated for F32, BF16 and F16 (fp32 math inside, outputs rounded once).

// ---- attention.cu: causal GQA attention, flash-style tiles (attention_launch.h) -------------------
// Forward: online softmax over key tiles, lse[B, H, T] saved. Backward: P recomputed from lse tile by
// tile; one kernel for dK/dV (a block per key tile and kv head loops over the group's query heads
// and the query tiles at or after it: no atomics) and one for dQ (a block per query tile and head).
// No scratch (attention_scratch_bytes = 0). Head dim D <= 128; doc_start as the CPU contract
// (device memory, trusted: clamped into [0, t], not validated); window as the CPU contract.
template <DType D>
void attention_forward(void* out, float* lse, const void* qkv, int64_t B, int64_t T, int64_t H, int64_t KVH, int64_t Dh,
                       void* scratch, const int32_t* doc_start, int64_t window, float scale, float softcap);
template <DType D>
void attention_backward(void* dqkv, const void* dout, const void* qkv, const void* out, const float* lse, int64_t B,
                        int64_t T, int64_t H, int64_t KVH, int64_t Dh, void* scratch, const int32_t* doc_start,
                        int64_t window, float scale, float softcap);
size_t attention_scratch_bytes(int64_t T, int64_t Dh);

// ---- attention_cudnn.cpp: cuDNN's fused SDPA (model.attention_kernel: cudnn), bf16 and fp16 -------
// The attention slots' contract (lse = cuDNN's softmax stats, the natural-log log-sum-exp as above).
// Passes with doc_start or a sliding window (window in [1, T)), and shapes cuDNN cannot run
// (decided once per shape for both directions), use the kernels above. cudnn_unavailable_reason: "" when this build has
// cuDNN and it can be used.
std::string cudnn_unavailable_reason();
template <DType D>
void cudnn_attention_forward(void* out, float* lse, const void* qkv, int64_t B, int64_t T, int64_t H, int64_t KVH,
                             int64_t Dh, void* scratch, const int32_t* doc_start, int64_t window, float scale,
                             float softcap);
template <DType D>
void cudnn_attention_backward(void* dqkv, const void* dout, const void* qkv, const void* out, const float* lse,
                              int64_t B, int64_t T, int64_t H, int64_t KVH, int64_t Dh, void* scratch,
                              const int32_t* doc_start, int64_t window, float scale, float softcap);

// ---- lm_head_loss.cu: fused lm head + softmax + cross-entropy in chunks of rows -------------------
// Per chunk of R rows: logits [R, V] fp32 (gemm_nt_f32out), one block per row for max / exp-sum
// (double) / loss / dlogits (in place for fp32, rounded to the table's dtype for 16-bit tables),
// then dx = dlogits @ w and dw += dlogits^T @ x (matmul_backward). Targets are checked on the device
// first (an out-of-range target throws before anything is written). Returns the loss sum on the host
// (waits for the stream). Scratch layout: lm_head_loss_launch.h. Vocab parallel (vp != nullptr, the
// slot's contract in kernels/backend.h): per chunk the local row max is all-reduced (max), then the
// exp sums and target logits (sum), through vp->all_reduce on device doubles written on stream().
template <DType D>
double lm_head_loss(float* losses, void* dx, float* dw, const void* x, const void* w, const int32_t* targets, int64_t N,
                    int64_t C, int64_t V, float grad_scale, bool backward, void* scratch, int64_t chunk_rows,
                    const VocabParallel* vp, float softcap);
template <DType D>
size_t lm_head_loss_scratch_bytes(int64_t chunk_rows, int64_t V);
// logits[M, V] fp32 = x[M, C] @ w[V, C]^T (fp32 accumulation).
template <DType D>
void logits_forward(float* logits, const void* x, const void* w, int64_t M, int64_t C, int64_t V);

// The training-step ops (optimizer.cu: the StepOps table) are declared in kernels/cuda/optimizer.h.

}  // namespace lathe::cuda
