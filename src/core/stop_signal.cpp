#include "core/stop_signal.h"

#include <pthread.h>

#include <atomic>
#include <csignal>

#include "core/error.h"

namespace lathe {

namespace {
std::atomic<int> g_signal{0};
std::atomic<int> g_guards{0};
struct sigaction g_old_int {
}, g_old_term{};
sigset_t g_old_mask;

extern "C" void on_stop(int sig) {
  g_signal.store(sig);
  std::signal(sig, SIG_DFL);  // a second signal terminates as usual
}
}  // namespace

StopSignalGuard::StopSignalGuard() {
  if (g_guards.fetch_add(1) != 0) return;  // nested: the outer guard's handler stays
  g_signal.store(0);
  struct sigaction sa {};
  sa.sa_handler = on_stop;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, &g_old_int);
  sigaction(SIGTERM, &sa, &g_old_term);
  // A tool started with the two blocked (a mask inherited from its parent) would never see them;
  // unblocking delivers one that is already pending now, to the handler (tests rely on that to
  // stop a tool at its first safe point without timing).
  sigset_t both;
  sigemptyset(&both);
  sigaddset(&both, SIGINT);
  sigaddset(&both, SIGTERM);
  pthread_sigmask(SIG_UNBLOCK, &both, &g_old_mask);
}

StopSignalGuard::~StopSignalGuard() {
  if (g_guards.fetch_sub(1) != 1) return;
  pthread_sigmask(SIG_SETMASK, &g_old_mask, nullptr);
  sigaction(SIGINT, &g_old_int, nullptr);
  sigaction(SIGTERM, &g_old_term, nullptr);
  g_signal.store(0);
}

int stop_signal() { return g_signal.load(std::memory_order_relaxed); }

const char* signal_name(int sig) {
  if (sig == SIGINT) return "SIGINT";
  if (sig == SIGTERM) return "SIGTERM";
  return "a signal";
}

void throw_if_stopped(const char* what, const char* undone) {
  if (const int sig = stop_signal()) throw_error("{}: interrupted by {}; {}", what, signal_name(sig), undone);
}

}  // namespace lathe
