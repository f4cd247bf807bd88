// lathe report RUN_DIR... [--out FILE]: the HTML report of cli/report_html.h for one or several runs.
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <filesystem>
#include <string>
#include <vector>

#include "cli/command.h"
#include "cli/report_html.h"
#include "io/fs.h"

namespace {

namespace fs = std::filesystem;
using lathe::report::Run;
using lathe::report::build_html;
using lathe::report::get;
using lathe::report::load_run;

int run_report(int argc, char** argv) {
  CLI::App app{"One self-contained HTML report of one or several training runs", "lathe report"};
  std::vector<std::string> dirs;
  std::string out;
  app.add_option("run_dirs", dirs, "output.dir of one or more `lathe train` runs")->required();
  app.add_option("--out", out, "HTML file to write (default: RUN_DIR/report.html for one run)");
  LATHE_CLI_PARSE(app, argc, argv);
  if (out.empty()) {
    if (dirs.size() > 1) {
      fmt::print(stderr, "lathe report: usage error: --out FILE is needed with several runs\n");
      return 2;
    }
    out = (fs::path(dirs[0]) / "report.html").string();
  }
  // --out may be none of the report's inputs, nor inside a run's checkpoints/ or model/ (D4).
  std::vector<lathe::io::PathUse> in;
  for (const auto& d : dirs) {
    in.push_back({d, "the run directory"});
    for (const char* f : {"metrics.jsonl", "recipe.yaml", "run_info.json", "anomalies.jsonl", "lathe.json"})
      in.push_back({(fs::path(d) / f).string(), fmt::format("the run's {}", f)});
    for (const char* sub : {"checkpoints", "model"})
      in.push_back(
          {(fs::path(d) / sub).string(), fmt::format("the run's {}/ directory", sub), lathe::io::PathUse::Dir});
  }
  lathe::io::check_output_paths(in, {{out, "--out"}});
  std::vector<Run> runs;
  for (const auto& d : dirs) runs.push_back(load_run(d));
  lathe::io::atomic_write_file(out, build_html(runs));
  size_t steps = 0;
  for (const Run& r : runs) steps += get(r, "loss").size();
  fmt::print("wrote {} ({} run{}, {} logged steps)\n", out, runs.size(), runs.size() == 1 ? "" : "s", steps);
  return 0;
}

lathe::cli::Registrar reg("report", "write one self-contained HTML report (curves, breakdown, recipe) of training runs",
                          run_report);

}  // namespace
