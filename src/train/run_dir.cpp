#include "train/run_dir.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <ctime>
#include <filesystem>
#include <regex>

#include "core/error.h"

namespace lathe {

namespace fs = std::filesystem;

std::vector<std::string> run_entries(const std::string& dir) {
  std::vector<std::string> out;
  std::error_code ec;
  const fs::path d = dir.empty() ? fs::path(".") : fs::path(dir);
  if (!fs::is_directory(d, ec)) return out;
  static const std::regex kStepDir("step_[0-9]{8}");
  auto entries_in = [](const fs::path& p) {
    std::error_code e2;
    size_t n = 0;
    for (fs::directory_iterator it(p, e2), end; !e2 && it != end; it.increment(e2)) ++n;
    return n;
  };
  std::vector<std::string> names;
  for (fs::directory_iterator it(d, ec), end; !ec && it != end; it.increment(ec))
    names.push_back(it->path().filename().string());
  std::sort(names.begin(), names.end());
  for (const std::string& n : names) {
    const fs::path p = d / n;
    std::error_code e2;
    const bool is_dir = fs::is_directory(p, e2);
    if (n == "metrics.jsonl" || n == "anomalies.jsonl") {
      out.push_back(n);
    } else if (n == "checkpoints" || n == "model" || n == "trace") {
      const size_t k = is_dir ? entries_in(p) : 1;
      if (k > 0) out.push_back(is_dir ? fmt::format("{}/ ({} entr{})", n, k, k == 1 ? "y" : "ies") : n);
    } else if (is_dir && std::regex_match(n, kStepDir)) {
      out.push_back(n + "/");
    }
  }
  return out;
}

bool resume_continues_dir(const std::string& resume, const std::string& out_dir) {
  if (resume.empty()) return false;
  if (resume == "auto") return true;
  std::error_code ec;
  fs::path ck = fs::path(resume).lexically_normal();
  if (ck.filename().empty()) ck = ck.parent_path();  // "run/checkpoints/step_00000002/"
  const fs::path parent = ck.parent_path();
  const fs::path mine = fs::path(out_dir.empty() ? "." : out_dir) / "checkpoints";
  if (fs::equivalent(parent.empty() ? fs::path(".") : parent, mine, ec)) return true;
  // Not created yet or not comparable on disk: compare the absolute, normalised paths.
  return fs::absolute(parent, ec).lexically_normal() == fs::absolute(mine, ec).lexically_normal();
}

namespace {
std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : ", ") + x;
  return s;
}

}  // namespace

std::string run_dir_refusal(const Recipe& r, const std::string& resume) {
  const std::string& dir = r.output.dir;
  if (resume_continues_dir(resume, dir)) return "";
  const std::vector<std::string> held = run_entries(dir);
  if (held.empty()) return "";
  const std::string why = resume.empty() ? "without --resume" : fmt::format("resuming from {}, outside it,", resume);
  return fmt::format(
      "{}: output.dir already holds a training run ({}); lathe train {} never reuses a run directory. "
      "Continue that run with --resume auto, or start a new one with --overwrite (the old run directory is "
      "moved aside to {}.replaced-N, nothing is deleted), or set output.dir to another directory",
      dir, join(held), why, fs::path(dir).lexically_normal().string());
}

namespace {
// Rank 0's verdict: "" (go on) or the error every rank reports.
std::string claim_on_rank0(const Recipe& r, const std::string& resume, bool overwrite,
                           const std::function<void(const std::string&)>& say) {
  const std::string& dir = r.output.dir;
  if (overwrite && resume_continues_dir(resume, dir))
    return fmt::format(
        "--overwrite starts a new run in output.dir {} (moving the old one aside), but the resume setting ({}) "
        "continues the run there: use one or the other",
        dir, resume == "auto" ? "--resume auto / training.resume: auto" : resume);
  const std::string refusal = run_dir_refusal(r, resume);
  if (refusal.empty()) return "";
  if (!overwrite) return refusal;
  const std::vector<std::string> held = run_entries(dir);
  // Moving the directory that holds the process's working directory would move the new run too.
  std::error_code ec;
  fs::path abs = fs::absolute(dir).lexically_normal();  // a symlink is moved itself, not its target
  if (abs.filename().empty()) abs = abs.parent_path();  // "runs/x/"
  const fs::path cwd = fs::current_path(ec);
  const std::string rel = cwd.lexically_relative(fs::weakly_canonical(abs, ec)).string();
  if (rel.empty() || rel == "." || rel.rfind("..", 0) != 0)
    return fmt::format(
        "{}: --overwrite cannot move output.dir aside: it holds the current working directory {} (set output.dir "
        "to a directory below it, or run from elsewhere)",
        dir, cwd.string());
  std::string aside;
  for (int n = 1;; ++n) {
    aside = fmt::format("{}.replaced-{}", abs.string(), n);
    if (!fs::exists(fs::symlink_status(aside, ec))) break;
  }
  fs::rename(abs, aside, ec);
  if (ec)
    return fmt::format(
        "{}: --overwrite: cannot move the old run aside to {}: {} (move it yourself, or set output.dir "
        "to another directory)",
        dir, aside, ec.message());
  // The new run's directory (preflight proved it writable), with the data cache: content-addressed
  // and shared by the runs of this directory, it stays.
  fs::create_directories(abs, ec);
  if (ec) return fmt::format("{}: --overwrite: cannot create the directory again: {}", dir, ec.message());
  const fs::path cache = fs::path(aside) / "data_cache";
  if (fs::is_directory(cache, ec)) fs::rename(cache, abs / "data_cache", ec);
  say(fmt::format("--overwrite: moved the old run in {} ({}) aside to {}{}", dir, join(held), aside,
                  fs::is_directory(abs / "data_cache", ec) ? " (its data_cache/ stays for the new run)" : ""));
  return "";
}
}  // namespace

