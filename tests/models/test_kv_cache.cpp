// KV-cache decoding (models/kv_cache.h) against the full recompute (Model::forward_last_logits,
// the oracle): logits of every step within 1e-5 and greedy tokens identical, for GPT-2 (learned
// positions, LayerNorm, GELU), Llama (RoPE, RMSNorm, SwiGLU, GQA 4 query / 2 kv heads) and Qwen2
// (q|k|v bias, rope_theta 1e6), prompts of length 1 and > 1, batched prefill vs token-by-token,
// B = 2; bf16 and fp16 against the recompute in the same dtype; a full cache and unsupported
// models are refused with a clear error.
// Tolerance 1e-5 absolute: the same fp32 kernels run on fewer rows, only the attention's summation
// order differs (a few ulp of logits of magnitude ~1; measured differences are ~1e-7).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "config/model_config.h"
#include "core/error.h"
#include "core/rng.h"
#include "error_of.h"
#include "model_fixtures.h"
#include "models/kv_cache.h"
#include "models/model.h"

using namespace lathe;

namespace {

using lathe::test::error_of;

// A preset, or "mistral-head-dim": model_fixtures.h's explicit head_dim (4 x 32 != hidden 96), or
// "gemma2-capped": gemma2-debug with weights of std 0.4, soft caps 5 / 3 and window 4 that bind.
ModelConfig config_of(const std::string& name) {
  if (name == "gemma2-capped") {
    ModelConfig c = ModelConfig::preset("gemma2-debug");
    c.initializer_range = 0.4;
    c.attn_logit_softcapping = 5.0;
    c.final_logit_softcapping = 3.0;
    c.sliding_window = 4;
    return c;
  }
  return name == "mistral-head-dim" ? model_test::mistral_head_dim_config(0.1) : ModelConfig::preset(name);
}

std::unique_ptr<Model> make(const std::string& preset, int64_t T, DType dt = DType::F32) {
  auto m = build_model(config_of(preset), ComputeSpec{nullptr, dt});
  m->init_weights(42);
  // Biases and norm weights perturbed, so that a bias or norm the decoder dropped would show.
  Rng prng(7);
  for (const ParamSpec& s : m->params().specs())
    if (s.init != Init::Normal)
      for (int64_t i = 0; i < s.numel(); ++i) m->param_data()[s.offset + i] += 0.1f * prng.normal();
  m->refresh_compute_weights();
  m->allocate(2, T);
  return m;
}

std::vector<int32_t> random_tokens(int64_t n, int64_t V, uint64_t seed) {
  Rng rng(seed);
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (auto& x : t) x = static_cast<int32_t>(rng.next_u64() % static_cast<uint64_t>(V));
  return t;
}

float max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  float d = 0;
  for (size_t i = 0; i < a.size(); ++i) d = std::max(d, std::fabs(a[i] - b[i]));
  return d;
}

int32_t argmax(const float* x, int64_t n) { return static_cast<int32_t>(std::max_element(x, x + n) - x); }

class KvCacheFamily : public ::testing::TestWithParam<std::tuple<std::string, int>> {};

// Greedy decoding of `steps` tokens from a prompt of `P` tokens, cache vs recompute: every step's
// logits and every token.
TEST_P(KvCacheFamily, GreedyMatchesFullRecompute) {
  const auto& [preset, P] = GetParam();
  const int64_t steps = 12, T = P + steps;
  auto m = make(preset, T);
  const int64_t V = m->config().vocab_size;
  std::vector<int32_t> seq = random_tokens(P, V, 3);
  KvCache cache(*m, 1, T);
  std::vector<float> got(static_cast<size_t>(V)), want(static_cast<size_t>(V));
  prefill(*m, cache, seq.data(), P, got.data());
  EXPECT_EQ(cache.size(), P);
  float worst = 0;
  for (int64_t s = 0; s < steps; ++s) {
    m->forward_last_logits(seq.data(), 1, static_cast<int64_t>(seq.size()), want.data());
    const float d = max_abs_diff(got, want);
    worst = std::max(worst, d);
    ASSERT_LE(d, 1e-5f) << preset << " step " << s << " (context " << seq.size() << ")";
    const int32_t tok = argmax(want.data(), V);
    ASSERT_EQ(argmax(got.data(), V), tok) << preset << " step " << s;
    seq.push_back(tok);
    decode_step(*m, cache, &tok, got.data());
  }
  EXPECT_EQ(cache.size(), P + steps);
  std::printf("%s prompt %d: worst |logit diff| %.3g over %lld steps\n", preset.c_str(), P, worst,
              static_cast<long long>(steps));
}

