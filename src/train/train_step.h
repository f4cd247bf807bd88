// One optimizer step of the trainer (train/trainer.cpp's loop calls it once per step): what the
// step works on (StepContext, owned by the run's session), what it reports (StepStats), and
// train_step itself.
// Internal to src/train: the trainer builds the parts for the run's layout (data, tensor, pipeline
// parallelism; CPU or device) and the step runs them in the same order on every rank.
#pragma once
#include <cmath>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "data/loader.h"
#include "dist/comm.h"
#include "models/documents.h"
#include "models/model.h"
#include "optim/loss_scaler.h"
#include "optim/schedule.h"
#include "parallel/grad_sync.h"
#include "parallel/parallelize.h"
#include "parallel/pipeline_executor.h"
#include "parallel/sharded_optimizer.h"
#include "train/anomaly.h"
#include "train/device_step.h"
#include "train/fault_plan.h"

namespace lathe {

// Micro-batch, sequence length, gradient-accumulation steps and global batch (samples) of a run.
struct BatchGeometry {
  int64_t B = 1, T = 1, accum = 1, G = 1;
};

// This rank's gradient path: the data-parallel reduction (buckets issued by the model's
// grads_ready hook during the last micro-batch's backward), the global gradient norm and the
// optimizer update of its part of the flat buffer (ZeRO); on a device (train/device_step.h) the
// device optimizer does the reduction, norm and update. Opened by train/session.cpp; issue 24
// item 2 makes it one distributed-optimizer type for host and device.
struct GradientPath {
  std::unique_ptr<parallel::ShardedOptimizer> opt;
  std::unique_ptr<DeviceOptimizer> dev;      // device: cuda: the norm and update run on the device
  std::unique_ptr<parallel::GradSync> sync;  // data parallelism on the host; null otherwise
  bool sync_this_pass = false;               // read by the grads_ready hook: only the last micro-batch reduces
  dist::Communicator* data = nullptr;        // the data-parallel group (the world without tensor/pipeline)
  // Tensor/pipeline parallelism: the group the gradient norm's squares are summed over (the
  // replica, or the world with ZeRO) and the elements of the gradient buffer this rank counts.
  dist::Communicator* tp_norm_group = nullptr;
  std::vector<std::pair<size_t, size_t>> tp_owned;
  double grad_clip = 0;  // optimizer.grad_clip (global norm)
};

// What one optimizer step works on (owned by the run's session, train/session.h).
struct StepContext {
  RankModel& rm;             // this rank's model (and pipeline executor)
  data::DataLoader& loader;  // hands out this rank's B x accum rows of each global batch
  GradientPath& grads;
  optim::LossScaler& scaler;  // loss scale (fp16) and the skipping of non-finite steps
  AnomalyPolicy& anomaly;     // loss-spike and NaN policy (train/anomaly.h): may skip, lowers the lr
  const optim::ScheduleConfig& sched;
  BatchGeometry geo;
  const DocumentOptions& docs;    // documents in the samples (data.attention etc.)
  FaultPlan& faults;              // tests' injected faults (train/fault_plan.h); empty: none
  std::vector<int32_t> inputs{};  // the step's rows, filled by the loader
  std::vector<int32_t> targets{};
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
StepStats train_step(StepContext& c, int64_t step, const StepStats& prev);

}  // namespace lathe
