// lathe check RECIPE.yaml [--set key=value ...]: validates the recipe and the consistency of its
// model, tokenizer and data (train/consistency.h) without training. Exit code 1 on any failure.
#include <fmt/format.h>

#include <CLI/CLI.hpp>

#include "cli/command.h"
#include "config/recipe.h"
#include "train/consistency.h"

namespace {

int run_check(int argc, char** argv) {
  CLI::App app{"Check a recipe: keys, values, and model/tokenizer/data consistency", "lathe check"};
  std::string path;
  std::vector<std::string> sets;
  app.add_option("recipe", path, "recipe file (YAML)")->required();
  app.add_option("--set", sets, "override a recipe value (repeatable)");
  LATHE_CLI_PARSE(app, argc, argv);
  lathe::Recipe r = lathe::load_recipe(path, sets);
  fmt::print("ok   recipe {} is valid\n", path);
  auto rep = lathe::check_consistency(r);
  for (auto& l : rep.passed) fmt::print("ok   {}\n", l);
  for (auto& l : rep.failures) fmt::print("FAIL {}\n", l);
  return rep.failures.empty() ? 0 : 1;
}

lathe::cli::Registrar reg("check", "validate a recipe and its model/tokenizer/data consistency", run_check);

}  // namespace
