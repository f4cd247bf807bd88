// Device-resident models (device: cuda). Here, without a GPU: the CPU path's backend buffers are
// its host buffers and the staging calls do nothing; the stand-in cuda backend has no step
// kernels; device layouts the device path lacks are refused naming the key. On a GPU
// (tests/cuda/run_on_gpu.sh runs tests/cuda/test_*): whole-model parity CUDA vs CPU for GPT-2, Llama and Gemma 2 — fp32
// loss and gradients within 1e-5 relative (gradient: norm of the difference over the norm), bf16 within 2e-2 (loss) /
// 5e-2 (gradients) of the CPU fp32 reference (bf16 rounding of activations and weights, ~3 significant digits) — one
// AdamW step on the device vs optim/ on the CPU (1e-5 relative: a few ulp from FMA contraction), logits, and
// bit-identical repeats on the same GPU. Without a GPU those cases are SKIPPED with the CUDA runtime's reason, never
// passed.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "config/model_config.h"
#include "config/recipe.h"
#include "core/error.h"
#include "core/rng.h"
#include "dist/nccl_comm.h"
#include "error_of.h"
#include "kernels/backend.h"
#include "kernels/backend_select.h"
#include "models/model.h"
#include "optim/optimizer.h"
#include "parallel/dist_optimizer.h"
#include "parallel/parallelize.h"

using namespace lathe;

namespace {

std::string error_of(const std::function<void()>& f) { return lathe::test::exception_of(f); }

TEST(DeviceModelCpu, HostModelsStageNothing) {
  auto m = build_model(ModelConfig::preset("gpt2-debug"));
  EXPECT_FALSE(m->on_device());
  EXPECT_EQ(m->backend_param_data(), m->param_data());
  EXPECT_EQ(m->backend_grad_data(), m->grad_data());
  m->init_weights(3);
  const std::vector<float> before(m->param_data(), m->param_data() + m->num_params());
  m->param_data()[0] = 42.0f;
  m->download_params();  // no-op: must not overwrite the host values
  EXPECT_EQ(m->param_data()[0], 42.0f);
  m->upload_params();
  EXPECT_EQ(m->param_data()[1], before[1]);
  EXPECT_NE(cpu_backend().step_ops(), nullptr);  // optim/'s own kernels (the device path on the host)
  EXPECT_EQ(no_cuda_backend().step_ops(), nullptr);
}

TEST(DeviceModelCpu, DeviceLayoutsTheDevicePathLacksAreRefused) {
  const char* y = "model: {preset: gpt2-debug}\ndata: {train: x}\ndevice: cuda\n";
  Recipe r = parse_recipe(y, "r.yaml");
  EXPECT_NO_THROW(parallel::check_device_layout(r, 1));
  // Data parallelism runs over NCCL where it was built (tests/parallel/test_dist_optimizer.cpp has the rest).
  std::string e = error_of([&] { parallel::check_device_layout(r, 4); });
  if (!dist::have_nccl()) {
    EXPECT_NE(e.find("r.yaml: device: cuda does not run this job has 4 processes"), std::string::npos) << e;
    EXPECT_NE(e.find("use device: cpu"), std::string::npos) << e;
  }
  r = parse_recipe(y, "r.yaml", {"parallel.tensor=2", "optimizer.name=lamb"});
  e = error_of([&] { parallel::check_device_layout(r, 2); });
  EXPECT_NE(e.find("optimizer.name = lamb with parallel.tensor = 2"), std::string::npos) << e;
  r = parse_recipe(y, "r.yaml", {"device=cpu"});
  EXPECT_NO_THROW(parallel::check_device_layout(r, 8));  // the CPU runs every layout
}

// ---- on a GPU ----------------------------------------------------------------------------------

// The cuda backend when it can run here with a complete table for `dtype`, else skip with why.
#define REQUIRE_CUDA(dtype)                                                                            \
  const Backend& cuda = backend_by_name("cuda");                                                       \
  if (const std::string why = backend_unavailable_reason(cuda); !why.empty())                          \
    GTEST_SKIP() << "no usable GPU: " << why;                                                          \
  if (const std::string why = error_of([&] { ops_for(cuda, dtype); }); why != "(no error)")            \
    GTEST_SKIP() << "the cuda backend cannot compute in " << compute_dtype_name(dtype) << ": " << why; \
  if (!cuda.step_ops()) GTEST_SKIP() << "the cuda backend has no step ops in this build"

struct Pass {
  double loss;
  std::vector<float> grads;
};

Pass run_pass(Model& m, const std::vector<int32_t>& tokens, const std::vector<int32_t>& targets, int64_t B, int64_t T) {
  m.zero_grad();
  Pass p;
  p.loss = m.forward_backward(tokens.data(), targets.data(), B, T, 1.0f / static_cast<float>(B * T), true);
  m.download_grads();
  p.grads.assign(m.grad_data(), m.grad_data() + m.num_params());
  return p;
}

double rel_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double d = 0, n = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    d += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    n += static_cast<double>(b[i]) * b[i];
  }
  return std::sqrt(d) / std::max(std::sqrt(n), 1e-30);
}

void batch(const ModelConfig& cfg, int64_t B, int64_t T, std::vector<int32_t>* tok, std::vector<int32_t>* tgt) {
  Rng rng(11);
  tok->resize(static_cast<size_t>(B * T));
  tgt->resize(tok->size());
  for (auto& t : *tok) t = static_cast<int32_t>(rng.uniform() * static_cast<float>(cfg.vocab_size - 1));
  for (auto& t : *tgt) t = static_cast<int32_t>(rng.uniform() * static_cast<float>(cfg.vocab_size - 1));
}

