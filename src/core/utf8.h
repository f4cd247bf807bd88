// UTF-8 helpers: validation, decoding and encoding of code points. Used by the tokenizers and by
// the recipe loader (config/), which is why they live in core/. They stay in namespace lathe::tok,
// where they were written, so that their callers read unchanged.
#pragma once
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

namespace lathe::tok {

// Length of the UTF-8 sequence starting at s[i] if it is a valid, complete, shortest-form
// sequence; 1 for an invalid byte (so a scanner never loses bytes: each bad byte is one unit).
inline size_t utf8_char_len(std::string_view s, size_t i) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  size_t n = s.size();
  unsigned char c = p[i];
  if (c < 0x80) return 1;
  auto cont = [&](size_t k) { return i + k < n && (p[i + k] & 0xC0) == 0x80; };
  if (c >= 0xC2 && c <= 0xDF) return cont(1) ? 2 : 1;
  if (c >= 0xE0 && c <= 0xEF) {
    if (!cont(1) || !cont(2)) return 1;
    if (c == 0xE0 && p[i + 1] < 0xA0) return 1;   // overlong
    if (c == 0xED && p[i + 1] >= 0xA0) return 1;  // surrogates
    return 3;
  }
  if (c >= 0xF0 && c <= 0xF4) {
    if (!cont(1) || !cont(2) || !cont(3)) return 1;
    if (c == 0xF0 && p[i + 1] < 0x90) return 1;
    if (c == 0xF4 && p[i + 1] >= 0x90) return 1;
    return 4;
  }
  return 1;
}

inline bool utf8_valid_at(std::string_view s, size_t i) {
  return static_cast<unsigned char>(s[i]) < 0x80 || utf8_char_len(s, i) > 1;
}

inline bool is_valid_utf8(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  for (size_t i = 0, n = s.size(); i < n;) {
    if (i + 8 <= n) {  // 8 ASCII bytes at a time
      uint64_t w;
      std::memcpy(&w, p + i, 8);
      if ((w & 0x8080808080808080ull) == 0) {
        i += 8;
        continue;
      }
    }
    if (!utf8_valid_at(s, i)) return false;
    i += utf8_char_len(s, i);
  }
  return true;
}

// Code point of the (valid) sequence at s[i] of length len.
inline uint32_t utf8_decode(std::string_view s, size_t i, size_t len) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data()) + i;
  switch (len) {
    case 1:
      return p[0];
    case 2:
      return ((p[0] & 0x1Fu) << 6) | (p[1] & 0x3Fu);
    case 3:
      return ((p[0] & 0x0Fu) << 12) | ((p[1] & 0x3Fu) << 6) | (p[2] & 0x3Fu);
    default:
      return ((p[0] & 0x07u) << 18) | ((p[1] & 0x3Fu) << 12) | ((p[2] & 0x3Fu) << 6) | (p[3] & 0x3Fu);
  }
}

inline void utf8_append(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

}  // namespace lathe::tok
