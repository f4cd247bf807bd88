// One training run's parts, opened in the order the run needs them: the layout every rank agrees
// on, preflight's checked inputs, the rank's model, loss scaler and anomaly policy, the optimizer
// and gradient reduction, the resume bookkeeping, the startup report and the data loader; then the
// evaluator, checkpointer and anomaly responder that work on them. train() (train/trainer.cpp)
// keeps only the order of events of the step loop. Internal to src/train.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "config/recipe.h"
#include "data/loader.h"
#include "dist/comm.h"
#include "optim/loss_scaler.h"
#include "optim/schedule.h"
#include "parallel/dist_optimizer.h"
#include "parallel/parallelize.h"
#include "train/anomaly.h"
#include "train/anomaly_rollback.h"
#include "train/checkpointer.h"
#include "train/evaluator.h"
#include "train/preflight.h"
#include "train/run_control.h"
#include "train/run_log.h"
#include "train/train_step.h"
#include "train/trainer.h"

namespace lathe {

class TrainSession {
 public:
  // Sets the run up (collective over opts.world: every rank opens the same session). Throws on bad
  // input before any training work, as `lathe check` would.
  TrainSession(const Recipe& recipe, const TrainOptions& opts);
  ~TrainSession();
  TrainSession(const TrainSession&) = delete;
  TrainSession& operator=(const TrainSession&) = delete;

  int64_t start_step() const { return start_step_; }  // optimizer steps already done (resume)
  int64_t steps() const { return r_.training.steps; }
  StepContext& step_context() { return *step_; }
  RunControl& control() { return *control_; }
  Evaluator& eval() { return *eval_; }
  Checkpointer& ckpt() { return *ckpt_; }
  AnomalyResponder& anomaly() { return *responder_; }
  const RunLog& log() const { return log_; }

  // After step `step` (0-based): the loss for the result, the health a checkpoint records, the
  // metrics record and log line.
  void record(int64_t step, const StepStats& st);
  // The checkpoint after `done` steps (and the newest one in the result).
  void save_checkpoint(int64_t done, double lr);
  // ZeRO 3: every weight complete on this rank before what reads them outside a training step
  // (validation, checkpoints, HF directories; collective over the data group). Nothing otherwise.
  void whole_weights();
  // Step `done` finished the loop's work for the step (validation, checkpoint).
  void completed(int64_t done) { result_.end_step = done; }
  // A stop before the end (signal or --stop-after; the checkpoint is saved): says why and how to go on.
  TrainResult stopped(int64_t done, const StopRequest& stop);
  // The end of the run: final validation and tasks, the HF model directory, peak memory, a sample.
  TrainResult finish();

 private:
  void open_inputs();
  void open_model();
  void restore_counters();
  void open_optimizer();
  void open_resume();
  void report_startup();
  void open_data();
  void open_parts();

  const TrainOptions& opts_;
  std::unique_ptr<dist::Communicator> own_world_;  // a one-process world when opts.world is null
  dist::Communicator& world_;
  Recipe r_;  // the recipe with its layout resolved
  RunLog log_;
  std::unique_ptr<Topology> topo_;
  std::unique_ptr<RunControl> control_;
  struct CleanupJoin {  // old checkpoints are removed in the background; done before the run returns
    ~CleanupJoin();
  } cleanup_join_;
  int threads_ = 1;
  // Every step consumes one global batch of G samples, rank r taking rows [r*B*accum,
  // (r+1)*B*accum) of it as accum micro-batches of B (the sample order does not depend on the layout).
  BatchGeometry geo_;
  double copy_gbps_ = 100;
  Preflight pf_;
  std::unique_ptr<RankModel> rm_;
  std::unique_ptr<optim::LossScaler> scaler_;
  std::unique_ptr<AnomalyPolicy> policy_;
  std::vector<optim::ParamRange> ranges_;
  optim::ScheduleConfig sched_;
  std::unique_ptr<parallel::DistOptimizer> opt_;
  int64_t start_step_ = 0;
  std::unique_ptr<data::DataLoader> loader_;
  std::unique_ptr<Evaluator> eval_;
  TrainResult result_;
  FaultPlan faults_;  // train_step strikes a loss spike from it once it has fired
  std::unique_ptr<Checkpointer> ckpt_;
  std::unique_ptr<AnomalyResponder> responder_;
  std::unique_ptr<StepContext> step_;
};

}  // namespace lathe
