// One optimizer step of the trainer (train/trainer.cpp's loop calls it once per step): what the
// step works on (StepParts, owned by train()), what it reports (StepStats), and train_step itself.
// Internal to src/train: the trainer builds the parts for the run's layout (data, tensor, pipeline
// parallelism; CPU or device) and the step runs them in the same order on every rank.
#pragma once
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "data/loader.h"
#include "dist/comm.h"
#include "models/documents.h"
#include "models/model.h"
#include "optim/loss_scaler.h"
#include "optim/schedule.h"
#include "parallel/grad_sync.h"
#include "parallel/pipeline_executor.h"
#include "parallel/sharded_optimizer.h"
#include "train/anomaly.h"
#include "train/device_step.h"
#include "train/fault_plan.h"

namespace lathe {

// What one optimizer step works on (owned by train()).
struct StepParts {
  Model& model;
  data::DataLoader& loader;  // hands out this rank's B x accum rows of each global batch
  parallel::ShardedOptimizer& opt;
  parallel::GradSync* sync;   // null with one rank
  bool& sync_this_pass;       // read by the model's grads_ready hook
  dist::Communicator& world;  // the data-parallel group (the whole world without tensor parallelism)
  // Tensor parallelism: the group the gradient norm's squares are summed over (the tensor group, or
  // the world with ZeRO) and the elements of the gradient buffer this rank counts; null without.
  dist::Communicator* tp_norm_group;
  const std::vector<std::pair<size_t, size_t>>& tp_owned;
  const optim::ScheduleConfig& sched;
  double grad_clip;
  optim::LossScaler& scaler;  // loss scale (fp16) and the skipping of non-finite steps
  int64_t B, T, accum, G;     // micro-batch, seq_len, accumulation, global batch (samples)
  std::vector<int32_t>& inputs;
  std::vector<int32_t>& targets;
  AnomalyPolicy& anomaly;                      // loss-spike and NaN policy (train/anomaly.h): may skip, lowers the lr
  const DocumentOptions& docs;                 // documents in the samples (data.attention etc.)
  FaultPlan& faults;                           // tests' injected faults (train/fault_plan.h); empty: none
  parallel::PipelineExecutor* pipe = nullptr;  // pipeline parallelism: runs the step's micro-batches
  DeviceOptimizer* dev = nullptr;              // device: cuda: the norm and update run on the device
};

struct StepStats {
  double loss = NAN, norm = NAN, lr = NAN;
  int64_t step = 0;         // 1-based
  double loss_scale = 1;    // the scale this step's gradients carried
  bool skipped = false;     // non-finite loss or gradient norm: no update
  AnomalyDecision anomaly;  // the anomaly policy's verdict (skip: no update either)
  double lr_factor = 1;     // the anomaly policy's multiplier in lr
  double data_wait_s = 0, comm_wait_s = 0, optimizer_s = 0, seconds = 0;
};

// One optimizer step of this rank: its micro-batches (gradients accumulate, the loss gradient
// multiplied by the loss scale), the data-parallel reduction (buckets issued during the last
// backward; the wait that backward did not hide is comm_wait_s), the loss summed over ranks, the
// global norm (unscaled), the scaler's verdict, and the update unless the step is skipped. Every
// rank takes the same decision: the loss and the norm are global. A stop (too many consecutive
// skipped steps, an overflow at the minimum scale) names the last finite values (`prev`).
StepStats train_step(StepParts& p, int64_t step, const StepStats& prev);

}  // namespace lathe
