// Fuzz target: the JSONL line path of lathe tokenize. fast_extract_json_string (the DOM-free
// scanner) must agree with nlohmann whenever it answers (a differential check: a disagreement
// aborts), and extract_json_text (scanner + depth check + nlohmann fallback) must return or skip
// cleanly. The whole input is also split with for_each_line as a chunk of a JSONL file.
#include <cstdint>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <string>

#include "fuzz_target.h"
#include "io/json.h"
#include "tokenizer/corpus.h"
#include "tokenizer/json_scan.h"

namespace {

void one_line(std::string_view line) {
  std::string fast;
  if (lathe::tok::fast_extract_json_string(line, "text", fast)) {
    // The scanner only answers within its depth limit; nlohmann parses iteratively.
    if (lathe::io::json_nesting_depth(line, lathe::tok::kMaxJsonLineDepth) > lathe::tok::kMaxJsonLineDepth)
      std::abort();
    auto j = nlohmann::json::parse(line.begin(), line.end(), nullptr, false);
    if (j.is_discarded() || !j.is_object() || !j.contains("text") || !j["text"].is_string() ||
        j["text"].get<std::string>() != fast) {
      std::fprintf(stderr, "fuzz_jsonl_line: the scanner and nlohmann disagree\n");
      std::abort();
    }
  }
  std::string out, detail;
  lathe::tok::SkipReason why;
  lathe::fuzz::expect_clean([&] { lathe::tok::extract_json_text(line, "text", out, why, detail); });
  if (detail.size() > 1000) std::abort();  // skip messages stay bounded
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text = lathe::fuzz::as_text(data, size);
  one_line(text);
  lathe::tok::InputChunk c;
  c.data.assign(text);
  c.lines = true;
  c.is_json = true;
  c.first_line = 1;
  int lines = 0;
  lathe::tok::for_each_line(c, [&](std::string_view line, uint64_t) {
    if (++lines <= 64 && line.size() != text.size()) one_line(line);
  });
  return 0;
}
