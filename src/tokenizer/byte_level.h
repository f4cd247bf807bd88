// The GPT-2 byte <-> unicode table (bytes_to_unicode) of byte-level vocabularies, shared by the
// BPE encoder and the tokenizer.json components.
#pragma once
#include <array>
#include <cstdint>
#include <string>
#include <string_view>

#include "core/utf8.h"

namespace lathe::tok {

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
