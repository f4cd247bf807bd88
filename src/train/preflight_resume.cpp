// Preflight's step 5 (train/preflight.h): which checkpoint a run continues from, the recipe diff
// against it, and its state.json against this run (step, samples consumed, loader position, blend
// plan, seed, optimizer). Kept apart from preflight.cpp's other steps because it is the one that
// reads a previous run.
#include "train/preflight_resume.h"

#include <fmt/format.h>

#include <filesystem>
#include <string>
#include <vector>

#include "config/recipe_diff.h"
#include "core/checked.h"
#include "core/error.h"
#include "data/blend_cache.h"
#include "io/json.h"
#include "io/xxh64.h"
#include "train/preflight.h"

namespace lathe {

namespace fs = std::filesystem;

// Which checkpoint, if any, this run continues from; notes say why (auto).
std::string resolve_checkpoint(const Recipe& r, const TrainOptions& opts, const PreflightLog& log) {
  const std::string resume = opts.resume.empty() ? r.training.resume : opts.resume;
  if (resume != "auto") return resume;
  std::string notes;
  const std::string ckpt = find_latest_checkpoint(r.output.dir, &notes);
  size_t a = 0;
  while (a < notes.size()) {
    const size_t b = notes.find('\n', a);
    log.note("resume auto: " + notes.substr(a, b - a));
    a = b == std::string::npos ? notes.size() : b + 1;
  }
  if (ckpt.empty())
    log.note(fmt::format("resume auto: no complete checkpoint in {}/checkpoints; starting fresh", r.output.dir));
  else
    log.note(
        fmt::format("resume auto: resuming from {}{}", ckpt,
                    notes.find("skipping") != std::string::npos ? " (falling back past the corrupt ones above)" : ""));
  return ckpt;
}

// The recipe diff: harmless changes are noted, breaking ones refused unless forced. Returns
// whether the run continues exactly (no breaking change).
bool check_recipe_changes(const Recipe& r, const TrainOptions& opts, const Preflight& pf, const PreflightLog& log) {
  const auto changes = diff_recipes(pf.cs.recipe, r.to_json());
  std::string breaking, harmless, shapes;
  bool position_encoding = false;
  for (const auto& c : changes) {
    const std::string line = fmt::format("\n  {}: {} -> {}", c.key, c.before, c.after);
    (c.breaks_exactness ? breaking : harmless) += line;
    if (c.shape) shapes += line;
    for (const char* k : {"model.rope_theta", "model.rope_scaling", "model.max_position_embeddings"})
      position_encoding |= c.key == k;
  }
  if (!shapes.empty())
    throw_error(
        "{}: the recipe changes the model's shape against the checkpoint's:{}\n"
        "The checkpoint's weights and moments have the old shapes, so no resume can load them "
        "(--force-resume-changes does not apply to shape keys). Resume with the checkpoint's model "
        "section ({}/recipe.yaml), or start a new run.",
        pf.ckpt, shapes, pf.ckpt);
  if (!harmless.empty()) log.note("resume: recipe changes that keep the run exact (allowed):" + harmless);
  if (!breaking.empty()) {
    if (!opts.force_resume_changes)
      throw_error(
          "{}: the recipe differs from the checkpoint's in ways that change the training results:{}\n"
          "Resume with the checkpoint's recipe ({}/recipe.yaml), or pass --force-resume-changes to "
          "continue anyway with these differences{}.",
          pf.ckpt, breaking, pf.ckpt,
          position_encoding ? " (a long-context continuation changes the position encoding on purpose: the "
                              "weights, optimizer moments, schedule position and data position carry over)"
                            : "");
    log.note(
        "resume: --force-resume-changes: continuing with changes that make this run differ from an "
        "uninterrupted one:" +
        breaking);
  }
  const nlohmann::json& tr = pf.cs.recipe.contains("training") ? pf.cs.recipe["training"] : nlohmann::json();
  if (tr.is_object() && tr.contains("steps") && tr["steps"] != nlohmann::json(r.training.steps))
    log.note("resume: training.steps changed: the learning-rate schedule is recomputed for the new total");
  return breaking.empty();
}

void adapt_data_position(CheckpointState& cs, const Recipe& r, int64_t train_samples, const PreflightLog& log) {
  const nlohmann::json& tr = cs.recipe.contains("training") ? cs.recipe["training"] : nlohmann::json();
  if (!tr.is_object() || !tr.contains("seq_len") || !tr["seq_len"].is_number_integer()) return;
  const int64_t from = tr["seq_len"].get<int64_t>(), to = r.training.seq_len;
  if (from == to || from <= 0) return;
  const data::LoaderState at = cs.loader;
  if (!r.data.blend.empty()) {
    log.note(
        fmt::format("resume: training.seq_len {} -> {}: the blend continues at sample {} of its plan (the "
                    "run's samples are counted; each is now {} tokens)",
                    from, to, at.position, to));
    return;
  }
  cs.loader = data::remap_seq_len(at, from, to, global_batch_samples(r), train_samples);
  log.note(fmt::format(
      "resume: training.seq_len {} -> {}: the checkpoint's data position (epoch {}, sample {} of {} tokens = {} "
      "tokens into the epoch) continues at epoch {}, sample {} of {} tokens ({} tokens into the epoch, whole "
      "batches of {}; the epoch's order is a new permutation of the {} samples of {} tokens)",
      from, to, at.epoch, at.position, from, at.position * from, cs.loader.epoch, cs.loader.position, to,
      cs.loader.position * to, global_batch_samples(r), train_samples, to));
}

void check_resume_state(const CheckpointState& cs, const Recipe& r, int64_t train_samples, bool exact,
                        const std::string& ckpt, const data::BlendPlan* plan) {
  const std::string sp = (fs::path(ckpt) / "state.json").string();
  const int64_t G = global_batch_samples(r);
  LATHE_CHECK(cs.step <= r.training.steps,
              "{}: field 'step' is {}, beyond training.steps = {}; raise training.steps to continue", sp, cs.step,
              r.training.steps);
  // One loader batch is one global batch (micro_batch_size x grad_accum_steps x parallel.data): the
  // checkpoint's own (the batch may change with --force-resume-changes, e.g. fewer samples of a
  // longer seq_len per step).
  const int64_t batches = cs.step;
  // A resharded checkpoint (lathe checkpoint reshard) carries the new layout's parallel section, so
  // under forced changes either batch may be the one its steps consumed.
  const int64_t G_ckpt = exact || !cs.recipe.is_object() ? G : recipe_global_batch(cs.recipe);
  const int64_t consumed_here = checked_mul(batches, G, "state.json step x global batch");
  const int64_t consumed = cs.consumed_samples == consumed_here
                               ? consumed_here
                               : checked_mul(batches, G_ckpt, "state.json step x global batch");
  LATHE_CHECK(cs.consumed_samples == consumed,
              "{}: field 'consumed_samples' is {} but step {} x global batch {} (training.micro_batch_size x "
              "grad_accum_steps x parallel.data{}) = {}",
              sp, cs.consumed_samples, cs.step, G_ckpt, G_ckpt == G ? "" : " of the checkpoint's recipe", consumed);
  // The loader hands out whole batches and starts a new epoch when the next batch would not fit,
  // so `batches` batches put it at exactly one (epoch, position).
  const int64_t per_epoch = train_samples / G;
  if (!r.data.blend.empty()) {
    // A blend is one pass over its plan: the position is the samples consumed (more after an
    // anomaly rollback skipped data: training.anomaly).
    const int64_t pos = cs.loader.position, planned = plan ? static_cast<int64_t>(plan->dataset.size()) : pos;
    LATHE_CHECK(!exact || (cs.loader.epoch == 0 && pos <= planned && pos >= consumed),
                "{}: field 'loader' is epoch {} position {} but a blend is at epoch 0, position >= {} ({} steps of {} "
                "samples) and <= {} (the plan of this run) (the checkpoint belongs to other data or was edited)",
                sp, cs.loader.epoch, pos, consumed, cs.step, G, planned);
    if (exact) {
      if (plan && !cs.blend_taken.empty()) {
        const std::vector<int64_t> taken = data::blend_taken_before(*plan, pos);
        const std::string hash = io::hex64(data::blend_prefix_hash(*plan, pos));
        std::string t0, t1;
        for (size_t i = 0; i < cs.blend_taken.size(); ++i) t0 += fmt::format("{}{}", i ? ", " : "", cs.blend_taken[i]);
        for (size_t i = 0; i < taken.size(); ++i) t1 += fmt::format("{}{}", i ? ", " : "", taken[i]);
        LATHE_CHECK(cs.blend_taken == taken && cs.blend_plan_xxh64 == hash,
                    "{}: field 'loader.blend' (samples taken per dataset [{}], plan hash {}) does not match this run's "
                    "blend plan up to sample {} ([{}], {}): a blended prefix changed its size since the checkpoint "
                    "(or the state was edited). Resume with the checkpoint's data, or pass --force-resume-changes to "
                    "continue on the new plan",
                    sp, t0, io::json_excerpt(nlohmann::json(cs.blend_plan_xxh64), 40), pos, t1, hash);
      }
    }
  } else if (exact && per_epoch > 0) {
    const int64_t epoch = batches / per_epoch, position = (batches % per_epoch) * G;
    LATHE_CHECK(cs.loader.epoch == epoch && cs.loader.position == position,
                "{}: field 'loader' is epoch {} position {} but {} batches of {} samples over {} training samples "
                "end at epoch {} position {} (the checkpoint belongs to other data or was edited)",
                sp, cs.loader.epoch, cs.loader.position, batches, G, train_samples, epoch, position);
  } else {
    LATHE_CHECK(cs.loader.position <= train_samples,
                "{}: field 'loader.position' is {} but this data has {} training samples per epoch", sp,
                cs.loader.position, train_samples);
  }
  // The trainer's only RNG state is the seed (the loader derives every epoch's order from it).
  LATHE_CHECK(cs.rng.size() == 1, "{}: field 'rng' holds {} values; lathe's trainer records exactly 1 (the seed)", sp,
              cs.rng.size());
  int64_t seed = r.training.seed;
  const nlohmann::json& tr = cs.recipe.contains("training") ? cs.recipe["training"] : nlohmann::json();
  if (tr.is_object() && tr.contains("seed") && tr["seed"].is_number_integer()) seed = tr["seed"].get<int64_t>();
  LATHE_CHECK(cs.rng[0] == static_cast<uint64_t>(seed),
              "{}: field 'rng' is [{}] but the checkpoint's training.seed is {} (the state was edited)", sp, cs.rng[0],
              seed);
  LATHE_CHECK(!cs.optimizer.empty(),
              "{}: field 'optimizer' is empty: the checkpoint holds no optimizer state, and resuming needs the "
              "moments",
              sp);
  const std::string name = io::json_excerpt(nlohmann::json(cs.optimizer), 40);
  LATHE_CHECK(cs.optimizer == r.optimizer.name,
              "{}: field 'optimizer' is {} but the recipe's optimizer.name is '{}': the saved moments belong to "
              "another optimizer (resume with optimizer.name: {}, or start fresh)",
              sp, name, r.optimizer.name, name);
}

}  // namespace lathe
