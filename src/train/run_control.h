// What steers a run from outside its recipe: SIGTERM/SIGINT (checkpoint at the next step boundary
// and stop), --stop-after N (as a preemption would), and the --profile-steps window. Every rank
// takes the same decision at the same step: a signal seen by any rank counts for all. Internal to
// src/train (opened by train/session.cpp).
#pragma once
#include <csignal>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/blas_env.h"
#include "dist/comm.h"
#include "train/run_log.h"
#include "train/trainer.h"

namespace lathe {

// For the duration of a run: the first SIGTERM/SIGINT sets core/stop.h's g_stop_request (checked at
// step boundaries and by long startup work) and restores the default action, so a second one
// terminates the process as usual. Off: nothing is installed.
class SignalGuard {
 public:
  explicit SignalGuard(bool on);
  ~SignalGuard();
  SignalGuard(const SignalGuard&) = delete;
  SignalGuard& operator=(const SignalGuard&) = delete;

 private:
  bool on_;
  struct sigaction old_term_ {
  }, old_int_{};
};

// Why the run stops after a step (neither: it goes on).
struct StopRequest {
  int signal = 0;           // SIGTERM or SIGINT, received by any rank
  bool stop_after = false;  // --stop-after reached
  explicit operator bool() const { return signal != 0 || stop_after; }
};

class RunControl {
 public:
  // `dp`: the data-parallel degree (the profile's metadata names it world_size).
  RunControl(const TrainOptions& opts, const Recipe& r, dist::Communicator& world, int dp, const RunLog& log);
  // Puts back the thread count of fix_threads (in-process callers such as the Python package run
  // more after a run).
  ~RunControl();

  // --profile-steps A-B: recording starts before step A (1-based) and stops after step B, which
  // writes OUTPUT/trace/rankRRRRR.json. `step` is 0-based.
  // Also, before each step: the thread count follows load that arrives or leaves mid-run (fp32 on
  // the CPU only; core/blas_env.h, LoadFollower), said once in the log.
  void before_step(int64_t step);
  void after_step(int64_t step);
  // From the session once the thread count is set: `threads` is the count to return to. Sets the
  // reduction parts (core/parallel.h) to `threads`, or LATHE_REDUCTION_PARTS, for the whole run,
  // so that a changed thread count changes no bit.
  void fix_threads(int threads);
  // After step `done` (1-based; `last`: the run's final step): a signal on any rank (collective
  // over the world, every step) or --stop-after. The final step never stops early: it ends the run.
  StopRequest stop_requested(int64_t done, bool last);
  // The line that says why the run stopped and how to continue it.
  void announce(const StopRequest& stop, int64_t done) const;

 private:
  const TrainOptions& opts_;
  const Recipe& r_;
  dist::Communicator& world_;
  const int dp_;
  const RunLog& log_;
  SignalGuard signals_;
  int threads_ = 0;                     // fix_threads' count (0: not called)
  std::unique_ptr<LoadFollower> load_;  // null: the thread count stays
  std::vector<int> test_thread_cycle_;  // LATHE_TEST_THREAD_CYCLE: the thread count of step k is [k % n]
};

}  // namespace lathe
