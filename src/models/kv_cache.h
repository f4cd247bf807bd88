// Incremental decoding with a key/value cache: each new token runs the decoder layers on its own
// row and attends over the keys and values cached for the positions before it, instead of
// recomputing the whole prefix (Model::forward_last_logits). The math is the body's
// (models/transformer.cpp, Model::layer_forward): same op table, same weights by role, same
// norms, RoPE at the token's absolute position or learned positions, GQA; only attention is a
// loop of its own, for a few queries over the cache (softmax in fp32).
//
// Every compute dtype of the CPU tables: activations stay in the compute dtype through the op table
// (bf16/fp16 read the 16-bit weight copies), keys and values are cached widened to fp32 (exact),
// and the attention loop widens q and rounds its output once, as the 16-bit attention kernels do.
// A model whose layers are split by tensor parallelism (StepHooks::tp) is refused
// (kv_cache_unsupported_reason says why; generation then recomputes the context per token).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "models/model.h"

namespace lathe {

class KvCache {
 public:
  // Room for `max_seq` positions of `batch` sequences that advance together (every row of a
  // decode_step is at the same position). Throws naming the reason when the model cannot decode
  // incrementally, or when max_seq exceeds a learned-position model's max_position_embeddings.
  KvCache(const Model& model, int64_t batch, int64_t max_seq);

  int64_t batch() const { return B_; }
  int64_t max_seq() const { return Tmax_; }
  // Positions filled so far (the absolute position of the next token).
  int64_t size() const { return pos_; }
  // Forget every position (the buffers are kept).
  void reset() { pos_ = 0; }

  // Layer l's keys / values: [B, KV, Tmax, D] fp32 (whatever the compute dtype) (positions >= size() are unspecified).
  float* keys(int64_t l) { return k_.data() + l * layer_stride_; }
  float* values(int64_t l) { return v_.data() + l * layer_stride_; }
  size_t bytes() const { return (k_.size() + v_.size()) * sizeof(float); }

 private:
  friend void decode_chunk(Model&, KvCache&, const int32_t*, int64_t, float*);
  int64_t B_, Tmax_, pos_ = 0, layer_stride_;
  std::vector<float> k_, v_;
  std::vector<float> rope_cos_, rope_sin_;  // [Tmax, rot/2] (rotary models)
  // Work buffers of one chunk of T new tokens, grown on demand: residual stream x [B*T, C],
  // norm output [B*T, C], q|k|v [B*T, Q], attention output [B*T, H*D], MLP [B*T, FF] and
  // [B*T, F], attention block output res1 [B*T, C], norm statistics [B*T], and the last rows
  // for the head [B, C].
  std::vector<float> x_, ln_, qkv_, att_, fc_, act_, res1_, mean_, rstd_, last_;
  // Arch::qk_norm: the q/k rows before their norms [B*T, H + KV, D] and the norms' rstd.
  std::vector<float> qk_saved_, qk_rstd_;
  // Arch::sandwich_norm: the attention's / MLP's output before its norm [B*T, C]; Arch::norm_weight_offset:
  // the offset + w weights of the norm being run [C].
  std::vector<float> post_, norm_w_;
};

// Empty when `model` can decode with a KvCache, else why not (one sentence, for a note or error).
std::string kv_cache_unsupported_reason(const Model& model);

// Runs T new tokens per sequence (tokens [B, T], row-major) at positions size()..size()+T-1,
// appends their keys and values, and writes the logits of each sequence's LAST new token to
// logits [B, V] (fp32; nullptr: skip the head). Throws if the cache would overflow (naming
// size, T and max_seq) or a token is outside the vocabulary; the cache is unchanged then.
void decode_chunk(Model& model, KvCache& cache, const int32_t* tokens, int64_t T, float* logits);

// One new token per sequence: tokens [B], logits [B, V].
inline void decode_step(Model& model, KvCache& cache, const int32_t* tokens, float* logits) {
  decode_chunk(model, cache, tokens, 1, logits);
}

// The prompt (tokens [B, T]) in one batched pass: logits [B, V] of the last prompt position.
// Same result as T decode_steps (attention is causal inside the chunk).
inline void prefill(Model& model, KvCache& cache, const int32_t* tokens, int64_t T, float* logits) {
  decode_chunk(model, cache, tokens, T, logits);
}

}  // namespace lathe
