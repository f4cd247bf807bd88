#include "tokenizer/hf_components.h"

#include <algorithm>
#include <limits>

#include "core/error.h"
#include "core/utf8.h"
#include "io/json.h"
#include "io/json_fields.h"
#include "tokenizer/bpe.h"
#include "tokenizer/byte_level.h"
#include "tokenizer/nfc.h"

namespace lathe::tok {

using nlohmann::json;

// ---------------------------------------------------------------- typed JSON access
namespace json_field {

std::string join(const std::string& path, std::string_view key) {
  return path.empty() ? std::string(key) : path + "." + std::string(key);
}
std::string index(const std::string& path, size_t i) { return fmt::format("{}[{}]", path, i); }
std::string member(const std::string& path, std::string_view key) { return path + "[" + quote(key) + "]"; }

std::string quote(std::string_view s) {
  // json_excerpt escapes control bytes and replaces invalid UTF-8, and bounds the length.
  return io::json_excerpt(json(std::string(s.substr(0, 200))), 80);
}

const json* find(const json& obj, std::string_view key) { return io::JsonFields::find(obj, key); }

namespace {
// tokenizer.json's wording: "FILE: PATH must be WHAT, got TYPE: EXCERPT", "FILE: PATH is missing (...)".
io::JsonFields fields(const std::string& file) {
  return io::JsonFields(io::JsonFields::Style::MustBe, [&file](const std::string& path, const std::string& what) {
    throw_error("{}: {} {}", file, path.empty() ? "the top level" : path, what);
  });
}
}  // namespace

void type_error(const std::string& file, const std::string& path, const char* what, const json& got) {
  fields(file).wrong(path, got, what);
}

void require_object(const json& v, const std::string& file, const std::string& path) {
  fields(file).object(v, path);
}

namespace {
const json& required(const json& obj, std::string_view key, const std::string& file, const std::string& path,
                     const char* what) {
  require_object(obj, file, path);
  return fields(file).at(obj, key, join(path, key), what);
}
}  // namespace

const json& object(const json& obj, std::string_view key, const std::string& file, const std::string& path) {
  return fields(file).object(required(obj, key, file, path, "an object"), join(path, key));
}
const json& array(const json& obj, std::string_view key, const std::string& file, const std::string& path) {
  return fields(file).array(required(obj, key, file, path, "a list"), join(path, key));
}
std::string string(const json& obj, std::string_view key, const std::string& file, const std::string& path) {
  return fields(file).string(required(obj, key, file, path, "a string"), join(path, key));
}
std::optional<std::string> opt_string(const json& obj, std::string_view key, const std::string& file,
                                      const std::string& path) {
  const json* v = find(obj, key);
  if (!v) return std::nullopt;
  return fields(file).string(*v, join(path, key));
}
bool opt_bool(const json& obj, std::string_view key, bool dflt, const std::string& file, const std::string& path) {
  const json* v = find(obj, key);
  return v ? fields(file).boolean(*v, join(path, key)) : dflt;
}
int64_t opt_int(const json& obj, std::string_view key, int64_t dflt, int64_t lo, int64_t hi, const std::string& file,
                const std::string& path) {
  const json* v = find(obj, key);
  return v ? fields(file).integer(*v, join(path, key), lo, hi) : dflt;
}

int32_t token_id(const json& v, int64_t limit, const std::string& file, const std::string& path) {
  if (!v.is_number_integer()) type_error(file, path, "an integer token id", v);
  const bool too_big = v.is_number_unsigned() && v.get<uint64_t>() >= static_cast<uint64_t>(limit);
  if (too_big || v.get<int64_t>() < 0 || v.get<int64_t>() >= limit)
    throw_error(
        "{}: {}: token id {} is out of range: ids must lie in [0, {}) for this file (its number of vocabulary "
        "entries and added tokens + {}; real tokenizers number their tokens densely from 0): the file is corrupt",
        file, path, io::json_excerpt(v, 40), limit, kTokenIdSlack);
  return static_cast<int32_t>(v.get<int64_t>());
}

}  // namespace json_field

GrowthBudget::GrowthBudget(size_t input_bytes) : input(input_bytes) {
  limit = input_bytes > (std::numeric_limits<size_t>::max() - kGrowthSlack) / kMaxGrowth
              ? std::numeric_limits<size_t>::max()
              : input_bytes * kMaxGrowth + kGrowthSlack;
}

void GrowthBudget::check(size_t n, const std::string& where, const char* kind) const {
  if (n > limit)
    throw_error(
        "{}: this {} would grow the text to {} bytes from {} bytes of input (the limit is {}x the input + 1 MiB): "
        "the {}s of this tokenizer expand text without bound (e.g. chained Replace stages that each lengthen "
        "their match); fix or remove this stage",
        where, kind, n, input, kMaxGrowth, kind);
}

namespace {

using namespace json_field;

bool is_unicode_ws(uint32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

// "FILE: PATH (TYPE)": the prefix of runtime messages of one component.
std::string component_where(const std::string& file, const std::string& path, const std::string& type) {
  return fmt::format("{}: {} ({})", file, path, type);
}

// {"String": s} or {"Regex": r} at `path` -> PCRE2 pattern (String is matched literally).
std::string pattern_of(const json& j, const std::string& file, const std::string& path) {
  if (j.is_object() && find(j, "String")) {
    std::string s = string(j, "String", file, path), out;
    for (char c : s) {
      if (std::string_view("\\^$.|?*+()[]{}-#/ ").find(c) != std::string_view::npos && c != ' ') out += '\\';
      out += c;
    }
    return out;
  }
  if (j.is_object() && find(j, "Regex")) return string(j, "Regex", file, path);
  type_error(file, path, "{\"String\": ...} or {\"Regex\": ...}", j);
}

// Metaspace's replacement is a Rust `char` in HF tokenizers: exactly one character. An empty one
// made the split loop below spin forever (find("") never advances).
std::string one_char(const json& j, const std::string& file, const std::string& path) {
  std::string r = opt_string(j, "replacement", file, path).value_or("\xE2\x96\x81");
  if (r.empty() || !utf8_valid_at(r, 0) || utf8_char_len(r, 0) != r.size())
    throw_error("{}: {} must be exactly one character (as in HF tokenizers, default \"\u2581\"), got {}", file,
                join(path, "replacement"), quote(r));
  return r;
}

void replace_all(std::string& s, std::string_view from, std::string_view to) {
  if (from.empty() || s.find(from) == std::string::npos) return;
  std::string out;
  out.reserve(s.size() + s.size() / 4);
  size_t pos = 0;
  while (true) {
    size_t k = s.find(from, pos);
    if (k == std::string::npos) break;
    out.append(s, pos, k - pos);
    out.append(to);
    pos = k + from.size();
  }
  out.append(s, pos, std::string::npos);
  s.swap(out);
}

// Replaces every regex match (or literal string) by `content`. The output size is computed
// before it is built, so a growing replacement is refused by the GrowthBudget, not allocated.
struct Replacer {
  std::string literal;
  std::unique_ptr<Regex> re;
  std::string content;
  std::string where;  // component_where(), for the growth message
  Replacer(const json& j, const std::string& file, const std::string& path, const std::string& type)
      : content(string(j, "content", file, path)), where(component_where(file, path, type)) {
    const json& pat = object(j, "pattern", file, path);
    const std::string ppath = join(path, "pattern");
    if (find(pat, "String"))
      literal = string(pat, "String", file, ppath);
    else
      re = std::make_unique<Regex>(pattern_of(pat, file, ppath));
  }
  // `other`: bytes of the text outside s that count against the same budget (other tokens).
  void apply(std::string& s, const GrowthBudget& budget, const char* kind, size_t other = 0) const {
    if (!re) {
      // An empty literal never matches (as HF's &str Pattern, which returns no match for "").
      if (literal.empty()) return;
      size_t count = 0;  // counted first (no vector of matches on this hot path of Llama-style tokenizers)
      for (size_t k = s.find(literal); k != std::string::npos; k = s.find(literal, k + literal.size())) ++count;
      if (count == 0) return;
      const size_t n = s.size() - count * literal.size() + count * content.size();
      if (content.size() > literal.size()) budget.check(other + n, where, kind);
      std::string out;
      out.reserve(n);
      size_t pos = 0;
      for (size_t k = s.find(literal); k != std::string::npos; k = s.find(literal, pos)) {
        out.append(s, pos, k - pos);
        out += content;
        pos = k + literal.size();
      }
      out.append(s, pos, std::string::npos);
      s.swap(out);
      return;
    }
    std::vector<std::pair<size_t, size_t>> m;
    re->find_all(s, m);  // empty matches are skipped
    if (m.empty()) return;
    size_t removed = 0;
    for (auto [a, b] : m) removed += b - a;
    const size_t n = s.size() - removed + m.size() * content.size();
    if (content.size() * m.size() > removed) budget.check(other + n, where, kind);
    std::string out;
    out.reserve(n);
    size_t prev = 0;
    for (auto [a, b] : m) {
      out.append(s, prev, a - prev);
      out += content;
      prev = b;
    }
    out.append(s, prev, std::string::npos);
    s.swap(out);
  }
};

// ---------------------------------------------------------------- normalizers
struct SequenceNormalizer : Normalizer {
  std::vector<std::unique_ptr<Normalizer>> parts;
  void run(std::string& s, const GrowthBudget& b) const override {
    for (auto& p : parts) p->run(s, b);
  }
};
struct PrependNormalizer : Normalizer {
  std::string prepend, where;
  void run(std::string& s, const GrowthBudget& b) const override {
    if (s.empty()) return;
    b.check(s.size() + prepend.size(), where, "normalizer");
    s.insert(0, prepend);
  }
};
struct ReplaceNormalizer : Normalizer {
  Replacer r;
  ReplaceNormalizer(const json& j, const std::string& file, const std::string& path) : r(j, file, path, "Replace") {}
  void run(std::string& s, const GrowthBudget& b) const override { r.apply(s, b, "normalizer"); }
};
struct NfcNormalizer : Normalizer {
  // NFC output is at most 3x its input (a Unicode stability guarantee): no budget check needed.
  void run(std::string& s, const GrowthBudget&) const override { nfc_normalize(s); }
};
struct StripNormalizer : Normalizer {
  bool left, right;
  void run(std::string& s, const GrowthBudget&) const override {
    size_t b = 0, e = s.size();
    if (left)
      while (b < e) {
        size_t len = utf8_char_len(s, b);
        if (!utf8_valid_at(s, b) || !is_unicode_ws(utf8_decode(s, b, len))) break;
        b += len;
      }
    if (right)
      while (e > b) {
        size_t k = e - 1;
        while (k > b && (static_cast<unsigned char>(s[k]) & 0xC0) == 0x80) --k;
        size_t len = utf8_char_len(s, k);
        if (k + len != e || !utf8_valid_at(s, k) || !is_unicode_ws(utf8_decode(s, k, len))) break;
        e = k;
      }
    s = s.substr(b, e - b);
  }
};

// ---------------------------------------------------------------- pre-tokenizers
enum class Behavior { Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous };

// HF NormalizedString::split: segments (matches and the gaps between them) combined by behavior.
void split_piece(const Piece& p, const std::vector<std::pair<size_t, size_t>>& matches, bool invert, Behavior bh,
                 std::vector<Piece>& out) {
  struct Seg {
    size_t a, b;
    bool m;
  };
  thread_local std::vector<Seg> segs, acc;
  segs.clear();
  acc.clear();
  size_t prev = 0;
  for (auto [a, b] : matches) {
    if (prev != a) segs.push_back({prev, a, invert});
    segs.push_back({a, b, !invert});
    prev = b;
  }
  if (prev != p.s.size()) segs.push_back({prev, p.s.size(), invert});
  switch (bh) {
    case Behavior::Removed:
      for (auto& s : segs)
        if (!s.m) acc.push_back(s);
      break;
    case Behavior::Isolated:
      acc = segs;
      break;
    case Behavior::MergedWithPrevious: {
      bool prev_m = false;
      for (auto& s : segs) {
        if (s.m && !prev_m && !acc.empty())
          acc.back().b = s.b;
        else
          acc.push_back(s);
        prev_m = s.m;
      }
      break;
    }
    case Behavior::MergedWithNext: {
      bool prev_m = false;
      for (size_t k = segs.size(); k-- > 0;) {
        auto& s = segs[k];
        if (s.m && !prev_m && !acc.empty())
          acc.back().a = s.a;
        else
          acc.push_back(s);
        prev_m = s.m;
      }
      std::reverse(acc.begin(), acc.end());
      break;
    }
    case Behavior::Contiguous: {
      bool prev_m = false;
      for (auto& s : segs) {
        if (s.m == prev_m && !acc.empty())
          acc.back().b = s.b;
        else
          acc.push_back(s);
        prev_m = s.m;
      }
      break;
    }
  }
  for (auto& s : acc)
    if (s.b > s.a) out.push_back({p.s.substr(s.a, s.b - s.a), p.origin && s.a == 0});
}

// One window of a regex split (see PreTokenizer::apply_window). The scan runs over all of s and
// is cut right after a match: from there the whole-text scan restarts, so every match is the same.
// Only behaviours that keep each segment on its own are cut (Isolated, Removed); merging ones
// could join the segments on both sides of a cut.
size_t regex_split_window(const Regex& re, bool invert, Behavior behavior, std::string_view s, size_t pos,
                          size_t min_len, bool origin, PieceBuf& buf) {
  if (behavior != Behavior::Isolated && behavior != Behavior::Removed) return 0;
  buf.matches.clear();
  const size_t end = re.find_window(s, pos, pos + min_len, buf.matches);
  for (auto& m : buf.matches) m.first -= pos, m.second -= pos;
  buf.pieces.clear();
  split_piece(Piece{s.substr(pos, end - pos), origin && pos == 0}, buf.matches, invert, behavior, buf.pieces);
  return end;
}

struct SplitPreTokenizer : PreTokenizer {
  std::unique_ptr<Regex> re;
  bool invert = false;
  Behavior behavior = Behavior::Isolated;
  void apply(PieceBuf& buf) const override {
    buf.tmp.clear();
    for (const Piece& p : buf.pieces) {
      buf.matches.clear();
      re->find_all(p.s, buf.matches);
      split_piece(p, buf.matches, invert, behavior, buf.tmp);
    }
    buf.pieces.swap(buf.tmp);
  }
  size_t apply_window(std::string_view s, size_t pos, size_t min_len, bool origin, PieceBuf& buf) const override {
    return regex_split_window(*re, invert, behavior, s, pos, min_len, origin, buf);
  }
};

const char* kGpt2Pattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

struct ByteLevelPreTokenizer : PreTokenizer {
  bool add_prefix_space = false;
  std::unique_ptr<Regex> re;  // null when use_regex=false
  bool is_byte_level() const override { return true; }
  void apply(PieceBuf& buf) const override {
    if (add_prefix_space) {
      for (Piece& p : buf.pieces)
        if (p.s.empty() || p.s[0] != ' ') {
          buf.owned.emplace_back(" ");
          buf.owned.back() += p.s;
          p.s = buf.owned.back();
        }
    }
    if (!re) return;
    buf.tmp.clear();
    for (const Piece& p : buf.pieces) {
      buf.matches.clear();
      re->find_all(p.s, buf.matches);
      split_piece(p, buf.matches, false, Behavior::Isolated, buf.tmp);
    }
    buf.pieces.swap(buf.tmp);
    // The byte -> unicode mapping is implicit: the byte-level BPE model works on raw bytes.
  }
  size_t apply_window(std::string_view s, size_t pos, size_t min_len, bool origin, PieceBuf& buf) const override {
    if (add_prefix_space || !re) return 0;  // the prefix space would change the text scanned
    return regex_split_window(*re, false, Behavior::Isolated, s, pos, min_len, origin, buf);
  }
};

struct MetaspacePreTokenizer : PreTokenizer {
  std::string rep;
  enum { Always, First, Never } scheme = Always;
  bool split = true;
  void apply(PieceBuf& buf) const override {
    buf.tmp.clear();
    for (const Piece& p : buf.pieces) {
      std::string s(p.s);
      replace_all(s, " ", rep);
      bool starts = s.compare(0, rep.size(), rep) == 0;
      if ((scheme == Always && !starts) || (scheme == First && !starts && p.origin)) s.insert(0, rep);
      buf.owned.push_back(std::move(s));
      Piece np{buf.owned.back(), p.origin};
      if (!split) {
        if (!np.s.empty()) buf.tmp.push_back(np);
        continue;
      }
      buf.matches.clear();
      for (size_t k = np.s.find(rep); k != std::string_view::npos; k = np.s.find(rep, k + rep.size()))
        buf.matches.emplace_back(k, k + rep.size());
      split_piece(np, buf.matches, false, Behavior::MergedWithNext, buf.tmp);
    }
    buf.pieces.swap(buf.tmp);
  }
};

struct SequencePreTokenizer : PreTokenizer {
  std::vector<std::unique_ptr<PreTokenizer>> parts;
  void apply(PieceBuf& buf) const override {
    for (auto& p : parts) p->apply(buf);
  }
  size_t apply_window(std::string_view s, size_t pos, size_t min_len, bool origin, PieceBuf& buf) const override {
    if (parts.empty()) return 0;
    const size_t end = parts[0]->apply_window(s, pos, min_len, origin, buf);
    if (end == 0) return 0;
    for (size_t i = 1; i < parts.size(); ++i) parts[i]->apply(buf);  // later stages act per piece
    return end;
  }
};

// ---------------------------------------------------------------- decoders
struct SequenceDecoder : Decoder {
  std::vector<std::unique_ptr<Decoder>> parts;
  void run(std::vector<std::string>& t, const GrowthBudget& b) const override {
    for (auto& p : parts) p->run(t, b);
  }
};
// Raw bytes, no lossy UTF-8 step: decode(encode(bytes)) == bytes for any bytes.
struct ByteLevelDecoder : Decoder {
  void run(std::vector<std::string>& t, const GrowthBudget& b) const override {
    std::string out;
    for (auto& s : t) bytelevel_to_bytes(s, out);
    t.assign(1, std::move(out));
  }
};
struct FuseDecoder : Decoder {
  void run(std::vector<std::string>& t, const GrowthBudget& b) const override {
    std::string out;
    for (auto& s : t) out += s;
    t.assign(1, std::move(out));
  }
};
struct ReplaceDecoder : Decoder {
  Replacer r;
  ReplaceDecoder(const json& j, const std::string& file, const std::string& path) : r(j, file, path, "Replace") {}
  void run(std::vector<std::string>& t, const GrowthBudget& b) const override {
    size_t total = 0;
    for (auto& s : t) total += s.size();
    for (auto& s : t) {
      const size_t other = total - s.size();
      r.apply(s, b, "decoder", other);
      total = other + s.size();
    }
  }
};
struct ByteFallbackDecoder : Decoder {
  void run(std::vector<std::string>& t, const GrowthBudget& b) const override {
    std::vector<std::string> out;
    std::string bytes;
    auto flush = [&] {
      if (bytes.empty()) return;
      if (is_valid_utf8(bytes))
        out.push_back(bytes);
      else
        for (size_t i = 0; i < bytes.size(); ++i) out.emplace_back("\xEF\xBF\xBD");
      bytes.clear();
    };
    auto hexval = [](char c) -> int {
      if (c >= '0' && c <= '9') return c - '0';
      if (c >= 'a' && c <= 'f') return c - 'a' + 10;
      if (c >= 'A' && c <= 'F') return c - 'A' + 10;
      return -1;
    };
    for (auto& s : t) {
      if (s.size() == 6 && s.compare(0, 3, "<0x") == 0 && s[5] == '>' && hexval(s[3]) >= 0 && hexval(s[4]) >= 0) {
        bytes += static_cast<char>(hexval(s[3]) * 16 + hexval(s[4]));
      } else {
        flush();
        out.push_back(std::move(s));
      }
    }
    flush();
    t.swap(out);
  }
};
struct StripDecoder : Decoder {
  std::string content;  // one char
  size_t start = 0, stop = 0;
  void run(std::vector<std::string>& t, const GrowthBudget& b) const override {
    for (auto& s : t) {
      std::vector<std::string_view> chars;
      for (size_t i = 0; i < s.size();) {
        size_t len = utf8_char_len(s, i);
        chars.push_back(std::string_view(s).substr(i, len));
        i += len;
      }
      size_t sc = 0, ec = 0;
      while (sc < chars.size() && sc < start && chars[sc] == content) ++sc;
      while (ec < chars.size() && ec < stop && chars[chars.size() - 1 - ec] == content) ++ec;
      // HF: chars().skip(start_cut).take(token.len() - start_cut - stop_cut) with len() in bytes.
      size_t take = std::min(chars.size() - std::min(sc, chars.size()), s.size() - sc - ec);
      std::string out;
      for (size_t k = sc; k < sc + take && k < chars.size(); ++k) out += chars[k];
      s.swap(out);
    }
  }
};
struct MetaspaceDecoder : Decoder {
  std::string rep;
  bool never = false;
  void run(std::vector<std::string>& t, const GrowthBudget& b) const override {
    for (size_t i = 0; i < t.size(); ++i) replace_all(t[i], rep, i == 0 && !never ? "" : " ");
  }
};

// The "type" of the component at `path`.
std::string type_of(const json& j, const std::string& file, const std::string& path) {
  require_object(j, file, path);
  return string(j, "type", file, path);
}

Behavior parse_behavior(const json& j, const std::string& file, const std::string& path) {
  std::string b = string(j, "behavior", file, path);
  if (b == "Removed") return Behavior::Removed;
  if (b == "Isolated") return Behavior::Isolated;
  if (b == "MergedWithPrevious") return Behavior::MergedWithPrevious;
  if (b == "MergedWithNext") return Behavior::MergedWithNext;
  if (b == "Contiguous") return Behavior::Contiguous;
  throw_error(
      "{}: {} {} is unknown (expected Removed, Isolated, MergedWithPrevious, MergedWithNext, "
      "Contiguous)",
      file, join(path, "behavior"), quote(b));
}

// Metaspace pre-tokenizer and decoder: prepend_scheme (and the older add_prefix_space).
std::string prepend_scheme(const json& j, const std::string& file, const std::string& path) {
  std::string scheme = opt_string(j, "prepend_scheme", file, path).value_or("always");
  if (!opt_bool(j, "add_prefix_space", true, file, path)) scheme = "never";
  if (scheme != "always" && scheme != "first" && scheme != "never")
    throw_error("{}: {} {} is unknown (always, first, never)", file, join(path, "prepend_scheme"), quote(scheme));
  return scheme;
}

}  // namespace

std::unique_ptr<Normalizer> make_normalizer(const json& j, const std::string& file, const std::string& path) {
  std::string type = type_of(j, file, path);
  if (type == "Sequence") {
    auto n = std::make_unique<SequenceNormalizer>();
    const json& parts = array(j, "normalizers", file, path);
    for (size_t i = 0; i < parts.size(); ++i)
      n->parts.push_back(make_normalizer(parts[i], file, json_field::index(join(path, "normalizers"), i)));
    return n;
  }
  if (type == "Prepend") {
    auto n = std::make_unique<PrependNormalizer>();
    n->prepend = string(j, "prepend", file, path);
    n->where = component_where(file, path, type);
    return n;
  }
  if (type == "Replace") return std::make_unique<ReplaceNormalizer>(j, file, path);
  if (type == "NFC") return std::make_unique<NfcNormalizer>();
  if (type == "Strip") {
    auto n = std::make_unique<StripNormalizer>();
    n->left = opt_bool(j, "strip_left", false, file, path);
    n->right = opt_bool(j, "strip_right", false, file, path);
    return n;
  }
  throw_error(
      "{}: {}: normalizer type {} is not supported by lathe (supported: Sequence, Prepend, Replace, Strip, NFC)", file,
      path, quote(type));
}

std::unique_ptr<PreTokenizer> make_pre_tokenizer(const json& j, const std::string& file, bool* byte_level,
                                                 const std::string& path) {
  std::string type = type_of(j, file, path);
  if (type == "Sequence") {
    auto p = std::make_unique<SequencePreTokenizer>();
    const json& parts = array(j, "pretokenizers", file, path);
    for (size_t i = 0; i < parts.size(); ++i) {
      bool bl = false;
      p->parts.push_back(make_pre_tokenizer(parts[i], file, &bl, json_field::index(join(path, "pretokenizers"), i)));
      LATHE_CHECK(!bl || i + 1 == parts.size(),
                  "{}: {}: ByteLevel must be the last pre-tokenizer of the Sequence (lathe runs the byte-level "
                  "model on raw bytes)",
                  file, path);
      if (bl) *byte_level = true;
    }
    return p;
  }
  if (type == "ByteLevel") {
    auto p = std::make_unique<ByteLevelPreTokenizer>();
    p->add_prefix_space = opt_bool(j, "add_prefix_space", false, file, path);
    if (opt_bool(j, "use_regex", true, file, path)) p->re = std::make_unique<Regex>(kGpt2Pattern);
    *byte_level = true;
    return p;
  }
  if (type == "Split") {
    auto p = std::make_unique<SplitPreTokenizer>();
    if (!find(j, "pattern")) throw_error("{}: {} is missing", file, join(path, "pattern"));
    p->re = std::make_unique<Regex>(pattern_of(j["pattern"], file, join(path, "pattern")));
    p->invert = opt_bool(j, "invert", false, file, path);
    p->behavior = parse_behavior(j, file, path);
    return p;
  }
  if (type == "Metaspace") {
    auto p = std::make_unique<MetaspacePreTokenizer>();
    p->rep = one_char(j, file, path);
    std::string scheme = prepend_scheme(j, file, path);
    p->scheme = scheme == "always"  ? MetaspacePreTokenizer::Always
                : scheme == "first" ? MetaspacePreTokenizer::First
                                    : MetaspacePreTokenizer::Never;
    p->split = opt_bool(j, "split", true, file, path);
    return p;
  }
  if (type == "Digits") {
    auto p = std::make_unique<SplitPreTokenizer>();
    p->re = std::make_unique<Regex>(R"(\p{N})");
    p->behavior = opt_bool(j, "individual_digits", false, file, path) ? Behavior::Isolated : Behavior::Contiguous;
    return p;
  }
  if (type == "Whitespace") {
    auto p = std::make_unique<SplitPreTokenizer>();
    p->re = std::make_unique<Regex>(R"(\w+|[^\w\s]+)");
    p->invert = true;
    p->behavior = Behavior::Removed;
    return p;
  }
  if (type == "WhitespaceSplit") {
    auto p = std::make_unique<SplitPreTokenizer>();
    p->re = std::make_unique<Regex>(R"(\s)");
    p->behavior = Behavior::Removed;
    return p;
  }
  throw_error(
      "{}: {}: pre_tokenizer type {} is not supported by lathe (supported: Sequence, ByteLevel, Split, "
      "Metaspace, Digits, Whitespace, WhitespaceSplit)",
      file, path, quote(type));
}

std::unique_ptr<Decoder> make_decoder(const json& j, const std::string& file, const std::string& path) {
  std::string type = type_of(j, file, path);
  if (type == "Sequence") {
    auto d = std::make_unique<SequenceDecoder>();
    const json& parts = array(j, "decoders", file, path);
    for (size_t i = 0; i < parts.size(); ++i)
      d->parts.push_back(make_decoder(parts[i], file, json_field::index(join(path, "decoders"), i)));
    return d;
  }
  if (type == "ByteLevel") return std::make_unique<ByteLevelDecoder>();
  if (type == "Fuse") return std::make_unique<FuseDecoder>();
  if (type == "ByteFallback") return std::make_unique<ByteFallbackDecoder>();
  if (type == "Replace") return std::make_unique<ReplaceDecoder>(j, file, path);
  if (type == "Strip") {
    auto d = std::make_unique<StripDecoder>();
    d->content = string(j, "content", file, path);
    constexpr int64_t kMax = std::numeric_limits<int32_t>::max();
    d->start = static_cast<size_t>(opt_int(j, "start", 0, 0, kMax, file, path));
    d->stop = static_cast<size_t>(opt_int(j, "stop", 0, 0, kMax, file, path));
    return d;
  }
  if (type == "Metaspace") {
    auto d = std::make_unique<MetaspaceDecoder>();
    d->rep = one_char(j, file, path);
    d->never = prepend_scheme(j, file, path) == "never";
    return d;
  }
  throw_error(
      "{}: {}: decoder type {} is not supported by lathe (supported: Sequence, ByteLevel, Fuse, ByteFallback, "
      "Replace, Strip, Metaspace)",
      file, path, quote(type));
}

// ---------------------------------------------------------------- added tokens
void AddedTokenMatcher::add(const std::string& pattern, const AddedToken* tok) {
  if (pattern.empty()) return;
  int32_t n = 0;
  for (unsigned char c : pattern) {
    int32_t nxt = -1;
    for (auto& [b, k] : nodes_[n].next)
      if (b == c) nxt = k;
    if (nxt < 0) {
      nxt = static_cast<int32_t>(nodes_.size());
      nodes_[n].next.emplace_back(c, nxt);
      nodes_.emplace_back();
    }
    n = nxt;
  }
  if (!nodes_[n].tok) nodes_[n].tok = tok;
  first_byte_[static_cast<unsigned char>(pattern[0])] = true;
}

void AddedTokenMatcher::find(std::string_view text, std::vector<Match>& out) const {
  // HF: Rust regex \w (Unicode) on the char before / after the match.
  static const Regex word_re(R"(^[\p{Alphabetic}\p{M}\p{Nd}\p{Pc}\x{200C}\x{200D}])");
  auto is_word = [](std::string_view s, size_t i) {
    thread_local std::vector<std::pair<size_t, size_t>> m;
    m.clear();
    word_re.find_all(s.substr(i, utf8_char_len(s, i)), m);
    return !m.empty();
  };
  size_t n = text.size(), pos = 0, start_offset = 0;
  while (pos < n) {
    if (!first_byte_[static_cast<unsigned char>(text[pos])]) {
      ++pos;
      continue;
    }
    int32_t node = 0;
    const AddedToken* best = nullptr;
    size_t best_end = 0;
    for (size_t k = pos; k < n; ++k) {
      int32_t nxt = -1;
      for (auto& [b, id] : nodes_[node].next)
        if (b == static_cast<unsigned char>(text[k])) nxt = id;
      if (nxt < 0) break;
      node = nxt;
      if (nodes_[node].tok) {
        best = nodes_[node].tok;
        best_end = k + 1;
      }
    }
    if (!best) {
      ++pos;
      continue;
    }
    size_t s = pos, e = best_end;
    if (best->single_word) {
      bool ok_left = s == 0;
      if (!ok_left) {
        size_t k = s - 1;
        while (k > 0 && (static_cast<unsigned char>(text[k]) & 0xC0) == 0x80) --k;
        ok_left = !is_word(text, k);
      }
      bool ok_right = e == n || !is_word(text, e);
      if (!ok_left || !ok_right) {
        // HF's Aho-Corasick iterator moves past the whole discarded match.
        pos = e;
        continue;
      }
    }
    if (best->lstrip) {
      size_t k = s;
      while (k > start_offset) {
        size_t j = k - 1;
        while (j > 0 && (static_cast<unsigned char>(text[j]) & 0xC0) == 0x80) --j;
        size_t len = utf8_char_len(text, j);
        if (j + len != k || !is_unicode_ws(utf8_decode(text, j, len))) break;
        k = j;
      }
      s = std::max(k, start_offset);
    }
    size_t next_pos = e;
    if (best->rstrip) {
      while (e < n) {
        size_t len = utf8_char_len(text, e);
        if (!utf8_valid_at(text, e) || !is_unicode_ws(utf8_decode(text, e, len))) break;
        e += len;
      }
    }
    out.push_back({s, e, best});
    start_offset = e;
    pos = std::max(next_pos, e);
  }
}

}  // namespace lathe::tok
