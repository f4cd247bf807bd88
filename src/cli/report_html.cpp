#include "cli/report_html.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "core/error.h"
#include "io/fs.h"
#include "io/json.h"
#include "train/checkpoint.h"

namespace lathe::report {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
const char* const kColors[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"};

}  // namespace

std::string esc(const std::string& s) {
  std::string o;
  for (char c : s) {
    switch (c) {
      case '<': o += "&lt;"; break;
      case '>': o += "&gt;"; break;
      case '&': o += "&amp;"; break;
      case '"': o += "&quot;"; break;
      default: o += c;
    }
  }
  return o;
}

std::string num(double v) {
  if (!std::isfinite(v)) return "n/a";
  const double a = std::fabs(v);
  if (a != 0 && (a < 1e-3 || a >= 1e6)) return fmt::format("{:.3g}", v);
  return fmt::format("{:.4g}", v);
}

Run load_run(const std::string& dir) {
  Run run;
  run.dir = dir;
  run.label = fs::path(dir).filename().string().empty() ? dir : fs::path(dir).filename().string();
  const std::string mpath = (fs::path(dir) / "metrics.jsonl").string();
  LATHE_CHECK(fs::exists(mpath),
              "{}: not a lathe run directory: no metrics.jsonl (pass the output.dir of a `lathe train` run)", dir);
  std::istringstream lines(lathe::io::read_file(mpath));
  std::string line;
  int64_t n = 0, nonempty = 0, skipped = 0, first_skipped = 0;
  std::string first_why;
  auto skip = [&](const std::string& why) {
    run.notes.push_back(fmt::format("skipped line {} of metrics.jsonl: {}", n, why));
    if (skipped++ == 0) {
      first_skipped = n;
      first_why = why;
    }
  };
  while (std::getline(lines, line)) {
    ++n;
    if (line.empty()) continue;
    ++nonempty;
    json j;
    try {
      j = lathe::io::parse_json(line, fmt::format("{} line {}", mpath, n));
    } catch (const lathe::Error& e) {
      skip(e.what());
      continue;
    }
    if (!j.is_object()) {
      skip(fmt::format("a JSON {}, not an object", lathe::io::json_type_name(j)));
      continue;
    }
    if (!j.contains("step") || !j["step"].is_number_integer()) continue;
    const int64_t step = j["step"].get<int64_t>();
    if (j.contains("peak_rss_mb_max_rank")) run.end = j;
    for (auto it = j.begin(); it != j.end(); ++it) {
      if (it.key() == "step") continue;
      if (it.value().is_number()) run.series[it.key()][step] = it.value().get<double>();
      if (it.value().is_null()) run.series[it.key()][step] = kNaN;  // a non-finite value of the run
    }
  }
  // A file of which no line reads (random bytes, a binary file, a truncation inside the first line)
  // is not a run to report on (S13); skipped lines of a readable one are said on stderr too.
  LATHE_CHECK(nonempty == 0 || skipped < nonempty,
              "{}: none of its {} lines is a JSON record (line {}: {}); is this the metrics.jsonl of a `lathe train` "
              "run?",
              mpath, nonempty, first_skipped, first_why);
  if (skipped > 0)
    fmt::print(stderr, "lathe report: note: {}: skipped {} of {} lines that do not parse (first: line {}: {})\n", mpath,
               skipped, nonempty, first_skipped, first_why);
  const std::string rpath = (fs::path(dir) / "recipe.yaml").string();
  if (fs::exists(rpath)) run.recipe = lathe::io::read_file(rpath);
  const std::string ipath = (fs::path(dir) / "run_info.json").string();
  if (fs::exists(ipath)) run.info = lathe::io::read_file(ipath);
  for (auto& [s, d] : lathe::list_checkpoints(dir)) run.checkpoints.push_back(fs::path(d).filename().string());
  // The anomaly policy's audit trail: a table, and markers on the loss plot (at the anomaly's own
  // loss; a non-finite one at the curve's value of that step).
  const std::string apath = (fs::path(dir) / "anomalies.jsonl").string();
  std::istringstream alines(fs::exists(apath) ? lathe::io::read_file(apath) : std::string());
  for (int64_t k = 1; std::getline(alines, line); ++k) {
    try {
      json j = lathe::io::parse_json(line, fmt::format("{} line {}", apath, k));
      if (!j.is_object() || !j.contains("step") || !j["step"].is_number_integer() || !j.contains("event")) continue;
      const int64_t step = j["step"].get<int64_t>();
      if (j["event"] == "anomaly") {
        const auto& loss = run.series["loss"];
        run.anomaly_markers[step] = j.contains("loss") && j["loss"].is_number() ? j["loss"].get<double>()
                                    : loss.count(step)                          ? loss.at(step)
                                                                                : kNaN;
      }
      run.anomalies.push_back(std::move(j));
    } catch (const lathe::Error& e) {
      run.notes.push_back(fmt::format("skipped line {} of anomalies.jsonl: {}", k, e.what()));
    }
  }
  return run;
}

namespace {

// Exponential moving average as TensorBoard's smoothing (weight 0.9), debiased at the start;
// NaN points stay NaN and do not poison the average.
std::map<int64_t, double> smooth(const std::map<int64_t, double>& s, double w = 0.9) {
  std::map<int64_t, double> out;
  double acc = 0, norm = 0;
  for (auto& [k, v] : s) {
    if (!std::isfinite(v)) {
      out[k] = kNaN;
      continue;
    }
    acc = w * acc + (1 - w) * v;
    norm = w * norm + (1 - w);
    out[k] = acc / norm;
  }
  return out;
}

struct Line {
  const std::map<int64_t, double>* pts;
  int run;
  std::string style;  // "raw", "smooth", "dashed", "marker"
  std::string name;
};

// One plot as inline SVG. data-* attributes let tests check what was drawn.
std::string plot(const std::string& id, const std::string& title, const std::string& ylabel,
                 const std::vector<Line>& lines, bool log_y = false) {
  constexpr double W = 760, H = 260, L = 70, R = 20, T = 30, B = 40;
  double x0 = std::numeric_limits<double>::max(), x1 = -x0, y0 = x0, y1 = -x0;
  size_t points = 0;
  auto yv = [&](double v) { return log_y ? std::log10(v) : v; };
  for (const Line& l : lines)
    for (auto& [k, v] : *l.pts) {
      if (!std::isfinite(v) || (log_y && v <= 0)) continue;
      x0 = std::min(x0, double(k)), x1 = std::max(x1, double(k));
      y0 = std::min(y0, yv(v)), y1 = std::max(y1, yv(v));
      ++points;
    }
  std::string svg = fmt::format(
      "<svg class=\"plot\" id=\"plot-{}\" data-plot=\"{}\" data-points=\"{}\" width=\"{}\" height=\"{}\" "
      "viewBox=\"0 0 {} {}\" xmlns=\"http://www.w3.org/2000/svg\">\n<text x=\"{}\" y=\"18\" class=\"title\">{}</text>\n",
      id, id, points, W, H, W, H, L, esc(title));
  if (points == 0) {
    svg += fmt::format("<text x=\"{}\" y=\"{}\" class=\"empty\">not recorded by {}</text>\n</svg>\n", L + 20, H / 2,
                       "these runs");
    return svg;
  }
  if (x1 == x0) x0 -= 1, x1 += 1;
  if (y1 == y0) y0 -= 1, y1 += 1;
  const double pad = (y1 - y0) * 0.05;
  y0 -= pad, y1 += pad;
  auto X = [&](double x) { return L + (x - x0) / (x1 - x0) * (W - L - R); };
  auto Y = [&](double y) { return T + (1 - (y - y0) / (y1 - y0)) * (H - T - B); };
  svg += fmt::format("<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" class=\"frame\"/>\n", L, T, W - L - R,
                     H - T - B);
  for (int i = 0; i <= 4; ++i) {
    const double yy = y0 + (y1 - y0) * i / 4, xx = x0 + (x1 - x0) * i / 4;
    svg += fmt::format("<line x1=\"{:.1f}\" x2=\"{:.1f}\" y1=\"{:.1f}\" y2=\"{:.1f}\" class=\"grid\"/>", L, W - R, Y(yy),
                       Y(yy));
    svg += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" class=\"tick\" text-anchor=\"end\">{}</text>", L - 4, Y(yy) + 4,
                       num(log_y ? std::pow(10.0, yy) : yy));
    svg += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" class=\"tick\" text-anchor=\"middle\">{}</text>\n", X(xx),
                       H - B + 16, num(std::round(xx)));
  }
  svg += fmt::format("<text x=\"{}\" y=\"{}\" class=\"axis\" text-anchor=\"middle\">step</text>", (L + W - R) / 2,
                     H - 6);
  svg += fmt::format("<text x=\"14\" y=\"{}\" class=\"axis\" transform=\"rotate(-90 14 {})\" "
                     "text-anchor=\"middle\">{}</text>\n",
                     (T + H - B) / 2, (T + H - B) / 2, esc(ylabel + (log_y ? " (log)" : "")));
  // Which series a style stands for (colours are runs, see the legend above the plots).
  std::vector<std::pair<std::string, std::string>> keys;
  for (const Line& l : lines)
    if (l.style != "marker" && std::find(keys.begin(), keys.end(), std::make_pair(l.name, l.style)) == keys.end())
      keys.push_back({l.name, l.style});
  double kx = W - R - 8;
  for (auto it = keys.rbegin(); it != keys.rend(); ++it) {
    const std::string dash = it->second == "dashed" ? " stroke-dasharray=\"5 3\"" : "";
    const std::string op = it->second == "raw" ? " stroke-opacity=\"0.3\"" : "";
    const double tw = 6.2 * static_cast<double>(it->first.size());
    svg += fmt::format("<text x=\"{:.1f}\" y=\"18\" class=\"tick\" text-anchor=\"end\">{}</text>", kx, esc(it->first));
    svg += fmt::format("<line x1=\"{:.1f}\" x2=\"{:.1f}\" y1=\"14\" y2=\"14\" stroke=\"#444\" stroke-width=\"2\"{}{}/>\n",
                       kx - tw - 22, kx - tw - 4, dash, op);
    kx -= tw + 30;
  }
  for (const Line& l : lines) {
    const char* color = kColors[l.run % 8];
    // Polyline segments (a non-finite value ends one) and their point counts.
    std::vector<std::pair<std::string, size_t>> segs(1);
    for (auto& [k, v] : *l.pts) {
      if (!std::isfinite(v) || (log_y && v <= 0)) {
        if (segs.back().second) segs.emplace_back();
        continue;
      }
      segs.back().first += fmt::format("{:.1f},{:.1f} ", X(double(k)), Y(yv(v)));
      ++segs.back().second;
    }
    const std::string attrs = fmt::format("data-run=\"{}\" data-series=\"{}\"", l.run, esc(l.name));
    if (l.style == "marker") {
      for (auto& [k, v] : *l.pts)
        if (std::isfinite(v) && !(log_y && v <= 0))
          svg += fmt::format("<circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"3\" fill=\"{}\" {}/>", X(double(k)), Y(yv(v)),
                             color, attrs);
      svg += "\n";
      continue;
    }
    const std::string stroke =
        l.style == "raw" ? "stroke-opacity=\"0.3\" stroke-width=\"1\""
                         : (l.style == "dashed" ? "stroke-dasharray=\"5 3\" stroke-width=\"1.5\"" : "stroke-width=\"2\"");
    for (const auto& [pts, n] : segs)
      if (n)
        svg += fmt::format("<polyline fill=\"none\" stroke=\"{}\" {} points=\"{}\" {} data-n=\"{}\"/>\n", color,
                           stroke, pts, attrs, n);
  }
  return svg + "</svg>\n";
}

}  // namespace

