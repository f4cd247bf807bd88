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

}  // namespace lathe
