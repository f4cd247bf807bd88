// fast_extract_json_string against nlohmann::json (the reference of
// extract_json_text): whenever the fast scanner answers, nlohmann must parse
// the line as an object whose member is a string with exactly the same bytes;
// on valid generated lines the scanner must answer (else the fast path would
// silently never run).
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <random>
#include <string>

#include "tokenizer/corpus.h"
#include "tokenizer/json_scan.h"

using lathe::tok::fast_extract_json_string;

namespace {

std::string escaped(const std::string& s) {
  static const char hex[] = "0123456789abcdef";
  std::string o;
  for (unsigned char c : s) {
    if (c >= 0x20 && c < 0x7f) {
      o.push_back(static_cast<char>(c));
    } else {
      o.append("\\x");
      o.push_back(hex[c >> 4]);
      o.push_back(hex[c & 15]);
    }
  }
  return o;
}

// nlohmann's verdict: the string under `key`, or nullopt when extract_json_text
// would skip.
std::optional<std::string> reference(const std::string& line, const std::string& key) {
  nlohmann::json j = nlohmann::json::parse(line.begin(), line.end(), nullptr, false);
  if (j.is_discarded() || !j.is_object()) return std::nullopt;
  auto it = j.find(key);
  if (it == j.end() || !it->is_string()) return std::nullopt;
  return it->get<std::string>();
}

// Checks the contract on one line; returns whether the fast path answered.
bool check_line(const std::string& line, const std::string& key) {
  std::string fast;
  bool answered = fast_extract_json_string(line, key, fast);
  if (answered) {
    auto ref = reference(line, key);
    EXPECT_TRUE(ref.has_value()) << "fast path accepted a line nlohmann rejects: " << escaped(line);
    if (ref) {
      EXPECT_EQ(fast, *ref) << "line: " << escaped(line);
    }
  }
  // extract_json_text (fast path + fallback) must always agree with the
  // reference.
  std::string got, detail;
  lathe::tok::SkipReason why;
  bool ok = lathe::tok::extract_json_text(line, key, got, why, detail);
  auto ref = reference(line, key);
  EXPECT_EQ(ok, ref.has_value()) << "line: " << escaped(line);
  if (ok && ref) {
    EXPECT_EQ(got, *ref);
  }
  return answered;
}

TEST(JsonScan, HandPickedLinesMatchNlohmann) {
  const std::vector<std::pair<std::string, bool>> cases = {
      {R"({"text": "hello"})", true},
      {R"(  {"id":1,"text":"a\nb\tc\"d\\e\/f\b\f\r"}  )", true},
      {R"({"text":"caf\u00e9 \u00E9 \ud83d\ude00 \u0000 end"})", true},
      {R"({"te\u0078t":"escaped key"})", true},
      {R"({"text":"first","text":"second"})", true},
      {R"({"meta":{"a":[1,-2.5,0,true,false,null,{"x":[]}],"b":{}},"text":"nested","z":[[[]]]})", true},
      {"{\"text\":\"raw utf8 \xc3\xa9 \xe4\xb8\xad \xf0\x9f\x98\x80\"}", true},
      {"{\"text\":\"\"}", true},
      {R"({"text":"x","n":-0})", true},
      // The fast path must decline these (nlohmann rejects them, or they are
      // not strings).
      {R"({"text":"first","text":2})", false},
      {R"({"text": 5})", false},
      {R"({"other":"x"})", false},
      {R"(["text"])", false},
      {R"({"text":"x"} trailing)", false},
      {R"({"text":"x",})", false},
      {R"({"text":"\ud83d"})", false},
      {R"({"text":"\ude00"})", false},
      {R"({"text":"\x"})", false},
      {"{\"text\":\"bad \xc3\x28\"}", false},
      {"{\"text\":\"overlong \xc0\xaf\"}", false},
      {"{\"text\":\"surrogate \xed\xa0\x80\"}", false},
      {"{\"text\":\"ctrl \x01\"}", false},
      {R"({"text":"x","n":01})", false},
      {R"({"text":"x","n":1.})", false},
      {R"({"text":"x","n":tru})", false},
      {R"({})", false},
      {"", false},
      // Decided by nlohmann (may be valid): exponents and a BOM.
      {R"({"text":"x","n":1e999})", false},
      {R"({"text":"x","n":1e5})", false},
      {"\xef\xbb\xbf{\"text\":\"bom\"}", false},
  };
  for (const auto& [line, answers] : cases) {
    SCOPED_TRACE(escaped(line));
    EXPECT_EQ(check_line(line, "text"), answers);
  }
}

