#include "optim/loss_scaler.h"

#include <fmt/format.h>

#include <cmath>

#include "core/error.h"

namespace lathe::optim {

namespace {
// Upper bounds that keep every product finite and the counters far from overflow.
constexpr double kMaxScale = 0x1p100;
// And the lower bound that keeps the unscaling factor 1 / scale a finite float (2^100).
constexpr double kMinScale = 0x1p-100;
constexpr int64_t kMaxInterval = 1'000'000'000'000;
}  // namespace

void validate(const LossScaleConfig& c) {
  auto fin = [](double v) { return std::isfinite(v); };
  LATHE_CHECK(fin(c.initial) && c.initial >= kMinScale && c.initial <= kMaxScale,
              "precision.loss_scale.initial: {} must be in [2^-100, 2^100] (default 65536 = 2^16)", c.initial);
  LATHE_CHECK(c.growth_interval >= 1 && c.growth_interval <= kMaxInterval,
              "precision.loss_scale.growth_interval: {} must be in [1, {}] (default 2000 clean steps)",
              c.growth_interval, kMaxInterval);
  LATHE_CHECK(fin(c.backoff) && c.backoff > 0 && c.backoff < 1,
              "precision.loss_scale.backoff: {} must be in (0, 1) (default 0.5: halve on overflow)", c.backoff);
  LATHE_CHECK(fin(c.growth) && c.growth > 1 && c.growth <= 65536,
              "precision.loss_scale.growth: {} must be in (1, 65536] (default 2: double after growth_interval)",
              c.growth);
  LATHE_CHECK(fin(c.min) && c.min >= kMinScale && c.min <= c.initial,
              "precision.loss_scale.min: {} must be >= 2^-100 and <= precision.loss_scale.initial = {} (default 1)",
              c.min, c.initial);
  LATHE_CHECK(c.max_skipped_steps >= 0 && c.max_skipped_steps <= kMaxInterval,
              "training.max_skipped_steps: {} must be in [0, {}] (0 = never stop on skipped steps)",
              c.max_skipped_steps, kMaxInterval);
}

LossScaler::LossScaler(const LossScaleConfig& cfg) : cfg_(cfg) {
  validate(cfg_);
  st_.scale = cfg_.enabled ? cfg_.initial : 1.0;
}

void LossScaler::restore(const LossScalerState& st, const std::string& what) {
  LATHE_CHECK(std::isfinite(st.scale) && st.scale > 0 && st.scale <= kMaxScale,
              "{}: loss scale {} must be finite, > 0 and <= 2^100", what, st.scale);
  LATHE_CHECK(st.good_steps >= 0 && st.skipped_steps >= 0 && st.consecutive_skipped >= 0 &&
                  st.consecutive_skipped <= st.skipped_steps,
              "{}: loss scaler counters are inconsistent (good steps {}, skipped {}, consecutive skipped {})", what,
              st.good_steps, st.skipped_steps, st.consecutive_skipped);
  st_ = st;
  if (!cfg_.enabled) {
    st_.scale = 1.0;
    st_.good_steps = 0;
  }
  first_skipped_ = 0;  // only named in messages; unknown across a resume
  stop_.clear();
}

LossScaler::Verdict LossScaler::update(bool found_non_finite, int64_t step) {
  if (!found_non_finite) {
    st_.consecutive_skipped = 0;
    first_skipped_ = 0;
    if (cfg_.enabled && ++st_.good_steps >= cfg_.growth_interval) {
      const double grown = st_.scale * cfg_.growth;
      if (grown <= kMaxScale) st_.scale = grown;
      st_.good_steps = 0;
    }
    return Verdict::Apply;
  }
  if (cfg_.enabled && st_.scale <= cfg_.min) {
    stop_ = fmt::format(
        "step {}: the gradients are non-finite at the minimum loss scale {} (precision.loss_scale.min): fp16 cannot "
        "represent them. Use precision.compute: bf16 (or fp32), or lower optimizer.lr",
        step, st_.scale);
    return Verdict::Stop;
  }
  if (cfg_.enabled) {
    st_.scale = std::max(st_.scale * cfg_.backoff, cfg_.min);
    st_.good_steps = 0;
  }
  ++st_.skipped_steps;
  if (st_.consecutive_skipped++ == 0 || first_skipped_ == 0) first_skipped_ = step - st_.consecutive_skipped + 1;
  if (cfg_.max_skipped_steps > 0 && st_.consecutive_skipped >= cfg_.max_skipped_steps) {
    stop_ = fmt::format(
        "steps {}-{}: {} consecutive steps had a non-finite loss or gradient norm and were skipped "
        "(training.max_skipped_steps = {}{})",
        first_skipped_, step, st_.consecutive_skipped, cfg_.max_skipped_steps,
        cfg_.enabled ? fmt::format("; loss scale now {}", st_.scale) : std::string());
    return Verdict::Stop;
  }
  return Verdict::Skip;
}

}  // namespace lathe::optim
