// PCRE2 (JIT, UTF + UCP, PCRE2_MATCH_INVALID_UTF) wrapper for the pre-tokenizer regexes.
// HF tokenizers uses Oniguruma; the patterns in real tokenizer.json files (GPT-2, Llama-3,
// Qwen2: \p{L}, \p{N}, (?i:...), (?!\S), {1,3}) have the same meaning in PCRE2 with UCP.
// Invalid UTF-8 never matches anything (MATCH_INVALID_UTF), so those bytes end up in the gaps
// between matches, which callers keep: no byte is ever lost.
#pragma once
#include <cstddef>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace lathe::tok {

class Regex {
 public:
  explicit Regex(const std::string& pattern);
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;
  // Non-overlapping matches [start, end) in order, leftmost first; empty matches are skipped.
  void find_all(std::string_view text, std::vector<std::pair<size_t, size_t>>& out) const;
  // The same scan over the whole of `text` (lookarounds see all of it), but starting at `start`
  // (which must be 0 or a value this function returned) and stopping after the first match that
  // ends at or beyond `stop_after`. Returns that match's end (a point where the whole-text scan
  // restarts), or text.size() when no such match exists. Appends matches as absolute offsets.
  size_t find_window(std::string_view text, size_t start, size_t stop_after,
                     std::vector<std::pair<size_t, size_t>>& out) const;
  const std::string& pattern() const { return pattern_; }

 private:
  std::string pattern_;
  void* code_ = nullptr;  // pcre2_code_8*
};

}  // namespace lathe::tok
