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
//  * Results are deterministic (no atomics, fixed reduction order); the fp32 kernels give the same
//    bits on any thread count for a fixed reduction_parts() (core/parallel.h).
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
// Deterministic parameter-gradient reduction: reduction_parts() partial sums in `scratch`
// (at least layernorm_scratch_floats(C) floats), combined in part order.
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

// ---- block attention: context parallelism (issue 27; kernels/cpu/attention_block.cpp) -----------
// One block of attention between Tq query rows and Tk key/value rows that need not be the same
// rows: the sequence is cut across ranks and each rank attends its rows to every rank's keys, one
// block at a time, the blocks merged by their log-sum-exp (attention_lse_merge). Rows are given by
// their GLOBAL positions (q_pos[Tq], k_pos[Tk], both strictly increasing, the same for every batch
// row). Key j is visible to query i iff k_pos[j] <= q_pos[i] (causal), k_pos[j] >= q_doc[b, i]
// when q_doc != nullptr ([B, Tq]: the global position of the query's document start) and
// k_pos[j] > q_pos[i] - window when window > 0 (sliding window, as attention_forward).
// Strided views: element d of head h of row i of batch b is q[(b*Tq + i)*ldq + h*D + d] (likewise
// k, v with Tk, ldk, ldv and kv head g = h / (H / KVH)), so a packed qkv row serves directly.
// Work in [16 query x 16 key] tiles per query head; a tile with no visible pair is skipped, not
// computed (counted by attention_block_tiles()). fp32; deterministic (fixed order, no atomics) and
// independent of the thread count.
struct BlockAttention {
  int64_t B = 0, Tq = 0, Tk = 0, H = 0, KVH = 0, D = 0;
  const float* q = nullptr;
  int64_t ldq = 0;
  const float* k = nullptr;
  int64_t ldk = 0;
  const float* v = nullptr;
  int64_t ldv = 0;
  const int32_t* q_pos = nullptr;  // [Tq]
  const int32_t* k_pos = nullptr;  // [Tk]
  const int32_t* q_doc = nullptr;  // [B, Tq] or nullptr
  int64_t window = 0;
  // Gemma 2 (as attention_forward's trailing arguments): the score scale (0 = 1/sqrt(D)) and the
  // soft cap of every visible score, softcap * tanh(scale q.k / softcap) (0 = none).
  float scale = 0.0f, softcap = 0.0f;
};
// out[(b*Tq + i)*ldo + h*D + d] (overwritten) and lse[B, H, Tq] (fp32) of this block alone; a query
// row that sees no key of the block gets out = 0 and lse = -inf (the identity of the merge).
void attention_block_forward(const BlockAttention& a, float* out, int64_t ldo, float* lse);
// The flash-attention backward of one block given the FINAL out, lse (after every block was merged)
// and dout (rows as out, stride ldo): with Di = sum_d dout[i,d] * out[i,d] and P = exp(S - lse),
//   dq += dS K,  dk += dS^T Q,  dv += P^T dO,  dS = P * (dO V^T - Di) * scale.
// All three ACCUMULATE (+=) into strided views laid out as q, k, v (strides lddq, lddk, lddv).
void attention_block_backward(const BlockAttention& a, const float* out, const float* dout, int64_t ldo,
                              const float* lse, float* dq, int64_t lddq, float* dk, int64_t lddk, float* dv,
                              int64_t lddv);
// (out, lse) <- the merge of (out, lse) and (out_b, lse_b), rows [B, T] of H heads of D (stride
// ldo), lse [B, H, T]: l = log(exp(lse) + exp(lse_b)), out = exp(lse - l) out + exp(lse_b - l) out_b,
// in fp32. lse = -inf on one side takes the other side's values exactly.
void attention_lse_merge(float* out, float* lse, const float* out_b, const float* lse_b, int64_t B, int64_t T,
                         int64_t H, int64_t D, int64_t ldo);
// [16 x 16] tiles computed by the block kernels since the process started (per query head).
AttentionTiles attention_block_tiles();

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

