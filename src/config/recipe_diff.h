// What changed between a checkpoint's recipe and the recipe of the run resuming from it, and
// whether the change breaks exactness. Each key's class is its schema row's (config/recipe_schema.h
// OnResume):
//   breaking (resume would not continue the same run): model.* (except model.init_from, which only
//   matters at initialisation), data.{train, valid, valid_fraction, blend, attention,
//   reset_position_ids, mask_loss_after_eod, eod_token}, optimizer.* (lr included: it changes
//   every later update), schedule.*, training.{seq_len, seed}, precision.compute, and any key
//   without a row whose section's rows are not all of one other class;
//   harmless: training.{steps, eval_interval, eval_batches, log_interval, threads, peak_gflops,
//   resume, max_skipped_steps, eval_tasks, eval_tasks_interval}, training.anomaly.*, output.*,
//   parallel.*, data.{tokenizer, prefetch}, recompute, device (checkpoints are host fp32);
//   training.{micro_batch_size, grad_accum_steps}: harmless while the global batch
//   (x parallel.data) stays the same, every step still seeing the same samples;
//   precision.loss_scale.*: only where loss scaling is on in either recipe.
// (training.steps is allowed by design even though decaying schedules are recomputed for the new
// total; threads changes the float summation order, the trainer warns about it.) Keys added after
// a checkpoint was written compare as their old implied value (their default) when absent: fp32,
// no loss scaling, causal attention, no anomaly policy, ...
#pragma once
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace lathe {

// One differing key between a checkpoint's recipe and the new one ("training.seq_len").
struct RecipeChange {
  std::string key, before, after;
  bool breaks_exactness = false;
};

// Compares two Recipe::to_json() trees key by key, classified as above.
std::vector<RecipeChange> diff_recipes(const nlohmann::json& before, const nlohmann::json& after);

}  // namespace lathe
