// lathe train RECIPE.yaml [--set key.path=value ...] [--save-every N] [--resume auto|PATH | --overwrite]
//                         [--force-resume-changes] [--stop-after N]
// Exit codes: 0 done (or stopped by --stop-after), 1 error, 2 usage error (an option out of its
// range), 75 (kExitInterrupted) stopped by SIGTERM/SIGINT after saving a checkpoint.
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <cstdlib>

#include "cli/command.h"
#include "config/recipe.h"
#include "dist/comm.h"
#include "train/trainer.h"

namespace {

// The comma-separated step numbers of environment variable `name` ("3,5"; empty when unset).
std::vector<int64_t> steps_from_env(const char* name) {
  std::vector<int64_t> v;
  for (const char* c = std::getenv(name); c && *c;) {
    char* end = nullptr;
    const long long x = std::strtoll(c, &end, 10);
    if (end == c) break;
    v.push_back(x);
    c = *end == ',' ? end + 1 : end;
  }
  return v;
}

// The test hooks' faults (train/fault_plan.h), read here once so that the library never reads them.
lathe::FaultPlan fault_plan_from_env() {
  lathe::FaultPlan f;
  f.nonfinite_steps = steps_from_env("LATHE_TEST_NONFINITE_STEPS");
  f.loss_spike_steps = steps_from_env("LATHE_TEST_LOSS_SPIKE_STEPS");
  if (const char* factor = std::getenv("LATHE_TEST_LOSS_SPIKE_FACTOR")) f.loss_spike_factor = std::atof(factor);
  const char* stall_rank = std::getenv("LATHE_TEST_STALL_RANK");
  const char* stall_step = std::getenv("LATHE_TEST_STALL_STEP");
  if (stall_rank && stall_step) {
    f.stall_rank = std::atoi(stall_rank);
    f.stall_step = std::atoll(stall_step);
  }
  if (const char* ms = std::getenv("LATHE_TEST_CKPT_SLEEP_MS")) f.checkpoint_pause_ms = std::atoi(ms);
  const char* on_host = std::getenv("LATHE_TEST_DEVICE_PATH_ON_HOST");
  f.device_path_on_host = on_host != nullptr && std::string(on_host) == "1";
  return f;
}

int run_train(int argc, char** argv) {
  CLI::App app{"Train a model from a YAML recipe", "lathe train"};
  std::string recipe_path, resume;
  std::vector<std::string> sets;
  int64_t save_every = -1, checkpoint_every = -1, stop_after = 0;
  bool quiet = false, force = false, overwrite = false;
  app.add_option("recipe", recipe_path, "recipe file (YAML)")->required();
  app.add_option("--set", sets, "override a recipe value: --set training.steps=10 (repeatable)");
  app.add_option("--save-every", save_every, "write a Hugging Face model directory every N steps");
  app.add_option("--checkpoint-every", checkpoint_every,
                 "write a full training-state checkpoint every N steps (output.checkpoint_every)");
  app.add_option("--resume", resume,
                 "continue a run: 'auto' = newest complete checkpoint of output.dir (fresh start if none), "
                 "or a checkpoint directory");
  app.add_flag("--overwrite", overwrite,
               "start a new run even if output.dir holds one: the old run directory is moved aside to "
               "OUTPUT.DIR.replaced-N (nothing is deleted); without it such a run is refused");
  app.add_flag("--force-resume-changes", force,
               "resume even if the recipe changed in ways that break exactness (the differences are logged)");
  app.add_option("--stop-after", stop_after,
                 "save a checkpoint after this many optimizer steps and exit 0 (as a preemption would)");
  app.add_flag("--quiet", quiet, "no per-step log lines");
  std::string profile;
  app.add_option("--profile-steps", profile,
                 "record steps A-B (or one step A) with the profiler: OUTPUT/trace/rankRRRRR.json (Perfetto, "
                 "chrome://tracing)")
      ->check(CLI::Validator(
          [](std::string& v) -> std::string {
            long long a = 0, b = 0;
            char dash = 0, extra = 0;
            const int n = std::sscanf(v.c_str(), "%lld%c%lld%c", &a, &dash, &b, &extra);
            if ((n == 1 && a >= 1) || (n == 3 && dash == '-' && a >= 1 && b >= a)) return "";
            return "must be A-B with 1 <= A <= B (steps, 1-based), or one step A, got " + v;
          },
          "A-B"));
  app.footer(
      "On SIGTERM or SIGINT a checkpoint is saved at the next step boundary and lathe exits with code 75; "
      "a second signal stops immediately.");
  LATHE_CLI_PARSE(app, argc, argv);
  // Values the parser accepts but that mean nothing: refused by name, as a usage error.
  auto usage = [&](const std::string& what) {
    std::fprintf(stderr, "lathe train: usage error: %s\nRun 'lathe train --help' for the options.\n", what.c_str());
    return 2;
  };
  if (app.count("--stop-after") && stop_after < 1)
    return usage(
        fmt::format("--stop-after {} must be >= 1 (optimizer steps; omit it to train to the end)", stop_after));
  if (app.count("--checkpoint-every") && checkpoint_every < 0)
    return usage(fmt::format("--checkpoint-every {} must be >= 0 (steps; 0 = only on a signal or --stop-after)",
                             checkpoint_every));
  if (app.count("--save-every") && save_every < 0)
    return usage(fmt::format("--save-every {} must be >= 0 (steps; 0 = only at the end)", save_every));
  if (app.count("--resume") && resume.empty())
    return usage("--resume is empty: give 'auto' or a checkpoint directory (omit --resume to start a new run)");
  if (overwrite && app.count("--resume") && resume == "auto")
    return usage("--overwrite starts a new run (moving the old one aside) and --resume auto continues it: use one");
  if (save_every >= 0) sets.push_back(fmt::format("output.save_every={}", save_every));
  if (checkpoint_every >= 0) sets.push_back(fmt::format("output.checkpoint_every={}", checkpoint_every));
  lathe::Recipe recipe = lathe::load_recipe(recipe_path, sets);
  // Under mpirun/srun every process runs this; alone it is a one-rank world (no MPI needed).
  auto world = lathe::dist::make_world_communicator(recipe.parallel.timeout_s);
  lathe::TrainOptions opts;
  opts.world = world.get();
  opts.quiet = quiet;
  opts.resume = resume;
  opts.force_resume_changes = force;
  opts.overwrite = overwrite;
  opts.stop_after_steps = stop_after;
  opts.handle_signals = true;
  opts.faults = fault_plan_from_env();
  if (!profile.empty()) {
    long long a = 0, b = 0;
    char dash = 0;
    if (std::sscanf(profile.c_str(), "%lld%c%lld", &a, &dash, &b) < 3) b = a;
    opts.profile_first = a;
    opts.profile_last = b;
  }
  lathe::TrainResult res = lathe::train(recipe, opts);
  return res.interrupted ? lathe::kExitInterrupted : 0;
}

lathe::cli::Registrar reg("train", "train a model from a YAML recipe", run_train);

}  // namespace
