#include "train/run_control.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <nlohmann/json.hpp>

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

void RunControl::before_step(int64_t step) {
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
