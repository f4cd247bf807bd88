// Learning-rate schedules. lr_at(cfg, step) is the rate of optimizer step `step`, 0-based: the first
// update uses lr_at(cfg, 0).
//   warmup (all schedules): lr * (step+1) / warmup_steps for step < warmup_steps
//   constant: lr
//   linear:   lr + (min_lr - lr) * progress
//   cosine:   min_lr + 0.5 * (lr - min_lr) * (1 + cos(pi * progress))
//             with progress = (step - warmup) / (total - warmup), clamped to [0, 1]
//   wsd:      warmup-stable-decay: lr until the last decay_steps = round(decay_fraction * total)
//             steps, then from lr to min_lr with progress = (step - (total - decay_steps)) /
//             decay_steps and decay_shape linear (1-p) | cosine (0.5(1+cos(pi p))) | 1-sqrt (1-sqrt(p))
// Steps at or past total_steps get the end value (min_lr, or lr for constant).
#pragma once
#include <cstdint>
#include <string>

namespace lathe::optim {

// The shape of a schedule: the recipe's `schedule` section (config/recipe.h) as it is, with its
// defaults (decay_fraction 0.2 is what every recipe without the key has always run with).
struct ScheduleSpec {
  std::string name = "cosine";  // constant | linear | cosine | wsd
  int64_t warmup_steps = 0;
  double min_lr = 0.0;
  double decay_fraction = 0.2;         // wsd only, (0, 1]
  std::string decay_shape = "linear";  // wsd only: linear | cosine | 1-sqrt
};

// A schedule over a run: the spec, the peak rate (optimizer.lr) and the run's length
// (training.steps).
struct ScheduleConfig : ScheduleSpec {
  double lr = 3e-4;
  int64_t total_steps = 1;
};

double lr_at(const ScheduleConfig& cfg, int64_t step);
// Errors name the field, e.g. "schedule.min_lr (0.5) must be <= schedule.lr (0.0003)".
void validate(const ScheduleConfig& cfg);
int64_t wsd_decay_steps(const ScheduleConfig& cfg);  // round(decay_fraction * total_steps)

}  // namespace lathe::optim
