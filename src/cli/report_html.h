// The HTML report of `lathe report RUN_DIR... [--out FILE]` and `lathe runs DIR --html FILE`: one
// self-contained HTML file (inline SVG drawn here, no script, no network) with the curves of one or several training
// runs overlaid: loss (raw and smoothed) with validation loss, learning rate, gradient norm, tokens/s, MFU, the time
// breakdown (every *_pct field of metrics.jsonl), loss scale and skipped steps, memory; and per run the resolved
// recipe, run_info.json (hardware, version) when the run wrote one, and its checkpoints; the anomaly policy's actions
// (anomalies.jsonl) as a table and as markers on the loss plot.
//
// Input is what `lathe train` writes to output.dir: metrics.jsonl (one JSON object per line;
// records with "step" are plotted by field; a record repeated for a step after a resume replaces
// the earlier one, so resumed runs have no duplicates), recipe.yaml, checkpoints/step_XXXXXXXX/.
// A line that does not parse (a run killed mid-write) is skipped and named in the report.
// null values (NaN/Inf in the run) break the curve instead of being drawn as zeros.
#pragma once
#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace lathe::report {

struct Run {
  std::string dir, label;
  std::map<std::string, std::map<int64_t, double>> series;  // field -> step -> value (NaN = gap)
  nlohmann::json end = nlohmann::json::object();            // the final record (peak memory)
  std::vector<std::string> notes;
  std::string recipe, info;
  std::vector<std::string> checkpoints;
  std::vector<nlohmann::json> anomalies;      // anomalies.jsonl (training.anomaly), in order
  std::map<int64_t, double> anomaly_markers;  // step -> loss of each detected anomaly
};

// OUTPUT/metrics.jsonl (required), recipe.yaml, run_info.json, checkpoints/ and anomalies.jsonl of
// one run directory. Lines that do not parse are skipped and noted (on stderr too).
Run load_run(const std::string& dir);
// The run's series `key` (empty when it never recorded it).
const std::map<int64_t, double>& get(const Run& r, const std::string& key);
// The whole page: `title`, then `preamble` (HTML, e.g. an index table), the overlaid plots, the
// memory table and each run's details.
std::string build_html(const std::vector<Run>& runs, const std::string& title = "lathe report",
                       const std::string& preamble = "");
std::string esc(const std::string& s);  // HTML-escaped text
std::string num(double v);              // 4 significant digits; "n/a" when not finite

}  // namespace lathe::report
