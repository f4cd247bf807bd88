#include "tokenizer/json_scan.h"

#include <cstdint>
#include <cstring>

#include "core/utf8.h"

namespace lathe::tok {

namespace {

constexpr int kMaxDepth = 512;
constexpr size_t kMaxNumberChars = 300;

inline bool is_ws(unsigned char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

inline int hex_value(unsigned char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// 8 bytes at once: true when any byte is '"', '\\', a control character (<
// 0x20) or non-ASCII.
inline bool needs_attention(uint64_t v) {
  constexpr uint64_t ones = 0x0101010101010101ull, highs = 0x8080808080808080ull;
  auto has_zero = [&](uint64_t x) { return ((x - ones) & ~x & highs) != 0; };
  const bool below_space = ((v - ones * 0x20) & ~v & highs) != 0;
  return below_space || has_zero(v ^ (ones * '"')) || has_zero(v ^ (ones * '\\')) || (v & highs) != 0;
}

struct Scanner {
  const unsigned char* p;
  const unsigned char* end;

  void skip_ws() {
    while (p < end && is_ws(*p)) ++p;
  }

  // Four hex digits after "\u" (p at the first digit); -1 if malformed.
  int32_t read_hex4() {
    if (end - p < 4) return -1;
    int32_t v = 0;
    for (int i = 0; i < 4; ++i) {
      int h = hex_value(p[i]);
      if (h < 0) return -1;
      v = v << 4 | h;
    }
    p += 4;
    return v;
  }

  // One UTF-8 sequence at p (first byte >= 0x80): valid, complete and shortest-form, as nlohmann
  // checks (RFC 3629).
  bool skip_utf8() {
    const size_t len =
        utf8_char_len(std::string_view(reinterpret_cast<const char*>(p), static_cast<size_t>(end - p)), 0);
    if (len == 1) return false;  // an invalid byte
    p += len;
    return true;
  }

  // A string starting at p (which is '"'); validates it and leaves p after the
  // closing quote.
  bool skip_string(bool& has_escape) {
    ++p;
    has_escape = false;
    for (;;) {
      while (end - p >= 8) {
        uint64_t v;
        std::memcpy(&v, p, 8);
        if (needs_attention(v)) break;
        p += 8;
      }
      if (p >= end) return false;
      const unsigned char c = *p;
      if (c == '"') {
        ++p;
        return true;
      }
      if (c == '\\') {
        has_escape = true;
        if (end - p < 2) return false;
        const unsigned char e = p[1];
        p += 2;
        if (e == 'u') {
          int32_t cp = read_hex4();
          if (cp < 0) return false;
          if (cp >= 0xD800 && cp <= 0xDBFF) {
            if (end - p < 2 || p[0] != '\\' || p[1] != 'u') return false;
            p += 2;
            int32_t lo = read_hex4();
            if (lo < 0xDC00 || lo > 0xDFFF) return false;
          } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
            return false;
          }
        } else if (!(e == '"' || e == '\\' || e == '/' || e == 'b' || e == 'f' || e == 'n' || e == 'r' || e == 't')) {
          return false;
        }
      } else if (c < 0x20) {
        return false;
      } else if (c < 0x80) {
        ++p;
      } else if (!skip_utf8()) {
        return false;
      }
    }
  }

  bool skip_number() {
    const unsigned char* start = p;
    if (*p == '-') ++p;
    if (p >= end) return false;
    if (*p == '0') {
      ++p;
    } else if (*p >= '1' && *p <= '9') {
      while (p < end && *p >= '0' && *p <= '9') ++p;
    } else {
      return false;
    }
    if (p < end && *p == '.') {
      ++p;
      if (p >= end || !(*p >= '0' && *p <= '9')) return false;
      while (p < end && *p >= '0' && *p <= '9') ++p;
    }
    // Exponents and very long numbers may overflow a double, which nlohmann
    // rejects: let it decide.
    if (p < end && (*p == 'e' || *p == 'E')) return false;
    return static_cast<size_t>(p - start) <= kMaxNumberChars;
  }

  bool skip_literal(const char* lit, size_t n) {
    if (static_cast<size_t>(end - p) < n || std::memcmp(p, lit, n) != 0) return false;
    p += n;
    return true;
  }

  bool skip_value(int depth) {
    if (p >= end) return false;
    bool esc;
    switch (*p) {
      case '"':
        return skip_string(esc);
      case '{': {
        if (depth >= kMaxDepth) return false;
        ++p;
        skip_ws();
        if (p < end && *p == '}') {
          ++p;
          return true;
        }
        for (;;) {
          if (p >= end || *p != '"' || !skip_string(esc)) return false;
          skip_ws();
          if (p >= end || *p != ':') return false;
          ++p;
          skip_ws();
          if (!skip_value(depth + 1)) return false;
          skip_ws();
          if (p >= end) return false;
          if (*p == '}') {
            ++p;
            return true;
          }
          if (*p != ',') return false;
          ++p;
          skip_ws();
        }
      }
      case '[': {
        if (depth >= kMaxDepth) return false;
        ++p;
        skip_ws();
        if (p < end && *p == ']') {
          ++p;
          return true;
        }
        for (;;) {
          if (!skip_value(depth + 1)) return false;
          skip_ws();
          if (p >= end) return false;
          if (*p == ']') {
            ++p;
            return true;
          }
          if (*p != ',') return false;
          ++p;
          skip_ws();
        }
      }
      case 't':
        return skip_literal("true", 4);
      case 'f':
        return skip_literal("false", 5);
      case 'n':
        return skip_literal("null", 4);
      default:
        return skip_number();
    }
  }
};

// Decodes the body of an already validated string (between the quotes).
void decode_string(const unsigned char* p, const unsigned char* end, std::string& out) {
  out.clear();
  out.reserve(static_cast<size_t>(end - p));
  while (p < end) {
    const unsigned char* run = p;
    const void* bs = std::memchr(p, '\\', static_cast<size_t>(end - p));
    p = bs ? static_cast<const unsigned char*>(bs) : end;
    out.append(reinterpret_cast<const char*>(run), static_cast<size_t>(p - run));
    if (p >= end) break;
    const unsigned char e = p[1];
    p += 2;
    switch (e) {
      case 'b':
        out += '\b';
        break;
      case 'f':
        out += '\f';
        break;
      case 'n':
        out += '\n';
        break;
      case 'r':
        out += '\r';
        break;
      case 't':
        out += '\t';
        break;
      case 'u': {
        auto hex4 = [&] {
          uint32_t v = 0;
          for (int i = 0; i < 4; ++i) v = v << 4 | static_cast<uint32_t>(hex_value(p[i]));
          p += 4;
          return v;
        };
        uint32_t cp = hex4();
        if (cp >= 0xD800 && cp <= 0xDBFF) {
          p += 2;  // "\u" (validated)
          uint32_t lo = hex4();
          cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
        }
        utf8_append(out, cp);
        break;
      }
      default:
        out += static_cast<char>(e);
        break;  // '"', '\\', '/'
    }
  }
}

}  // namespace

bool fast_extract_json_string(std::string_view line, std::string_view key, std::string& out) {
  Scanner s{reinterpret_cast<const unsigned char*>(line.data()),
            reinterpret_cast<const unsigned char*>(line.data()) + line.size()};
  s.skip_ws();
  if (s.p >= s.end || *s.p != '{') return false;  // also a UTF-8 BOM: nlohmann decides
  ++s.p;
  s.skip_ws();
  if (s.p < s.end && *s.p == '}') return false;  // empty object: the key is missing
  const unsigned char* val_begin = nullptr;      // body of the last string value under `key`
  const unsigned char* val_end = nullptr;
  bool val_escaped = false, last_is_string = false, found = false;
  std::string decoded_key;
  for (;;) {
    if (s.p >= s.end || *s.p != '"') return false;
    const unsigned char* kb = s.p + 1;
    bool kesc;
    if (!s.skip_string(kesc)) return false;
    const unsigned char* ke = s.p - 1;
    bool match;
    if (!kesc) {
      match = static_cast<size_t>(ke - kb) == key.size() && std::memcmp(kb, key.data(), key.size()) == 0;
    } else {
      decode_string(kb, ke, decoded_key);
      match = decoded_key == key;
    }
    s.skip_ws();
    if (s.p >= s.end || *s.p != ':') return false;
    ++s.p;
    s.skip_ws();
    if (match) {
      // nlohmann keeps the last of duplicate keys.
      found = true;
      last_is_string = s.p < s.end && *s.p == '"';
      if (last_is_string) {
        val_begin = s.p + 1;
        if (!s.skip_string(val_escaped)) return false;
        val_end = s.p - 1;
      } else if (!s.skip_value(1)) {
        return false;
      }
    } else if (!s.skip_value(1)) {
      return false;
    }
    s.skip_ws();
    if (s.p >= s.end) return false;
    if (*s.p == '}') {
      ++s.p;
      break;
    }
    if (*s.p != ',') return false;
    ++s.p;
    s.skip_ws();
  }
  s.skip_ws();
  if (s.p != s.end || !found || !last_is_string) return false;
  if (!val_escaped)
    out.assign(reinterpret_cast<const char*>(val_begin), static_cast<size_t>(val_end - val_begin));
  else
    decode_string(val_begin, val_end, out);
  return true;
}

}  // namespace lathe::tok
