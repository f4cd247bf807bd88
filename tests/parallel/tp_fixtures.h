// What the thread-rank tensor-parallel tests share (test_tensor_parallel.cpp,
// test_sequence_parallel.cpp): the perturbed deterministic init both oracles start from, the
// relative error they hold their tolerances to, random token batches, one step of plain SGD, and
// a rank's shard model built from the global one on the in-process thread communicator.
#pragma once

#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include "../models/model_fixtures.h"
#include "config/model_config.h"
#include "core/rng.h"
#include "dist/comm.h"
#include "models/model.h"
#include "parallel/tensor_parallel.h"

namespace lathe::tp_test {

// A model layout and the tensor-parallel degrees it is tested at.
struct Family {
  const char* name;
  ModelConfig cfg;
  std::vector<int> degrees;
};

// The layouts every thread-rank tensor-parallel test covers.
// gpt-neox-debug with 2 heads of 24 (6 rotated dims) so that tp=2 divides them: parallel residual
// (two row-parallel reductions per layer), exact GELU, vocabulary 101 (uneven vocab shards).
inline ModelConfig neox_h2_config() {
  ModelConfig c = ModelConfig::preset("gpt-neox-debug");
  c.num_attention_heads = c.num_key_value_heads = 2;
  c.validate("neox_h2_config");
  return c;
}

// gemma2-debug with caps and a window that bind at weights of std 0.4 (as test_gemma2.cpp's parity).
inline ModelConfig gemma2_tp_config() {
  ModelConfig c = ModelConfig::preset("gemma2-debug");
  c.initializer_range = 0.4;
  c.attn_logit_softcapping = 5.0;
  c.final_logit_softcapping = 3.0;
  c.sliding_window = 4;
  return c;
}

// olmo2-debug at weights of std 0.4: attention, RoPE and the whole-projection norms matter.
inline ModelConfig olmo2_tp_config() {
  ModelConfig c = ModelConfig::preset("olmo2-debug");
  c.initializer_range = 0.4;
  return c;
}

inline std::vector<Family> base_families() {
  ModelConfig untied = ModelConfig::preset("llama-debug");
  untied.tie_word_embeddings = false;
  untied.attention_bias = true;  // q/k/v and o_proj biases (a row-parallel bias on the shard)
  return {{"gpt2", ModelConfig::preset("gpt2-debug"), {2, 4}},     // fused c_attn, LayerNorm with bias
          {"llama_gqa", ModelConfig::preset("llama-debug"), {2}},  // 4 query heads, 2 KV heads, RMSNorm
          {"qwen2", ModelConfig::preset("qwen2-debug"), {2}},      // q/k/v biases, tied
          {"llama_untied_bias", untied, {2}},
          // explicit head_dim: 4 heads of 32 (q/o 128 wide) with hidden 96; 2 heads of 32 per rank
          {"mistral_head_dim", model_test::mistral_head_dim_config(0.1), {2}},
          // per-head q/k norms (replicated weights, each rank its own heads), 4 heads of 16 in hidden 48
          {"qwen3", ModelConfig::preset("qwen3-debug"), {2}},
          {"gpt_neox_parallel_residual", neox_h2_config(), {2}},
          // sandwich norms (replicated), 1 + w norms, GeGLU, embedding scale, soft caps, even-layer windows
          {"gemma2", gemma2_tp_config(), {2}},
          // post norms only, q/k norms over the whole projection (60 / 20 wide: each rank holds 3 of
          // the 6 q heads and 1 of the 2 kv heads, the norms' sums reduced over the group)
          {"olmo2", olmo2_tp_config(), {2}}};
}

// Deterministic init, with biases and norm weights perturbed so that their use and gradients show.
inline void perturbed_init(Model& m) {
  m.init_weights(42);
  Rng prng(7);
  for (const ParamSpec& s : m.params().specs())
    if (s.init != Init::Normal)
      for (int64_t i = 0; i < s.numel(); ++i) m.param_data()[s.offset + i] += 0.1f * prng.normal();
  m.refresh_compute_weights();
}

// ||a - b|| / ||b|| over n values (||a - b|| when b is all zeros), accumulated in double.
inline double rel_err(const float* a, const float* b, int64_t n) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < n; ++i) {
    num += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    den += static_cast<double>(b[i]) * b[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

struct Batch {
  std::vector<int32_t> tokens, targets;  // [B * T] each, row-major [B, T]
};

// Random tokens and targets in [0, vocab) seeded by the step (every rank draws the same batch);
// target 3 is -1 (ignored) so that the loss's ignore path runs.
inline Batch random_batch(const ModelConfig& cfg, int step, int64_t B, int64_t T) {
  Rng rng(1000 + static_cast<uint64_t>(step));
  Batch b;
  for (int64_t i = 0; i < B * T; ++i) {
    b.tokens.push_back(static_cast<int32_t>(rng.next_u64() % static_cast<uint64_t>(cfg.vocab_size)));
    b.targets.push_back(static_cast<int32_t>(rng.next_u64() % static_cast<uint64_t>(cfg.vocab_size)));
  }
  b.targets[3] = -1;  // an ignored target
  return b;
}

// One step of plain SGD (p -= lr * g over the model's own parameters, a shard's on a rank) on the
// [B, T] batch with the loss averaged over its B*T positions; returns the loss.
inline double sgd_step(Model& m, const Batch& b, int64_t B, int64_t T, float lr) {
  m.zero_grad();
  const double loss = m.forward_backward(b.tokens.data(), b.targets.data(), B, T, 1.0f / (B * T), true);
  for (size_t i = 0; i < m.num_params(); ++i) m.param_data()[i] -= lr * m.grad_data()[i];
  m.refresh_compute_weights();
  return loss;
}

// Rank `rank`'s model of the shard config `local`: its slice of the global model's weights, hooked
// to `comm` (the tensor-parallel group of `tp` ranks). Not yet allocated.
inline std::unique_ptr<Model> attached_shard(const Model& global, dist::Communicator& comm, int rank, int tp,
                                             bool sequence = false, const ComputeSpec& compute = {}) {
  auto m = parallel::build_shard_model(global.config(), tp, sequence, rank, compute);
  parallel::scatter_shard(global.params(), global.param_data(), m->params(), m->param_data(), rank, tp);
  m->refresh_compute_weights();
  parallel::attach_tensor_parallel(*m, comm);
  return m;
}

}  // namespace lathe::tp_test