// ---- mixture of experts (issue 28; kernels/cpu/moe.cpp) ----------------------------------------
// One sparse MoE block (Mixtral / Qwen2-MoE / OLMoE): N tokens x[N,C], E experts, top-k routing,
// SwiGLU experts of width F in Mixtral's layout w1 = gate [E,F,C], w3 = up [E,F,C], w2 = down [E,C,F]:
//   logits[N,E] = x @ wr^T                     (router weight wr[E,C]; matmul_forward)
//   probs       = softmax(logits) (fp32, over E) or sigmoid(logits)
//   topk_idx[N,k], topk_w[N,k]: the k largest probs of each row, in descending order, ties broken
//                 by the lower expert index; optionally renormalised to sum 1 (Mixtral;
//                 Qwen2-MoE's norm_topk_prob)
//   slots: the N*k (token, j) pairs sorted by expert id, stably (ties in token order): expert e
//          owns rows [offsets[e], offsets[e+1]) of the permuted buffers (dropless: always N*k rows)
//   xp[slot] = x[slot_token[slot]];  y[slot] = w2_e (silu(w1_e xp) * (w3_e xp))   per expert e
//   out[n] = sum over j = 0..k-1 in order of topk_w[n,j] * y[token_slot[n*k+j]]
// No atomics anywhere; each expert's GEMMs run single-threaded inside one OpenMP loop over the
// experts, so every result is bit-identical for any thread count.
// The selection itself is piecewise constant: no gradient flows through the choice of experts.
enum class MoeScore { softmax, sigmoid };

struct MoeShape {
  int64_t N = 0, C = 0, F = 0, E = 0, k = 0;
  MoeScore score = MoeScore::softmax;
  bool renormalize = true;  // divide the top-k weights by their sum
};

// What the forward saves for the backward: caller-owned buffers of the sizes given.
struct MoeActs {
  float* logits = nullptr;        // [N, E]
  float* probs = nullptr;         // [N, E]
  int32_t* topk_idx = nullptr;    // [N, k]
  float* topk_w = nullptr;        // [N, k]
  int32_t* offsets = nullptr;     // [E + 1]
  int32_t* slot_token = nullptr;  // [N*k] slot -> token
  int32_t* slot_k = nullptr;      // [N*k] slot -> j (which of the token's k choices)
  int32_t* token_slot = nullptr;  // [N*k] n*k + j -> slot
  float* xp = nullptr;            // [N*k, C] gathered inputs, expert-major
  float* gate = nullptr;          // [N*k, F] w1 xp (pre-activation)
  float* up = nullptr;            // [N*k, F] w3 xp
  float* act = nullptr;           // [N*k, F] silu(gate) * up
  float* y = nullptr;             // [N*k, C] expert outputs
};

// Router scores and top-k from logits[N,E] (any source): probs[N,E], topk_idx[N,k], topk_w[N,k].
// select_bias[E] (nullable; DeepSeek-V3's aux-loss-free e_score_correction_bias): the choice ranks
// probs + select_bias, the weights stay the unbiased probs of the chosen experts.
void moe_router_forward(float* probs, int32_t* topk_idx, float* topk_w, const float* logits, int64_t N, int64_t E,
                        int64_t k, MoeScore score, bool renormalize, const float* select_bias = nullptr);
// DeepSeek-V3's update of that bias from one step's load (counts[E] assignments, e.g. from
// moe_load_stats): bias[e] += rate * sign(mean count - counts[e]) (underloaded experts rise).
void moe_update_select_bias(float* bias, const int64_t* counts, int64_t E, float rate);
// dlogits[N,E] = gradient through the scores and the (renormalised) top-k weights from
// dtopk_w[N,k] (overwrites); plus dlogits_add[N,E] if not null (aux / z-loss gradients).
void moe_router_backward(float* dlogits, const float* dtopk_w, const float* dlogits_add, const float* probs,
                         const int32_t* topk_idx, int64_t N, int64_t E, int64_t k, MoeScore score, bool renormalize);
// Stable counting sort of the N*k assignments by expert id: offsets[E+1], slot_token, slot_k,
// token_slot (all overwritten). Checks every index is in [0, E).
void moe_permute(int32_t* offsets, int32_t* slot_token, int32_t* slot_k, int32_t* token_slot, const int32_t* topk_idx,
                 int64_t N, int64_t E, int64_t k);
