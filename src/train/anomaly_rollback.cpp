#include "train/anomaly_rollback.h"

#include <fmt/format.h>

#include <ctime>
#include <filesystem>

#include "core/error.h"
#include "train/checkpoint.h"

namespace lathe {

namespace fs = std::filesystem;

RollbackTarget find_healthy_checkpoint(const std::string& run_dir, int64_t max_step, dist::Communicator& world,
                                       std::vector<std::string>* notes) {
  RollbackTarget t;
  if (world.rank() == 0) {
    auto all = list_checkpoints(run_dir);
    for (auto it = all.rbegin(); it != all.rend() && t.step < 0; ++it) {
      if (it->first > max_step) continue;
      try {
        const CheckpointState c = read_checkpoint_state(it->second);  // its own checksum verified
        if (c.has_health && c.health.healthy) t.step = it->first;
      } catch (const Error& e) {
        if (notes) notes->push_back(fmt::format("{}: not a rollback target: {}", it->second, e.what()));
      }
    }
  }
  if (world.size() > 1) world.broadcast(&t.step, sizeof(t.step), 0);
  if (t.step >= 0) t.dir = (fs::path(run_dir) / "checkpoints" / fmt::format("step_{:08d}", t.step)).string();
  return t;
}

RollbackResult restore_for_rollback(
    const RollbackTarget& t, int64_t step_done, int64_t skip_samples, Model& model, parallel::DistOptimizer& opt,
    data::DataLoader& loader, optim::LossScaler& scaler, AnomalyPolicy& policy, int64_t epoch_samples, int64_t G,
    const std::function<CheckpointState(const std::string&)>& load_weights_and_moments) {
  wait_for_checkpoint_cleanup();  // no background deletion under our feet
  RollbackResult res;
  res.before = loader.state();
  // Weights and moments (verifying every file's checksum); a tensor-parallel trainer passes its own
  // loader, which reads the whole model and keeps this rank's shard.
  const CheckpointState c = load_weights_and_moments ? load_weights_and_moments(t.dir) : [&] {
    CheckpointState st = load_checkpoint(t.dir, model, nullptr);
    load_checkpoint_moments(t.dir, model,
                            moment_slice(opt.local(), opt.state_begin(), opt.state_begin(), opt.state_end()));
    return st;
  }();
  model.refresh_compute_weights();  // the bf16/fp16 copies of the restored weights
  // As a resume does (train/session.cpp): a checkpoint of a run without dynamic scaling keeps the
  // current scale.
  optim::LossScalerState ls;
  ls.scale = c.loss_scale_dynamic ? c.loss_scale : scaler.scale();
  ls.good_steps = c.loss_scale_dynamic ? c.loss_scale_good_steps : 0;
  ls.skipped_steps = c.skipped_steps;
  ls.consecutive_skipped = c.consecutive_skipped_steps;
  scaler.restore(ls, (fs::path(t.dir) / "state.json").string());
  res.skipped_samples = skip_samples < 0 ? (step_done - t.step) * G : skip_samples;
  if (skip_samples >= 0) loader.restore(advance_loader_state(c.loader, skip_samples, epoch_samples, G));
  res.after = loader.state();
  policy.rolled_back(c.has_anomaly ? &c.anomaly : nullptr);
  return res;
}

void move_checkpoints_after(const std::string& run_dir, int64_t step) {
  for (auto& [s, dir] : list_checkpoints(run_dir)) {
    if (s <= step) continue;
    std::error_code ec;
    const std::string aside = dir + fmt::format(".abandoned-{}", static_cast<int64_t>(std::time(nullptr)));
    fs::rename(dir, aside, ec);
    if (ec) throw_error("{}: cannot move this checkpoint aside to {}: {}", dir, aside, ec.message());
  }
}

}  // namespace lathe

