// The optimizer step of a device-resident model (Model::on_device()): gradient norm, non-finite
// check, scaling and the AdamW / LAMB update run where the buffers are, through the backend's step
// ops (Backend::step_ops(), kernels/step_ops.h), so the trainer names no backend.
//
// DeviceOptimizer owns the moments in backend memory (allocated once) and stages them through the
// host optimizer's buffers for checkpoints: download_state() before a save, upload_state() after a
// load; checkpoints stay host fp32 (a GPU run resumes on the CPU and back).
// Data parallelism (several processes, one GPU each; ZeRO 0, 1, 2): the gradients are reduced and
// the weights' shards gathered over NCCL, the scalars over the host communicator
// (train/device_dp.h); tensor parallelism's hooks get an NCCL group (train/device_tp.h); pipeline
// parallelism's messages are staged through host memory over MPI (parallel/pipeline_executor.h).
// What the device path does not do yet (refused by check_device_layout, naming the key): LAMB and
// training.eval_tasks under tensor parallelism.
#pragma once
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "config/recipe.h"
#include "dist/comm.h"
#include "kernels/backend.h"
#include "models/model.h"
#include "optim/optimizer.h"
#include "train/device_dp.h"

namespace lathe::parallel {
class ShardedOptimizer;
}

namespace lathe {

// The layouts the device path runs: one process, or data and tensor parallelism over NCCL (any
// ZeRO stage; train/device_dp.h, train/device_tp.h) in a build with NCCL, and pipeline parallelism
// (host-staged messages); with tensor parallelism neither LAMB nor training.eval_tasks. Throws naming the recipe key,
// the reason and the fix otherwise (lathe check and train call it for device: cuda).
void check_device_layout(const Recipe& r, int world_size);

class DeviceOptimizer {
 public:
  // `host` is the trainer's optimizer: its state buffers are the staging copies of the moments
  // (sized dp->state_end() - dp->state_begin() under ZeRO, as ShardedOptimizer::local()).
  // dp: data parallelism (null: one process). Runs the step ops of the model's backend (on a CPU
  // model: optim/'s own kernels, cpu_backend().step_ops()).
  DeviceOptimizer(Model& model, const optim::OptimConfig& cfg, std::vector<optim::ParamRange> ranges,
                  optim::Optimizer& host, std::unique_ptr<DeviceDataParallel> dp = nullptr);
  ~DeviceOptimizer();
  // From the model's grads_ready hook (the step's last backward): buckets reduced as they fill.
  void grads_ready(size_t begin, size_t end) {
    if (dp_) dp_->grads_ready(begin, end);
  }
  // After the step's backward: the rest of the data-parallel reduction of the backend gradients
  // (device group); the seconds spent waiting (0 in one process).
  double reduce_grads();
  // The global gradient norm (fp64 sums in fixed chunk order: the same chunks as
  // optim::global_grad_norm); under ZeRO each rank's chunk sums of its shard, gathered over the
  // host group and added in chunk order (parallel::sharded_grad_norm).
  double grad_norm() const;
  // One update of the model's backend parameters (this rank's shard under ZeRO, then the shards
  // gathered over the device group); grad_scale as optim::Optimizer::step.
  void step(double lr, int64_t step, float grad_scale);
  // Moments backend -> host optimizer (before a checkpoint) and host -> backend (after a load).
  void download_state();
  void upload_state();
  DeviceDataParallel* data_parallel() { return dp_.get(); }
  // Tensor parallelism: the norm counts the elements `owned` of this rank's gradient buffer and
  // sums the squares over `group` (the trainer's tp_norm_group / tp_owned: the tensor group, or the
  // world with ZeRO with `owned` clipped to the shard). `group` must outlive the optimizer.
  void set_grad_norm_group(dist::Communicator& group, std::vector<std::pair<size_t, size_t>> owned);

 private:
  Model& model_;
  optim::OptimConfig cfg_;
  std::vector<optim::ParamRange> ranges_;  // relative to begin_
  optim::Optimizer& host_;
  const StepOps* k_;
  std::unique_ptr<DeviceDataParallel> dp_;
  size_t begin_ = 0, end_ = 0;                // the moments' part of the flat buffer
  dist::Communicator* norm_group_ = nullptr;  // tensor parallelism (set_grad_norm_group)
  std::vector<std::pair<size_t, size_t>> norm_owned_;
  DeviceBuffer m_, v_;
};

// The trainer's device optimizer: null unless model.on_device(). With a data-parallel group of
// several ranks (`dp`, host memory: MPI), bootstraps an NCCL group of the same ranks on this
// process's GPU (collective over `dp`) and reduces over it with opt's shards and ZeRO stage
// (buckets of r.parallel.bucket_mb). `dp` and `opt` must outlive the result.
// LATHE_DEVICE_DP_OVERLAP=0 reduces the buckets after backward instead of from the grads_ready
// hook during it (train/device_dp.h).
// Test hook: device_path_on_host (FaultPlan::device_path_on_host, LATHE_TEST_DEVICE_PATH_ON_HOST=1
// read by lathe train) sends a CPU model (except LAMB under tensor parallelism) through this path
// too (the cpu backend's step ops, a second host group standing in for NCCL), so the trainer's
// device wiring is tested end to end on the CPU: its results must be bit-identical to the CPU
// path's (tests/train/test_device_dp_host.py).
std::unique_ptr<DeviceOptimizer> make_device_optimizer(Model& model, const Recipe& r,
                                                       std::vector<optim::ParamRange> ranges,
                                                       parallel::ShardedOptimizer& opt, dist::Communicator& dp,
                                                       bool device_path_on_host = false);

}  // namespace lathe