void claim_run_dir(const Recipe& r, const std::string& resume, bool overwrite, dist::Communicator& world,
                   const std::function<void(const std::string&)>& say) {
  std::string msg;
  if (world.rank() == 0) msg = claim_on_rank0(r, resume, overwrite, say);
  if (world.size() > 1) {
    int64_t len = static_cast<int64_t>(msg.size());
    world.broadcast(&len, sizeof(len), 0);
    msg.resize(static_cast<size_t>(len));
    if (len > 0) world.broadcast(msg.data(), msg.size(), 0);
  }
  if (!msg.empty()) throw_error("{}", msg);
}

void move_newer_checkpoints_aside(const std::string& run_dir, const std::string& ckpt, int64_t step,
                                  const std::function<void(const std::string&)>& say) {
  for (auto& [s, dir] : list_checkpoints(run_dir)) {
    std::error_code ec;
    if (s <= step || fs::equivalent(dir, ckpt, ec)) continue;
    const std::string aside = dir + fmt::format(".abandoned-{}", static_cast<int64_t>(std::time(nullptr)));
    fs::rename(dir, aside, ec);
    if (ec) throw_error("{}: cannot move this newer checkpoint aside to {}: {}", dir, aside, ec.message());
    say(fmt::format("resume: moved newer checkpoint {} aside to {}", dir, aside));
  }
}

optim::LossScalerState resume_loss_scale(const CheckpointState& cs, const std::string& ckpt, double current_scale,
                                         bool dynamic, double min, const std::function<void(const std::string&)>& say) {
  optim::LossScalerState ls;
  ls.scale = cs.loss_scale_dynamic ? cs.loss_scale : current_scale;
  ls.good_steps = cs.loss_scale_dynamic ? cs.loss_scale_good_steps : 0;
  ls.skipped_steps = cs.skipped_steps;
  ls.consecutive_skipped = cs.consecutive_skipped_steps;
  if (!dynamic || !cs.loss_scale_dynamic || ls.scale >= min) return ls;
  // The scaler never goes below its minimum: a lower scale comes from an edit, or from a recipe
  // whose minimum was raised since the checkpoint.
  const nlohmann::json* saved = nullptr;
  const nlohmann::json& rec = cs.recipe;
  if (rec.contains("precision") && rec["precision"].is_object() && rec["precision"].contains("loss_scale") &&
      rec["precision"]["loss_scale"].is_object() && rec["precision"]["loss_scale"].contains("min"))
    saved = &rec["precision"]["loss_scale"]["min"];
  const std::string sp = (fs::path(ckpt) / "state.json").string();
  if (!saved || !saved->is_number() || saved->get<double>() > ls.scale)
    throw_error(
        "{}: field 'loss_scale' is {}, below the minimum loss scale {} of the recipe that wrote it "
        "(precision.loss_scale.min; the scaler never goes below it) (the checkpoint is damaged or was edited by "
        "hand; resume from another checkpoint, or start fresh)",
        sp, ls.scale, saved && saved->is_number() ? saved->get<double>() : min);
  say(
      fmt::format("resume: the checkpoint's loss scale {} is below precision.loss_scale.min {} (raised since the "
                  "checkpoint, which had {}): starting at {}",
                  ls.scale, min, saved->get<double>(), min));
  ls.scale = min;
  ls.good_steps = 0;
  return ls;
}

}  // namespace lathe
