// Per-token generation cost with and without the KV cache (models/kv_cache.h) at a context of
// CTX tokens on a model preset with random weights (issue 13 item 6: >= 10x at 512 on gpt2-124m).
//   build/bench/bench_generate [preset=gpt2-124m] [ctx=512] [steps=8]
// Without the cache one token = Model::forward_last_logits over the whole context (what
// generate did before); with it = one decode_step after a prefill of the context. Both the
// median ms/token over `steps` tokens, and the speedup; the logits of the two paths are compared
// at the last step (max |diff|) so the figure is of equal work.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

#include "config/model_config.h"
#include "core/rng.h"
#include "models/kv_cache.h"
#include "models/model.h"

using namespace lathe;

static double now_ms() {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

static double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int main(int argc, char** argv) {
  const std::string preset = argc > 1 ? argv[1] : "gpt2-124m";
  const int64_t ctx = argc > 2 ? std::atoll(argv[2]) : 512, steps = argc > 3 ? std::atoll(argv[3]) : 8;
  auto m = build_model(ModelConfig::preset(preset));
  m->init_weights(1);
  const int64_t V = m->config().vocab_size, T = ctx + steps;
  m->allocate(1, T);
  Rng rng(9);
  std::vector<int32_t> seq(static_cast<size_t>(T));
  for (auto& t : seq) t = static_cast<int32_t>(rng.next_u64() % static_cast<uint64_t>(V));
  std::vector<float> full(static_cast<size_t>(V)), cached(static_cast<size_t>(V));

  KvCache cache(*m, 1, T);
  double t0 = now_ms();
  prefill(*m, cache, seq.data(), ctx, cached.data());
  const double prefill_ms = now_ms() - t0;
  std::vector<double> with, without;
  for (int64_t s = 0; s < steps; ++s) {
    t0 = now_ms();
    decode_step(*m, cache, &seq[static_cast<size_t>(ctx + s)], cached.data());
    with.push_back(now_ms() - t0);
  }
  for (int64_t s = 0; s < steps; ++s) {
    t0 = now_ms();
    m->forward_last_logits(seq.data(), 1, ctx + s + 1, full.data());
    without.push_back(now_ms() - t0);
  }
  float diff = 0;
  for (int64_t i = 0; i < V; ++i) diff = std::max(diff, std::fabs(full[i] - cached[i]));
  const double a = median(without), b = median(with);
  fmt::print("{} context {} ({} tokens timed, {} threads): prefill {:.1f} ms ({:.2f} ms/token)\n", preset, ctx, steps,
             std::getenv("OMP_NUM_THREADS") ? std::getenv("OMP_NUM_THREADS") : "default", prefill_ms,
             prefill_ms / static_cast<double>(ctx));
  fmt::print(
      "  full recompute: {:.1f} ms/token\n  kv cache:       {:.2f} ms/token\n  speedup {:.1f}x  (max |logit diff| "
      "at the last step {:.2g})\n",
      a, b, a / b, diff);
  return 0;
}
