#include "train/generate.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/error.h"
#include "core/rng.h"

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
  const int64_t V = model.config().vocab_size;
  if (model.max_batch() < 1 || model.max_seq() < 1) model.allocate(1, model.config().max_position_embeddings);
  const int64_t window = model.max_seq();
  std::vector<int32_t> seq = prompt;
  std::vector<float> logits(static_cast<size_t>(V));
  uint64_t rng_state = opts.seed;
  for (int64_t i = 0; i < opts.max_new_tokens; ++i) {
    const int64_t start = std::max<int64_t>(0, static_cast<int64_t>(seq.size()) - window);
    const int64_t T = static_cast<int64_t>(seq.size()) - start;
    model.forward_last_logits(seq.data() + start, 1, T, logits.data());
    const int64_t limit = opts.vocab_limit > 0 ? std::min(opts.vocab_limit, V) : V;
    int32_t tok = sample_token(logits.data(), limit, opts, rng_state);
    seq.push_back(tok);
    if (on_token) on_token(tok);
  }
  return std::vector<int32_t>(seq.begin() + static_cast<int64_t>(prompt.size()), seq.end());
}

}  // namespace lathe
