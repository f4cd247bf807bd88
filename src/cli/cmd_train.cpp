// lathe train RECIPE.yaml [--set key.path=value ...] [--save-every N]
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "cli/command.h"
#include "config/recipe.h"
#include "train/trainer.h"

namespace {

int run_train(int argc, char** argv) {
  CLI::App app{"Train a model from a YAML recipe", "lathe train"};
  std::string recipe_path;
  std::vector<std::string> sets;
  int64_t save_every = -1;
  bool quiet = false;
  app.add_option("recipe", recipe_path, "recipe file (YAML)")->required();
  app.add_option("--set", sets, "override a recipe value: --set training.steps=10 (repeatable)");
  app.add_option("--save-every", save_every, "write a Hugging Face model directory every N steps");
  app.add_flag("--quiet", quiet, "no per-step log lines");
  CLI11_PARSE(app, argc, argv);
  if (save_every >= 0) sets.push_back(fmt::format("output.save_every={}", save_every));
  lathe::Recipe recipe = lathe::load_recipe(recipe_path, sets);
  lathe::TrainOptions opts;
  opts.quiet = quiet;
  lathe::train(recipe, opts);
  return 0;
}

lathe::cli::Registrar reg("train", "train a model from a YAML recipe", run_train);

}  // namespace