namespace lathe {

namespace {

nlohmann::json event(const nlohmann::json& base, const char* name, const nlohmann::json& extra) {
  nlohmann::json j = base;
  j["event"] = name;
  j.update(extra);
  return j;
}

}  // namespace

std::optional<int64_t> AnomalyResponder::act(int64_t step, const StepStats& st) {
  const AnomalyDecision& d = st.anomaly;
  const auto& ac = p_.r.training.anomaly;
  RunLog& log = p_.log;
  const std::string at = fmt::format("step {:>6}/{} | anomaly policy:", step + 1, p_.r.training.steps);
  const nlohmann::json base = {{"step", step + 1}, {"loss", st.loss}, {"grad_norm", st.norm}};
  if (d.overflow) {
    log.audit(event(base, "overflow", {{"reason", d.reason}}), fmt::format("{} {}", at, d.reason));
    return std::nullopt;
  }
  if (!d.anomaly) return std::nullopt;
  log.audit(event(base, "anomaly",
                  {{"reason", d.reason},
                   {"loss_z", d.loss_z},
                   {"grad_norm_z", d.grad_norm_z},
                   {"in_window", d.in_window},
                   {"anomalies", p_.policy.state().anomalies}}),
            fmt::format("{} ANOMALY: {} (loss {:.4f}, z {:.1f}; grad norm {:.4f}, z {:.1f}); {} in the last {} steps "
                        "(training.anomaly.rollback_after {})",
                        at, d.reason, st.loss, d.loss_z, st.norm, d.grad_norm_z, d.in_window, ac.rollback_window,
                        ac.rollback_after));
  if (d.skip)
    log.audit(event(base, "skip", nlohmann::json::object()),
              fmt::format("{} update skipped (weights and moments unchanged, batch consumed)", at));
  if (d.lower_lr)
    log.audit(event(base, "lower_lr",
                    {{"factor", ac.lr_factor}, {"steps", ac.lr_steps}, {"until_step", step + 1 + ac.lr_steps}}),
              fmt::format("{} learning rate x{} for steps {}-{}", at, ac.lr_factor, step + 2, step + 1 + ac.lr_steps));
  if (d.stop) {
    log.audit(event(base, "stop", {{"reason", d.stop_reason}}), fmt::format("{} STOP: {}", at, d.stop_reason));
    throw_error(
        "training.anomaly: {}: training stopped. The checkpoints in {} hold the run up to here (state.json "
        "\"health\" says which are healthy); resume one with --resume DIR after lowering optimizer.lr (or "
        "optimizer.grad_clip), or raise training.anomaly.max_rollbacks",
        d.stop_reason, (fs::path(p_.r.output.dir) / "checkpoints").string());
  }
  if (!d.rollback) return std::nullopt;
  return roll_back(step, st, at, base);
}

std::optional<int64_t> AnomalyResponder::roll_back(int64_t step, const StepStats& st, const std::string& at,
                                                   const nlohmann::json& base) {
  const AnomalyDecision& d = st.anomaly;
  const auto& ac = p_.r.training.anomaly;
  RunLog& log = p_.log;
  RankModel& rm = p_.rm;
  std::vector<std::string> notes;
  const RollbackTarget target = find_healthy_checkpoint(p_.r.output.dir, step + 1, p_.topo.world, &notes);
  for (const auto& n : notes) log.say(fmt::format("{} {}", at, n));
  if (target.step < 0) {
    p_.policy.no_rollback_target();
    log.audit(event(base, "rollback_unavailable", {{"in_window", d.in_window}}),
              fmt::format("{} {} anomalies within {} steps, but no checkpoint recorded as healthy to roll back to: "
                          "continuing (the window restarts)",
                          at, d.in_window, ac.rollback_window));
    return std::nullopt;
  }
  // Tensor parallelism: the checkpoint holds the whole model; this rank keeps its shard.
  std::function<CheckpointState(const std::string&)> load_tp;
  if (rm.sharded())
    load_tp = [&](const std::string& dir) {
      Model& w = rm.ensure_whole();
      CheckpointState c = load_checkpoint(dir, w, nullptr);
      rm.scatter(w.param_data(), rm.model().param_data());
      p_.ckpt.load_moments(dir);
      return c;
    };
  // A blend is one pass over its plan (sized for the rollbacks by preflight): its "epoch" is the plan.
  const RollbackResult rb = restore_for_rollback(target, step + 1, ac.skip_samples, rm.model(), p_.opt, p_.loader,
                                                 p_.scaler, p_.policy, p_.epoch_samples, p_.G, load_tp);
  if (p_.opt
          .device_path()) {  // the restored moments, and the weights (a tensor-parallel shard is scattered on the host)
    rm.model().upload_params();
    rm.model().refresh_compute_weights();
    p_.opt.upload_state();
  }
  rm.release_whole();
  // The curves continue from the checkpoint (as after a resume); anomalies.jsonl keeps everything.
  log.restart_metrics_at(target.step);
  if (log.rank0()) move_checkpoints_after(p_.r.output.dir, target.step);
  p_.topo.world.barrier();
  p_.losses.resize(static_cast<size_t>(std::max<int64_t>(0, target.step - p_.start_step)));
  const data::LoaderState &before = rb.before, &after = rb.after;
  const AnomalyState& state = p_.policy.state();
  log.audit(event(base, "rollback",
                  {{"to_step", target.step},
                   {"checkpoint", target.dir},
                   {"skip_samples", rb.skipped_samples},
                   {"loader_before", {{"epoch", before.epoch}, {"position", before.position}}},
                   {"loader_after", {{"epoch", after.epoch}, {"position", after.position}}},
                   {"rollbacks", state.rollbacks},
                   {"lr_factor", ac.lr_factor},
                   {"lr_steps", state.lr_steps_left}}),
            fmt::format("{} ROLLBACK {} of {}: {} anomalies within {} steps; weights, moments and loss scale restored "
                        "from {} (step {}); {} samples skipped (loader epoch {} position {} -> epoch {} position {}); "
                        "learning rate x{} for {} steps; newer checkpoints moved aside",
                        at, state.rollbacks, ac.max_rollbacks, d.in_window, ac.rollback_window, target.dir, target.step,
                        rb.skipped_samples, before.epoch, before.position, after.epoch, after.position, ac.lr_factor,
                        state.lr_steps_left));
  return target.step;
}

}  // namespace lathe
