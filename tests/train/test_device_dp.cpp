// The device path's data parallelism (train/device_dp.h, train/device_step.h) without a GPU: the
// model is a CPU model, the step ops are the cpu backend's (Backend::step_ops(): optim/'s own
// kernels) and the "NCCL" group is a second thread communicator of the same ranks.
// Oracle: the CPU trainer's own data parallelism (GradSync + ShardedOptimizer) on the same
// gradients. Over threads both reduce in rank order, so the norms, the updated weights and the
// moments (what a checkpoint stages) must be BIT-identical for DP = 2 and 3, ZeRO 0/1/2, AdamW and
// LAMB, with the buckets issued after backward (step 1) and from grads_ready as backward reports
// ranges (step 2). Also checked: which communicator carries what (bucket reductions and the weights'
// all-gather on the device group, only scalars on the host group), the refusals of
// check_device_layout naming the key, and mismatched groups refused.
// What only a GPU can check (NCCL's sums, the real bootstrap, DP=2 device vs DP=2 CPU within
// tolerances) is tests/train/test_device_dp_train.py, SKIPPED here with its reason.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>

#include "config/model_config.h"
#include "config/recipe.h"
#include "core/error.h"
#include "dist/comm.h"
#include "dist/nccl_comm.h"
#include "error_of.h"
#include "models/model.h"
#include "optim/optimizer.h"
#include "parallel/grad_sync.h"
#include "parallel/sharded_optimizer.h"
#include "train/device_dp.h"
#include "train/device_step.h"

using namespace lathe;

namespace {

std::string error_of(const std::function<void()>& f) { return lathe::test::exception_of(f); }

float grad_of(int rank, int step, size_t i) {
  return static_cast<float>(std::sin(0.0013 * static_cast<double>(i) * (rank + 1) + step) *
                            std::pow(10.0, static_cast<int>((i * 7 + static_cast<size_t>(rank)) % 5) - 3));
}

std::vector<optim::ParamRange> ranges_of(const Model& m) {
  std::vector<optim::ParamRange> ranges;
  for (const ParamSpec& s : m.params().specs())
    ranges.push_back({s.offset, static_cast<size_t>(s.numel()), s.decay, static_cast<int64_t>(ranges.size())});
  return ranges;
}

struct Case {
  int dp, zero;
  const char* optimizer;
  size_t bucket;  // elements
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << "dp " << c.dp << " zero " << c.zero << " " << c.optimizer << " buckets of " << c.bucket;
}

class DeviceDp : public ::testing::TestWithParam<Case> {};

// Two optimizer steps on each path; returns through EXPECTs. The device path's model is the one
// the DeviceOptimizer updates; the reference updates plain vectors with the CPU trainer's classes.
TEST_P(DeviceDp, BitIdenticalToTheCpuDataParallelPath) {
  const Case c = GetParam();
  optim::OptimConfig cfg;
  cfg.name = c.optimizer;
  dist::run_threads(c.dp, [&](dist::Communicator& world) {
    const int rank = world.rank();
    auto model = build_model(ModelConfig::preset("gpt2-debug"));
    model->init_weights(7);
    const size_t P = model->num_params();
    const auto ranges = ranges_of(*model);
    // Reference: the CPU trainer's data parallelism.
    std::vector<float> ref_params(model->param_data(), model->param_data() + P), ref_grads(P);
    parallel::ShardedOptimizer ref_opt(world, cfg, P, ranges, c.zero);
    parallel::GradSync sync(world, ref_grads.data(), ref_opt.shards(), c.zero, c.bucket);
    // Device path: host group = `world`, device group = a second group of the same ranks.
    auto dev_group = world.split(0, rank, "device");
    dist::Communicator* dev_comm = dev_group.get();
    parallel::ShardedOptimizer staging(world, cfg, P, ranges, c.zero);  // the trainer's `opt`: host staging only
    auto ddp = std::make_unique<DeviceDataParallel>(world, std::move(dev_group), staging.shards(), c.zero, c.bucket,
                                                    model->backend(), model->backend_grad_data());
    EXPECT_EQ(ddp->num_buckets(), sync.num_buckets());
    DeviceOptimizer dev(*model, cfg, ranges, staging.local(), std::move(ddp));
    EXPECT_EQ(staging.state_begin(), dev.data_parallel()->state_begin());
    for (int step = 1; step <= 2; ++step) {
      sync.zero_grads();
      model->zero_grad();
      for (size_t i = 0; i < P; ++i) ref_grads[i] = model->grad_data()[i] = grad_of(rank, step, i);
      sync.ready(0, P);
      sync.finish();
      const double ref_norm = ref_opt.grad_norm(ref_grads.data());
      const float coef = 0.5f;
      ref_opt.step(ref_params.data(), ref_grads.data(), 1e-3, step, coef);

      const uint64_t host0 = world.issued(), dev0 = dev_comm->issued();
      if (step == 2) {  // as backward reports them (last tensors first): buckets issued as they fill
        const auto& specs = model->params().specs();
        for (auto it = specs.rbegin(); it != specs.rend(); ++it)
          dev.grads_ready(it->offset, it->offset + static_cast<size_t>(it->numel()));
        EXPECT_EQ(dev_comm->issued() - dev0, sync.num_buckets()) << "every bucket issued from grads_ready";
      }  // step 1: all of them in reduce_grads
      dev.reduce_grads();
      const double norm = dev.grad_norm();
      dev.step(1e-3, step, coef);
      // The device group moves the buckets (and the weights' shards under ZeRO); the host group only
      // the norm's chunk sums (ZeRO) and LAMB's chunk sums (ZeRO: a count and the sums).
      const uint64_t dev_ops = dev_comm->issued() - dev0, host_ops = world.issued() - host0;
      EXPECT_EQ(dev_ops, sync.num_buckets() + (c.zero ? 1u : 0u)) << "rank " << rank;
      const bool lamb = std::string(c.optimizer) == "lamb";
      EXPECT_EQ(host_ops, c.zero ? 1u + (lamb ? 2u : 0u) : 0u) << "rank " << rank;

      EXPECT_EQ(norm, ref_norm) << "step " << step << " rank " << rank;
      ASSERT_EQ(0, std::memcmp(model->param_data(), ref_params.data(), P * sizeof(float)))
          << "weights differ after step " << step << " on rank " << rank;
    }
    // The moments a checkpoint stages (this rank's shard under ZeRO) equal the reference's.
    dev.download_state();
    const auto a = staging.local().state_buffers(), b = ref_opt.local().state_buffers();
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i) {
      ASSERT_EQ(a[i].second->size(), b[i].second->size());
      EXPECT_EQ(0, std::memcmp(a[i].second->data(), b[i].second->data(), a[i].second->size() * sizeof(float)))
          << a[i].first << " differs on rank " << rank;
    }
  });
}

