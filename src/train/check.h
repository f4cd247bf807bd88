// `lathe check` (src/cli/cmd_check.cpp) and the Python package's lathe.check: every check `lathe
// train` makes before its first step, without training. Each check that held goes to log.ok, what
// resume would decide to log.note; the first failure throws the message `lathe train` gives.
#pragma once
#include <cstdint>
#include <string>

#include "config/recipe.h"
#include "train/preflight.h"
#include "train/trainer.h"

namespace lathe {

// `r` is loaded from `path` (named in the lines); its layout is resolved for `world` processes.
void check_recipe(Recipe& r, const std::string& path, const TrainOptions& opts, int64_t world, const PreflightLog& log);

}  // namespace lathe
