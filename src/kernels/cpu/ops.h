// CPU kernels: forward and backward of every op a decoder-only transformer needs, fp32,
// row-major, OpenMP across batch / heads / rows. Forward and backward live side by side in one
// .cpp per op, as one template per kernel for every storage type (kernels/cpu/storage.h); these
// are the fp32 instances. Shapes are given in the comments; N = B*T rows. The model reaches them
// through the CPU op tables (kernels/backend.h, kernels/cpu/tables.cpp), the contract every
// backend table mirrors.
//
// Gradient conventions (the model relies on these):
//  * Parameter gradients (dweight, dbias, dwte, ...) always ACCUMULATE (+=): they collect over
//    micro-batches and are zeroed by the trainer once per optimizer step.
//  * Input gradients: "+=" or "=" as stated per function. LayerNorm/RMSNorm backward add into
//    dinp because their input is the residual stream whose gradient already holds the skip path.
//  * Nothing here allocates: scratch memory is passed in by the caller (sizes documented).
//  * Results are deterministic for a fixed thread count (no atomics, fixed reduction order).
#pragma once
#include <cstddef>
#include <cstdint>
#include <limits>

#include "kernels/backend.h"  // VocabParallel

namespace lathe::cpu {

// ---- matmul (OpenBLAS sgemm; PyTorch nn.Linear layout) -------------------------------------
// out[M,N] = inp[M,K] @ weight[N,K]^T (+ bias[N] if bias != nullptr).
// accumulate=true adds into out instead of overwriting it.
void matmul_forward(float* out, const float* inp, const float* weight, const float* bias, int64_t M, int64_t K,
                    int64_t N, bool accumulate = false);
// dinp[M,K] (= or += per accumulate_dinp) dout[M,N] @ weight[N,K]     (skipped if dinp == nullptr)
// dweight[N,K] += dout^T @ inp                                          (skipped if dweight == nullptr)
// dbias[N] += sum over rows of dout                                     (skipped if dbias == nullptr)
void matmul_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                     const float* weight, int64_t M, int64_t K, int64_t N, bool accumulate_dinp = false);

// ---- token + learned position embedding -----------------------------------------------------
// out[B,T,C] = wte[tokens[b,t], :] (+ wpe[pos(b,t), :] if wpe != nullptr), pos(b,t) = t, or
// positions[b,t] when positions != nullptr ([B,T]: documents restarting their positions).
// tokens and positions are validated by the caller.
// Vocab-parallel shard: wte holds rows [vocab_begin, vocab_begin + vocab_rows) only; a token outside
// them reads a zero row (out = the wpe row, or zeros).
void embedding_forward(float* out, const int32_t* tokens, const float* wte, const float* wpe, int64_t B, int64_t T,
                       int64_t C, const int32_t* positions = nullptr, int64_t vocab_begin = 0,
                       int64_t vocab_rows = std::numeric_limits<int64_t>::max());
// dwte[V,C] += scatter of dout by token; dwpe[T,C] += dout rows by position (if dwpe != nullptr).
// Deterministic: rows hit by several tokens are summed in (b,t) order (parallelise over C).
// Vocab-parallel shard: only tokens in [vocab_begin, vocab_begin + vocab_rows) add to dwte (row
// token - vocab_begin); dwpe gets every token.
void embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int64_t B, int64_t T,
                        int64_t C, const int32_t* positions = nullptr, int64_t vocab_begin = 0,
                        int64_t vocab_rows = std::numeric_limits<int64_t>::max());

// ---- LayerNorm (biased variance, eps inside sqrt, as torch.nn.LayerNorm) --------------------
// out[N,C], mean[N], rstd[N] (saved for backward) from inp[N,C], weight[C], bias[C] (bias may be null).
void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight, const float* bias,
                       int64_t N, int64_t C, float eps);
// dinp[N,C] += ..., dweight[C] += ..., dbias[C] += ... (dbias may be null).
// Deterministic parameter-gradient reduction: per-thread partial sums in `scratch`
// (at least layernorm_scratch_floats(C) floats), combined in thread order.
void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                        const float* weight, const float* mean, const float* rstd, int64_t N, int64_t C,
                        float* scratch);
size_t layernorm_scratch_floats(int64_t C);  // = 2 * C * max_threads

// ---- RMSNorm (HF LlamaRMSNorm: x * rsqrt(mean(x^2) + eps) * weight) ---------------------------
void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, int64_t N, int64_t C, float eps);
// dinp[N,C] += ..., dweight[C] += ... ; scratch: at least rmsnorm_scratch_floats(C).
void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp, const float* weight,
                      const float* rstd, int64_t N, int64_t C, float* scratch);
