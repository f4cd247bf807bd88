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
#include "train/check.h"

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
  auto note = [](const std::string& l) {
    fmt::print("note {}\n", l);
    std::fflush(stdout);
  };
  lathe::check_recipe(r, path, opts, world, lathe::PreflightLog{ok, note});
  fmt::print("ok   lathe train {} can start\n", path);
  return 0;
}

lathe::cli::Registrar reg("check", "run every check of `lathe train` before its first step, without training",
                          run_check);

}  // namespace