// Random JSON builder with every string feature (escapes, surrogate pairs, raw
// UTF-8).
struct Gen {
  std::mt19937_64 rng;
  explicit Gen(uint64_t seed) : rng(seed) {}
  int uni(int n) { return static_cast<int>(rng() % static_cast<uint64_t>(n)); }

  std::string ws() {
    static const char* w[] = {"", "", "", " ", "\t", "  ", "\r\n "};
    return w[uni(7)];
  }
  std::string str() {
    std::string s(1, '"');
    int n = uni(12);
    for (int i = 0; i < n; ++i) {
      switch (uni(12)) {
        case 0:
          s += "\\n";
          break;
        case 1:
          s += "\\\"";
          break;
        case 2:
          s += "\\\\";
          break;
        case 3:
          s += "\\u00e9";
          break;
        case 4:
          s += "\\ud83d\\ude00";
          break;
        case 5:
          s += "\xe4\xb8\xad";
          break;
        case 6:
          s += "\\/\\b\\f\\r\\t";
          break;
        case 7:
          s += "\\u0041";
          break;
        default:
          s += static_cast<char>('a' + uni(26));
          break;
      }
    }
    s += '"';
    return s;
  }
  std::string number() {
    std::string s = uni(3) == 0 ? "-" : "";
    s += uni(4) == 0 ? "0" : std::to_string(1 + uni(100000));
    if (uni(3) == 0) {
      s += '.';
      s += std::to_string(uni(1000));
    }
    return s;
  }
  std::string value(int depth) {
    int k = depth > 3 ? uni(4) : uni(7);
    switch (k) {
      case 0:
        return str();
      case 1:
        return number();
      case 2: {
        static const char* l[] = {"true", "false", "null"};
        return l[uni(3)];
      }
      case 3:
        return str();
      case 4: {
        std::string s = "[";
        s += ws();
        int n = uni(4);
        for (int i = 0; i < n; ++i) {
          if (i) {
            s += ',';
            s += ws();
          }
          s += value(depth + 1);
          s += ws();
        }
        s += ']';
        return s;
      }
      default:
        return object(depth + 1, false);
    }
  }
  std::string object(int depth, bool with_text) {
    static const char* keys[] = {"text", "id", "meta", "te\\u0078t", "txt", "url"};
    std::string s = "{";
    s += ws();
    int n = uni(4) + (with_text ? 1 : 0);
    int text_at = with_text ? uni(n) : -1;
    for (int i = 0; i < n; ++i) {
      std::string k = i == text_at ? "text" : keys[uni(6)];
      std::string v = i == text_at ? str() : value(depth);
      if (i) {
        s += ',';
        s += ws();
      }
      s += '"';
      s += k;
      s += '"';
      s += ws();
      s += ':';
      s += ws();
      s += v;
      s += ws();
    }
    s += '}';
    return s;
  }
};

TEST(JsonScan, GeneratedLinesAgreeAndTakeTheFastPath) {
  Gen g(7);
  int answered = 0, with_string = 0;
  for (int i = 0; i < 4000; ++i) {
    std::string line = g.ws();
    line += g.object(0, i % 2 == 0);
    line += g.ws();
    SCOPED_TRACE(escaped(line));
    bool a = check_line(line, "text");
    answered += a;
    // A valid line whose last "text" member is a string must be answered by the
    // fast path.
    if (reference(line, "text")) {
      ++with_string;
      EXPECT_TRUE(a);
    }
  }
  EXPECT_GT(with_string, 1500);
  EXPECT_EQ(answered, with_string);
}

TEST(JsonScan, MutatedLinesNeverDisagree) {
  Gen g(11);
  static const char alphabet[] =
      "\"\\{}[],: "
      "0123456789eE.-+tfnlrua\x00\x1f\x7f\x80\xc3\xa9\xed\xa0\xf4\x90";
  int answered = 0;
  for (int i = 0; i < 20000; ++i) {
    std::string line = g.object(0, true);
    int edits = 1 + g.uni(3);
    for (int e = 0; e < edits && !line.empty(); ++e) {
      size_t pos = static_cast<size_t>(g.uni(static_cast<int>(line.size())));
      char c = alphabet[g.uni(sizeof(alphabet) - 1)];
      switch (g.uni(3)) {
        case 0:
          line.erase(pos, 1);
          break;
        case 1:
          line.insert(pos, 1, c);
          break;
        default:
          line[pos] = c;
          break;
      }
    }
    answered += check_line(line, "text");
    if (HasFailure()) {
      ADD_FAILURE() << "first failing mutated line: " << escaped(line);
      break;
    }
  }
  EXPECT_GT(answered,
            1000);  // mutations that stay valid still take the fast path
}

}  // namespace
