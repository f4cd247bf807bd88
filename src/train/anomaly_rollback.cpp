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
    const RollbackTarget& t, int64_t step_done, int64_t skip_samples, Model& model, parallel::ShardedOptimizer& opt,
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
  // As a resume does (train/trainer.cpp): a checkpoint of a run without dynamic scaling keeps the
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