const std::map<int64_t, double>& get(const Run& r, const std::string& key) {
  static const std::map<int64_t, double> none;
  auto it = r.series.find(key);
  return it == r.series.end() ? none : it->second;
}

std::string build_html(const std::vector<Run>& runs, const std::string& title, const std::string& preamble) {
  std::vector<std::map<int64_t, double>> smoothed;
  for (const Run& r : runs) smoothed.push_back(smooth(get(r, "loss")));
  std::vector<std::map<int64_t, double>> mfu_pct(runs.size());
  for (size_t i = 0; i < runs.size(); ++i)
    for (auto& [k, v] : get(runs[i], "mfu")) mfu_pct[i][k] = 100 * v;
  auto lines_of = [&](const std::string& key, const std::string& style = "smooth") {
    std::vector<Line> ls;
    for (size_t i = 0; i < runs.size(); ++i)
      if (!get(runs[i], key).empty()) ls.push_back({&get(runs[i], key), int(i), style, key});
    return ls;
  };
  std::vector<Line> loss;
  for (size_t i = 0; i < runs.size(); ++i) {
    loss.push_back({&get(runs[i], "loss"), int(i), "raw", "loss"});
    loss.push_back({&smoothed[i], int(i), "smooth", "loss (smoothed)"});
    if (!runs[i].anomaly_markers.empty()) loss.push_back({&runs[i].anomaly_markers, int(i), "marker", "anomaly"});
    if (!get(runs[i], "val_loss").empty()) {
      loss.push_back({&get(runs[i], "val_loss"), int(i), "dashed", "val_loss"});
      loss.push_back({&get(runs[i], "val_loss"), int(i), "marker", "val_loss"});
    }
  }
  std::vector<Line> mfu;
  for (size_t i = 0; i < runs.size(); ++i)
    if (!mfu_pct[i].empty()) mfu.push_back({&mfu_pct[i], int(i), "smooth", "mfu"});
  // Time breakdown: every "*_pct" field (comm_exposed_pct, data_wait_pct, and whatever the trainer adds).
  std::set<std::string> pct_keys;
  for (const Run& r : runs)
    for (auto& [k, v] : r.series)
      if (k.size() > 4 && k.compare(k.size() - 4, 4, "_pct") == 0) pct_keys.insert(k);
  std::vector<Line> breakdown;
  int style_i = 0;
  for (const std::string& k : pct_keys) {
    for (size_t i = 0; i < runs.size(); ++i)
      if (!get(runs[i], k).empty()) breakdown.push_back({&get(runs[i], k), int(i), style_i % 2 ? "dashed" : "smooth", k});
    ++style_i;
  }
  std::vector<Line> scale = lines_of("loss_scale");
  for (Line& l : lines_of("skipped_steps", "dashed")) scale.push_back(l);

  std::string h = R"(<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>)" + esc(title) + R"(</title>
<style>
body{font-family:sans-serif;margin:20px;color:#222;max-width:1600px}
h1{font-size:22px} h2{font-size:17px;margin-top:28px}
.plots{display:flex;flex-wrap:wrap;gap:12px}
svg.plot{border:1px solid #ddd;background:#fff}
.title{font-size:14px;font-weight:bold} .tick{font-size:10px;fill:#555} .axis{font-size:11px;fill:#333}
.frame{fill:none;stroke:#999} .grid{stroke:#eee} .empty{font-size:13px;fill:#999}
.legend span{display:inline-block;margin-right:18px} .swatch{display:inline-block;width:14px;height:4px;margin-right:5px;vertical-align:middle}
table{border-collapse:collapse;font-size:13px} td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}
pre{background:#f6f6f6;padding:8px;font-size:12px;max-height:360px;overflow:auto}
.note{color:#a60}
</style></head><body>
)";
  h += "<h1>" + esc(title) + "</h1>\n" + preamble;
  h += "<div class=\"legend\" id=\"legend\">";
  for (size_t i = 0; i < runs.size(); ++i)
    h += fmt::format("<span data-run=\"{}\"><i class=\"swatch\" style=\"background:{}\"></i>{}</span>", i,
                     kColors[i % 8], esc(runs[i].label));
  h += "</div>\n<p>Loss: thin = raw, thick = smoothed (EMA 0.9), dashed with dots = validation. Time breakdown: "
       "solid and dashed alternate between fields.</p>\n<div class=\"plots\">\n";
  h += plot("loss", "loss", "loss", loss);
  h += plot("lr", "learning rate", "lr", lines_of("lr"));
  h += plot("grad_norm", "gradient norm (before clipping)", "norm", lines_of("grad_norm"), true);
  h += plot("tokens_per_s", "throughput", "tokens/s", lines_of("tokens_per_s"));
  h += plot("mfu", "model FLOPs utilisation", "MFU %", mfu);
  h += plot("breakdown", "time breakdown (% of step)", "%", breakdown);
  h += plot("loss_scale", "loss scale and skipped steps", "value", scale, true);
  h += "</div>\n<h2>Memory and layout</h2>\n<table id=\"memory\"><tr><th>run</th><th>world size</th><th>peak RSS, "
       "largest rank (MB)</th><th>last step</th><th>checkpoints</th></tr>\n";
  for (size_t i = 0; i < runs.size(); ++i) {
    const Run& r = runs[i];
    const auto& loss_pts = get(r, "loss");
    h += fmt::format("<tr><td style=\"text-align:left\">{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>\n",
                     esc(r.label), r.end.contains("world_size") ? r.end["world_size"].dump() : "n/a",
                     r.end.contains("peak_rss_mb_max_rank") ? num(r.end["peak_rss_mb_max_rank"].get<double>()) : "n/a",
                     loss_pts.empty() ? std::string("n/a") : std::to_string(loss_pts.rbegin()->first),
                     r.checkpoints.size());
  }
  h += "</table>\n";
  for (size_t i = 0; i < runs.size(); ++i) {
    const Run& r = runs[i];
    h += fmt::format("<h2 id=\"run-{}\">Run {}: {}</h2>\n", i, i, esc(r.dir));
    for (const auto& n : r.notes) h += "<p class=\"note\">" + esc(n) + "</p>\n";
    h += "<p>Hardware and version: ";
    h += r.info.empty() ? "not recorded by this run (no run_info.json)</p>\n" : "</p><pre>" + esc(r.info) + "</pre>\n";
    h += "<p>Checkpoints: " + (r.checkpoints.empty() ? std::string("none") : esc([&] {
                                  std::string s;
                                  for (const auto& c : r.checkpoints) s += (s.empty() ? "" : ", ") + c;
                                  return s;
                                }())) +
         "</p>\n";
    if (!r.anomalies.empty()) {  // training.anomaly's detections and actions (markers on the loss plot)
      h += fmt::format(
          "<p>Anomalies (anomalies.jsonl):</p><table id=\"anomalies-{}\"><tr><th>step</th><th>event</th>"
          "<th>details</th></tr>\n",
          i);
      for (const json& a : r.anomalies) {
        json rest = a;
        for (const char* k : {"step", "event"}) rest.erase(k);
        h += fmt::format("<tr><td>{}</td><td>{}</td><td style=\"text-align:left\">{}</td></tr>\n", a["step"].dump(),
                         esc(a["event"].is_string() ? a["event"].get<std::string>() : a["event"].dump()),
                         esc(rest.dump()));
      }
      h += "</table>\n";
    }
    h += "<p>Resolved recipe:</p><pre>" + (r.recipe.empty() ? std::string("(no recipe.yaml)") : esc(r.recipe)) +
         "</pre>\n";
  }
  h += fmt::format("<p style=\"color:#888\">written by lathe {}</p>\n</body></html>\n", LATHE_VERSION);
  return h;
}

}  // namespace lathe::report
