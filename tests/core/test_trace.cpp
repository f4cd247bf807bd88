// The profiler's recorder (core/trace.h): spans nest per thread, the JSON parses and holds what was
// recorded, nothing is recorded while off, and an off span costs (almost) nothing (measured and
// printed; asserted loosely so that a loaded machine does not fail it).
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "core/trace.h"

namespace lathe::trace {
namespace {

nlohmann::json read(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return nlohmann::json::parse(ss.str());
}

void busy_us(int us) {
  const auto t0 = std::chrono::steady_clock::now();
  while (std::chrono::steady_clock::now() - t0 < std::chrono::microseconds(us)) {
  }
}

TEST(Trace, SpansNestPerThreadAndTheJsonHoldsThem) {
  const std::string path = (std::filesystem::temp_directory_path() / "lathe_test_trace.json").string();
  { Scope before("not recorded", Cat::Step); }
  start();
  set_thread_name("main");
  {
    Scope step("step", Cat::Step, 7);
    for (int l = 0; l < 3; ++l) {
      Scope fwd("layer forward", Cat::Compute, l);
      busy_us(200);
    }
    std::thread comm([] {
      set_thread_name("comm world");
      Scope ar("all_reduce", Cat::Comm, 4096);
      busy_us(300);
    });
    comm.join();
  }
  stop();
  { Scope after("not recorded either", Cat::Step); }
  const Summary s = write_chrome_json(path, 3, "rank 3", R"({"version":"test"})");
  EXPECT_EQ(s.spans, 5);
  EXPECT_EQ(s.threads, 2);
  const nlohmann::json j = read(path);
  EXPECT_EQ(j["displayTimeUnit"], "ms");
  EXPECT_EQ(j["otherData"]["version"], "test");
  std::map<int, std::vector<nlohmann::json>> by_tid;
  std::map<int, std::string> names;
  for (const auto& e : j["traceEvents"]) {
    EXPECT_EQ(e["pid"], 3);
    if (e["ph"] == "M" && e["name"] == "thread_name") names[e["tid"].get<int>()] = e["args"]["name"];
    if (e["ph"] == "X") by_tid[e["tid"].get<int>()].push_back(e);
  }
  ASSERT_EQ(by_tid.size(), 2u);
  for (auto& [tid, ev] : by_tid) {
    if (names[tid] == "main") {
      ASSERT_EQ(ev.size(), 4u);
      EXPECT_EQ(ev[0]["name"], "step");  // the enclosing span first
      EXPECT_EQ(ev[0]["args"]["index"], 7);
      const double b = ev[0]["ts"], e = b + ev[0]["dur"].get<double>();
      double prev_end = b;
      for (size_t i = 1; i < 4; ++i) {  // children inside the parent, one after another
        EXPECT_EQ(ev[i]["name"], "layer forward");
        EXPECT_EQ(ev[i]["args"]["index"], static_cast<int>(i - 1));
        EXPECT_GE(ev[i]["ts"].get<double>(), prev_end);
        prev_end = ev[i]["ts"].get<double>() + ev[i]["dur"].get<double>();
        EXPECT_LE(prev_end, e);
        EXPECT_GE(ev[i]["dur"].get<double>(), 200.0);
      }
    } else {
      EXPECT_EQ(names[tid], "comm world");
      ASSERT_EQ(ev.size(), 1u);
      EXPECT_EQ(ev[0]["cat"], "comm");
      EXPECT_EQ(ev[0]["args"]["bytes"], 4096);
    }
  }
  // A new recording starts empty.
  start();
  stop();
  EXPECT_EQ(write_chrome_json(path, 0, "rank 0").spans, 0);
  std::filesystem::remove(path);
}

TEST(Trace, AnOffSpanCostsAlmostNothing) {
  stop();
  constexpr int kN = 20'000'000;
  volatile int64_t sink = 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < kN; ++i) {
    Scope s("off", Cat::Kernel, i);
    sink = sink + 1;
  }
  const double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count() / kN;
  start();
  const auto t1 = std::chrono::steady_clock::now();
  for (int i = 0; i < 200'000; ++i) {
    Scope s("on", Cat::Kernel, i);
    sink = sink + 1;
  }
  const double on_ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t1).count() / 2e5;
  stop();
  std::printf("span cost: %.2f ns off, %.1f ns on (per span, including a volatile increment)\n", ns, on_ns);
  EXPECT_LT(ns, 20.0);  // measured ~1 ns here; generous for loaded CI machines
}

}  // namespace
}  // namespace lathe::trace
