#include "core/progress.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "core/timer.h"

namespace lathe::progress {

std::string format_duration(double s) {
  if (!(s >= 0) || s > 1e8) return "?";
  auto t = static_cast<uint64_t>(s + 0.5);
  if (t >= 3600) return fmt::format("{}:{:02d}:{:02d}", t / 3600, (t / 60) % 60, t % 60);
  return fmt::format("{}:{:02d}", t / 60, t % 60);
}

std::string format_count(double v) {
  if (!(v >= 0)) return "?";
  if (v >= 1e9) return fmt::format("{:.2f}G", v / 1e9);
  if (v >= 1e6) return fmt::format("{:.2f}M", v / 1e6);
  if (v >= 1e4) return fmt::format("{:.1f}K", v / 1e3);
  if (v >= 100 || v == std::floor(v)) return fmt::format("{}", static_cast<uint64_t>(v));
  return fmt::format("{:.2f}", v);  // slow rates ("0.25 items/s")
}

double eta_seconds(double done, double total, double elapsed) {
  if (!(done > 0) || !(total > 0) || !(elapsed >= 0)) return -1;
  if (done >= total) return 0;
  return elapsed * (total - done) / done;
}

std::string bar_cells(double frac, int width) {
  if (!(frac >= 0)) frac = 0;  // NaN too
  frac = std::min(frac, 1.0);
  const int filled = std::min(width, static_cast<int>(frac * width));
  std::string out;
  out.reserve(static_cast<size_t>(width) + 2);
  out.push_back('[');
  out.append(static_cast<size_t>(filled), '#');
  out.append(static_cast<size_t>(width - filled), '.');
  out.push_back(']');
  return out;
}

std::string format_line(const std::string& label, int64_t done, int64_t total, const std::string& unit,
                        double elapsed) {
  const double rate = elapsed > 0 ? static_cast<double>(done) / elapsed : 0;
  const std::string u = unit.empty() ? "" : " " + unit;
  if (total <= 0)
    return fmt::format("{} {}{}  {}{}/s  {}", label, done, u, format_count(rate), u, format_duration(elapsed));
  const double frac = static_cast<double>(done) / static_cast<double>(total);
  return fmt::format("{} {} {:5.1f}%  {}/{}{}  {}{}/s  ETA {}", label, bar_cells(frac), 100.0 * std::min(frac, 1.0),
                     done, total, u, format_count(rate), u,
                     format_duration(eta_seconds(static_cast<double>(done), static_cast<double>(total), elapsed)));
}

bool stderr_is_tty() {
  if (const char* e = std::getenv("LATHE_PROGRESS")) {
    if (std::strcmp(e, "tty") == 0) return true;
    if (std::strcmp(e, "plain") == 0) return false;
  }
  return ::isatty(2) != 0;
}

Line::Line(bool enabled, double plain_interval)
    : enabled_(enabled), tty_(stderr_is_tty()), interval_(tty_ ? 0.2 : plain_interval) {
  // Off a terminal the first time-based line comes after one interval (short runs print only the
  // 10% steps and the final line).
  if (!tty_) last_ = now_seconds();
}

bool Line::due(bool force, double frac) {
  if (!enabled_) return false;
  const double t = now_seconds();
  bool step = false;
  if (!tty_ && frac >= 0 && frac * 10 >= next_tenth_ - 1e-9) {
    step = true;
    while (next_tenth_ <= 10 && frac * 10 >= next_tenth_ - 1e-9) ++next_tenth_;
  }
  if (!force && !step && t - last_ < interval_) return false;
  last_ = t;
  return true;
}

void Line::show(const std::string& line) {
  if (!enabled_) return;
  if (tty_) {
    const std::string pad = line.size() < last_len_ ? std::string(last_len_ - line.size(), ' ') : std::string();
    std::fprintf(stderr, "\r%s%s", line.c_str(), pad.c_str());
    last_len_ = line.size();
    drawn_ = true;
  } else {
    std::fprintf(stderr, "%s\n", line.c_str());
  }
  std::fflush(stderr);
}

void Line::finish() {
  if (enabled_ && tty_ && drawn_) {
    std::fprintf(stderr, "\n");
    std::fflush(stderr);
  }
  drawn_ = false;
  last_len_ = 0;
}

Bar::Bar(std::string label, int64_t total, std::string unit, bool enabled, double plain_interval)
    : label_(std::move(label)),
      unit_(std::move(unit)),
      total_(total),
      t0_(now_seconds()),
      line_(enabled, plain_interval) {}

void Bar::update(int64_t done) {
  done_ = done;
  if (finished_) return;
  const double frac = total_ > 0 ? static_cast<double>(done_) / static_cast<double>(total_) : -1;
  // The final 100% line is finish()'s (so it is printed exactly once).
  if (total_ > 0 && done_ >= total_) return;
  if (line_.due(false, frac)) line_.show(format_line(label_, done_, total_, unit_, now_seconds() - t0_));
}

void Bar::finish() {
  if (finished_) return;
  finished_ = true;
  if (!line_.enabled()) return;
  line_.show(format_line(label_, done_, total_, unit_, now_seconds() - t0_));
  line_.finish();
}

}  // namespace lathe::progress
