// The model's seams (issue 8): tensors found by role, so a missing or misplaced tensor is an error
// (never a silently dropped bias); per-block passes whose composition is forward_backward; hooks
// that report every gradient range exactly once, after the last block that adds to it, in
// backward order (what data-parallel bucketing relies on).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <vector>

#include "config/model_config.h"
#include "models/model.h"

using namespace lathe;

namespace {
std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

std::vector<int32_t> tokens_for(const ModelConfig& c, int64_t n, int salt) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) t[static_cast<size_t>(i)] = static_cast<int32_t>((i * 7 + salt) % c.vocab_size);
  return t;
}
}  // namespace

TEST(ModelRoles, MissingRequiredRoleIsAnErrorNamingRoleAndLayer) {
  const ModelConfig cfg = ModelConfig::preset("gpt2-debug");
  auto good = build_gpt2(cfg);
  // Rebuild the table without layer 1's attention output bias (as a misspelt name would lose it).
  ParamTable t;
  for (const ParamSpec& s : good->params().specs())
    if (!(s.role == Role::OB && s.layer == 1))
      t.add(s.name, s.shape, s.init, s.init_std, s.shard, s.decay, s.hf_transposed).as(s.role, s.layer);
  const std::string msg = error_of([&] { Model m(cfg, good->arch(), std::move(t)); });
  EXPECT_NE(msg.find("role o_b for layer 1"), std::string::npos) << msg;
}

TEST(ModelRoles, RoleTheArchDoesNotUseIsAnError) {
  const ModelConfig cfg = ModelConfig::preset("llama-debug");
  auto good = build_llama(cfg);
  ParamTable t;
  for (const ParamSpec& s : good->params().specs())
    t.add(s.name, s.shape, s.init, s.init_std, s.shard, s.decay, s.hf_transposed).as(s.role, s.layer);
  t.add("extra.bias", {cfg.hidden_size}, Init::Zeros, 0, ShardRule::Replicated, false).as(Role::OB, 0);
  const std::string msg = error_of([&] { Model m(cfg, good->arch(), std::move(t)); });
  EXPECT_NE(msg.find("'extra.bias' has role o_b"), std::string::npos) << msg;
}

TEST(ModelRoles, FusedGroupOfTheWrongSizeIsAnError) {
  const ModelConfig cfg = ModelConfig::preset("llama-debug");
  auto good = build_llama(cfg);
  ParamTable t;  // drop layer 0's v_proj: q|k no longer fills the fused q|k|v operand
  for (const ParamSpec& s : good->params().specs())
    if (s.name != "model.layers.0.self_attn.v_proj.weight")
      t.add(s.name, s.shape, s.init, s.init_std, s.shard, s.decay, s.hf_transposed).as(s.role, s.layer);
  const std::string msg = error_of([&] { Model m(cfg, good->arch(), std::move(t)); });
  EXPECT_NE(msg.find("model.layers.0.self_attn.q_proj.weight"), std::string::npos) << msg;
}

class ModelHooks : public ::testing::TestWithParam<const char*> {};

TEST_P(ModelHooks, GradientsReportedOnceAfterTheirLastBlockInBackwardOrder) {
  const ModelConfig cfg = ModelConfig::preset(GetParam());
  auto model = build_model(cfg);
  model->init_weights(3);
  const int64_t B = 2, T = 16, L = cfg.num_hidden_layers;
  model->allocate(B, T);
  auto in = tokens_for(cfg, B * T, 1), tg = tokens_for(cfg, B * T, 2);
  const size_t P = model->num_params();

  // Reference: gradients of a pass without hooks.
  model->zero_grad();
  const double loss_ref = model->forward_backward(in.data(), tg.data(), B, T, 1.0f / (B * T), true);
  std::vector<float> g_ref(model->grad_data(), model->grad_data() + P);

  std::vector<int> covered(P, 0);
  std::vector<std::pair<int64_t, bool>> blocks;
  int64_t current_block = -1;
  std::vector<float> g_at_report(P, 0.0f);
  StepHooks hooks;
  hooks.before_block = [&](int64_t block, bool backward) {
    blocks.push_back({block, backward});
    current_block = block;
  };
  hooks.grads_ready = [&](size_t b, size_t e) {
    for (size_t i = b; i < e; ++i) ++covered[i], g_at_report[i] = model->grad_data()[i];
  };
  model->set_hooks(hooks);
  model->zero_grad();
  const double loss = model->forward_backward(in.data(), tg.data(), B, T, 1.0f / (B * T), true);
  model->set_hooks({});
  EXPECT_EQ(loss, loss_ref);
  // Every element exactly once, and its gradient was already final when reported.
  EXPECT_TRUE(std::all_of(covered.begin(), covered.end(), [](int c) { return c == 1; }));
  EXPECT_EQ(0, std::memcmp(g_at_report.data(), g_ref.data(), P * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(model->grad_data(), g_ref.data(), P * sizeof(float)));
  // Blocks: forward 0..L+1, then backward L..0 (the head's backward is part of its forward call).
  std::vector<std::pair<int64_t, bool>> want;
  for (int64_t b = 0; b <= L + 1; ++b) want.push_back({b, false});
  for (int64_t b = L; b >= 0; --b) want.push_back({b, true});
  EXPECT_EQ(blocks, want);
  (void)current_block;
}

INSTANTIATE_TEST_SUITE_P(Families, ModelHooks, ::testing::Values("gpt2-debug", "llama-debug", "qwen2-debug"));
