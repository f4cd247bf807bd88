// The distributed optimizer (parallel/dist_optimizer.h) on the in-process thread communicator,
// against the single-process computation (the oracle): every rank's gradients are known functions of
// (rank, step, element); the reference sums them in rank order (as one process accumulating the
// ranks' micro-batches one after another does), takes the global norm and applies optim/'s own
// AdamW / LAMB (optim::make_optimizer) to the whole buffer. Over threads every reduction is summed
// in rank order, so the norms, the weights after each step and the moments (what a checkpoint
// holds) must be BIT-identical, for DP = 1..3, ZeRO 0/1/2, AdamW and LAMB, buckets issued from
// grads_ready as backward reports ranges (step 2) or all after backward (step 1), on both paths:
//   * the host path (a CPU model: the reduction over the data group, host moments);
//   * the device path with a CPU model (device_path_on_host: backend-memory moments staged through
//     local(), a second group of the same ranks standing in for NCCL). Also checked there: which
//     group carries what (buckets and weight shards on the device group, only scalars on the data
//     group).
// What only a GPU can check (NCCL's sums, the real bootstrap, DP=2 device vs DP=2 CPU within
// tolerances) is tests/train/test_device_dp_train.py, SKIPPED here with its reason.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>

#include "config/model_config.h"
#include "config/recipe.h"
#include "dist/comm.h"
#include "dist/nccl_comm.h"
#include "error_of.h"
#include "models/model.h"
#include "optim/clip.h"
#include "optim/optimizer.h"
#include "parallel/dist_optimizer.h"
#include "parallel/parallelize.h"

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
  bool device_path;
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << "dp " << c.dp << " zero " << c.zero << " " << c.optimizer << " buckets of " << c.bucket
      << (c.device_path ? " device path" : " host path");
}

class DistOptimizerLayouts : public ::testing::TestWithParam<Case> {};

constexpr float kCoef = 0.5f;  // the clipping coefficient x loss-scale reciprocal of both steps

TEST_P(DistOptimizerLayouts, BitIdenticalToOneProcess) {
  const Case c = GetParam();
  optim::OptimConfig cfg;
  cfg.name = c.optimizer;
  auto whole = build_model(ModelConfig::preset("gpt2-debug"));
  whole->init_weights(7);
  const size_t P = whole->num_params();
  const auto ranges = ranges_of(*whole);
  // The oracle: one process with the ranks' gradients summed in rank order.
  std::vector<float> ref_params(whole->param_data(), whole->param_data() + P), ref_grads(P);
  auto ref_opt = optim::make_optimizer(cfg, P);
  std::vector<double> ref_norms;
  for (int step = 1; step <= 2; ++step) {
    std::fill(ref_grads.begin(), ref_grads.end(), 0.0f);
    for (int r = 0; r < c.dp; ++r)
      for (size_t i = 0; i < P; ++i) ref_grads[i] += grad_of(r, step, i);
    ref_norms.push_back(optim::global_grad_norm(ref_grads.data(), P));
    ref_opt->step(ref_params.data(), ref_grads.data(), ranges, 1e-3, step, kCoef);
  }
  dist::run_threads(c.dp, [&](dist::Communicator& world) {
    const int rank = world.rank();
    auto model = build_model(ModelConfig::preset("gpt2-debug"));
    model->init_weights(7);
    parallel::DistOptimizerConfig dc;
    dc.optim = cfg;
    dc.zero = c.zero;
    dc.bucket_elems = c.bucket;
    dc.device_path_on_host = c.device_path;
    parallel::DistOptimizer opt(
        parallel::FlatState{&model->backend(), model->backend_param_data(), model->backend_grad_data(), P}, world, dc,
        ranges);
    EXPECT_EQ(opt.device_path(), c.device_path);
    EXPECT_EQ(opt.reduces(), c.dp > 1);
    for (int step = 1; step <= 2; ++step) {
      opt.zero_grads();
      for (size_t i = 0; i < P; ++i) model->grad_data()[i] = grad_of(rank, step, i);
      const uint64_t data0 = world.issued();
      if (step == 2) {  // as backward reports them (last tensors first): buckets issued as they fill
        opt.set_last_backward(true);
        const auto& specs = model->params().specs();
        for (auto it = specs.rbegin(); it != specs.rend(); ++it)
          opt.grads_ready(it->offset, it->offset + static_cast<size_t>(it->numel()));
        opt.set_last_backward(false);
      }  // step 1: all of them in reduce_grads
      EXPECT_GE(opt.reduce_grads(), 0.0);
      const double norm = opt.grad_norm();
      opt.step(1e-3, step, kCoef);
      EXPECT_EQ(norm, ref_norms[static_cast<size_t>(step - 1)]) << "step " << step << " rank " << rank;
      if (c.device_path && c.dp > 1) {
        // The data group carries only scalars: the norm's chunk sums (ZeRO) and LAMB's chunk sums
        // (ZeRO: a count and the sums); buckets and weight shards travel on the device group.
        const bool lamb = std::string(c.optimizer) == "lamb";
        EXPECT_EQ(world.issued() - data0, c.zero ? 1u + (lamb ? 2u : 0u) : 0u) << "rank " << rank;
      }
    }
    ASSERT_EQ(0, std::memcmp(model->param_data(), ref_params.data(), P * sizeof(float)))
        << "weights differ after two steps on rank " << rank;
    // The moments a checkpoint holds (this rank's shard under ZeRO) equal the oracle's.
    opt.download_state();
    const size_t b = opt.state_begin(), e = opt.state_end();
    EXPECT_EQ(e - b, c.zero ? opt.shards().size(rank) : P);  // moments shrink with the data degree under ZeRO
    const auto mine = opt.local().state_buffers(), ref = ref_opt->state_buffers();
    ASSERT_EQ(mine.size(), ref.size());
    for (size_t i = 0; i < mine.size(); ++i) {
      ASSERT_EQ(mine[i].second->size(), e - b);
      EXPECT_EQ(0, std::memcmp(mine[i].second->data(), ref[i].second->data() + b, (e - b) * sizeof(float)))
          << mine[i].first << " differs on rank " << rank;
    }
  });
}

