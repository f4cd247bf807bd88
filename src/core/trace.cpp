#include "core/trace.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <vector>

#include "core/error.h"

namespace lathe::trace {

namespace detail {
std::atomic<bool> g_on{false};
}  // namespace detail

namespace {

struct Event {
  const char* name;
  int64_t begin, end, arg;
  Cat cat;
};

// One per thread that ever recorded a span or named itself; owned by the registry (threads may
// exit before the trace is written).
struct ThreadBuf {
  std::mutex mu;  // taken by its thread only while appending; by the writer while reading
  std::vector<Event> events;
  std::string name;
  int tid = 0;
};

struct Registry {
  std::mutex mu;
  std::vector<std::unique_ptr<ThreadBuf>> bufs;
  int64_t origin_ns = 0;
  uint64_t generation = 0;  // bumped by start(): a thread's buffer is cleared lazily
};
Registry& registry() {
  static Registry r;
  return r;
}

ThreadBuf& my_buf() {
  thread_local ThreadBuf* buf = nullptr;
  if (!buf) {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mu);
    r.bufs.push_back(std::make_unique<ThreadBuf>());
    buf = r.bufs.back().get();
    buf->tid = static_cast<int>(r.bufs.size());
    buf->events.reserve(4096);
  }
  return *buf;
}

}  // namespace

const char* cat_name(Cat c) {
  switch (c) {
    case Cat::Step: return "step";
    case Cat::Compute: return "compute";
    case Cat::Kernel: return "kernel";
    case Cat::Comm: return "comm";
    case Cat::Data: return "data";
    case Cat::Optimizer: return "optimizer";
    case Cat::Io: return "io";
    case Cat::Eval: return "eval";
  }
  return "other";
}

int64_t detail::now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void detail::record(const char* name, Cat cat, int64_t begin_ns, int64_t end_ns, int64_t arg) {
  const int64_t origin = registry().origin_ns;
  if (begin_ns < origin) return;  // began before this recording
  ThreadBuf& b = my_buf();
  std::lock_guard<std::mutex> lock(b.mu);
  b.events.push_back({name, begin_ns, end_ns, arg, cat});
}

void start() {
  Registry& r = registry();
  {
    std::lock_guard<std::mutex> lock(r.mu);
    for (auto& b : r.bufs) {
      std::lock_guard<std::mutex> l2(b->mu);
      b->events.clear();
    }
    r.origin_ns = detail::now_ns();
  }
  detail::g_on.store(true, std::memory_order_relaxed);
}

void stop() { detail::g_on.store(false, std::memory_order_relaxed); }

void set_thread_name(const std::string& name) {
  ThreadBuf& b = my_buf();
  std::lock_guard<std::mutex> lock(b.mu);
  b.name = name;
}

Summary write_chrome_json(const std::string& path, int pid, const std::string& process_name,
                          const std::string& other_data_json) {
  Registry& r = registry();
  Summary s;
  std::string out = "{\"displayTimeUnit\":\"ms\",\"otherData\":" + other_data_json + ",\"traceEvents\":[\n";
  auto quoted = [](const std::string& v) {  // a JSON string literal
    return nlohmann::json(v).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  };
  out += fmt::format(R"({{"name":"process_name","ph":"M","pid":{},"tid":0,"args":{{"name":{}}}}})", pid,
                     quoted(process_name));
  std::lock_guard<std::mutex> lock(r.mu);
  for (auto& b : r.bufs) {
    std::lock_guard<std::mutex> l2(b->mu);
    if (b->events.empty()) continue;
    ++s.threads;
    const std::string tname = b->name.empty() ? fmt::format("thread {}", b->tid) : b->name;
    out += fmt::format(",\n{{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":{},\"tid\":{},\"args\":{{\"name\":{}}}}}",
                       pid, b->tid, quoted(tname));
    out += fmt::format(
        ",\n{{\"name\":\"thread_sort_index\",\"ph\":\"M\",\"pid\":{},\"tid\":{},\"args\":{{\"sort_index\":{}}}}}", pid,
        b->tid, b->tid);
    // A span is recorded when it ends, so children come before their parent; viewers want the
    // enclosing span first when two start together: sort by begin, then longer first.
    std::vector<Event> ev = b->events;
    std::stable_sort(ev.begin(), ev.end(), [](const Event& x, const Event& y) {
      return x.begin != y.begin ? x.begin < y.begin : x.end > y.end;
    });
    for (const Event& e : ev) {
      out += fmt::format(",\n{{\"name\":{},\"cat\":\"{}\",\"ph\":\"X\",\"pid\":{},\"tid\":{},\"ts\":{:.3f},\"dur\":{:.3f}",
                         quoted(e.name), cat_name(e.cat), pid, b->tid, (e.begin - r.origin_ns) / 1e3,
                         (e.end - e.begin) / 1e3);
      if (e.arg >= 0) out += fmt::format(",\"args\":{{\"{}\":{}}}", e.cat == Cat::Comm ? "bytes" : "index", e.arg);
      out += "}";
      ++s.spans;
    }
  }
  out += "\n]}\n";
  const std::string tmp = path + ".tmp";
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  LATHE_CHECK(f != nullptr, "{}: cannot write the trace", tmp);
  const bool ok = std::fwrite(out.data(), 1, out.size(), f) == out.size();
  LATHE_CHECK(std::fclose(f) == 0 && ok, "{}: writing the trace failed", tmp);
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  LATHE_CHECK(!ec, "{}: cannot move the trace into place: {}", path, ec.message());
  return s;
}

}  // namespace lathe::trace
