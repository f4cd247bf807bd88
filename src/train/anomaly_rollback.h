// The I/O half of the anomaly policy's rollback (train/anomaly.h decides when; this finds the
// checkpoint and restores the training state from it). Used by train/trainer.cpp.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "data/loader.h"
#include "dist/comm.h"
#include "models/model.h"
#include "optim/loss_scaler.h"
#include "parallel/sharded_optimizer.h"
#include "train/anomaly.h"
#include "train/checkpoint.h"

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
    const RollbackTarget& t, int64_t step_done, int64_t skip_samples, Model& model, parallel::ShardedOptimizer& opt,
    data::DataLoader& loader, optim::LossScaler& scaler, AnomalyPolicy& policy, int64_t epoch_samples, int64_t G,
    const std::function<CheckpointState(const std::string&)>& load_weights_and_moments = {});

// Rank 0: checkpoints of run_dir newer than `step` belong to an abandoned timeline; they are
// renamed to step_XXXXXXXX.abandoned-TIME so that --resume auto and keep_last ignore them.
void move_checkpoints_after(const std::string& run_dir, int64_t step);

}  // namespace lathe
