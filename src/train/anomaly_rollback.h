// The anomaly policy's actions (train/anomaly.h decides; AnomalyResponder acts: audit lines, stop,
// rollback) and the I/O half of a rollback (find the checkpoint, restore the training state from
// it). Used by train/session.cpp.
#pragma once
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "data/loader.h"
#include "dist/comm.h"
#include "models/model.h"
#include "optim/loss_scaler.h"
#include "parallel/dist_optimizer.h"
#include "parallel/parallelize.h"
#include "train/anomaly.h"
#include "train/checkpoint.h"
#include "train/checkpointer.h"
#include "train/run_log.h"
#include "train/train_step.h"

namespace lathe {

// The newest complete checkpoint of run_dir at or before `max_step` whose state.json records it
// healthy (checkpoints without a health record are not known to be healthy). Rank 0 reads the
// files and broadcasts its choice, so every rank takes the same one. step -1: none. A state.json
// that cannot be read is passed over with a line in *notes.
struct RollbackTarget {
  int64_t step = -1;
  std::string dir;
};
RollbackTarget find_healthy_checkpoint(const std::string& run_dir, int64_t max_step, dist::Communicator& world,
                                       std::vector<std::string>* notes);

struct RollbackResult {
  data::LoaderState before, after;  // the data position before and after
  int64_t skipped_samples = 0;      // samples of the data after the checkpoint that are skipped
};
// Every rank, after step `step_done` (1-based): the weights (checksums of every file verified) and
// this rank's part of the moments (any layout that wrote them), the loss scaler's state and the
// policy's (AnomalyPolicy::rolled_back) from `t`; the loader moves to the checkpoint's position
// plus skip_samples samples, or stays where it is when skip_samples is -1 (all samples consumed
// since the checkpoint are skipped). epoch_samples: the training samples the loader draws from;
// G: samples per step.
RollbackResult restore_for_rollback(
    const RollbackTarget& t, int64_t step_done, int64_t skip_samples, Model& model, parallel::DistOptimizer& opt,
    data::DataLoader& loader, optim::LossScaler& scaler, AnomalyPolicy& policy, int64_t epoch_samples, int64_t G,
    const std::function<CheckpointState(const std::string&)>& load_weights_and_moments = {});

// Rank 0: checkpoints of run_dir newer than `step` belong to an abandoned timeline; they are
// renamed to step_XXXXXXXX.abandoned-TIME so that --resume auto and keep_last ignore them.
void move_checkpoints_after(const std::string& run_dir, int64_t step);

// What the run does about the anomaly policy's verdict on a step: each detection and action is a
// line in OUTPUT/anomalies.jsonl and the log; a stop ends the run with an error that says how to
// go on; a rollback restores the newest healthy checkpoint (weights, this rank's moments, loss
// scale, data position plus the samples skipped), trims metrics.jsonl and moves newer checkpoints
// aside. Every rank acts alike (the loss and norm the policy sees are global).
class AnomalyResponder {
 public:
  struct Parts {
    const Recipe& r;
    Topology& topo;
    RankModel& rm;
    parallel::DistOptimizer& opt;
    data::DataLoader& loader;
    optim::LossScaler& scaler;
    AnomalyPolicy& policy;
    Checkpointer& ckpt;
    int64_t epoch_samples;        // what the loader draws from (a blend: its one-pass plan)
    int64_t G;                    // samples per step
    std::vector<double>& losses;  // the run's per-step losses, cut back on a rollback
    int64_t start_step;           // the step losses[0] follows
    RunLog& log;
  };
  explicit AnomalyResponder(const Parts& p) : p_(p) {}
  // After step `step` (0-based) with stats `st`: the step to continue from after a rollback (the
  // healthy checkpoint's), else nothing.
  std::optional<int64_t> act(int64_t step, const StepStats& st);

 private:
  std::optional<int64_t> roll_back(int64_t step, const StepStats& st, const std::string& at,
                                   const nlohmann::json& base);

  Parts p_;
};

}  // namespace lathe