class DeviceParity : public ::testing::TestWithParam<const char*> {};

TEST_P(DeviceParity, Fp32LossGradsLogitsAndAdamwMatchTheCpu) {
  REQUIRE_CUDA(DType::F32);
  const ModelConfig cfg = ModelConfig::preset(GetParam());
  const int64_t B = 2, T = 37;  // odd T
  auto cpu = build_model(cfg);
  auto dev = build_model(cfg, ComputeSpec{&cuda, DType::F32});
  ASSERT_TRUE(dev->on_device());
  cpu->init_weights(5);
  dev->init_weights(5);
  cpu->allocate(B, T, 2);
  dev->allocate(B, T, 2);
  std::vector<int32_t> tok, tgt;
  batch(cfg, B, T, &tok, &tgt);
  const Pass a = run_pass(*cpu, tok, tgt, B, T), b = run_pass(*dev, tok, tgt, B, T);
  EXPECT_NEAR(b.loss, a.loss, 1e-5 * std::abs(a.loss)) << GetParam();
  EXPECT_LE(rel_diff(b.grads, a.grads), 1e-5) << GetParam();
  // Bit-reproducible on the same GPU.
  const Pass c = run_pass(*dev, tok, tgt, B, T);
  EXPECT_EQ(c.loss, b.loss);
  EXPECT_EQ(c.grads, b.grads);
  // Logits.
  std::vector<float> la(static_cast<size_t>(B * T * cfg.vocab_size)), lb(la.size());
  cpu->forward_logits(tok.data(), B, T, la.data());
  dev->forward_logits(tok.data(), B, T, lb.data());
  EXPECT_LE(rel_diff(lb, la), 1e-5);
  // One AdamW step on each (grads of the pass above, clip coefficient 0.5).
  run_pass(*cpu, tok, tgt, B, T);
  run_pass(*dev, tok, tgt, B, T);
  std::vector<optim::ParamRange> ranges;
  for (const ParamSpec& s : cpu->params().specs())
    ranges.push_back({s.offset, static_cast<size_t>(s.numel()), s.decay, static_cast<int64_t>(ranges.size())});
  optim::OptimConfig oc;
  auto host_cpu = optim::make_optimizer(oc, cpu->num_params());
  auto own_world = dist::make_local_communicator();  // one process: no data parallelism
  host_cpu->step(cpu->param_data(), cpu->grad_data(), ranges, 1e-3, 1, 0.5f);
  parallel::DistOptimizer dopt(
      parallel::FlatState{&dev->backend(), dev->backend_param_data(), dev->backend_grad_data(), dev->num_params()},
      *own_world, parallel::DistOptimizerConfig{.optim = oc}, ranges);
  EXPECT_NEAR(dopt.grad_norm(), std::sqrt([&] {
                double s = 0;
                for (size_t i = 0; i < cpu->num_params(); ++i) s += double(cpu->grad_data()[i]) * cpu->grad_data()[i];
                return s;
              }()),
              1e-5 * dopt.grad_norm());
  dopt.step(1e-3, 1, 0.5f);
  dev->download_params();
  const std::vector<float> pc(cpu->param_data(), cpu->param_data() + cpu->num_params()),
      pd(dev->param_data(), dev->param_data() + dev->num_params());
  EXPECT_LE(rel_diff(pd, pc), 1e-5);
  // Moments come back to the host optimizer for checkpoints.
  dopt.download_state();
  EXPECT_LE(rel_diff(std::vector<float>(dopt.local().state_buffers()[0].second->data(),
                                        dopt.local().state_buffers()[0].second->data() + dev->num_params()),
                     std::vector<float>(host_cpu->state_buffers()[0].second->data(),
                                        host_cpu->state_buffers()[0].second->data() + cpu->num_params())),
            1e-5);
}

TEST_P(DeviceParity, Bf16WithinStatedToleranceOfCpuFp32) {
  REQUIRE_CUDA(DType::BF16);
  const ModelConfig cfg = ModelConfig::preset(GetParam());
  const int64_t B = 2, T = 32;
  auto cpu = build_model(cfg);
  auto dev = build_model(cfg, ComputeSpec{&cuda, DType::BF16});
  cpu->init_weights(5);
  dev->init_weights(5);
  cpu->allocate(B, T, 2);
  dev->allocate(B, T, 2);
  std::vector<int32_t> tok, tgt;
  batch(cfg, B, T, &tok, &tgt);
  const Pass a = run_pass(*cpu, tok, tgt, B, T), b = run_pass(*dev, tok, tgt, B, T);
  EXPECT_NEAR(b.loss, a.loss, 2e-2 * std::abs(a.loss)) << GetParam();
  EXPECT_LE(rel_diff(b.grads, a.grads), 5e-2) << GetParam();
  const Pass c = run_pass(*dev, tok, tgt, B, T);
  EXPECT_EQ(c.loss, b.loss);  // bit-reproducible
  EXPECT_EQ(c.grads, b.grads);
}

INSTANTIATE_TEST_SUITE_P(Families, DeviceParity, ::testing::Values("gpt2-debug", "llama-debug", "gemma2-debug"));

}  // namespace
