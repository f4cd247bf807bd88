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
#include "parallel/dist_optimizer.h"
#include "parallel/parallelize.h"
#include "parallel/pipeline_executor.h"
#include "train/anomaly.h"
#include "train/fault_plan.h"

namespace lathe {

// Micro-batch, sequence length, gradient-accumulation steps and global batch (samples) of a run.
struct BatchGeometry {
  int64_t B = 1, T = 1, accum = 1, G = 1;
};

// What one optimizer step works on (owned by the run's session, train/session.h).
struct StepContext {
  RankModel& rm;                 // this rank's model (and pipeline executor)
  data::DataLoader& loader;      // hands out this rank's B x accum rows of each global batch
  parallel::DistOptimizer& opt;  // reduction, norm and update (parallel/dist_optimizer.h)
  dist::Communicator& data;      // the data-parallel group: the loss and token counts are summed over it
  optim::LossScaler& scaler;     // loss scale (fp16) and the skipping of non-finite steps
  AnomalyPolicy& anomaly;        // loss-spike and NaN policy (train/anomaly.h): may skip, lowers the lr
  const optim::ScheduleConfig& sched;
  BatchGeometry geo;
  const DocumentOptions& docs;    // documents in the samples (data.attention etc.)
  FaultPlan& faults;              // tests' injected faults (train/fault_plan.h); empty: none
  std::vector<int32_t> inputs{};  // the step's rows, filled by the loader
  std::vector<int32_t> targets{};
  // Context parallelism (parallel/context_parallel.h): this rank's rows of each sample (empty:
  // none) and its place in the context group; the rows of the step's micro-batches taken from
  // inputs / targets.
  std::vector<int32_t> cp_rows{};
  int cp_rank = 0;
  std::vector<int32_t> cp_inputs{}, cp_targets{};
};

struct StepStats {
  double loss = NAN, norm = NAN, lr = NAN;
  int64_t step = 0;         // 1-based
  double loss_scale = 1;    // the scale this step's gradients carried
  bool skipped = false;     // non-finite loss or gradient norm: no update
  AnomalyDecision anomaly;  // the anomaly policy's verdict (skip: no update either)
  double lr_factor = 1;     // the anomaly policy's multiplier in lr
  double data_wait_s = 0, comm_wait_s = 0, optimizer_s = 0, seconds = 0;
  double context_wait_s = 0;  // context parallelism: waits for the context group's K/V and dK/dV
  int64_t weight_gather_bytes = -1;  // ZeRO 3: bytes this rank received by the step's weight gathers
  // Mixture of experts: the load-balancing loss (unweighted; the token-weighted mean of the
  // micro-batches', over every data rank); NaN for a dense model.
  double moe_aux_loss = NAN;
};

// One optimizer step of this rank: its micro-batches (gradients accumulate, the loss gradient
// multiplied by the loss scale), the data-parallel reduction (buckets issued during the last
// backward; the wait that backward did not hide is comm_wait_s), the loss summed over ranks, the
// global norm (unscaled), the scaler's verdict, and the update unless the step is skipped. Every
// rank takes the same decision: the loss and the norm are global. A stop (too many consecutive
// skipped steps, an overflow at the minimum scale) names the last finite values (`prev`).
StepStats train_step(StepContext& c, int64_t step, const StepStats& prev);

}  // namespace lathe