// Batched prefill of B = 2 different prompts, then steps with different tokens per row, against
// the batched full recompute (each row its own sequence); and prefill == token-by-token feeding.
TEST_P(KvCacheFamily, BatchAndPrefillEqualStepwise) {
  const auto& [preset, P] = GetParam();
  const int64_t T = P + 4;
  auto m = make(preset, T);
  const int64_t V = m->config().vocab_size;
  std::vector<int32_t> rows = random_tokens(2 * T, V, 11);  // [2, T]: row b's tokens at b*T
  std::vector<int32_t> prompt(2 * static_cast<size_t>(P));
  for (int b = 0; b < 2; ++b)
    std::copy(rows.begin() + b * T, rows.begin() + b * T + P, prompt.begin() + static_cast<int64_t>(b) * P);
  KvCache batched(*m, 2, T), stepwise(*m, 2, T);
  std::vector<float> got(2 * static_cast<size_t>(V)), step(2 * static_cast<size_t>(V)),
      want(2 * static_cast<size_t>(V));
  prefill(*m, batched, prompt.data(), P, got.data());
  for (int64_t t = 0; t < P; ++t) {
    const int32_t col[2] = {rows[static_cast<size_t>(t)], rows[static_cast<size_t>(T + t)]};
    decode_step(*m, stepwise, col, step.data());
  }
  EXPECT_LE(max_abs_diff(got, step), 1e-5f) << "batched prefill vs token-by-token";
  for (int64_t t = P; t <= T; ++t) {
    // Full recompute of both rows over their first t tokens.
    std::vector<int32_t> both(2 * static_cast<size_t>(t));
    for (int b = 0; b < 2; ++b)
      std::copy(rows.begin() + b * T, rows.begin() + b * T + t, both.begin() + static_cast<int64_t>(b) * t);
    m->forward_last_logits(both.data(), 2, t, want.data());
    ASSERT_LE(max_abs_diff(got, want), 1e-5f) << preset << " batch of 2 at context " << t;
    if (t == T) break;
    const int32_t col[2] = {rows[static_cast<size_t>(t)], rows[static_cast<size_t>(T + t)]};
    decode_step(*m, batched, col, got.data());
  }
}

INSTANTIATE_TEST_SUITE_P(Families, KvCacheFamily,
                         ::testing::Combine(::testing::Values("gpt2-debug", "llama-debug", "qwen2-debug",
                                                              "mistral-head-dim", "qwen3-debug", "gpt-neox-debug",
                                                              "gemma2-debug", "gemma2-capped"),
                                            ::testing::Values(1, 7)),
                         [](const auto& info) {
                           std::string n =
                               std::get<0>(info.param) + "_prompt" + std::to_string(std::get<1>(info.param));
                           std::replace(n.begin(), n.end(), '-', '_');
                           return n;
                         });

TEST(KvCache, FullCacheIsAClearErrorAndLeavesTheCacheUsable) {
  auto m = make("llama-debug", 8);
  const int64_t V = m->config().vocab_size;
  KvCache cache(*m, 1, 4);
  std::vector<int32_t> toks = random_tokens(5, V, 5);
  std::vector<float> logits(static_cast<size_t>(V));
  std::string e = error_of([&] { prefill(*m, cache, toks.data(), 5, logits.data()); });
  EXPECT_NE(e.find("kv cache full"), std::string::npos) << e;
  EXPECT_NE(e.find("max_seq 4"), std::string::npos) << e;
  EXPECT_EQ(cache.size(), 0);
  prefill(*m, cache, toks.data(), 4, logits.data());
  e = error_of([&] { decode_step(*m, cache, toks.data() + 4, logits.data()); });
  EXPECT_NE(e.find("kv cache full: 4 positions filled of max_seq 4"), std::string::npos) << e;
  EXPECT_EQ(cache.size(), 4);
  cache.reset();
  EXPECT_EQ(cache.size(), 0);
  decode_step(*m, cache, toks.data(), logits.data());  // usable again after reset
}

