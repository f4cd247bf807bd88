#include "train/check.h"

#include <fmt/format.h>

#include "core/error.h"
#include "train/run_dir.h"

namespace lathe {

void check_recipe(Recipe& r, const std::string& path, const TrainOptions& opts, int64_t world, const PreflightLog& log) {
  log.ok(fmt::format("recipe {} is valid", path));
  resolve_layout(r, world);
  log.ok(fmt::format("layout: {} process{} = parallel.data {} x tensor {} x pipeline {}{}; ZeRO {}; global batch {} samples",
                     world, world == 1 ? "" : "es", r.parallel.data, r.parallel.tensor, r.parallel.pipeline,
                     r.parallel.context > 1 ? fmt::format(" x context {}", r.parallel.context) : std::string(),
                     r.parallel.zero, global_batch_samples(r)));
  preflight(r, opts, log, /*check_only=*/true);
  // The run-directory check `lathe train` makes right after preflight (train/run_dir.h).
  if (!opts.overwrite) {
    const std::string refusal = run_dir_refusal(r, opts.resume.empty() ? r.training.resume : opts.resume);
    if (!refusal.empty()) throw_error("{}", refusal);
    log.ok(fmt::format("output.dir {} holds no other run", r.output.dir));
  } else {
    log.note(fmt::format("--overwrite: a run in output.dir {} would be moved aside", r.output.dir));
  }
}

}  // namespace lathe
