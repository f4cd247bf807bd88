// Preflight's resume step (step 5 of train/preflight.h), used by preflight() only; check_resume_state,
// which `lathe checkpoint` tools call too, is declared in train/preflight.h.
#pragma once
#include <string>

#include "config/recipe.h"
#include "train/preflight.h"

namespace lathe {

// Which checkpoint, if any, this run continues from: training.resume or --resume; "auto" the
// newest complete one (notes say why, and which were skipped). "" = start fresh.
std::string resolve_checkpoint(const Recipe& r, const TrainOptions& opts, const PreflightLog& log);

// The recipe diff: harmless changes are noted, breaking ones refused unless forced. Returns
// whether the run continues exactly (no breaking change).
bool check_recipe_changes(const Recipe& r, const TrainOptions& opts, const Preflight& pf, const PreflightLog& log);

// A resume that changes training.seq_len (allowed with --force-resume-changes): the checkpoint's
// data position (cs.loader, counted in samples of the old length) is mapped onto this run's samples
// and the mapping noted. Without a blend: data::remap_seq_len (the same epoch, as many tokens into
// it). A blend's position counts the run's samples in its plan (rebuilt for the new length), so it
// stays: the blend continues at the same sample number, each sample now the new length. The
// samples consumed (state.json consumed_samples = step x global batch) and the step are unchanged.
void adapt_data_position(CheckpointState& cs, const Recipe& r, int64_t train_samples, const PreflightLog& log);

}  // namespace lathe