// Buckets of 20000 elements cut the ~100k-parameter model into several (some straddle shards).
INSTANTIATE_TEST_SUITE_P(Layouts, DistOptimizerLayouts,
                         ::testing::Values(Case{1, 0, "adamw", 20000, false}, Case{1, 1, "lamb", 20000, true},
                                           Case{2, 0, "adamw", 20000, false}, Case{2, 0, "adamw", 20000, true},
                                           Case{2, 1, "adamw", 20000, false}, Case{2, 1, "adamw", 20000, true},
                                           Case{2, 2, "adamw", 20000, false}, Case{2, 2, "adamw", 20000, true},
                                           Case{3, 1, "adamw", 30000, true}, Case{3, 2, "lamb", 20000, false},
                                           Case{3, 2, "lamb", 20000, true}, Case{2, 1, "lamb", 1 << 30, true},
                                           Case{3, 0, "lamb", 20000, false}, Case{3, 0, "lamb", 20000, true}),
                         [](const ::testing::TestParamInfo<Case>& i) {
                           return fmt::format(
                               "dp{}_zero{}_{}_b{}_{}", i.param.dp, i.param.zero, i.param.optimizer,
                               i.param.bucket == (1u << 30) ? std::string("one") : std::to_string(i.param.bucket),
                               i.param.device_path ? "device" : "host");
                         });

