#include "optim/schedule.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace lathe::optim {
namespace {
constexpr double kPi = 3.14159265358979323846;

double decay_factor(const std::string& shape, double p) {  // 1 at p=0 -> 0 at p=1
  if (shape == "linear") return 1.0 - p;
  if (shape == "cosine") return 0.5 * (1.0 + std::cos(kPi * p));
  if (shape == "1-sqrt") return 1.0 - std::sqrt(p);
  throw_error("schedule.decay_shape '{}' is unknown (valid: linear, cosine, 1-sqrt)", shape);
}
}  // namespace

int64_t wsd_decay_steps(const ScheduleConfig& cfg) {
  return std::llround(cfg.decay_fraction * static_cast<double>(cfg.total_steps));
}

void validate(const ScheduleConfig& cfg) {
  LATHE_CHECK(cfg.name == "constant" || cfg.name == "linear" || cfg.name == "cosine" || cfg.name == "wsd",
              "schedule.name '{}' is unknown (valid: constant, linear, cosine, wsd)", cfg.name);
  LATHE_CHECK(std::isfinite(cfg.lr) && cfg.lr > 0.0, "schedule.lr ({}) must be > 0", cfg.lr);
  LATHE_CHECK(std::isfinite(cfg.min_lr) && cfg.min_lr >= 0.0, "schedule.min_lr ({}) must be >= 0", cfg.min_lr);
  LATHE_CHECK(cfg.min_lr <= cfg.lr, "schedule.min_lr ({}) must be <= schedule.lr ({})", cfg.min_lr, cfg.lr);
  LATHE_CHECK(cfg.total_steps >= 1, "schedule.total_steps ({}) must be >= 1", cfg.total_steps);
  LATHE_CHECK(cfg.warmup_steps >= 0, "schedule.warmup_steps ({}) must be >= 0", cfg.warmup_steps);
  LATHE_CHECK(cfg.warmup_steps <= cfg.total_steps, "schedule.warmup_steps ({}) must be <= schedule.total_steps ({})",
              cfg.warmup_steps, cfg.total_steps);
  if (cfg.name == "wsd") {
    LATHE_CHECK(cfg.decay_fraction >= 0.0 && cfg.decay_fraction <= 1.0,
                "schedule.decay_fraction ({}) must be in [0, 1]", cfg.decay_fraction);
    decay_factor(cfg.decay_shape, 0.0);  // validates the name
    const int64_t decay = wsd_decay_steps(cfg);
    LATHE_CHECK(cfg.warmup_steps + decay <= cfg.total_steps,
                "schedule.warmup_steps ({}) + decay steps ({} = round(schedule.decay_fraction {} * "
                "schedule.total_steps {})) must be <= schedule.total_steps",
                cfg.warmup_steps, decay, cfg.decay_fraction, cfg.total_steps);
  }
}

double lr_at(const ScheduleConfig& cfg, int64_t step) {
  LATHE_CHECK(step >= 0, "lr_at: step must be >= 0, got {}", step);
  if (step < cfg.warmup_steps) return cfg.lr * static_cast<double>(step + 1) / static_cast<double>(cfg.warmup_steps);
  if (cfg.name == "constant") return cfg.lr;
  if (cfg.name == "linear" || cfg.name == "cosine") {
    const int64_t span = cfg.total_steps - cfg.warmup_steps;
    const double p =
        span > 0 ? std::clamp(static_cast<double>(step - cfg.warmup_steps) / static_cast<double>(span), 0.0, 1.0) : 1.0;
    if (cfg.name == "linear") return cfg.lr + (cfg.min_lr - cfg.lr) * p;
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + std::cos(kPi * p));
  }
  if (cfg.name == "wsd") {
    const int64_t decay = wsd_decay_steps(cfg);
    const int64_t start = cfg.total_steps - decay;
    if (step < start) return cfg.lr;
    const double p = decay > 0 ? std::min(1.0, static_cast<double>(step - start) / static_cast<double>(decay)) : 1.0;
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * decay_factor(cfg.decay_shape, p);
  }
  throw_error("schedule.name '{}' is unknown (valid: constant, linear, cosine, wsd)", cfg.name);
}

}  // namespace lathe::optim
