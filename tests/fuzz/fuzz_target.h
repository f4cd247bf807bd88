// Shared by the fuzz targets (tests/fuzz/fuzz_<name>.cpp). A target feeds the bytes to one parser
// and accepts exactly two outcomes: the parser returns, or it throws lathe::Error (a clear message
// for bad input). Anything else — another exception type escaping, a crash, a sanitizer report,
// a hang (libFuzzer's -timeout), unbounded memory (-rss_limit_mb) — is a finding.
#pragma once
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <string_view>

#include "core/error.h"

namespace lathe::fuzz {

// Runs fn(); lathe::Error is the expected rejection; any other exception aborts (a finding).
template <typename Fn>
void expect_clean(Fn&& fn) {
  try {
    fn();
  } catch (const lathe::Error&) {
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fuzz: escaped a non-lathe exception: %s\n", e.what());
    std::abort();
  }
}

// Writes the input to a private temporary file (for parsers that take a path); removed on exit.
class TempFile {
 public:
  TempFile(const uint8_t* data, size_t size, const char* suffix = "") {
    path_ = std::string("/tmp/lathe_fuzz_") + std::to_string(::getpid()) + suffix;
    FILE* f = std::fopen(path_.c_str(), "wb");
    if (!f) std::abort();
    if (size && std::fwrite(data, 1, size, f) != size) std::abort();
    std::fclose(f);
  }
  ~TempFile() { std::remove(path_.c_str()); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

inline std::string_view as_text(const uint8_t* data, size_t size) {
  return {reinterpret_cast<const char*>(data), size};
}

}  // namespace lathe::fuzz
