#include "eval/generate.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <numeric>

#include "core/error.h"
#include "core/rng.h"
#include "models/kv_cache.h"

namespace lathe {

int32_t sample_token(const float* logits, int64_t V, const SamplingOptions& opts, uint64_t& rng_state) {
  if (opts.temperature <= 0.0f) return static_cast<int32_t>(std::max_element(logits, logits + V) - logits);
  std::vector<int32_t> idx(static_cast<size_t>(V));
  std::iota(idx.begin(), idx.end(), 0);
  int64_t keep = V;
  if (opts.top_k > 0 && opts.top_k < V) {
    keep = opts.top_k;
    std::partial_sort(idx.begin(), idx.begin() + keep, idx.end(),
                      [&](int32_t a, int32_t b) { return logits[a] > logits[b]; });
  } else {
    std::sort(idx.begin(), idx.end(), [&](int32_t a, int32_t b) { return logits[a] > logits[b]; });
  }
  // probabilities of the kept ids, sorted by descending logit
  std::vector<double> p(static_cast<size_t>(keep));
  const double mx = logits[idx[0]];
  double sum = 0;
  for (int64_t i = 0; i < keep; ++i) sum += p[i] = std::exp((logits[idx[i]] - mx) / opts.temperature);
  if (opts.top_p < 1.0f) {
    double cum = 0;
    int64_t k = 0;
    while (k < keep) {
      cum += p[k] / sum;
      ++k;
      if (cum >= opts.top_p) break;
    }
    keep = k;
    sum = std::accumulate(p.begin(), p.begin() + keep, 0.0);
  }
  Rng rng(rng_state);
  rng_state = rng.next_u64();
  double r = rng.uniform_double() * sum;
  for (int64_t i = 0; i < keep; ++i) {
    r -= p[i];
    if (r <= 0) return idx[i];
  }
  return idx[keep - 1];
}

std::vector<int32_t> generate(Model& model, const std::vector<int32_t>& prompt, const SamplingOptions& opts,
                              const std::function<void(int32_t)>& on_token) {
  LATHE_CHECK(!prompt.empty(), "generate: the prompt is empty (give at least one token)");
  // Generation is plain causal attention over positions 0..: never a training batch's documents.
  model.set_documents(nullptr, nullptr, 0, 0);
  const int64_t V = model.global_vocab();  // forward_last_logits' width, also for a vocab shard
  const bool allocated = model.max_batch() >= 1 && model.max_seq() >= 1;
  const int64_t window = allocated ? model.max_seq() : model.config().max_position_embeddings;
  std::vector<int32_t> seq = prompt;
  std::vector<float> logits(static_cast<size_t>(V));
  uint64_t rng_state = opts.seed;
  const int64_t limit = opts.vocab_limit > 0 ? std::min(opts.vocab_limit, V) : V;
  const int64_t P = static_cast<int64_t>(prompt.size());
  // The cache holds every position the window can see: the prompt and all new tokens but the
  // last (which is never fed back), at most `window`.
  std::unique_ptr<KvCache> cache;
  if (opts.kv_cache && opts.max_new_tokens > 0 && P <= window && kv_cache_unsupported_reason(model).empty()) {
    cache = std::make_unique<KvCache>(model, 1, std::min(window, P + opts.max_new_tokens - 1));
    prefill(model, *cache, prompt.data(), P, logits.data());
  }
  for (int64_t i = 0; i < opts.max_new_tokens; ++i) {
    if (!cache) {  // full recompute of the window ending at the last token
      if (!model.max_batch() || !model.max_seq()) model.allocate(1, window);
      const int64_t start = std::max<int64_t>(0, static_cast<int64_t>(seq.size()) - window);
      const int64_t T = static_cast<int64_t>(seq.size()) - start;
      model.forward_last_logits(seq.data() + start, 1, T, logits.data());
    }
    int32_t tok = sample_token(logits.data(), limit, opts, rng_state);
    seq.push_back(tok);
    if (on_token) on_token(tok);
    if (cache && i + 1 < opts.max_new_tokens) {
      if (cache->size() < cache->max_seq())
        decode_step(model, *cache, &tok, logits.data());
      else
        cache.reset();  // the window slides from here: recompute it per token, as without a cache
    }
  }
  return std::vector<int32_t>(seq.begin() + P, seq.end());
}

}  // namespace lathe
