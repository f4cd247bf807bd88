#pragma once
#include <cstdint>
#include <functional>
#include <vector>

#include "models/model.h"

namespace lathe {

struct SamplingOptions {
  int64_t max_new_tokens = 64;
  float temperature = 1.0f;  // 0 = greedy
  int64_t top_k = 0;         // 0 = off
  float top_p = 1.0f;        // 1 = off
  uint64_t seed = 0;
  // Only ids below this are sampled (0 = the whole vocabulary). A model's vocab_size is often
  // padded beyond its tokenizer's size; ids past the tokenizer cannot be decoded.
  int64_t vocab_limit = 0;
  // Decode with a KV cache (models/kv_cache.h): the prompt once, then one row per new token.
  // false: rerun the whole window for every token (the reference path). Models the cache cannot
  // decode (kv_cache_unsupported_reason: tensor parallel) take the reference path.
  bool kv_cache = true;
};

// Autoregressive sampling over a window of model.max_seq() tokens (max_position_embeddings when
// the model is not allocated). With opts.kv_cache the tokens come from the KV cache while the
// sequence fits the window; past it (and without the cache) each new token reruns the window of
// the last tokens, so the output is the same either way. on_token is called with each new id as
// it is produced. The model's documents (Model::set_documents) are cleared first: causal attention.
std::vector<int32_t> generate(Model& model, const std::vector<int32_t>& prompt, const SamplingOptions& opts,
                              const std::function<void(int32_t)>& on_token = {});

// Picks one id from logits[V] with temperature, top-k and top-p (exposed for tests).
int32_t sample_token(const float* logits, int64_t V, const SamplingOptions& opts, uint64_t& rng_state);

}  // namespace lathe
