// What the model tests that run a debug model against an oracle share (test_doc_attention.cpp,
// test_model_bf16.cpp): the perturbed deterministic init, random token ids, a fresh scratch
// directory, and running a Python (torch) oracle script while keeping what it printed.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "core/rng.h"
#include "models/model.h"

namespace lathe::model_test {

// A model of `dt` with a deterministic init (seed 42) whose biases and norm weights (0 / 1 at init)
// are perturbed so that their use and gradients are exercised. The fp32 masters are the same for
// every dtype, so models of two dtypes hold the same weights.
inline std::unique_ptr<Model> perturbed_model(const ModelConfig& cfg, DType dt = DType::F32) {
  auto m = build_model(cfg, ComputeSpec{nullptr, dt});
  m->init_weights(42);
  Rng prng(7);
  for (const ParamSpec& s : m->params().specs())
    if (s.init != Init::Normal)
      for (int64_t i = 0; i < s.numel(); ++i) m->param_data()[s.offset + i] += 0.1f * prng.normal();
  m->refresh_compute_weights();
  return m;
}

// A mistral with an explicit head_dim (Mistral-Nemo's shape scaled down): hidden 96, 4 query heads
// of 32 (q and o 128 wide, not 96), 2 KV heads, MLP 192, untied. `std`: the init std of the
// weights (large enough that attention and RoPE matter in the oracle checks).
inline ModelConfig mistral_head_dim_config(double std = 0.02) {
  ModelConfig c = ModelConfig::preset("mistral-debug");
  c.hidden_size = 96;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.explicit_head_dim = 32;
  c.intermediate_size = 192;
  c.initializer_range = std;
  c.validate("mistral_head_dim_config");
  return c;
}

// n token ids uniform in [0, V), from Rng(seed).
inline std::vector<int32_t> random_tokens(int64_t n, int64_t V, uint64_t seed) {
  Rng rng(seed);
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (auto& x : t) x = static_cast<int32_t>(rng.below(V));
  return t;
}

// `dir` emptied (a crashed run may have left it) and created.
inline void fresh_dir(const std::filesystem::path& dir) {
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
}

// Runs the shell command `cmd` (stderr merged into stdout by the caller's 2>&1), echoes what it
// printed to stdout (the oracle's figures appear in the test log) and returns it in `out` with the
// exit status in `rc`. A failure to start it is fatal: call it under ASSERT_NO_FATAL_FAILURE.
inline void run_oracle(const std::string& cmd, int& rc, std::string& out) {
  rc = -1;
  FILE* p = popen(cmd.c_str(), "r");
  ASSERT_NE(p, nullptr);
  char buf[4096];
  while (fgets(buf, sizeof buf, p)) out += buf;
  rc = pclose(p);
  std::cout << out;
}

}  // namespace lathe::model_test
