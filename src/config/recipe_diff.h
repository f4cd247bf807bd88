// What changed between a checkpoint's recipe and the recipe of the run resuming from it, and
// whether the change breaks exactness. Each key's class is its schema row's (config/recipe_schema.h
// OnResume):
//   refused even with --force-resume-changes: the model keys that set a weight's shape or presence
//   (config/model_keys.h: hidden_size, num_hidden_layers, vocab_size, GPT-2's n_positions, ...);
//   the checkpoint's tensors cannot be loaded into a model of another shape;
//   breaking (resume would not continue the same run; allowed with --force-resume-changes): the
//   other model.* keys (rope_theta, rope_scaling, max_position_embeddings of a RoPE model, ...:
//   a long-context continuation changes them on purpose; model.init_from is harmless, it only
//   matters at initialisation; model.rope_scaling compares as one value), data.{train, valid, valid_fraction, blend, attention,
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
  bool shape = false;  // a model shape key: refused even with --force-resume-changes (implies breaks_exactness)
};

// Samples per optimizer step of a Recipe::to_json() tree (a checkpoint's recipe): micro_batch_size x
// grad_accum_steps x parallel.data, each 1 when absent (a recipe from before the parallel section).
int64_t recipe_global_batch(const nlohmann::json& recipe);

// Compares two Recipe::to_json() trees key by key, classified as above.
std::vector<RecipeChange> diff_recipes(const nlohmann::json& before, const nlohmann::json& after);

}  // namespace lathe
