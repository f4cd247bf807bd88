// src/core/progress: the formatter and ETA arithmetic against hand-computed values, and the two
// display modes (LATHE_PROGRESS=plain|tty stands in for isatty) on captured stderr.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <string>

#include "core/progress.h"

using namespace lathe::progress;

TEST(Progress, Duration) {
  EXPECT_EQ(format_duration(0), "0:00");
  EXPECT_EQ(format_duration(59.4), "0:59");
  EXPECT_EQ(format_duration(59.6), "1:00");
  EXPECT_EQ(format_duration(245), "4:05");
  EXPECT_EQ(format_duration(3723), "1:02:03");
  EXPECT_EQ(format_duration(-1), "?");
  EXPECT_EQ(format_duration(0.0 / 0.0), "?");
  EXPECT_EQ(format_duration(1e9), "?");
}

TEST(Progress, Count) {
  EXPECT_EQ(format_count(987), "987");
  EXPECT_EQ(format_count(12345), "12.3K");
  EXPECT_EQ(format_count(4.56e6), "4.56M");
  EXPECT_EQ(format_count(7.891e9), "7.89G");
  EXPECT_EQ(format_count(0.25), "0.25");
  EXPECT_EQ(format_count(-3), "?");
}

TEST(Progress, Eta) {
  // 25 of 100 in 10 s: 75 left at 2.5/s = 30 s.
  EXPECT_DOUBLE_EQ(eta_seconds(25, 100, 10), 30);
  EXPECT_DOUBLE_EQ(eta_seconds(100, 100, 10), 0);
  EXPECT_DOUBLE_EQ(eta_seconds(150, 100, 10), 0);
  EXPECT_LT(eta_seconds(0, 100, 10), 0);  // nothing done: unknown
  EXPECT_LT(eta_seconds(5, 0, 10), 0);    // no total: unknown
  EXPECT_EQ(format_duration(eta_seconds(0, 100, 10)), "?");
  // The trainer's form: remaining steps x mean step time (steps 10 of 1000 in 5 s -> 990 x 0.5 s).
  EXPECT_DOUBLE_EQ(eta_seconds(10, 1000, 5), 495);
}

TEST(Progress, BarAndLine) {
  EXPECT_EQ(bar_cells(0, 10), "[..........]");
  EXPECT_EQ(bar_cells(0.45, 10), "[####......]");
  EXPECT_EQ(bar_cells(1, 10), "[##########]");
  EXPECT_EQ(bar_cells(7, 10), "[##########]");  // clamped
  EXPECT_EQ(bar_cells(-1, 4), "[....]");
  EXPECT_EQ(format_line("eval", 4, 10, "items", 2.0),
            "eval [########............]  40.0%  4/10 items  2 items/s  ETA 0:03");
  EXPECT_EQ(format_line("write", 30, 0, "tensors", 10.0), "write 30 tensors  3 tensors/s  0:10");
}

namespace {
std::string run_bar(const char* mode, int64_t total) {
  setenv("LATHE_PROGRESS", mode, 1);
  testing::internal::CaptureStderr();
  {
    // plain_interval 1e9: off a tty only the 10% steps and the final line print.
    Bar b("job", total, "items", true, 1e9);
    for (int64_t i = 0; i < total; ++i) b.add(1);
    b.finish();
  }
  unsetenv("LATHE_PROGRESS");
  return testing::internal::GetCapturedStderr();
}
}  // namespace

TEST(Progress, PlainLinesEveryTenPercent) {
  const std::string out = run_bar("plain", 20);
  EXPECT_EQ(std::count(out.begin(), out.end(), '\n'), 10) << out;  // 10%, 20%, ..., 90% and the final 100%
  EXPECT_EQ(out.find('\r'), std::string::npos) << out;
  EXPECT_NE(out.find(" 50.0%  10/20 items"), std::string::npos) << out;
  EXPECT_NE(out.find("100.0%  20/20 items"), std::string::npos) << out;
  // Fewer items than steps: one line per item, no repeats.
  const std::string few = run_bar("plain", 3);
  EXPECT_EQ(std::count(few.begin(), few.end(), '\n'), 3) << few;
}

TEST(Progress, TerminalRedrawsInPlace) {
  const std::string out = run_bar("tty", 20);
  EXPECT_NE(out.find("\rjob [####################] 100.0%  20/20 items"), std::string::npos) << out;
  EXPECT_EQ(std::count(out.begin(), out.end(), '\n'), 1) << out;  // one newline, at the end
  EXPECT_EQ(out.back(), '\n');
}

TEST(Progress, Disabled) {
  setenv("LATHE_PROGRESS", "plain", 1);
  testing::internal::CaptureStderr();
  {
    Bar b("job", 5, "items", false);
    for (int i = 0; i < 5; ++i) b.add();
  }
  unsetenv("LATHE_PROGRESS");
  EXPECT_EQ(testing::internal::GetCapturedStderr(), "");
}
