// Errors that reach the user. Every message names the file, key or value at fault and, where
// possible, says how to fix it. Never catch-and-continue: lathe does not fall back silently.
#pragma once
#include <fmt/format.h>

#include <stdexcept>
#include <string>

namespace lathe {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& msg) : std::runtime_error(msg) {}
};

// throw_error("data.path {}: file not found", path)
template <typename... Args>
[[noreturn]] inline void throw_error(fmt::format_string<Args...> f, Args&&... args) {
  throw Error(fmt::format(f, std::forward<Args>(args)...));
}

#define LATHE_CHECK(cond, ...)                      \
  do {                                              \
    if (!(cond)) ::lathe::throw_error(__VA_ARGS__); \
  } while (0)

}  // namespace lathe
