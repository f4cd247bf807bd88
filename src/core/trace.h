// The profiler's recorder: named spans (begin/end times in ns) collected per thread while tracing
// is on, written as Chrome trace-event JSON (shared/reference/chrome-trace.md: one "X" event per
// span, one pid per rank, one tid per thread, thread names as "M" events) for Perfetto or
// chrome://tracing.
//
//   { trace::Scope s("forward", trace::Cat::Compute, layer); ... }     // a span, arg shown in args
//
// When tracing is off a Scope costs one relaxed atomic load and a branch (tests/core/test_trace.cpp
// measures it). Names are string literals (pointers are stored, not copied); a per-span integer
// (layer, bytes) goes in `arg`. Spans on one thread nest by construction (scopes are RAII), so the
// timeline is valid per track; a thread's buffer grows as needed and is kept until the next start().
#pragma once
#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>

namespace lathe::trace {

enum class Cat : uint8_t { Step, Compute, Kernel, Comm, Data, Optimizer, Io, Eval };
const char* cat_name(Cat c);  // "step", "compute", ...

namespace detail {
extern std::atomic<bool> g_on;
int64_t now_ns();
void record(const char* name, Cat cat, int64_t begin_ns, int64_t end_ns, int64_t arg);
}  // namespace detail

inline bool enabled() { return detail::g_on.load(std::memory_order_relaxed); }

// Starts recording (drops the spans of an earlier recording); spans that began before start() and
// end after it are dropped too (their begin is unknown to this recording).
void start();
void stop();
// The calling thread's track name ("main", "comm world", "prefetch"); shown in the viewer.
void set_thread_name(const std::string& name);

class Scope {
 public:
  explicit Scope(const char* name, Cat cat, int64_t arg = -1) : name_(name), arg_(arg), cat_(cat) {
    if (enabled()) begin_ = detail::now_ns();
  }
  ~Scope() {
    if (begin_ >= 0 && enabled()) detail::record(name_, cat_, begin_, detail::now_ns(), arg_);
  }
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;

 private:
  const char* name_;
  int64_t arg_;
  int64_t begin_ = -1;
  Cat cat_;
};

struct Summary {
  int64_t spans = 0, threads = 0;
};
// Writes every span recorded since start() as {"traceEvents": [...], "displayTimeUnit": "ms",
// "otherData": {...}} to `path` (atomically: tmp + rename). pid = rank; ts in µs relative to
// start(). `process_name` labels the pid ("rank 0"). Call after stop() (or while recording: spans
// still open are not included).
Summary write_chrome_json(const std::string& path, int pid, const std::string& process_name,
                          const std::string& other_data_json = "{}");

}  // namespace lathe::trace
