// UTF-8 helpers and the GPT-2 byte <-> unicode table shared by the tokenizer implementations.
#pragma once
#include <array>
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

// GPT-2 bytes_to_unicode: printable bytes map to themselves, the other 68 to U+0100 + n.
struct ByteUnicodeTable {
  std::array<uint32_t, 256> byte_to_cp{};
  std::array<int16_t, 256 + 68> cp_to_b{};
  ByteUnicodeTable() {
    int n = 0;
    cp_to_b.fill(-1);
    for (int b = 0; b < 256; ++b) {
      bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      byte_to_cp[b] = printable ? static_cast<uint32_t>(b) : static_cast<uint32_t>(256 + n++);
      cp_to_b[byte_to_cp[b]] = static_cast<int16_t>(b);
    }
  }
  // Byte of code point cp, or -1 when cp is not in the table.
  int cp_to_byte(uint32_t cp) const { return cp < cp_to_b.size() ? cp_to_b[cp] : -1; }
};

inline const ByteUnicodeTable& byte_unicode() {
  static const ByteUnicodeTable t;
  return t;
}

// Raw bytes of a byte-level token string ("Ġthe" -> " the"); false if some char is not in the
// table (such tokens cannot be produced by the ByteLevel pre-tokenizer). `out` then holds the
// decoder's fallback (the char's own UTF-8 bytes for unmapped chars).
inline bool bytelevel_to_bytes(std::string_view tok, std::string& out) {
  const auto& t = byte_unicode();
  bool all = true;
  for (size_t i = 0; i < tok.size();) {
    size_t len = utf8_char_len(tok, i);
    if (len == 1 && static_cast<unsigned char>(tok[i]) >= 0x80) {  // invalid byte: keep it
      out += tok[i];
      all = false;
      i += 1;
      continue;
    }
    uint32_t cp = utf8_decode(tok, i, len);
    int b = t.cp_to_byte(cp);
    if (b >= 0) {
      out += static_cast<char>(b);
    } else {
      out.append(tok.substr(i, len));
      all = false;
    }
    i += len;
  }
  return all;
}

inline std::string bytes_to_bytelevel(std::string_view bytes) {
  std::string out;
  for (unsigned char c : bytes) utf8_append(out, byte_unicode().byte_to_cp[c]);
  return out;
}

}  // namespace lathe::tok
