// lathe runs DIR [--json] [--html FILE]: the experiment index. Every run under DIR (a directory
// holding metrics.jsonl, or recipe.yaml with run_info.json, as `lathe train` writes them; its own
// subdirectories are not searched) is one row: status, model and size, data, tokens seen, steps,
// LR schedule, final train/validation loss, best validation loss, task accuracy, median tokens/s
// and MFU, the time spent in training steps, and the recipe hash. Reads only what the runs wrote.
//
// Status, from the run's own records:
//   finished          metrics.jsonl has the end-of-run record (peak memory, written after the final
//                     validation and the model directory)
//   stopped at step N the last session of train.log says it stopped (--stop-after, SIGTERM/SIGINT:
//                     a checkpoint was saved); without a train.log (runs of older versions): the
//                     last step record is the newest checkpoint's step
//   crashed           train.log's last session ends with "error: ..." (the message is the row's
//                     "error"), or the process its start marker names is gone without an end
//   running           the process its start marker names (pid on this host) is a live lathe
// Recipe hash: XXH64 of recipe.yaml without its comment lines and its output section, so that one
// recipe run in two directories has one hash.
#include <fmt/format.h>
#include <signal.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cerrno>
#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "cli/command.h"
#include "cli/report_html.h"
#include "core/error.h"
#include "core/progress.h"
#include "io/fs.h"
#include "io/xxh64.h"
#include "io/yaml.h"
#include "train/checkpoint.h"

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

bool is_run(const fs::path& d) {
  return fs::is_regular_file(d / "metrics.jsonl") ||
         (fs::is_regular_file(d / "recipe.yaml") && fs::is_regular_file(d / "run_info.json"));
}

// The runs under `root` (root itself when it is one), sorted by path.
std::vector<fs::path> find_runs(const fs::path& root) {
  LATHE_CHECK(fs::is_directory(root), "{}: not a directory (pass a directory that holds lathe runs)", root.string());
  std::vector<fs::path> runs;
  if (is_run(root)) return {root};
  for (auto it = fs::recursive_directory_iterator(root, fs::directory_options::skip_permission_denied);
       it != fs::recursive_directory_iterator(); ++it) {
    if (!it->is_directory()) continue;
    if (is_run(it->path())) {
      runs.push_back(it->path());
      it.disable_recursion_pending();
    }
  }
  std::sort(runs.begin(), runs.end());
  return runs;
}

std::optional<json> read_json_file(const fs::path& p) {
  if (!fs::is_regular_file(p)) return std::nullopt;
  try {
    return json::parse(lathe::io::read_file(p.string()));
  } catch (const json::exception&) {
    return std::nullopt;
  }
}

// The facts of the last session of OUTPUT/train.log.
struct LogTail {
  bool present = false;
  std::string error;               // "error: ..." that ended it
  std::optional<int64_t> stopped;  // "stopped after step N" / "saved a checkpoint at step N and stopped"
  long pid = 0;
  std::string host;
};

LogTail read_log_tail(const fs::path& dir) {
  LogTail t;
  const fs::path p = dir / "train.log";
  if (!fs::is_regular_file(p)) return t;
  t.present = true;
  std::istringstream lines(lathe::io::read_file(p.string()));
  static const std::regex marker(R"(^==== .*; pid (\d+) on (\S+)\) ====$)");
  static const std::regex stop_after(R"(^stopped after step (\d+) as requested)");
  static const std::regex stop_signal(R"(^received SIG\w+: saved a checkpoint at step (\d+) and stopped)");
  std::string line;
  std::smatch m;
  while (std::getline(lines, line)) {
    if (std::regex_search(line, m, marker)) {
      t = LogTail{true, "", std::nullopt, std::stol(m[1]), m[2]};
    } else if (line.rfind("error: ", 0) == 0) {
      t.error = line.substr(7);
    } else if (std::regex_search(line, m, stop_after) || std::regex_search(line, m, stop_signal)) {
      t.stopped = std::stoll(m[1]);
    }
  }
  return t;
}

