// The run's checkpoints: when one is due, what goes into it (weights, this rank's moments, the
// data position, loss scale, anomaly policy and the health of the last step) and how the layout
// writes it (one process; data ranks sharing the moments; tensor/pipeline ranks gathering the whole
// model for their replica's writer), the moments read back on a resume or rollback, and the HF
// model directories (every output.save_every steps and at the end). Format and protocol:
// train/checkpoint.h. Internal to src/train (opened by train/session.cpp).
#pragma once
#include <cstdint>
#include <string>

#include "config/recipe.h"
#include "data/blend.h"
#include "data/loader.h"
#include "optim/loss_scaler.h"
#include "parallel/dist_optimizer.h"
#include "parallel/parallelize.h"
#include "train/anomaly.h"
#include "train/run_log.h"
#include "train/train_step.h"

namespace lathe {

// This rank's moments from checkpoint `dir` (resume, rollback), whatever layout wrote it
// (re-sharded by flat offset: train/checkpoint.h); with tensor or pipeline parallelism only the
// runs of each global moment that land in this rank's tensors and its ZeRO shard are read.
void load_rank_moments(const std::string& dir, RankModel& rm, parallel::DistOptimizer& opt);

class Checkpointer {
 public:
  struct Parts {
    const Recipe& r;
    Topology& topo;
    RankModel& rm;
    parallel::DistOptimizer& opt;
    const data::DataLoader& loader;
    const data::BlendPlan* plan;  // data.blend: the plan whose prefix a checkpoint records
    const optim::LossScaler& scaler;
    const AnomalyPolicy& anomaly;
    int64_t G;  // samples per step
    int threads;
    RunLog& log;
    int pause_ms = 0;  // the test pause of every save (FaultPlan::checkpoint_pause_ms)
  };
  explicit Checkpointer(const Parts& p) : p_(p) {}

  void load_moments(const std::string& dir) { load_rank_moments(dir, p_.rm, p_.opt); }
  // The loss and norm of the step just done: the health a checkpoint records (rollback targets).
  void note_step(const StepStats& st) {
    last_loss_ = st.loss;
    last_norm_ = st.norm;
  }
  // output.checkpoint_every (and the final step when it is set).
  bool due(int64_t done, bool last) const;
  // The checkpoint after `done` optimizer steps (collective over the world).
  void save(int64_t done, double lr);
  // output.save_every: an HF model directory OUTPUT/step_XXXXXXXX (not at the final step, which
  // writes OUTPUT/model).
  void maybe_export_hf(int64_t done, bool last);
  bool export_due(int64_t done, bool last) const;  // maybe_export_hf writes a directory
  // OUTPUT/model at the end of the run; returns the whole model (for the sample).
  Model& export_final(const std::string& dir);
  // The newest checkpoint this process wrote ("" none).
  const std::string& last_saved() const { return last_saved_; }

 private:
  void save_sharded(const CheckpointState& st, CheckpointSaveInfo& info);

  Parts p_;
  double last_loss_ = NAN, last_norm_ = NAN;
  std::string last_saved_;
};

}  // namespace lathe