size_t rmsnorm_scratch_floats(int64_t C);  // = C * max_threads

// ---- pointwise ---------------------------------------------------------------------------------
// GELU, tanh approximation (HF "gelu_new" / torch gelu(approximate="tanh")).
void gelu_forward(float* out, const float* inp, int64_t n);
// dinp = gelu'(inp) * dout; dinp may alias dout.
void gelu_backward(float* dinp, const float* inp, const float* dout, int64_t n);

// SwiGLU on a fused gate|up projection: inp[N, 2F] holds gate in columns [0,F) and up in [F,2F)
// (gate_proj and up_proj weights sit next to each other in the flat parameter buffer, so one GEMM
// produces both). out[N,F] = silu(gate) * up.
void swiglu_forward(float* out, const float* inp, int64_t N, int64_t F);
// dinp[N,2F] = (d gate | d up) from dout[N,F] (overwrites dinp).
void swiglu_backward(float* dinp, const float* inp, const float* dout, int64_t N, int64_t F);
// GeGLU on the same fused gate|up layout (Gemma 2): out = gelu_tanh(gate) * up; backward as swiglu's.
void geglu_forward(float* out, const float* inp, int64_t N, int64_t F);
void geglu_backward(float* dinp, const float* inp, const float* dout, int64_t N, int64_t F);

// out[n] = a[n] + b[n]  (out may alias a or b)
void residual_forward(float* out, const float* a, const float* b, int64_t n);
// out[N, C] += bias[C].
void bias_add(float* out, const float* bias, int64_t N, int64_t C);

// ---- rotary position embedding (HF rotate_half convention) ------------------------------------
// cos/sin tables [T, half]: angle(t, i) = float(t) * inv_freq[i] (fp32 product), cos/sin of it,
// times attention_factor (config/rope_scaling.h computes inv_freq and the factor).
void rope_tables(float* cos_table, float* sin_table, int64_t T, int64_t half, const float* inv_freq,
                 float attention_factor = 1.0f);
// In place on x viewed as [B, T, row_stride] where each row holds `n_heads` heads of size D
// starting at column 0 (pass a pointer to the q or k section of a fused qkv row). The first `rot`
// dims of each head rotate (tables [T, rot/2]), the other D - rot pass through:
//   x1 = x[..., :rot/2], x2 = x[..., rot/2:rot];  (x1, x2) <- (x1*cos - x2*sin, x2*cos + x1*sin)
// Row (b,t) uses table row t, or positions[b,t] when positions != nullptr ([B,T], each below the
// tables' length: the caller checks).
void rope_forward(float* x, const float* cos_table, const float* sin_table, int64_t B, int64_t T, int64_t n_heads,
                  int64_t D, int64_t rot, int64_t row_stride, const int32_t* positions = nullptr);
// Gradient of rope_forward, in place (rotation by -angle).
void rope_backward(float* dx, const float* cos_table, const float* sin_table, int64_t B, int64_t T, int64_t n_heads,
                   int64_t D, int64_t rot, int64_t row_stride, const int32_t* positions = nullptr);

// ---- causal self-attention with grouped-query heads -----------------------------------------
// qkv[B, T, (H + 2*KVH) * D]: per row, H query heads, then KVH key heads, then KVH value heads.
// Query head h uses kv head h / (H / KVH). Scale 1/sqrt(D), causal mask.
// out[B, T, H*D]; lse[B, H, T] = logsumexp of each score row (saved for backward).
// Never materialises more than one (T x T) score tile per thread: scratch must hold
// attention_scratch_floats(T, D) floats.
// Documents: with doc_start != nullptr ([B, T]: the index in the sample of the first token of each
// token's document; doc_start[b,0] = 0 and each entry equals the previous one or its own index,
// else an error) token t attends to keys [doc_start[b,t], t] only, and tiles of keys before a
// query block's first document are skipped, not computed and masked (models/documents.h builds it).
// Sliding window: with window > 0 token t also sees only keys j > t - window (HF Mistral's
// sliding_window), i.e. keys [max(doc_start[b,t], t - window + 1), t]; tiles of keys before a
// query block's first key are not computed. window >= T is the same as 0 (none); < 0 is an error.
// Scores: s = scale * q.k with scale > 0, or 1/sqrt(D) for scale 0 (Gemma 2's
// 1/sqrt(query_pre_attn_scalar)); softcap > 0 replaces every visible s by softcap * tanh(s / softcap)
// before the softmax (Gemma 2's attn_logit_softcapping; 0 = none, the code of before). lse is the
// log-sum-exp of the capped scores. Negative or non-finite scale / softcap are errors.
void attention_forward(float* out, float* lse, const float* qkv, int64_t B, int64_t T, int64_t H, int64_t KVH,
                       int64_t D, float* scratch, const int32_t* doc_start = nullptr, int64_t window = 0,
                       float scale = 0.0f, float softcap = 0.0f);
