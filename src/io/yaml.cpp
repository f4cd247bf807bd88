#include "io/yaml.h"

#include <fmt/format.h>
#include <yaml-cpp/depthguard.h>
#include <yaml-cpp/eventhandler.h>
#include <yaml-cpp/yaml.h>

#include <cerrno>
#include <cstdlib>
#include <map>
#include <sstream>
#include <vector>

#include "core/error.h"
#include "core/utf8.h"  // header-only: the one UTF-8 validator

namespace lathe::io {

using json = nlohmann::json;

std::string excerpt(std::string_view s, size_t max_chars) {
  if (s.size() <= max_chars) return std::string(s);
  return fmt::format("{}... ({} characters)", s.substr(0, max_chars), s.size());
}

namespace {

// The plain-scalar grammars of the core schema, scanned by hand (std::regex recurses once per
// character and overflows the stack on a 100,000-digit scalar):
//   integer: [-+]?[0-9]+
//   float:   [-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?
size_t skip_digits(std::string_view s, size_t i) {
  while (i < s.size() && s[i] >= '0' && s[i] <= '9') ++i;
  return i;
}
bool is_int_text(std::string_view s) {
  size_t i = !s.empty() && (s[0] == '+' || s[0] == '-') ? 1 : 0;
  const size_t d = skip_digits(s, i);
  return d > i && d == s.size();
}
bool is_float_text(std::string_view s) {
  size_t i = !s.empty() && (s[0] == '+' || s[0] == '-') ? 1 : 0;
  const size_t int_end = skip_digits(s, i);
  const bool int_digits = int_end > i;
  i = int_end;
  if (i < s.size() && s[i] == '.') {
    const size_t frac_end = skip_digits(s, i + 1);
    if (!int_digits && frac_end == i + 1) return false;  // "." or ".e5": no digit at all
    i = frac_end;
  } else if (!int_digits) {
    return false;
  }
  if (i < s.size() && (s[i] == 'e' || s[i] == 'E')) {
    ++i;
    if (i < s.size() && (s[i] == '+' || s[i] == '-')) ++i;
    const size_t exp_end = skip_digits(s, i);
    if (exp_end == i) return false;
    i = exp_end;
  }
  return i == s.size();
}

// An integer literal beyond int64 (scalar_to_json keeps it as text).
bool int_beyond_int64(const std::string& s) {
  if (!is_int_text(s)) return false;
  errno = 0;
  char* end = nullptr;
  (void)std::strtoll(s.c_str(), &end, 10);
  return errno == ERANGE;
}

json scalar_to_json(const YAML::Node& n) {
  const std::string& s = n.Scalar();
  if (n.Tag() == "!") return s;  // quoted
  if (s.empty() || s == "~" || s == "null" || s == "Null" || s == "NULL") return nullptr;
  if (s == "true" || s == "True" || s == "TRUE") return true;
  if (s == "false" || s == "False" || s == "FALSE") return false;
  if (is_int_text(s)) {
    errno = 0;
    char* end = nullptr;
    long long v = std::strtoll(s.c_str(), &end, 10);
    if (errno == 0 && *end == '\0') return static_cast<int64_t>(v);
    return s;  // out of range: keep the text, the typed getters report it
  }
  // An overflowing float (1e999) becomes inf; every float field requires a finite value.
  if (is_float_text(s)) return std::strtod(s.c_str(), nullptr);
  return s;
}

class YamlConverter {
 public:
  // `what`: "recipe.yaml" or "recipe.yaml: --set k=v", the prefix of every error.
  explicit YamlConverter(std::string what) : what_(std::move(what)) {}

  json convert(const YAML::Node& root) { return node(root, ""); }

 private:
  std::string what_;
  int64_t nodes_ = 0;
  std::vector<YAML::Node> stack_;  // ancestors, to tell an alias cycle from deep nesting

  static int line(const YAML::Node& n) { return n.Mark().line + 1; }
  std::string at(const std::string& path) const { return path.empty() ? "the top level" : "'" + path + "'"; }

  void check_tag(const YAML::Node& n, const std::string& path) const {
    // "?" = no tag (plain scalar or collection); "!" = quoted scalar / non-specific tag.
    const std::string& tag = n.Tag();
    if (tag.empty() || tag == "?" || tag == "!") return;
    throw_error(
        "{}: line {}: explicit YAML tag '{}' at {} is not supported: recipes hold plain values (quote a value "
        "to make it a string, e.g. \"123\")",
        what_, line(n), excerpt(tag), at(path));
  }