// Whether `pid` on `host` is a live lathe process on this machine.
bool alive(long pid, const std::string& host) {
  char me[256] = {0};
  ::gethostname(me, sizeof(me) - 1);
  if (pid <= 0 || host != me) return false;
  if (::kill(static_cast<pid_t>(pid), 0) != 0 && errno != EPERM) return false;
  // The executable (not /proc/PID/comm: lathe re-executes itself through /proc/self/exe, core/blas_env.h).
  std::error_code ec;
  const fs::path exe = fs::read_symlink(fs::path("/proc") / std::to_string(pid) / "exe", ec);
  if (ec) return true;  // no /proc, or not ours to read: trust kill()
  return exe.filename().string().rfind("lathe", 0) == 0;
}

std::string recipe_hash(const std::string& yaml) {
  std::istringstream lines(yaml);
  std::string line, kept;
  bool in_output = false;
  while (std::getline(lines, line)) {
    if (!line.empty() && line[0] != ' ' && line[0] != '#') in_output = line.rfind("output:", 0) == 0;
    if (in_output || (!line.empty() && line[0] == '#')) continue;
    kept += line + "\n";
  }
  return lathe::io::hex64(lathe::io::Xxh64::hash(kept.data(), kept.size()));
}

double median(std::vector<double> v) {
  if (v.empty()) return NAN;
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

json num_or_null(double v) { return std::isfinite(v) ? json(v) : json(nullptr); }

// What metrics.jsonl says: the last step record, the validation and task records, the end record.
struct Metrics {
  std::optional<json> last_step, end;
  double last_val = NAN, best_val = NAN, tasks_acc = NAN, step_time_s = 0;
  std::vector<double> tok_s, mfu;
};

Metrics read_metrics(const fs::path& dir) {
  Metrics m;
  const fs::path p = dir / "metrics.jsonl";
  if (!fs::is_regular_file(p)) return m;
  std::istringstream lines(lathe::io::read_file(p.string()));
  std::string line;
  while (std::getline(lines, line)) {
    json j;
    try {
      j = json::parse(line);
    } catch (const json::exception&) {
      continue;  // a torn last line of a killed run
    }
    if (!j.is_object() || !j.contains("step")) continue;
    auto number = [&](const char* k) { return j.contains(k) && j[k].is_number() ? j[k].get<double>() : NAN; };
    if (j.contains("loss")) {
      m.last_step = j;
      if (std::isfinite(number("tokens_per_s"))) m.tok_s.push_back(number("tokens_per_s"));
      if (std::isfinite(number("mfu"))) m.mfu.push_back(number("mfu"));
      if (std::isfinite(number("ms_per_step"))) m.step_time_s += number("ms_per_step") / 1e3;
    }
    if (std::isfinite(number("val_loss"))) {
      m.last_val = number("val_loss");
      m.best_val = std::isfinite(m.best_val) ? std::min(m.best_val, m.last_val) : m.last_val;
    }
    if (std::isfinite(number("tasks_acc"))) m.tasks_acc = number("tasks_acc");
    if (j.contains("peak_rss_mb_max_rank")) m.end = j;
  }
  return m;
}

std::string status_of(const fs::path& dir, const Metrics& m, const LogTail& t, int64_t last_step, std::string& error) {
  if (m.end) return "finished";
  if (!t.error.empty()) {
    error = t.error;
    return "crashed";
  }
  if (t.stopped) return fmt::format("stopped at step {}", *t.stopped);
  if (t.present && alive(t.pid, t.host)) return "running";
  if (!t.present) {  // a run of a version without train.log
    const auto ck = lathe::list_checkpoints(dir.string());
    if (!ck.empty() && ck.back().first == last_step) return fmt::format("stopped at step {}", last_step);
  }
  return "crashed";
}

// One row of the index (JSON; the table and the page format it).
json describe_run(const fs::path& root, const fs::path& dir) {
  const Metrics m = read_metrics(dir);
  const LogTail t = read_log_tail(dir);
  json recipe = json::object();
  std::string yaml;
  if (fs::is_regular_file(dir / "recipe.yaml")) {
    yaml = lathe::io::read_file((dir / "recipe.yaml").string());
    try {
      recipe = lathe::io::load_yaml(yaml, (dir / "recipe.yaml").string());
    } catch (const lathe::Error&) {
    }
  }
  const json info = read_json_file(dir / "run_info.json").value_or(json::object());
  auto at = [&](const char* sec, const char* key) -> json {
    return recipe.contains(sec) && recipe[sec].is_object() && recipe[sec].contains(key) ? recipe[sec][key] : json();
  };
  const int64_t last_step = m.last_step ? m.last_step->value("step", int64_t{0}) : 0;
  std::string error;
  json row;
  const std::string rel = fs::relative(dir, root).string();
  fs::path whole = fs::absolute(dir).lexically_normal();  // "runs/x/" and "." have a name too
  if (whole.filename().empty()) whole = whole.parent_path();
  row["run"] = rel == "." ? whole.filename().string() : rel;
  row["path"] = dir.string();
  row["status"] = status_of(dir, m, t, last_step, error);
  if (!error.empty()) row["error"] = error;
  row["model"] = at("model", "model_type");
  row["parameters"] = info.contains("parameters") ? info["parameters"] : json();
  const json blend = at("data", "blend");
  row["data"] = blend.is_null() || (blend.is_array() && blend.empty()) ? at("data", "train") : blend;
  row["tokens"] = m.last_step ? (*m.last_step)["tokens"] : json();
  row["step"] = last_step;
  row["steps"] = at("training", "steps");
  row["schedule"] = {{"name", at("schedule", "name")},
                     {"lr", at("optimizer", "lr")},
                     {"warmup_steps", at("schedule", "warmup_steps")},
                     {"min_lr", at("schedule", "min_lr")}};
  row["train_loss"] = m.last_step ? (*m.last_step)["loss"] : json();
  row["val_loss"] = num_or_null(m.last_val);
  row["best_val_loss"] = num_or_null(m.best_val);
  row["tasks_acc"] = num_or_null(m.tasks_acc);
  row["tokens_per_s"] = num_or_null(median(m.tok_s));
  row["mfu"] = num_or_null(median(m.mfu));
  row["step_time_s"] = m.step_time_s;
  row["recipe_hash"] = yaml.empty() ? json() : json(recipe_hash(yaml));
  return row;
}

std::string cell(const json& v, int digits = 4) {
  if (v.is_null()) return "-";
  if (v.is_string()) return v.get<std::string>();
  if (v.is_number_integer()) return std::to_string(v.get<int64_t>());
  if (v.is_number()) return fmt::format("{:.{}g}", v.get<double>(), digits);
  return v.dump();
}

// The row's columns as text, in table order.
std::vector<std::string> columns(const json& r) {
  const json& s = r["schedule"];
  const std::string model = cell(r["model"]) + (r["parameters"].is_number()
                                                    ? " " + lathe::progress::format_count(r["parameters"].get<double>())
                                                    : std::string());
  return {cell(r["run"]),
          cell(r["status"]),
          model,
          lathe::io::excerpt(cell(r["data"]), 40),
          r["tokens"].is_number() ? lathe::progress::format_count(r["tokens"].get<double>()) : "-",
          fmt::format("{}/{}", cell(r["step"]), cell(r["steps"])),
          fmt::format("{} lr {} warmup {}", cell(s["name"]), cell(s["lr"]), cell(s["warmup_steps"])),
          cell(r["train_loss"]),
          cell(r["val_loss"]),
          cell(r["best_val_loss"]),
          cell(r["tasks_acc"]),
          r["tokens_per_s"].is_number() ? lathe::progress::format_count(r["tokens_per_s"].get<double>()) : "-",
          r["mfu"].is_number() ? fmt::format("{:.1f}%", 100 * r["mfu"].get<double>()) : "-",
          lathe::progress::format_duration(r["step_time_s"].get<double>()),
          cell(r["recipe_hash"])};
}

const std::vector<std::string> kHeader = {"run",       "status",   "model", "data", "tokens",
                                          "steps",     "schedule", "loss",  "val",  "best val",
                                          "tasks acc", "tok/s",    "MFU",   "time", "recipe hash"};

std::string text_table(const json& rows) {
  std::vector<std::vector<std::string>> t = {kHeader};
  for (const json& r : rows) t.push_back(columns(r));
  std::vector<size_t> w(kHeader.size(), 0);
  for (const auto& row : t)
    for (size_t c = 0; c < row.size(); ++c) w[c] = std::max(w[c], row[c].size());
  std::string out;
  for (const auto& row : t) {
    std::string line;
    for (size_t c = 0; c < row.size(); ++c) line += fmt::format("{:<{}}", row[c], c + 1 < row.size() ? w[c] + 2 : 0);
    out += line + "\n";
  }
  return out;
}

std::string html_table(const json& rows) {
  std::string h = "<h2>Runs</h2>\n<table id=\"runs\"><tr>";
  for (const auto& c : kHeader) h += "<th>" + lathe::report::esc(c) + "</th>";
  h += "</tr>\n";
  for (const json& r : rows) {
    h += fmt::format("<tr data-status=\"{}\">", lathe::report::esc(r["status"].get<std::string>()));
    for (const auto& c : columns(r)) h += "<td style=\"text-align:left\">" + lathe::report::esc(c) + "</td>";
    h += "</tr>\n";
  }
  h += "</table>\n<p>Status from what each run wrote (metrics.jsonl's end record, train.log's last session). "
       "Time: the sum of the recorded step times. Recipe hash: XXH64 of recipe.yaml without comments and "
       "output section.</p>\n";
  for (const json& r : rows)
    if (r.contains("error"))
      h += "<p class=\"note\">" +
           lathe::report::esc(r["run"].get<std::string>() + ": " + r["error"].get<std::string>()) + "</p>\n";
  return h;
}

int run_runs(int argc, char** argv) {
  CLI::App app{"List the training runs under a directory (the experiment index)", "lathe runs"};
  std::string dir, html;
  bool as_json = false;
  app.add_option("dir", dir, "directory holding lathe runs (searched recursively)")->required();
  app.add_flag("--json", as_json, "print the rows as a JSON list instead of a table");
  app.add_option("--html", html, "also write one self-contained HTML page with the table and the overlaid curves");
  LATHE_CLI_PARSE(app, argc, argv);
  const fs::path root(dir);
  const std::vector<fs::path> runs = find_runs(root);
  json rows = json::array();
  for (const fs::path& r : runs) rows.push_back(describe_run(root, r));
  if (!html.empty()) {
    std::vector<lathe::io::PathUse> in;
    for (const fs::path& r : runs)
      for (const char* f : {"metrics.jsonl", "recipe.yaml", "run_info.json", "anomalies.jsonl", "train.log"})
        in.push_back({(r / f).string(), fmt::format("a run's {}", f)});
    lathe::io::check_output_paths(in, {{html, "--html"}});
    std::vector<lathe::report::Run> loaded;
    for (size_t i = 0; i < runs.size(); ++i)
      if (fs::is_regular_file(runs[i] / "metrics.jsonl")) {
        loaded.push_back(lathe::report::load_run(runs[i].string()));
        loaded.back().label = rows[i]["run"].get<std::string>();
      }
    lathe::io::atomic_write_file(html, lathe::report::build_html(loaded, "lathe runs: " + dir, html_table(rows)));
  }
  if (as_json)
    fmt::print("{}\n", rows.dump(2));
  else if (rows.empty())
    fmt::print("no lathe runs under {} (a run directory holds metrics.jsonl, or recipe.yaml and run_info.json)\n", dir);
  else
    fmt::print("{}", text_table(rows));
  if (!html.empty()) fmt::print(stderr, "wrote {} ({} runs)\n", html, rows.size());
  return 0;
}

lathe::cli::Registrar reg("runs", "list the training runs under a directory: status, losses, throughput, recipe hash",
                          run_runs);

}  // namespace
