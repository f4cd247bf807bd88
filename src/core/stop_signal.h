// SIGINT/SIGTERM for the offline tools that write large outputs (lathe export, lathe checkpoint
// reshard): while a StopSignalGuard lives, the first signal only records itself (and restores the
// default action, so a second one ends the process at once, as in `lathe train`); the tool polls
// stop_signal() at safe points (between tensors, between files) and unwinds with an error, its
// RAII writers removing their temporaries (io::AtomicFileWriter). Without a guard stop_signal() is
// always 0. `lathe train` keeps its own handler (train/run_control.cpp): it saves a checkpoint instead.
#pragma once

namespace lathe {

class StopSignalGuard {
 public:
  StopSignalGuard();
  ~StopSignalGuard();
  StopSignalGuard(const StopSignalGuard&) = delete;
  StopSignalGuard& operator=(const StopSignalGuard&) = delete;
};

// The signal received under the innermost guard (SIGINT or SIGTERM), 0 when none.
int stop_signal();
// "SIGINT", "SIGTERM" or "signal N".
const char* signal_name(int sig);
// Throws "<what>: interrupted by SIGINT ...; <undone>" when a signal was received.
void throw_if_stopped(const char* what, const char* undone);

}  // namespace lathe