  json node(const YAML::Node& n, const std::string& path) {
    if (++nodes_ > kMaxYamlNodes)
      throw_error("{}: the YAML expands to more than {} values (aliases repeating aliases?); a recipe has a few dozen",
                  what_, kMaxYamlNodes);
    for (const auto& a : stack_)
      if (a.is(n))
        throw_error(
            "{}: line {}: the alias at {} refers to a node that contains it (a cycle); a recipe cannot be "
            "infinite",
            what_, line(n), at(path));
    if (static_cast<int>(stack_.size()) >= kMaxYamlDepth)
      throw_error("{}: line {}: YAML nests deeper than {} levels at {}; a recipe nests 3", what_, line(n),
                  kMaxYamlDepth, at(path));
    check_tag(n, path);
    switch (n.Type()) {
      case YAML::NodeType::Null:
      case YAML::NodeType::Undefined:
        return nullptr;
      case YAML::NodeType::Scalar:
        // Strings end up in JSON (recipe.yaml, checkpoints), which requires UTF-8.
        if (!tok::is_valid_utf8(n.Scalar()))
          throw_error("{}: line {}: the value at {} is not valid UTF-8", what_, line(n), at(path));
        return scalar_to_json(n);
      case YAML::NodeType::Sequence: {
        stack_.push_back(n);
        json a = json::array();
        size_t i = 0;
        for (const auto& e : n) a.push_back(node(e, fmt::format("{}[{}]", path, i++)));
        stack_.pop_back();
        return a;
      }
      case YAML::NodeType::Map: {
        stack_.push_back(n);
        json o = json::object();
        std::map<std::string, int> key_lines;
        for (const auto& kv : n) {
          const YAML::Node& k = kv.first;
          if (!k.IsScalar())
            throw_error("{}: line {}: a key at {} is a {}; keys must be plain names", what_, line(k), at(path),
                        k.IsSequence() ? "list"
                        : k.IsMap()    ? "mapping"
                                       : "null");
          check_tag(k, path);
          const std::string key = k.Scalar();
          if (!tok::is_valid_utf8(key))
            throw_error("{}: line {}: a key at {} is not valid UTF-8", what_, line(k), at(path));
          const std::string sub = path.empty() ? key : path + "." + key;
          auto [it, fresh] = key_lines.emplace(key, line(k));
          if (!fresh)
            throw_error("{}: duplicate {} '{}' (lines {} and {}); YAML keeps only one of them, so give it once", what_,
                        path.empty() ? "section" : "key", excerpt(sub), it->second, line(k));
          o[key] = node(kv.second, sub);
        }
        stack_.pop_back();
        return o;
      }
    }
    return nullptr;
  }
};

// Records where each document starts; builds nothing (pass 1 of load_yaml).
class DocumentStarts : public YAML::EventHandler {
 public:
  std::vector<YAML::Mark> starts;
  void OnDocumentStart(const YAML::Mark& m) override { starts.push_back(m); }
  void OnDocumentEnd() override {}
  void OnNull(const YAML::Mark&, YAML::anchor_t) override {}
  void OnAlias(const YAML::Mark&, YAML::anchor_t) override {}
  void OnScalar(const YAML::Mark&, const std::string&, YAML::anchor_t, const std::string&) override {}
  void OnSequenceStart(const YAML::Mark&, const std::string&, YAML::anchor_t, YAML::EmitterStyle::value) override {}
  void OnSequenceEnd() override {}
  void OnMapStart(const YAML::Mark&, const std::string&, YAML::anchor_t, YAML::EmitterStyle::value) override {}
  void OnMapEnd() override {}
};

}  // namespace

bool yaml_int_out_of_range(const std::string& s) { return int_beyond_int64(s); }

json load_yaml(const std::string& text, const std::string& what) {
  YAML::Node doc;
  try {
    // Pass 1 counts documents, stopping at the second. Not YAML::LoadAll: on a stray ',' at the
    // top level yaml-cpp 0.7 returns an empty document at the same place forever, and LoadAll
    // collects them until memory runs out (found by fuzz_recipe).
    std::istringstream in(text);
    YAML::Parser parser(in);
    DocumentStarts docs;
    while (docs.starts.size() < 2 && parser.HandleNextDocument(docs)) {
    }
    if (docs.starts.size() >= 2) {
      const YAML::Mark &a = docs.starts[0], &b = docs.starts[1];
      if (b.pos == a.pos)
        throw_error(
            "{}: invalid YAML at line {}, column {}: the parser cannot get past this point (a stray ',' "
            "outside [ ] or {{ }}?)",
            what, a.line + 1, a.column + 1);
      throw_error(
          "{}: holds more than one YAML document (a second one starts at line {}); a recipe is one document: "
          "remove the '---' and what follows, or merge it into the first",
          what, b.line + 1);
    }
    doc = YAML::Load(text);
  } catch (const YAML::DeepRecursion& e) {
    throw_error("{}: YAML nests too deeply (more than {} levels at line {}, column {}); a recipe nests 3", what,
                e.depth(), e.mark.line + 1, e.mark.column + 1);
  } catch (const YAML::Exception& e) {
    throw_error("{}: invalid YAML: {}", what, e.what());
  }
  return YamlConverter(what).convert(doc);
}

std::string yaml_flow(const json& v) {
  if (v.is_null()) return "null";
  if (v.is_boolean()) return v.get<bool>() ? "true" : "false";
  if (v.is_number_integer()) return v.dump();
  if (v.is_number_float()) {
    std::string s = fmt::format("{}", v.get<double>());
    if (s.find_first_of(".en") == std::string::npos) s += ".0";
    return s;
  }
  if (v.is_string()) return v.dump();  // JSON escapes are valid in YAML double-quoted scalars
  if (v.is_array()) {
    std::string o = "[";
    for (size_t i = 0; i < v.size(); ++i) o += (i ? ", " : "") + yaml_flow(v[i]);
    return o + "]";
  }
  std::string o = "{";
  bool first = true;
  for (auto it = v.begin(); it != v.end(); ++it) {
    o += (first ? "" : ", ") + json(it.key()).dump() + ": " + yaml_flow(it.value());
    first = false;
  }
  return o + "}";
}


}  // namespace lathe::io