// dqkv[B, T, (H+2*KVH)*D] = gradient w.r.t. qkv (overwrites). Recomputes probabilities from lse.
// Parallel over (b, kv head) so that the dk/dv of a kv head shared by several query heads are
// summed by one thread in a fixed order.
void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out, const float* lse, int64_t B,
                        int64_t T, int64_t H, int64_t KVH, int64_t D, float* scratch,
                        const int32_t* doc_start = nullptr, int64_t window = 0, float scale = 0.0f,
                        float softcap = 0.0f);
size_t attention_scratch_floats(int64_t T, int64_t D);  // per-call total (covers all threads)
// Work counters of the attention kernels (every table, all threads), cumulative since the process
// started: [16 queries x 16 keys] score tiles computed by forward (per query head) and by backward
// (per query head, so equal to forward's for the same call). Tests and benches compare differences.
struct AttentionTiles {
  int64_t forward = 0, backward = 0;
};
AttentionTiles attention_tiles();

// ---- lm head + softmax + cross-entropy, fused and chunked over rows ---------------------------
// For x[N,C] and the output embedding w[V,C] (tied wte or a separate lm_head):
//   logits = x @ w^T; loss_n = logsumexp(logits_n) - logits_n[target_n]
// computed `chunk_rows` rows at a time into scratch[chunk_rows, V] so the full N x V logits are
// never held at once. losses[N] receives per-row losses (0 where target < 0: ignored).
// If backward: dlogits = (softmax - onehot) * grad_scale computed in place in the chunk, then
//   dx[N,C] = dlogits @ w (overwrites), dw[V,C] += dlogits^T @ x.
// grad_scale is 1 / (number of target tokens in the whole global batch) so that accumulation over
// micro-batches yields the mean over every token.
// Returns the sum of the losses of this call (double accumulation).
// softcap > 0 (Gemma 2's final_logit_softcapping): logits <- softcap * tanh(logits / softcap) before
// the softmax, dlogits times 1 - tanh^2 (0 = none).
double lm_head_loss(float* losses, float* dx, float* dw, const float* x, const float* w, const int32_t* targets,
                    int64_t N, int64_t C, int64_t V, float grad_scale, bool backward, float* scratch,
                    int64_t chunk_rows, float softcap = 0.0f);

// Vocab-parallel twin (tensor parallelism; contract in kernels/backend.h, Ops::lm_head_loss): w[V,C]
// holds rows [vp.vocab_begin, +V) of vp.global_V; losses and the returned sum are the whole
// vocabulary's; dw += this shard's rows; dx = this shard's partial input gradient (the caller sums
// it across the group). Same scratch as lm_head_loss.
double lm_head_loss_vocab_parallel(float* losses, float* dx, float* dw, const float* x, const float* w,
                                   const int32_t* targets, int64_t N, int64_t C, int64_t V, float grad_scale,
                                   bool backward, float* scratch, int64_t chunk_rows, const VocabParallel& vp,
                                   float softcap = 0.0f);
// The softmax / cross-entropy of one chunk of local logits s[R, V] (rows n0.. of targets and
// losses) across the vocab-parallel group: max and sums all-reduced (vp.all_reduce, 2 calls), loss
// per row; with backward, s becomes dlogits = (softmax - onehot) * grad_scale for this shard's
// columns (ignored rows: 0). Shared by every CPU table's vocab-parallel path. Returns the rows' loss
// sum (row order).
// softcap > 0: s holds the capped logits and the dlogits include the cap's 1 - tanh^2.
double vocab_parallel_softmax_rows(float* s, float* losses, const int32_t* targets, int64_t R, int64_t V,
                                   float grad_scale, bool backward, const VocabParallel& vp, float softcap = 0.0f);
// Checks shape, chunk and targets (< vp.global_V) of a vocab-parallel call; errors as lm_head_loss's.
void check_vocab_parallel_args(const int32_t* targets, int64_t N, int64_t C, int64_t V, int64_t chunk_rows,
                               bool backward, bool have_grads, const VocabParallel& vp);

}  // namespace lathe::cpu