TEST(KvCache, RefusesWhatItCannotDecode) {
  auto g = make("gpt2-debug", 8);
  // Learned positions stop at max_position_embeddings.
  const int64_t mpe = g->config().max_position_embeddings;
  std::string e = error_of([&] { KvCache c(*g, 1, mpe + 1); });
  EXPECT_NE(e.find("max_position_embeddings"), std::string::npos) << e;
  // A token outside the vocabulary names itself; nothing is appended.
  KvCache c(*g, 1, 4);
  const int32_t bad = static_cast<int32_t>(g->config().vocab_size);
  std::vector<float> logits(static_cast<size_t>(g->config().vocab_size));
  e = error_of([&] { decode_step(*g, c, &bad, logits.data()); });
  EXPECT_NE(e.find("outside the vocabulary"), std::string::npos) << e;
  EXPECT_EQ(c.size(), 0);
  // Tensor-parallel layers (a partial sum to reduce) are refused by name.
  g->hooks().tp.comm.all_reduce = [](void*, int64_t) {};
  EXPECT_NE(kv_cache_unsupported_reason(*g).find("tensor parallelism"), std::string::npos);
  e = error_of([&] { KvCache ct(*g, 1, 4); });
  EXPECT_NE(e.find("tensor parallelism"), std::string::npos) << e;
}

// bf16 / fp16 models decode on their own op table: against the full recompute in the same dtype.
// Both round every activation to 16 bits; the GEMMs of 1 row and of T rows may sum in another
// order, so one rounding can differ by an ulp (bf16: 2^-8 relative) and propagate: tolerance
// 5e-2 absolute on logits of magnitude ~1 (measured: 0, the same roundings); greedy tokens agree.
class KvCacheLowp : public ::testing::TestWithParam<std::tuple<std::string, DType>> {};

TEST_P(KvCacheLowp, MatchesFullRecomputeInTheSameDtype) {
  const auto& [preset, dt] = GetParam();
  const int64_t P = 5, steps = 8, T = P + steps;
  auto m = make(preset, T, dt);
  ASSERT_EQ(kv_cache_unsupported_reason(*m), "");
  const int64_t V = m->config().vocab_size;
  std::vector<int32_t> seq = random_tokens(P, V, 3);
  KvCache cache(*m, 1, T);
  std::vector<float> got(static_cast<size_t>(V)), want(static_cast<size_t>(V));
  prefill(*m, cache, seq.data(), P, got.data());
  float worst = 0;
  for (int64_t s = 0; s < steps; ++s) {
    m->forward_last_logits(seq.data(), 1, static_cast<int64_t>(seq.size()), want.data());
    worst = std::max(worst, max_abs_diff(got, want));
    ASSERT_LE(max_abs_diff(got, want), 5e-2f) << preset << " step " << s;
    const int32_t tok = argmax(want.data(), V);
    ASSERT_EQ(argmax(got.data(), V), tok) << preset << " step " << s;
    seq.push_back(tok);
    decode_step(*m, cache, &tok, got.data());
  }
  std::printf("%s %s: worst |logit diff| %.3g over %lld steps\n", preset.c_str(), compute_dtype_name(dt).c_str(), worst,
              static_cast<long long>(steps));
  // Stale 16-bit weight copies are refused as by the full forward.
  cache.reset();
  m->param_data()[m->params().specs().front().offset] += 1.0f;
  m->param_data()[m->params().total() - 1] += 1.0f;
  const std::string e = error_of([&] { decode_step(*m, cache, seq.data(), got.data()); });
  EXPECT_NE(e.find("stale"), std::string::npos) << e;
  EXPECT_EQ(cache.size(), 0);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, KvCacheLowp,
                         ::testing::Combine(::testing::Values("gpt2-debug", "llama-debug", "qwen3-debug",
                                                              "gemma2-debug"),
                                            ::testing::Values(DType::BF16, DType::F16)),
                         [](const auto& info) {
                           std::string n = std::get<0>(info.param) + "_" + compute_dtype_name(std::get<1>(info.param));
                           std::replace(n.begin(), n.end(), '-', '_');
                           return n;
                         });

}  // namespace
