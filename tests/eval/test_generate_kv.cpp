// lathe::generate with the KV cache (the default) against opts.kv_cache = false (full recompute of
// the window for every token, the reference path): the same tokens, greedy and sampled, for GPT-2
// and Llama (GQA, RoPE) debug models; also when the sequence runs past the window (the cache
// gives way to the sliding-window recompute) and for a bf16 model.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "config/model_config.h"
#include "core/rng.h"
#include "eval/generate.h"
#include "models/kv_cache.h"
#include "models/model.h"

using namespace lathe;

namespace {

std::unique_ptr<Model> make(const std::string& preset, int64_t T, DType dt = DType::F32) {
  auto m = build_model(ModelConfig::preset(preset), ComputeSpec{nullptr, dt});
  m->init_weights(5);
  m->allocate(1, T);
  return m;
}

std::vector<int32_t> run(Model& m, const std::vector<int32_t>& prompt, SamplingOptions so, bool kv) {
  so.kv_cache = kv;
  std::vector<int32_t> streamed;
  auto out = generate(m, prompt, so, [&](int32_t t) { streamed.push_back(t); });
  EXPECT_EQ(out, streamed);
  return out;
}

class GenerateKv : public ::testing::TestWithParam<std::string> {};

TEST_P(GenerateKv, SameTokensWithAndWithoutCache) {
  // Window 24: prompt 5 + 40 new tokens runs 21 tokens past it.
  auto m = make(GetParam(), 24);
  const std::vector<int32_t> prompt = {3, 17, 42, 9, 1};
  SamplingOptions greedy;
  greedy.temperature = 0;
  for (int64_t n : {1, 12, 40}) {
    greedy.max_new_tokens = n;
    const auto want = run(*m, prompt, greedy, false);
    EXPECT_EQ(run(*m, prompt, greedy, true), want) << GetParam() << " greedy, " << n << " new tokens";
    EXPECT_EQ(static_cast<int64_t>(want.size()), n);
  }
  // A one-token prompt, and a prompt that fills the window on its own.
  greedy.max_new_tokens = 6;
  EXPECT_EQ(run(*m, {7}, greedy, true), run(*m, {7}, greedy, false));
  std::vector<int32_t> long_prompt(24);
  for (size_t i = 0; i < long_prompt.size(); ++i) long_prompt[i] = static_cast<int32_t>(i * 5 % 90);
  EXPECT_EQ(run(*m, long_prompt, greedy, true), run(*m, long_prompt, greedy, false));
  // Sampling (temperature, top-k, top-p) with one seed draws the same tokens.
  SamplingOptions s;
  s.max_new_tokens = 30;
  s.temperature = 0.9f;
  s.top_k = 20;
  s.top_p = 0.9f;
  s.seed = 123;
  EXPECT_EQ(run(*m, prompt, s, true), run(*m, prompt, s, false)) << GetParam() << " sampled";
}

INSTANTIATE_TEST_SUITE_P(Families, GenerateKv, ::testing::Values("gpt2-debug", "llama-debug"),
                         [](const auto& info) { return info.param == "gpt2-debug" ? "gpt2" : "llama"; });

TEST(GenerateKv, Bf16SameTokens) {
  auto m = make("llama-debug", 16, DType::BF16);
  ASSERT_EQ(kv_cache_unsupported_reason(*m), "");
  SamplingOptions greedy;
  greedy.temperature = 0;
  greedy.max_new_tokens = 8;
  EXPECT_EQ(run(*m, {1, 2, 3}, greedy, true), run(*m, {1, 2, 3}, greedy, false));
}

}  // namespace
