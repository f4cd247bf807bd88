// lathe check RECIPE.yaml [--set key=value ...] [--resume auto|PATH] [--force-resume-changes] [--world N]:
// runs exactly the checks `lathe train` runs before its first step (train/preflight.h: recipe,
// datasets and their token ranges, model/tokenizer consistency, optimizer and schedule, output
// directory writable, model dimensions and memory, init_from weights, resume checkpoint, the EOD
// id the document settings need, training.eval_tasks, the blend plan's size and cache path) without
// training, printing each check that held. --world N checks the layout of an N-process job (the
// degrees, the global batch, memory per rank with ZeRO) on one machine before submitting it. Exit code 0 when train would start, 1 on the first
// failure (the same message `lathe train` prints), 2 for a usage error.
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <cstdio>

#include "cli/command.h"
#include "config/recipe.h"
#include "train/preflight.h"
#include "train/run_dir.h"

namespace {

int run_check(int argc, char** argv) {
  CLI::App app{"Check a recipe: everything `lathe train` checks before its first step", "lathe check"};
  std::string path;
  std::vector<std::string> sets;
  lathe::TrainOptions opts;
  app.add_option("recipe", path, "recipe file (YAML)")->required();
  app.add_option("--set", sets, "override a recipe value (repeatable)");
  app.add_option("--resume", opts.resume, "check resuming as `lathe train --resume` would: 'auto' or a checkpoint");
  app.add_flag("--force-resume-changes", opts.force_resume_changes, "as for `lathe train`");
  app.add_flag("--overwrite", opts.overwrite, "check as `lathe train --overwrite` would (an old run in output.dir is "
                                              "moved aside)");
  int64_t world = 1;
  app.add_option("--world", world, "check for a job of this many processes (mpirun -np N): degrees, global batch, "
                                   "memory per rank")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  LATHE_CLI_PARSE(app, argc, argv);
  lathe::Recipe r = lathe::load_recipe(path, sets);
  auto ok = [](const std::string& l) {
    fmt::print("ok   {}\n", l);
    std::fflush(stdout);
  };
  ok(fmt::format("recipe {} is valid", path));
  lathe::resolve_layout(r, world);
  ok(fmt::format("layout: {} process{} = parallel.data {} x tensor {} x pipeline {}{}; ZeRO {}; global batch {} samples",
                 world, world == 1 ? "" : "es", r.parallel.data, r.parallel.tensor, r.parallel.pipeline,
                 r.parallel.context > 1 ? fmt::format(" x context {}", r.parallel.context) : std::string(),
                 r.parallel.zero, lathe::global_batch_samples(r)));
  auto note = [](const std::string& l) {
    fmt::print("note {}\n", l);
    std::fflush(stdout);
  };
  lathe::preflight(r, opts, lathe::PreflightLog{ok, note}, /*check_only=*/true);
  // The run-directory check `lathe train` makes right after preflight (train/run_dir.h).
  if (!opts.overwrite) {
    const std::string refusal = lathe::run_dir_refusal(r, opts.resume.empty() ? r.training.resume : opts.resume);
    if (!refusal.empty()) lathe::throw_error("{}", refusal);
    ok(fmt::format("output.dir {} holds no other run", r.output.dir));
  } else {
    note(fmt::format("--overwrite: a run in output.dir {} would be moved aside", r.output.dir));
  }
  fmt::print("ok   lathe train {} can start\n", path);
  return 0;
}

lathe::cli::Registrar reg("check", "run every check of `lathe train` before its first step, without training",
                          run_check);

}  // namespace
