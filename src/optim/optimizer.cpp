#include "optim/optimizer.h"

#include <cmath>

#include "core/error.h"

namespace lathe::optim {

void validate(const OptimConfig& cfg) {
  LATHE_CHECK(cfg.name == "adamw" || cfg.name == "lamb", "optim.name '{}' is unknown (valid: adamw, lamb)", cfg.name);
  LATHE_CHECK(cfg.beta1 >= 0.0 && cfg.beta1 < 1.0, "optim.beta1 ({}) must be in [0, 1)", cfg.beta1);
  LATHE_CHECK(cfg.beta2 >= 0.0 && cfg.beta2 < 1.0, "optim.beta2 ({}) must be in [0, 1)", cfg.beta2);
  LATHE_CHECK(cfg.eps > 0.0 && std::isfinite(cfg.eps), "optim.eps ({}) must be > 0", cfg.eps);
  LATHE_CHECK(cfg.weight_decay >= 0.0 && std::isfinite(cfg.weight_decay), "optim.weight_decay ({}) must be >= 0",
              cfg.weight_decay);
}

std::unique_ptr<Optimizer> make_optimizer(const OptimConfig& cfg, size_t num_params) {
  validate(cfg);
  if (cfg.name == "adamw") return make_adamw(cfg, num_params);
  return make_lamb(cfg, num_params);
}

void check_step_args(const char* who, size_t num_params, std::span<const ParamRange> ranges, int64_t step) {
  LATHE_CHECK(step >= 1, "{}: step must count from 1, got {}", who, step);
  for (size_t i = 0; i < ranges.size(); ++i)
    LATHE_CHECK(ranges[i].offset <= num_params && ranges[i].size <= num_params - ranges[i].offset,
                "{}: parameter range {} [{}, {}) exceeds the {} parameters the optimizer was built "
                "for",
                who, i, ranges[i].offset, ranges[i].offset + ranges[i].size, num_params);
}

}  // namespace lathe::optim
