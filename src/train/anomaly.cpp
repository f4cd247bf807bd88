#include "train/anomaly.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

namespace lathe {

void RunningStat::add(double x, double ema_decay) {
  ++n;
  // 1/n while that is larger than 1 - decay: the exact running mean/variance (Welford's update with
  // population variance), then an EMA of the same form.
  const double a = std::max(1.0 - ema_decay, 1.0 / static_cast<double>(n));
  const double d = x - mean;
  mean += a * d;
  var = (1.0 - a) * (var + a * d * d);
}

double RunningStat::z(double x, double min_rel_std) const {
  const double sd = std::max({std::sqrt(std::max(var, 0.0)), min_rel_std * std::fabs(mean), 1e-12});
  return (x - mean) / sd;
}

nlohmann::json anomaly_state_to_json(const AnomalyState& s) {
  auto stat = [](const RunningStat& r) { return nlohmann::json{{"n", r.n}, {"mean", r.mean}, {"var", r.var}}; };
  return {{"loss", stat(s.loss)},
          {"grad_norm", stat(s.grad_norm)},
          {"lr_steps_left", s.lr_steps_left},
          {"recent", std::vector<int64_t>(s.recent.begin(), s.recent.end())},
          {"last_anomaly", s.last_anomaly},
          {"skipped_updates", s.skipped_updates},
          {"anomalies", s.anomalies},
          {"rollbacks", s.rollbacks}};
}

void AnomalyPolicy::prune(int64_t step) {
  // The window holds steps step-W+1 .. step.
  while (!st_.recent.empty() && st_.recent.front() <= step - cfg_.rollback_window) st_.recent.pop_front();
}

AnomalyDecision AnomalyPolicy::observe(int64_t step, double loss, double grad_norm, bool scaler_skipped,
                                       bool scaler_overflow) {
  AnomalyDecision d;
  if (!cfg_.enabled) return d;
  // This step ran at the lowered rate (lr_factor() was read before it): one fewer to go.
  if (st_.lr_steps_left > 0) --st_.lr_steps_left;
  const bool loss_ok = std::isfinite(loss), norm_ok = std::isfinite(grad_norm);
  if (!loss_ok || !norm_ok) {
    if (scaler_overflow && loss_ok) {
      d.overflow = true;
      d.reason = "grad norm not finite (loss-scaler overflow: the scale backs off; not counted)";
      d.skip = true;
      prune(step);
      d.in_window = static_cast<int64_t>(st_.recent.size());
      return d;
    }
    d.anomaly = true;
    d.reason = !loss_ok && !norm_ok ? "loss and grad norm not finite"
               : !loss_ok           ? "loss not finite"
                                    : "grad norm not finite";
  } else if (!scaler_skipped) {
    // Never with no statistics (n 0: deviation 0, every step a spike), whatever warmup_steps says.
    const bool detecting = st_.loss.n >= std::max<int64_t>(cfg_.warmup_steps, 1);
    if (detecting) {
      d.loss_z = st_.loss.z(loss, cfg_.min_rel_std);
      d.grad_norm_z = st_.grad_norm.z(grad_norm, cfg_.min_rel_std);
      const bool loss_spike = cfg_.loss_z_threshold > 0 && d.loss_z > cfg_.loss_z_threshold;
      const bool norm_spike = cfg_.grad_norm_z_threshold > 0 && d.grad_norm_z > cfg_.grad_norm_z_threshold;
      if (loss_spike || norm_spike) {
        d.anomaly = true;
        d.reason = loss_spike && norm_spike ? "loss and grad norm spike"
                   : loss_spike             ? "loss spike"
                                            : "grad norm spike";
      }
    }
    if (!d.anomaly) {
      st_.loss.add(loss, cfg_.ema_decay);
      st_.grad_norm.add(grad_norm, cfg_.ema_decay);
    }
  }
  prune(step);
  if (!d.anomaly) {
    d.skip = scaler_skipped;
    d.in_window = static_cast<int64_t>(st_.recent.size());
    return d;
  }
  ++st_.anomalies;
  st_.recent.push_back(step);
  st_.last_anomaly = step;
  d.in_window = static_cast<int64_t>(st_.recent.size());
  d.skip = scaler_skipped || cfg_.skip;
  if (d.skip && !scaler_skipped) ++st_.skipped_updates;
  if (cfg_.lr_steps > 0 && cfg_.lr_factor != 1.0) {
    st_.lr_steps_left = cfg_.lr_steps;
    d.lower_lr = true;
  }
  if (cfg_.rollback_after > 0 && d.in_window >= cfg_.rollback_after) {
    if (st_.rollbacks >= cfg_.max_rollbacks) {
      d.stop = true;
      d.stop_reason = fmt::format(
          "step {}: {} anomalies within {} steps (training.anomaly.rollback_after {}) and the run already rolled "
          "back {} time{} (training.anomaly.max_rollbacks {})",
          step, d.in_window, cfg_.rollback_window, cfg_.rollback_after, st_.rollbacks, st_.rollbacks == 1 ? "" : "s",
          cfg_.max_rollbacks);
    } else {
      d.rollback = true;
    }
  }
  return d;
}

void AnomalyPolicy::rolled_back(const AnomalyState* ckpt) {
  const int64_t anomalies = st_.anomalies, rollbacks = st_.rollbacks + 1;
  st_ = ckpt ? *ckpt : AnomalyState{};
  st_.anomalies = anomalies;
  st_.rollbacks = rollbacks;
  st_.recent.clear();
  st_.lr_steps_left = cfg_.lr_factor != 1.0 ? cfg_.lr_steps : 0;
}

CheckpointHealthInfo AnomalyPolicy::health(int64_t step, double loss, double grad_norm) const {
  CheckpointHealthInfo h;
  h.loss = loss;
  h.grad_norm = grad_norm;
  h.anomalies = st_.anomalies;
  const bool recent_anomaly = st_.last_anomaly > 0 && st_.last_anomaly > step - cfg_.rollback_window;
  h.healthy = std::isfinite(loss) && std::isfinite(grad_norm) && !recent_anomaly;
  return h;
}

data::LoaderState advance_loader_state(data::LoaderState st, int64_t n, int64_t epoch_samples, int64_t batch) {
  // Samples the loader hands out per epoch: whole batches only.
  const int64_t served = batch > 0 ? epoch_samples / batch * batch : 0;
  if (served <= 0) return st;
  auto normalise = [&](data::LoaderState s) {
    if (s.position + batch > epoch_samples) {
      ++s.epoch;
      s.position = 0;
    }
    return s;
  };
  st = normalise(st);
  const int64_t left = std::max<int64_t>(0, served - st.position);
  if (n < left) {
    st.position += n;
    return normalise(st);
  }
  n -= left;
  st.epoch += 1 + n / served;
  st.position = n % served;
  return normalise(st);
}

}  // namespace lathe
