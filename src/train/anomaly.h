// Loss-spike and NaN policy (issue 13 item 4; recipe section `training.anomaly`). Pure logic: the
// trainer feeds every step's globally reduced loss and gradient norm (identical on every rank, so
// every rank takes the same decision) and carries out what the policy decides.
//
// Detection. Two running statistics, one for the loss and one for the gradient norm, each a mean
// and variance updated with weight a = max(1 - ema_decay, 1/n) (n = observations so far): the
// first ~1/(1-ema_decay) steps are an exact running mean/variance (Welford), later an EMA. A step
// is a spike when (x - mean) / max(std, min_rel_std * |mean|) exceeds the threshold (upward only:
// a falling loss is no anomaly), once `warmup_steps` steps have been observed. Anomalous and
// skipped steps do not enter the statistics (a spike would otherwise raise the bar for the next).
// A non-finite loss or gradient norm is always an anomaly (also during warm-up), with one
// exception: under dynamic loss scaling (fp16) a non-finite gradient norm with a finite loss is
// the scaler's routine overflow (it halves the scale and skips the step by design, about once per
// growth_interval); it is recorded ("overflow", not counted) but triggers no action.
//
// Actions, in order, for a counted anomaly at step k:
//   1. skip: the update of step k is not applied (weights and moments unchanged; the batch is
//      consumed, the schedule moves on; AdamW's bias correction counts applied updates only);
//   2. the learning rate of steps k+1 .. k+lr_steps is multiplied by lr_factor (a later anomaly
//      restarts the count; factors do not compound);
//   3. when rollback_after anomalies fall within the last rollback_window steps (k included):
//      roll back to the newest checkpoint recorded as healthy, skip the data that followed it
//      (skip_samples, default: every sample consumed since that checkpoint, i.e. the loader keeps
//      its position), and continue from that checkpoint's step; the learning rate is then lowered
//      for lr_steps steps. More than max_rollbacks rollbacks stop the run with a message.
// A checkpoint is healthy when no counted anomaly lies within the last rollback_window steps and
// its step's loss and gradient norm are finite.
#pragma once
#include <cstdint>
#include <deque>
#include <nlohmann/json.hpp>
#include <string>

#include "config/recipe.h"
#include "data/loader.h"

namespace lathe {

using AnomalyConfig = Recipe::Training::Anomaly;

// Running mean/variance of one watched quantity.
struct RunningStat {
  int64_t n = 0;  // observations that entered the statistic
  double mean = 0, var = 0;
  void add(double x, double ema_decay);
  // Upward z-score of x; the deviation is floored at min_rel_std * |mean| (and 1e-12).
  double z(double x, double min_rel_std) const;
};

// Everything the policy carries from step to step: saved in checkpoints (state.json "anomaly") so
// that a resumed run continues exactly, and restored on rollback (except the counters marked
// "whole run", which keep counting across rollbacks).
struct AnomalyState {
  RunningStat loss, grad_norm;
  int64_t lr_steps_left = 0;    // steps that still run at the lowered learning rate
  std::deque<int64_t> recent;   // steps of counted anomalies within the window
  int64_t last_anomaly = 0;     // step of the newest counted anomaly (0 = none): the health
  int64_t skipped_updates = 0;  // updates the policy skipped (AdamW's step count excludes them)
  int64_t anomalies = 0;        // counted anomalies (whole run)
  int64_t rollbacks = 0;        // rollbacks done (whole run)
};
nlohmann::json anomaly_state_to_json(const AnomalyState& s);

// What the policy decided about one step.
struct AnomalyDecision {
  bool anomaly = false;                // counted (actions apply)
  bool overflow = false;               // an fp16 loss-scaler overflow: recorded only
  std::string reason;                  // "loss not finite", "loss spike", "grad norm spike", ...
  double loss_z = 0, grad_norm_z = 0;  // 0 when not computed (warm-up, non-finite)
  bool skip = false;                   // do not apply this step's update
  bool lower_lr = false;               // lr_steps_left was (re)started
  bool rollback = false;               // roll back now (the trainer calls rolled_back or no_rollback_target)
  bool stop = false;                   // the rollback cap is reached: stop with stop_reason
  std::string stop_reason;
  int64_t in_window = 0;  // counted anomalies in the window after this step
};

struct CheckpointHealthInfo {
  double loss = 0, grad_norm = 0;  // of the checkpoint's step (NaN when not finite)
  int64_t anomalies = 0;           // counted anomalies of the run so far
  bool healthy = true;
};

class AnomalyPolicy {
 public:
  explicit AnomalyPolicy(const AnomalyConfig& cfg) : cfg_(cfg) {}
  bool enabled() const { return cfg_.enabled; }
  const AnomalyConfig& config() const { return cfg_; }
  const AnomalyState& state() const { return st_; }

  // Continues from a checkpoint's state.
  void restore(const AnomalyState& s) { st_ = s; }
  // The learning-rate multiplier of the next step (1 when off or not lowered).
  double lr_factor() const { return cfg_.enabled && st_.lr_steps_left > 0 ? cfg_.lr_factor : 1.0; }
  // Step `step` (1-based) had this global loss and gradient norm. scaler_overflow: the loss scaler
  // skipped it as an overflow (dynamic scaling, loss finite); scaler_skipped: the step is skipped
  // whatever the policy says (non-finite). Returns the decision; nothing is done when disabled.
  AnomalyDecision observe(int64_t step, double loss, double grad_norm, bool scaler_skipped, bool scaler_overflow);
  // After a rollback to a checkpoint of step `to_step` with policy state `ckpt` (nullptr: the
  // checkpoint has none): its statistics and skip count, this run's counters, an empty window, and
  // the learning rate lowered for lr_steps steps.
  void rolled_back(const AnomalyState* ckpt);
  // The rollback was wanted but no healthy checkpoint exists: the window restarts (the health of
  // the next checkpoints still sees the anomalies: last_anomaly).
  void no_rollback_target() { st_.recent.clear(); }
  // The health record of a checkpoint written after step `step` with that step's loss and norm.
  CheckpointHealthInfo health(int64_t step, double loss, double grad_norm) const;

 private:
  void prune(int64_t step);
  AnomalyConfig cfg_;
  AnomalyState st_;
};

// Loader position `n` samples after `st` in the sample order (n >= 0), for an epoch of
// `epoch_samples` samples of which whole batches of `batch` are used (the tail that does not fill a
// batch is passed over, as the loader does).
data::LoaderState advance_loader_state(data::LoaderState st, int64_t n, int64_t epoch_samples, int64_t batch);

}  // namespace lathe
