// CLI11 validators with readable bounds for lathe's commands. CLI11's own Range prints its bounds
// with "%f" (a double bound of DBL_MAX becomes 300 digits) and lets NaN through (every comparison
// with NaN is false). These refuse NaN and infinities, say which end is open, and print integers
// as integers: "must be in (0, 1], got nan". A refused value is a usage error (exit 2).
#pragma once
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <string>

namespace lathe::cli {

// A real number in [lo, hi] (or (lo, hi] with lo_open; hi = +inf means no upper bound; the value
// itself must always be finite).
inline CLI::Validator real_range(double lo, double hi, bool lo_open = false) {
  const std::string desc = std::isinf(hi) ? fmt::format("{} {}", lo_open ? ">" : ">=", lo)
                                          : fmt::format("in {}{}, {}]", lo_open ? "(" : "[", lo, hi);
  return CLI::Validator(
      [=](std::string& s) -> std::string {
        char* end = nullptr;
        errno = 0;
        const double v = std::strtod(s.c_str(), &end);
        if (s.empty() || end != s.c_str() + s.size()) return fmt::format("'{}' is not a number", s);
        if (!std::isfinite(v) || errno == ERANGE) return fmt::format("must be a finite number {}, got {}", desc, s);
        if (v < lo || (lo_open && v == lo) || v > hi) return fmt::format("must be {}, got {}", desc, s);
        return "";
      },
      desc);
}

// An integer in [lo, hi] (hi = INT64_MAX: no upper bound is printed).
inline CLI::Validator int_range(int64_t lo, int64_t hi = std::numeric_limits<int64_t>::max()) {
  const std::string desc =
      hi == std::numeric_limits<int64_t>::max() ? fmt::format(">= {}", lo) : fmt::format("in [{}, {}]", lo, hi);
  return CLI::Validator(
      [=](std::string& s) -> std::string {
        char* end = nullptr;
        errno = 0;
        const long long v = std::strtoll(s.c_str(), &end, 10);
        if (s.empty() || end != s.c_str() + s.size() || errno == ERANGE)
          return fmt::format("must be an integer {}, got '{}'", desc, s);
        if (v < lo || v > hi) return fmt::format("must be an integer {}, got {}", desc, s);
        return "";
      },
      desc);
}

}  // namespace lathe::cli
