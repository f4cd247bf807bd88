// The model's seams (issue 8): tensors found by role, so a missing or misplaced tensor is an error
// (never a silently dropped bias); per-block passes whose composition is forward_backward; hooks
// that report every gradient range exactly once, after the last block that adds to it, in
// backward order (what data-parallel bucketing relies on). The backend seam (issue 9): the op table
// a model is built with, refusals of unimplemented ones, and the activation plan.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <vector>

#include "config/model_config.h"
#include "error_of.h"
#include "kernels/backend.h"
#include "models/model.h"
#include "models/traced_ops.h"

using namespace lathe;

namespace {
using lathe::test::error_of;

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

// ---- the backend seam (issue 9): the model computes through the op table it was built with ----

TEST(ModelCompute, DefaultIsTheCpuFp32Table) {
  auto model = build_model(ModelConfig::preset("gpt2-debug"));
  EXPECT_EQ(&model->backend(), &cpu_backend());
  // The model calls the table through its traced twin (models/traced_ops.h: profiler spans per kernel).
  EXPECT_EQ(&untraced_ops(model->ops()), &ops_for(cpu_backend(), DType::F32));
  EXPECT_EQ(model->compute_dtype(), DType::F32);
  auto same = build_llama(ModelConfig::preset("llama-debug"), ComputeSpec{&cpu_backend(), DType::F32});
  EXPECT_EQ(&untraced_ops(same->ops()), &ops_for(cpu_backend(), DType::F32));
  EXPECT_EQ(&same->ops(), &model->ops());  // one traced twin per table
}

TEST(ModelCompute, UnimplementedComputeIsRefusedBeforeAnyAllocation) {
  const ModelConfig cfg = ModelConfig::preset("gpt2-debug");
  // F64 has no CPU table: the error names the op, the dtype, the backend and what exists.
  const std::string f64 = error_of([&] { build_model(cfg, ComputeSpec{nullptr, DType::F64}); });
  EXPECT_EQ(f64, "[matmul_forward] no F64 implementation on cpu; implemented: fp32, bf16, fp16");
  const std::string cuda = error_of([&] { build_model(cfg, ComputeSpec{&no_cuda_backend(), DType::F32}); });
  EXPECT_EQ(cuda, "[matmul_forward] no fp32 implementation on cuda; implemented: none");
}

static std::unique_ptr<Model> fp32_only_builder(const ModelConfig& c) { return build_gpt2(c); }

TEST(ModelCompute, BuilderWithoutComputeSpecBuildsOnlyCpuFp32) {
  ModelRegistry r;
  r.add("gpt2", fp32_only_builder, "old.cpp");
  const ModelConfig cfg = ModelConfig::preset("gpt2-debug");
  EXPECT_EQ(r.build(cfg)->compute_dtype(), DType::F32);
  const std::string msg = error_of([&] { r.build(cfg, ComputeSpec{nullptr, DType::BF16}); });
  EXPECT_NE(msg.find("model_type 'gpt2' (registered by old.cpp) builds cpu fp32 models only; bf16 on cpu"),
            std::string::npos)
      << msg;
}

// The arena is one list of {name, count, dtype, offset}: entries are 64-byte aligned, disjoint, in
// order, cover exactly the allocated bytes, and the memory estimate reads the same total.
TEST(ModelCompute, ActivationPlanDescribesTheWholeArena) {
  for (const char* preset : {"gpt2-debug", "llama-debug"}) {
    const ModelConfig cfg = ModelConfig::preset(preset);
    auto model = build_model(cfg);
    EXPECT_TRUE(model->activation_plan().entries.empty());
    const int64_t B = 3, T = 17, L = cfg.num_hidden_layers;
    model->allocate(B, T);
    const ActivationPlan& plan = model->activation_plan();
    EXPECT_EQ(plan.bytes, model->activation_bytes()) << preset;
    EXPECT_EQ(static_cast<int64_t>(plan.bytes), Model::activation_floats(cfg, B, T) * 4) << preset;
    const ActivationPlan again = Model::plan_activations(cfg, B, T);
    ASSERT_EQ(again.entries.size(), plan.entries.size());
    EXPECT_EQ(again.bytes, plan.bytes);
    size_t end = 0;
    std::vector<std::string> labels;
    int64_t per_layer = 0;
    for (const ActivationEntry& e : plan.entries) {
      EXPECT_EQ(e.offset % 64, 0u) << e.label();
      EXPECT_GE(e.offset, end) << e.label() << " overlaps the previous entry";
      end = e.offset + static_cast<size_t>(e.count) * dtype_size(e.dtype);
      EXPECT_LE(end, plan.bytes) << e.label();
      EXPECT_GT(e.count, 0) << e.label();
      // Today everything is fp32 except the untyped scratch.
      EXPECT_EQ(e.dtype, std::string(e.name) == "scratch" ? DType::U8 : DType::F32) << e.label();
      labels.push_back(e.label());
      per_layer += e.layer >= 0;
    }
    EXPECT_EQ(per_layer, 13 * L);
    std::sort(labels.begin(), labels.end());
    EXPECT_TRUE(std::adjacent_find(labels.begin(), labels.end()) == labels.end()) << "duplicate entry names";
    EXPECT_TRUE(std::binary_search(labels.begin(), labels.end(), std::string("layers.1.qkv")));
    EXPECT_TRUE(std::binary_search(labels.begin(), labels.end(), std::string("lnf_rstd")));
  }
}
