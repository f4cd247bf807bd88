#include "train/checkpoint_dir.h"

#include <fmt/format.h>

#include <algorithm>
#include <ctime>
#include <thread>
#include <vector>

#include "core/error.h"
#include "io/fs.h"
#include "io/json.h"
#include "train/checkpoint.h"

namespace lathe {

namespace fs = std::filesystem;

namespace {

// Removes old checkpoints on a background thread; joined by the next save, by
// wait_for_checkpoint_cleanup() and at exit.
class Cleaner {
 public:
  ~Cleaner() { join(); }
  void start(std::vector<fs::path> dirs) {
    join();
    thread_ = std::thread([dirs = std::move(dirs)] {
      for (const auto& d : dirs) {
        std::error_code ec;  // a leftover *.tmp is removed by the next save anyway
        fs::remove_all(d, ec);
      }
    });
  }
  void join() {
    if (thread_.joinable()) thread_.join();
  }

 private:
  std::thread thread_;
};
Cleaner& cleaner() {
  static Cleaner c;
  return c;
}

// What checkpoints/latest says, checked: "" when it is absent or names the step_XXXXXXXX directory
// `newest`; otherwise a note saying why it is ignored. It is never followed as a path: the scan of
// step_XXXXXXXX directories decides (see find_latest_checkpoint).
std::string latest_note(const fs::path& root, const std::string& newest) {
  const fs::path p = root / "latest";
  if (!io::entry_present(p.string())) return "";
  std::string text;
  try {
    text = io::read_file(p.string());
  } catch (const Error& e) {
    return fmt::format("ignored {}: {}", p.string(), e.what());
  }
  std::string name = text.size() > 64 ? text.substr(0, 64) : text;
  while (!name.empty() && (name.back() == '\n' || name.back() == '\r' || name.back() == ' ')) name.pop_back();
  const std::string shown = io::json_excerpt(nlohmann::json(name), 70);  // quoted, bounded, bytes escaped
  if (ckpt_dir::parse_step_name(name) < 0)
    return fmt::format(
        "ignored {}: it holds {}, not the name of a step_XXXXXXXX directory inside checkpoints/ (lathe "
        "never follows it as a path; the newest complete checkpoint is found by scanning)",
        p.string(), shown);
  if (name != fs::path(newest).filename().string())
    return fmt::format(
        "ignored {}: it names {} but the newest complete checkpoint is {} (a save or a cleanup was "
        "interrupted; the scan decides)",
        p.string(), shown, newest.empty() ? std::string("(none)") : fs::path(newest).filename().string());
  return "";
}

}  // namespace

namespace ckpt_dir {

std::string step_name(int64_t step) { return fmt::format("step_{:08d}", step); }

int64_t parse_step_name(const std::string& s) {
  if (s.size() != 13 || s.rfind("step_", 0) != 0) return -1;
  int64_t v = 0;
  for (size_t i = 5; i < s.size(); ++i) {
    if (s[i] < '0' || s[i] > '9') return -1;
    v = v * 10 + (s[i] - '0');
  }
  return v;
}

bool is_tmp_name(const std::string& n) { return n.size() > 4 && n.compare(n.size() - 4, 4, ".tmp") == 0; }

void prepare_root(const fs::path& root) {
  fs::create_directories(root);
  wait_for_checkpoint_cleanup();
  for (const auto& e : fs::directory_iterator(root))
    if (is_tmp_name(e.path().filename().string())) fs::remove_all(e.path());
}

std::string move_aside(const fs::path& root, const std::string& name) {
  const fs::path dir = root / name;
  if (!fs::exists(fs::symlink_status(dir))) return "";
  fs::path aside = root / (name + fmt::format(".abandoned-{}", static_cast<int64_t>(std::time(nullptr))));
  for (int n = 2; fs::exists(fs::symlink_status(aside)); ++n)
    aside = root / (name + fmt::format(".abandoned-{}-{}", static_cast<int64_t>(std::time(nullptr)), n));
  fs::rename(dir, aside);
  return aside.string();
}

void prune(const std::string& run_dir, int64_t step, int keep_last, bool protect_healthy) {
  if (keep_last <= 0) return;
  // Only checkpoints up to this one count; the newest keep_last of them survive.
  std::vector<std::string> older;
  for (auto& [s, dir] : list_checkpoints(run_dir))
    if (s < step) older.push_back(dir);
  const size_t keep_older = static_cast<size_t>(keep_last - 1);
  // Anomaly rollback needs a healthy checkpoint: the newest one recorded healthy is kept beyond
  // keep_last while the new one is not healthy (it is the rollback target).
  std::string healthy;
  if (protect_healthy)
    for (auto it = older.rbegin(); it != older.rend() && healthy.empty(); ++it) try {
        const CheckpointState c = read_checkpoint_state(*it);
        if (c.has_health && c.health.healthy) healthy = *it;
      } catch (const Error&) {  // not a rollback target either
      }
  std::vector<fs::path> doomed;
  for (size_t i = 0; i + keep_older < older.size(); ++i) {
    if (older[i] == healthy) continue;
    // Renamed first (atomic), so a crash mid-delete leaves a *.tmp leftover, never a step_X that
    // looks like a damaged checkpoint. Freeing GBs of extents takes a while: a background
    // thread does it while training continues.
    doomed.push_back(older[i] + ".deleting.tmp");
    fs::rename(older[i], doomed.back());
  }
  if (!doomed.empty()) cleaner().start(std::move(doomed));
}

}  // namespace ckpt_dir

void wait_for_checkpoint_cleanup() { cleaner().join(); }

std::vector<std::pair<int64_t, std::string>> list_checkpoints(const std::string& run_dir) {
  std::vector<std::pair<int64_t, std::string>> out;
  const fs::path root = fs::path(run_dir) / "checkpoints";
  std::error_code ec;
  const bool is_dir = fs::is_directory(root, ec);
  if (ec && ec != std::errc::no_such_file_or_directory)
    throw_error("{}: cannot read the checkpoint directory: {} (fix or remove it; output.dir is {})", root.string(),
                ec.message(), run_dir);
  if (!is_dir) {
    LATHE_CHECK(!io::entry_present(root.string()),
                "{}: is not a directory (output.dir {} holds a file named checkpoints)", root.string(), run_dir);
    return out;
  }
  fs::directory_iterator dit(root, ec);
  if (ec) throw_error("{}: cannot list the checkpoint directory: {}", root.string(), ec.message());
  for (const auto& e : dit) {
    const int64_t s = ckpt_dir::parse_step_name(e.path().filename().string());
    std::error_code ec2;  // an entry that cannot be stat'ed (a symlink loop) is not a checkpoint
    if (s >= 0 && e.is_directory(ec2)) out.push_back({s, e.path().string()});
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::string find_latest_checkpoint(const std::string& run_dir, std::string* log) {
  auto note = [&](const std::string& s) {
    if (log) *log += s + "\n";
  };
  const fs::path root = fs::path(run_dir) / "checkpoints";
  auto all = list_checkpoints(run_dir);  // an unreadable checkpoints/ is an error, not "none"
  std::error_code ec;
  if (fs::is_directory(root, ec))
    for (const auto& e : fs::directory_iterator(root, ec))
      if (ckpt_dir::is_tmp_name(e.path().filename().string()))
        note(fmt::format("ignoring {}: incomplete (a save was interrupted)", e.path().string()));
  std::string found, refused;
  for (auto it = all.rbegin(); it != all.rend() && found.empty(); ++it) {
    try {
      verify_checkpoint(it->second);
      found = it->second;
    } catch (const Error& e) {
      note(fmt::format("skipping checkpoint {}: {}", it->second, e.what()));
      refused += fmt::format("\n  {}: {}", it->second, e.what());
    }
  }
  // Checkpoints exist but none can be resumed: neither a fresh start over them nor a guess.
  if (found.empty() && !all.empty())
    throw_error(
        "{}: none of the {} checkpoint{} can be resumed:{}\nRepair or restore one and resume it with --resume "
        "DIR, or move them aside yourself; a new run in this output.dir needs --overwrite (which moves the old "
        "run aside)",
        root.string(), all.size(), all.size() == 1 ? "" : "s", refused);
  const std::string ln = latest_note(root, found);
  if (!ln.empty()) note(ln);
  return found;
}

}  // namespace lathe