// xp[slot, :] = x[slot_token[slot], :]  (S = N*k slots).
void moe_gather(float* xp, const float* x, const int32_t* slot_token, int64_t S, int64_t C);
// dx[n, :] = sum over j in order of dxp[token_slot[n*k+j], :]  (overwrites).
void moe_gather_backward(float* dx, const float* dxp, const int32_t* token_slot, int64_t N, int64_t k, int64_t C);
// Grouped SwiGLU expert MLP over the permuted rows (see above); experts with no rows are skipped.
// gate, up, act, y [S, F|C] are overwritten.
void moe_experts_forward(float* y, float* gate, float* up, float* act, const float* xp, const float* w1,
                         const float* w3, const float* w2, const int32_t* offsets, int64_t E, int64_t C, int64_t F);
// dxp[S,C] = input gradient (overwrites); dw1/dw3 [E,F,C], dw2 [E,C,F] += (rows of expert e only).
// scratch: at least 2 * S * F floats (S = offsets[E]).
void moe_experts_backward(float* dxp, float* dw1, float* dw3, float* dw2, const float* dy, const float* xp,
                          const float* gate, const float* up, const float* act, const float* w1, const float* w3,
                          const float* w2, const int32_t* offsets, int64_t E, int64_t C, int64_t F, float* scratch);
// out[N,C] = weighted sum of the token's k expert outputs, in j order (overwrites).
void moe_combine(float* out, const float* y, const float* topk_w, const int32_t* token_slot, int64_t N, int64_t k,
                 int64_t C);
// dy[slot, :] = topk_w[n,j] * dout[n, :] (overwrites); dtopk_w[n,j] = <dout[n], y[slot]> (overwrites).
void moe_combine_backward(float* dy, float* dtopk_w, const float* dout, const float* y, const float* topk_w,
                          const int32_t* token_slot, int64_t N, int64_t k, int64_t C);

// The whole block: fills every buffer of acts and out[N,C] (overwrites). select_bias[E]: as in
// moe_router_forward (nullable).
void moe_forward(float* out, const MoeActs& acts, const float* x, const float* wr, const float* w1, const float* w3,
                 const float* w2, const MoeShape& s, const float* select_bias = nullptr);
// dx[N,C] = input gradient (overwrites: expert path + router path); dwr[E,C], dw1, dw3, dw2 +=.
// dlogits_add[N,E] (nullable): extra router-logit gradient (moe_aux_loss_backward, moe_z_loss).
// scratch: at least moe_backward_scratch_floats(s) floats.
void moe_backward(float* dx, float* dwr, float* dw1, float* dw3, float* dw2, const float* dout,
                  const float* dlogits_add, const MoeActs& acts, const float* x, const float* wr, const float* w1,
                  const float* w3, const float* w2, const MoeShape& s, float* scratch);
size_t moe_backward_scratch_floats(const MoeShape& s);

// Load-balancing loss in transformers' load_balancing_loss_func form: with f_e = (number of top-k
// assignments to e) / rows and P_e = (sum of probs[:, e]) / rows,  aux = E * sum_e f_e * P_e.
// Statistics accumulate (+=) over calls so the loss can span several layers as transformers'
// concatenation does: psum[E] += column sums of probs, counts[E] += assignments per expert.
void moe_load_stats(double* psum, int64_t* counts, const float* probs, const int32_t* topk_idx, int64_t N, int64_t E,
                    int64_t k);
double moe_aux_loss(const double* psum, const int64_t* counts, int64_t rows, int64_t E);
// dlogits[N,E] += coef * d aux / d logits of these N rows (f is constant: counts / rows of the
// whole set the loss spans; rows its total row count), through the same score function.
void moe_aux_loss_backward(float* dlogits, const float* probs, const int64_t* counts, int64_t rows, int64_t N,
                           int64_t E, float coef, MoeScore score);
// Router z-loss: returns sum over the N rows of logsumexp(logits[n])^2 (the mean divides by the
// row count); if dlogits != nullptr, dlogits += grad_scale * 2 * lse_n * softmax(logits[n]).
double moe_z_loss(float* dlogits, const float* logits, int64_t N, int64_t E, float grad_scale);

}  // namespace lathe::cpu