// Buckets of 20000 elements cut the ~100k-parameter model into several (some straddle shards).
INSTANTIATE_TEST_SUITE_P(Layouts, DeviceDp,
                         ::testing::Values(Case{2, 0, "adamw", 20000}, Case{2, 1, "adamw", 20000},
                                           Case{2, 2, "adamw", 20000}, Case{3, 1, "adamw", 30000},
                                           Case{3, 2, "lamb", 20000}, Case{2, 1, "lamb", 1 << 30},
                                           Case{3, 0, "lamb", 20000}),
                         [](const ::testing::TestParamInfo<Case>& i) {
                           return fmt::format(
                               "dp{}_zero{}_{}_b{}", i.param.dp, i.param.zero, i.param.optimizer,
                               i.param.bucket == (1u << 30) ? std::string("one") : std::to_string(i.param.bucket));
                         });

TEST(DeviceDpGroups, MismatchedDeviceGroupIsRefused) {
  dist::run_threads(2, [](dist::Communicator& world) {
    parallel::FlatShards shards(100000, 2, 8192);
    auto alone = world.split(world.rank(), 0, "alone");  // one rank each: not the host group
    std::vector<float> grads(100000);
    const std::string e =
        error_of([&] { DeviceDataParallel d(world, std::move(alone), shards, 1, 1000, cpu_backend(), grads.data()); });
    EXPECT_NE(e.find("is not the host group"), std::string::npos) << e;
  });
}

TEST(DeviceLayout, RefusalsNameTheKeyAndTheReason) {
  const char* y = "model: {preset: gpt2-debug}\ndata: {train: x}\ndevice: cuda\n";
  Recipe r = parse_recipe(y, "r.yaml");
  EXPECT_NO_THROW(check_device_layout(r, 1));
  // Several processes = data parallelism: runs where NCCL was built, refused (naming it) elsewhere.
  const std::string e4 = error_of([&] { check_device_layout(r, 4); });
  if (dist::have_nccl()) {
    EXPECT_EQ(e4, "(no error)");
  } else {
    EXPECT_NE(e4.find("r.yaml: device: cuda does not run this job has 4 processes (data or tensor parallelism)"),
              std::string::npos)
        << e4;
    EXPECT_NE(e4.find("built without NCCL"), std::string::npos) << e4;
    EXPECT_NE(e4.find("use device: cpu"), std::string::npos) << e4;
  }
  // Tensor parallelism runs (train/device_tp.h) with AdamW and without eval tasks.
  r = parse_recipe(y, "r.yaml", {"parallel.tensor=2"});
  std::string e = error_of([&] { check_device_layout(r, 2); });
  if (dist::have_nccl()) {
    EXPECT_EQ(e, "(no error)");
  }
  r = parse_recipe(y, "r.yaml", {"parallel.tensor=2", "optimizer.name=lamb"});
  e = error_of([&] { check_device_layout(r, 2); });
  EXPECT_NE(e.find("optimizer.name = lamb with parallel.tensor = 2"), std::string::npos) << e;
  EXPECT_NE(e.find("use adamw"), std::string::npos) << e;
  r = parse_recipe(y, "r.yaml", {"parallel.tensor=2", "training.eval_tasks=tasks.jsonl"});
  e = error_of([&] { check_device_layout(r, 2); });
  EXPECT_NE(e.find("training.eval_tasks with parallel.tensor = 2"), std::string::npos) << e;
  // Pipeline parallelism runs (host-staged messages), LAMB included; with NCCL for the world.
  r = parse_recipe(y, "r.yaml", {"parallel.pipeline=2", "optimizer.name=lamb"});
  e = error_of([&] { check_device_layout(r, 2); });
  if (dist::have_nccl()) {
    EXPECT_EQ(e, "(no error)");
  } else {
    EXPECT_NE(e.find("built without NCCL"), std::string::npos) << e;
  }
  r = parse_recipe(y, "r.yaml", {"device=cpu", "parallel.tensor=2"});
  EXPECT_NO_THROW(check_device_layout(r, 8));  // the CPU runs every layout
}

TEST(DeviceDpGroups, NcclCommunicatorWithoutNcclNamesTheFix) {
  if (dist::have_nccl()) GTEST_SKIP() << "this build has NCCL: the refusal cannot be provoked";
  dist::run_threads(2, [](dist::Communicator& world) {
    const std::string e = error_of([&] { dist::make_nccl_communicator(world, 0); });
    EXPECT_NE(e.find("-DLATHE_CUDA=ON"), std::string::npos) << e;
  });
}

}  // namespace
