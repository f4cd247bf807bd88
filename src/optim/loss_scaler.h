// Dynamic loss scaling (fp16 training) and the skipping of non-finite steps (every precision).
//
// fp16 has 5 exponent bits: gradients below ~6e-8 flush to zero. The trainer multiplies the loss
// gradient by `scale()` (so every activation gradient carries it), computes the gradient norm of
// the scaled gradients, divides it by the scale, and the optimizer unscales as it reads the
// gradients (Optimizer::step's grad_scale = clip coefficient / scale). After each step the trainer
// reports whether the gradients (or the loss) were non-finite:
//   * non-finite: the step is skipped (weights and moments untouched; the step counter, schedule
//     and data position advance, as in Megatron and torch.cuda.amp.GradScaler), the scale is
//     multiplied by `backoff` (not below `min`) and the clean-step counter restarts;
//   * finite: the clean-step counter grows; after `growth_interval` clean steps in a row the scale
//     is multiplied by `growth` and the counter restarts (PyTorch's GradScaler semantics; its and
//     Megatron's defaults: 2^16, x2 every 2000 clean steps, x0.5 on overflow).
// Stops (Verdict::Stop, with stop_reason() naming the step and the scale or the steps):
//   * an overflow while the scale is already at `min`: fp16 cannot represent these gradients, and
//     lowering the scale further is not allowed (Megatron clamps at min_scale and keeps skipping
//     silently; lathe stops instead so that the run does not burn its budget on skipped steps);
//   * `max_skipped_steps` consecutive skipped steps (0 = never), in every precision.
// Without dynamic scaling (fp32, bf16) the scale stays 1 and only the skip counting applies.
//
// With a power-of-two scale and no overflow or underflow, scaling is exact: every backward op is
// linear in the incoming gradient and multiplying by 2^k commutes with float rounding, so an fp32
// run with scaling enabled is bit-identical to one without (tests/train/test_precision.py).
#pragma once
#include <cstdint>
#include <string>

namespace lathe::optim {

// Dynamic loss scaling: the recipe's `precision.loss_scale` section (config/recipe.h) as it is.
// Defaults as PyTorch's GradScaler and Megatron.
struct LossScaleSpec {
  bool enabled = false;  // dynamic scaling (the recipe turns it on for fp16 unless set); false: scale fixed at 1
  double initial = 65536.0;
  int64_t growth_interval = 2000;  // clean steps in a row before the scale grows
  double backoff = 0.5;            // in (0, 1)
  double growth = 2.0;             // > 1
  double min = 1.0;                // > 0, <= initial
};

// Consecutive skipped steps that stop a run by default (training.max_skipped_steps); 0 = never.
constexpr int64_t kDefaultMaxSkippedSteps = 20;

// The scaler's settings: the spec and training.max_skipped_steps.
struct LossScaleConfig : LossScaleSpec {
  int64_t max_skipped_steps = kDefaultMaxSkippedSteps;
};

// Throws lathe::Error naming the field (precision.loss_scale.*, training.max_skipped_steps).
void validate(const LossScaleConfig& cfg);

// Everything the scaler carries from step to step; saved in checkpoints so that a resumed run
// continues exactly.
struct LossScalerState {
  double scale = 1.0;
  int64_t good_steps = 0;           // clean steps since the last change of the scale
  int64_t skipped_steps = 0;        // skipped steps of the whole run
  int64_t consecutive_skipped = 0;  // skipped steps since the last applied one
};

class LossScaler {
 public:
  enum class Verdict { Apply, Skip, Stop };

  explicit LossScaler(const LossScaleConfig& cfg);

  // The factor for the loss gradient of the next step (1 without dynamic scaling).
  double scale() const { return st_.scale; }
  bool dynamic() const { return cfg_.enabled; }
  const LossScaleConfig& config() const { return cfg_; }
  const LossScalerState& state() const { return st_; }
  // Continues from a checkpoint's state. `what` names the source in errors (a scale that is not
  // finite and > 0, negative counters, more consecutive than total skips).
  void restore(const LossScalerState& st, const std::string& what);

  // After step `step` (1-based, for messages): found_non_finite says whether the loss or the
  // gradient norm was NaN/Inf. Apply: do the update; Skip: leave weights and moments alone;
  // Stop: end the run with stop_reason(). Updates the scale and the counters.
  Verdict update(bool found_non_finite, int64_t step);
  const std::string& stop_reason() const { return stop_; }

 private:
  LossScaleConfig cfg_;
  LossScalerState st_;
  int64_t first_skipped_ = 0;  // first step of the current run of skipped steps
  std::string stop_;
};

}  // namespace lathe::optim
