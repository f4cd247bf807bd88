// src/train/: the training run. train() (trainer.cpp) keeps the order of events; TrainSession
// (session.h) opens the parts that own their state: RunLog, RunControl, Checkpointer (the format and
// protocol in checkpoint*.cpp, resharding in reshard.cpp), Evaluator, AnomalyResponder, and the
// StepContext train_step works on. It names no backend and includes no CUDA header: the step's
// reduction, norm and update are parallel::DistOptimizer's, the kernels the backend's op tables.
//
// The training loop, one process or a data-parallel group of processes (opts.world; ranks split
// every global batch and reduce gradients, parallel/): recipe -> model, data, optimizer, schedule; per step
// gradient accumulation over micro-batches in the recipe's compute precision (fp16: the loss
// gradient times the dynamic loss scale, optim/loss_scaler.h), global-norm clipping, the optimizer
// update -- skipped when the loss or gradient norm is not finite (training.max_skipped_steps in a
// row stop the run) -- the loss-spike and NaN policy (training.anomaly, train/anomaly.h: skip,
// lower the lr, roll back to a healthy checkpoint; OUTPUT/anomalies.jsonl) -- a log line and a
// JSONL metrics record; periodic validation; full-state
// checkpoints (checkpoint.h) every output.checkpoint_every steps, on SIGTERM/SIGINT and at
// --stop-after; bit-exact resume; HF model directory at the end. train() (train/trainer.cpp) keeps
// the order of these events; the parts that do them and own their state are opened by
// TrainSession (train/session.h).
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "config/recipe.h"
#include "data/indexed_dataset.h"
#include "data/loader.h"
#include "dist/comm.h"
#include "models/documents.h"
#include "models/model.h"
#include "train/fault_plan.h"

namespace lathe {

struct TrainResult {
  std::vector<double> losses;   // per optimizer step
  double final_val_loss = -1;   // -1 when there is no validation data
  std::string model_dir;        // HF directory written at the end ("" when stopped early)
  int64_t start_step = 0;       // optimizer steps already done when this process started
  int64_t end_step = 0;         // optimizer steps done when it returned
  std::string resumed_from;     // checkpoint directory, "" for a fresh start
  std::string last_checkpoint;  // newest checkpoint written by this process
  bool interrupted = false;     // stopped by SIGTERM/SIGINT after saving a checkpoint
};

// `lathe train` exits with this code after a SIGTERM/SIGINT stop (checkpoint saved; resume with
// --resume auto). EX_TEMPFAIL from sysexits.h: "try again later".
constexpr int kExitInterrupted = 75;

struct TrainOptions {
  bool quiet = false;         // no per-step log lines (tests)
  bool sample_at_end = true;  // print a short generated sample when a tokenizer is known
  // "" = recipe's training.resume; "auto" = newest complete checkpoint of output.dir (fresh start
  // when there is none); otherwise a checkpoint directory.
  std::string resume;
  // Resume even when the recipe changed in ways that break exactness (each change is logged).
  bool force_resume_changes = false;
  // --overwrite: a new run into an output.dir that holds another run moves that run aside
  // (train/run_dir.h) instead of being refused.
  bool overwrite = false;
  // > 0: after this many optimizer steps (counted from step 0), save a checkpoint and return
  // without the end-of-run outputs (as a preemption would; for tests and time-sliced jobs).
  int64_t stop_after_steps = 0;
  // Install SIGTERM/SIGINT handlers for the duration of train(): the first signal makes the loop
  // save a checkpoint at the next step boundary and return with interrupted = true; a second one
  // kills the process as usual.
  bool handle_signals = false;
  // The processes of this job (dist::make_world_communicator); nullptr = this process alone. Every
  // rank runs train() with the same recipe; the data-parallel degree is the world size.
  dist::Communicator* world = nullptr;
  // --profile-steps A-B: record the steps A..B (1-based, inclusive) with the profiler and write
  // OUTPUT/trace/rankRRRRR.json (Chrome trace events). 0 = off.
  int64_t profile_first = 0, profile_last = 0;
  // Called on rank 0 with each metrics.jsonl record as it is written (the Python package's
  // lathe.train(on_step=...)); it may throw to end the run. Unset: nothing.
  std::function<void(const nlohmann::json&)> on_metrics;
  // Faults tests inject (train/fault_plan.h); `lathe train` fills it from the LATHE_TEST_*
  // environment variables. Empty: none.
  FaultPlan faults;
};

TrainResult train(const Recipe& recipe, const TrainOptions& opts = {});

// Mean next-token loss of `model` over the given samples of `ds`, in order, batched by B
// (train/evaluator.cpp; also `lathe eval`).
// Returns {loss, tokens}. With `docs`, the samples' documents are applied as in training (document
// attention, restarted positions; targets masked after EOD are not counted). `forward` (optional)
// runs the forward pass of b rows and returns their loss sum (a pipeline's stages); unset:
// model.forward_backward.
using EvalForward = std::function<double(const int32_t* tokens, const int32_t* targets, int64_t b)>;
std::pair<double, int64_t> evaluate_samples(Model& model, const data::IndexedDataset& ds,
                                            const std::vector<int64_t>& samples, int64_t B, int64_t T,
                                            const DocumentOptions* docs = nullptr,
                                            const EvalForward* forward = nullptr);

}  // namespace lathe
