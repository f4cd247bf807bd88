#define PCRE2_CODE_UNIT_WIDTH 8
#include "tokenizer/regex.h"

#include <pcre2.h>

#include "core/error.h"
#include "core/utf8.h"

namespace lathe::tok {

namespace {

// Per-thread match data and JIT stack: pcre2_match_data is not shareable between threads.
struct ThreadMatchState {
  pcre2_match_data* md = nullptr;
  pcre2_jit_stack* stack = nullptr;
  pcre2_match_context* mctx = nullptr;
  ThreadMatchState() {
    md = pcre2_match_data_create(4, nullptr);
    stack = pcre2_jit_stack_create(32 * 1024, 4 * 1024 * 1024, nullptr);
    mctx = pcre2_match_context_create(nullptr);
    pcre2_jit_stack_assign(mctx, nullptr, stack);
  }
  ~ThreadMatchState() {
    pcre2_match_context_free(mctx);
    pcre2_jit_stack_free(stack);
    pcre2_match_data_free(md);
  }
};

ThreadMatchState& thread_state() {
  thread_local ThreadMatchState s;
  return s;
}

}  // namespace

Regex::Regex(const std::string& pattern) : pattern_(pattern) {
  int err = 0;
  PCRE2_SIZE off = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                   PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF, &err, &off, nullptr);
  if (!code) {
    PCRE2_UCHAR buf[256];
    pcre2_get_error_message(err, buf, sizeof(buf));
    throw_error("tokenizer regex '{}': does not compile at offset {}: {}", pattern, off,
                reinterpret_cast<const char*>(buf));
  }
  int jrc = pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);
  if (jrc != 0) {
    pcre2_code_free(code);
    throw_error("tokenizer regex '{}': PCRE2 JIT compilation failed (error {})", pattern, jrc);
  }
  code_ = code;
}

Regex::~Regex() { pcre2_code_free(static_cast<pcre2_code*>(code_)); }

void Regex::find_all(std::string_view text, std::vector<std::pair<size_t, size_t>>& out) const {
  find_window(text, 0, text.size() + 1, out);
}

size_t Regex::find_window(std::string_view text, size_t start, size_t stop_after,
                          std::vector<std::pair<size_t, size_t>>& out) const {
  auto& st = thread_state();
  auto* code = static_cast<pcre2_code*>(code_);
  auto subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  size_t n = text.size();
  size_t pos = start;
  while (pos <= n) {
    int rc = pcre2_jit_match(code, subject, n, pos, 0, st.md, st.mctx);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    LATHE_CHECK(rc >= 0, "tokenizer regex '{}': PCRE2 match error {} at byte {}", pattern_, rc, pos);
    // rc == 0: more capture groups than the ovector holds; the whole-match pair is still set.
    PCRE2_SIZE* ov = pcre2_get_ovector_pointer(st.md);
    size_t s = ov[0], e = ov[1];
    if (e > s) {
      out.emplace_back(s, e);
      if (e >= stop_after) return e;
      pos = e;
    } else {
      // Empty match: advance one character (or one invalid byte).
      if (e >= n) break;
      pos = e + utf8_char_len(text, e);
    }
  }
  return n;
}

}  // namespace lathe::tok