// Tensor/pipeline parallelism: the norm counts `owned` and sums the squares over the norm group
// (clipped to the shard under ZeRO). Two ranks each owning half of the buffer: the global norm.
TEST(DistOptimizer, NormGroupCountsTheOwnedElementsOnce) {
  constexpr size_t P = 3 * 8192 + 77;
  for (int zero : {0, 1}) {
    dist::run_threads(2, [&](dist::Communicator& world) {
      std::vector<float> params(P, 1.0f), grads(P);
      for (size_t i = 0; i < P; ++i) grads[i] = grad_of(0, 1, i);
      parallel::DistOptimizerConfig dc;
      dc.zero = zero;
      // A data group of one rank each (the replica is the norm group), or ZeRO over both.
      auto alone = world.split(world.rank(), 0, "alone");
      dist::Communicator& data = zero ? world : *alone;
      parallel::DistOptimizer opt(parallel::FlatState{&cpu_backend(), params.data(), grads.data(), P}, data, dc,
                                  {{0, P, true, 0}});
      const size_t half = P / 2;
      // Under ZeRO each rank owns [0, P) here and its shard of it is counted; without ZeRO each
      // rank counts its half.
      std::vector<std::pair<size_t, size_t>> owned =
          zero ? std::vector<std::pair<size_t, size_t>>{{0, P}}
               : std::vector<std::pair<size_t, size_t>>{world.rank() == 0 ? std::pair{size_t{0}, half}
                                                                          : std::pair{half, P}};
      opt.set_grad_norm_group(world, owned);
      const double ref = optim::global_grad_norm(grads.data(), P);  // every rank holds the same gradients
      EXPECT_NEAR(opt.grad_norm(), ref, 1e-12 * ref) << "zero " << zero;
    });
  }
}

TEST(DeviceLayout, RefusalsNameTheKeyAndTheReason) {
  const char* y = "model: {preset: gpt2-debug}\ndata: {train: x}\ndevice: cuda\n";
  Recipe r = parse_recipe(y, "r.yaml");
  EXPECT_NO_THROW(parallel::check_device_layout(r, 1));
  // Several processes = data parallelism: runs where NCCL was built, refused (naming it) elsewhere.
  const std::string e4 = error_of([&] { parallel::check_device_layout(r, 4); });
  if (dist::have_nccl()) {
    EXPECT_EQ(e4, "(no error)");
  } else {
    EXPECT_NE(e4.find("r.yaml: device: cuda does not run this job has 4 processes (data or tensor parallelism)"),
              std::string::npos)
        << e4;
    EXPECT_NE(e4.find("built without NCCL"), std::string::npos) << e4;
    EXPECT_NE(e4.find("use device: cpu"), std::string::npos) << e4;
  }
  // Tensor parallelism runs (parallel/tensor_parallel_device.cpp) with AdamW and without eval tasks.
  r = parse_recipe(y, "r.yaml", {"parallel.tensor=2"});
  std::string e = error_of([&] { parallel::check_device_layout(r, 2); });
  if (dist::have_nccl()) {
    EXPECT_EQ(e, "(no error)");
  }
  r = parse_recipe(y, "r.yaml", {"parallel.tensor=2", "optimizer.name=lamb"});
  e = error_of([&] { parallel::check_device_layout(r, 2); });
  EXPECT_NE(e.find("optimizer.name = lamb with parallel.tensor = 2"), std::string::npos) << e;
  EXPECT_NE(e.find("use adamw"), std::string::npos) << e;
  r = parse_recipe(y, "r.yaml", {"parallel.tensor=2", "training.eval_tasks=tasks.jsonl"});
  e = error_of([&] { parallel::check_device_layout(r, 2); });
  EXPECT_NE(e.find("training.eval_tasks with parallel.tensor = 2"), std::string::npos) << e;
  // Pipeline parallelism runs (host-staged messages), LAMB included; with NCCL for the world.
  r = parse_recipe(y, "r.yaml", {"parallel.pipeline=2", "optimizer.name=lamb"});
  e = error_of([&] { parallel::check_device_layout(r, 2); });
  if (dist::have_nccl()) {
    EXPECT_EQ(e, "(no error)");
  } else {
    EXPECT_NE(e.find("built without NCCL"), std::string::npos) << e;
  }
  r = parse_recipe(y, "r.yaml", {"device=cpu", "parallel.tensor=2"});
  EXPECT_NO_THROW(parallel::check_device_layout(r, 8));  // the CPU runs every layout
}

TEST(DeviceLayout, NcclCommunicatorWithoutNcclNamesTheFix) {
  if (dist::have_nccl()) GTEST_SKIP() << "this build has NCCL: the refusal cannot be provoked";
  dist::run_threads(2, [](dist::Communicator& world) {
    const std::string e = error_of([&] { dist::make_nccl_communicator(world, 0); });
    EXPECT_NE(e.find("-DLATHE_CUDA=ON"), std::string::npos) << e;
  });
}

}  // namespace
