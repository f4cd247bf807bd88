// A stop request (SIGINT / SIGTERM) that long work before the training loop polls: `lathe train`'s
// signal handler (train/run_control.cpp) stores the signal here, and blend planning (data/blend.h)
// checks it between chunks so that a signal during startup stops it promptly (issue 23 H3).
// `Interrupted` is the error such work throws: the CLI prints it and exits with its code (75, as a
// run stopped at a step boundary) instead of 1.
#pragma once
#include <atomic>

#include "core/error.h"

namespace lathe {

// The signal number of the first stop request of this process; 0 = none (constant-initialised, so
// a signal handler may store to it at any time).
inline std::atomic<int> g_stop_request{0};

// The exit code of a run stopped by a signal (train/trainer.h kExitInterrupted has the same value).
constexpr int kExitStopped = 75;

class Interrupted : public Error {
 public:
  Interrupted(const std::string& msg, int exit_code) : Error(msg), exit_code_(exit_code) {}
  int exit_code() const { return exit_code_; }

 private:
  int exit_code_;
};

}  // namespace lathe
