#include "train/run_control.h"

#include <fmt/format.h>

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/parallel.h"
#include "core/stop.h"
#include "core/trace.h"

namespace lathe {

namespace fs = std::filesystem;

namespace {

std::atomic<int>& g_stop_signal = g_stop_request;  // core/stop.h: polled by blend planning too
extern "C" void on_stop_signal(int sig) {
  g_stop_signal.store(sig);
  std::signal(sig, SIG_DFL);
}

}  // namespace

SignalGuard::SignalGuard(bool on) : on_(on) {
  if (!on_) return;
  g_stop_signal.store(0);
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGTERM, &sa, &old_term_);
  sigaction(SIGINT, &sa, &old_int_);
}

SignalGuard::~SignalGuard() {
  if (!on_) return;
  sigaction(SIGTERM, &old_term_, nullptr);
  sigaction(SIGINT, &old_int_, nullptr);
}

RunControl::RunControl(const TrainOptions& opts, const Recipe& r, dist::Communicator& world, int dp, const RunLog& log)
    : opts_(opts), r_(r), world_(world), dp_(dp), log_(log), signals_(opts.handle_signals) {}

RunControl::~RunControl() {
  if (threads_ <= 0) return;
  omp_set_num_threads(threads_);  // the reduction parts stay: rank threads of one process may still run
}

namespace {

// The comma-separated counts (each 1..4096) of environment variable `name`; empty when unset.
std::vector<int> env_counts(const char* name, const char* expected) {
  std::vector<int> counts;
  const char* v = std::getenv(name);
  for (const char* p = v; p != nullptr && *p != '\0';) {
    char* end = nullptr;
    const long n = std::strtol(p, &end, 10);
    LATHE_CHECK(end != p && n >= 1 && n <= 4096 && (*end == ',' || *end == '\0'), "{}={}: expected {}", name, v,
                expected);
    counts.push_back(static_cast<int>(n));
    p = *end == ',' ? end + 1 : end;
  }
  return counts;
}

}  // namespace

void RunControl::fix_threads(int threads) {
  threads_ = threads;
  const std::vector<int> parts = env_counts(
      "LATHE_REDUCTION_PARTS",
      "one whole number from 1 to 4096 (the partial sums of the deterministic reductions; unset: the thread count "
      "at start)");
  LATHE_CHECK(parts.size() <= 1, "LATHE_REDUCTION_PARTS={}: expected one number", std::getenv("LATHE_REDUCTION_PARTS"));
  set_reduction_parts(parts.empty() ? threads : parts[0]);
  test_thread_cycle_ = env_counts("LATHE_TEST_THREAD_CYCLE", "thread counts like 2,1,3");
  // fp32 CPU kernels give the same bits on any thread count once the parts are fixed; oneDNN's
  // 16-bit GEMMs and the device backends do not promise it, so their runs keep their count. A test
  // cycle decides the count itself.
  if (r_.device == "cpu" && r_.precision.compute == "fp32" && test_thread_cycle_.empty())
    load_ = std::make_unique<LoadFollower>(threads);
}

void RunControl::before_step(int64_t step) {
  if (!test_thread_cycle_.empty())
    omp_set_num_threads(test_thread_cycle_[static_cast<size_t>(step) % test_thread_cycle_.size()]);
  else if (load_)
    if (std::string note = load_->poll(); !note.empty()) {
      while (!note.empty() && note.back() == '\n') note.pop_back();
      log_.say(note);
    }
  if (opts_.profile_first > 0 && step + 1 == opts_.profile_first) {
    trace::start();
    trace::set_thread_name("main");
  }
}

void RunControl::after_step(int64_t step) {
  if (opts_.profile_first <= 0 || step + 1 != std::min(opts_.profile_last, r_.training.steps)) return;
  trace::stop();
  const fs::path dir = fs::path(r_.output.dir) / "trace";
  fs::create_directories(dir);
  const int rank = world_.rank();
  const std::string path = (dir / fmt::format("rank{:05d}.json", rank)).string();
  const auto sum =
      trace::write_chrome_json(path, rank, fmt::format("rank {}", rank),
                               nlohmann::json({{"lathe_version", LATHE_VERSION},
                                               {"steps", fmt::format("{}-{}", opts_.profile_first, step + 1)},
                                               {"world_size", dp_}})
                                   .dump());
  log_.say(
      fmt::format("profile: wrote {} ({} spans on {} threads, steps {}-{}; open in ui.perfetto.dev or "
                  "chrome://tracing)",
                  path, sum.spans, sum.threads, opts_.profile_first, step + 1));
}

StopRequest RunControl::stop_requested(int64_t done, bool last) {
  int64_t sig = opts_.handle_signals ? g_stop_signal.load() : 0;
  if (world_.size() > 1) world_.all_reduce(&sig, 1, DType::I64, dist::ReduceOp::Max);
  StopRequest stop;
  if (last) return stop;
  stop.signal = static_cast<int>(sig);
  stop.stop_after = opts_.stop_after_steps > 0 && done >= opts_.stop_after_steps;
  return stop;
}

void RunControl::announce(const StopRequest& stop, int64_t done) const {
  if (stop.signal)
    log_.say(
        fmt::format("received {}: saved a checkpoint at step {} and stopped; continue with --resume auto "
                    "(exit code {})",
                    stop.signal == SIGTERM ? "SIGTERM" : "SIGINT", done, kExitInterrupted));
  else if (stop.stop_after)
    log_.say(fmt::format("stopped after step {} as requested (--stop-after); continue with --resume auto", done));
}

}  // namespace lathe
