#include "io/json.h"

#include "core/error.h"
#include "io/fs.h"

namespace lathe::io {

namespace {
// Same scan as json_nesting_depth, but also reports where the limit was crossed.
int scan_depth(std::string_view t, int limit, size_t* where) {
  int depth = 0, max_depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < t.size(); ++i) {
    const char c = t[i];
    if (in_string) {
      if (c == '\\')
        ++i;  // skip the escaped character (\" does not end the string)
      else if (c == '"')
        in_string = false;
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > max_depth) max_depth = depth;
      if (depth > limit) {
        if (where) *where = i;
        return depth;
      }
    } else if (c == ']' || c == '}') {
      if (--depth <= 0) return max_depth;  // end of the first value (or stray closer: the parser reports it)
    }
  }
  return max_depth;
}
}  // namespace

int json_nesting_depth(std::string_view text, int limit) { return scan_depth(text, limit, nullptr); }

void check_json_depth(std::string_view text, const std::string& what, int max_depth) {
  size_t where = 0;
  if (scan_depth(text, max_depth, &where) > max_depth)
    throw_error(
        "{}: JSON nests deeper than {} levels (at byte {}); no valid file of this kind does: the file is "
        "corrupt or hostile",
        what, max_depth, where);
}

nlohmann::json parse_json(std::string_view text, const std::string& what, int max_depth) {
  check_json_depth(text, what, max_depth);
  try {
    return nlohmann::json::parse(text.begin(), text.end());
  } catch (const nlohmann::json::exception& e) {
    // nlohmann quotes the whole last token: a 1 MB string would make a 1 MB message.
    std::string msg = e.what();
    if (msg.size() > 300) msg = msg.substr(0, 300) + "...";
    throw_error("{}: not valid JSON: {}", what, msg);
  }
}

nlohmann::json read_json_file(const std::string& path, int max_depth) {
  return parse_json(read_file(path), path, max_depth);
}

std::string json_excerpt(const nlohmann::json& v, size_t max_chars) {
  std::string s = v.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  if (s.size() > max_chars) {
    s.resize(max_chars);
    s += "...";
  }
  return s;
}

const char* json_type_name(const nlohmann::json& v) {
  switch (v.type()) {
    case nlohmann::json::value_t::null:
      return "null";
    case nlohmann::json::value_t::object:
      return "an object";
    case nlohmann::json::value_t::array:
      return "an array";
    case nlohmann::json::value_t::string:
      return "a string";
    case nlohmann::json::value_t::boolean:
      return "a boolean";
    case nlohmann::json::value_t::number_integer:
    case nlohmann::json::value_t::number_unsigned:
      return "an integer";
    case nlohmann::json::value_t::number_float:
      return "a number";
    default:
      return "a binary value";
  }
}

}  // namespace lathe::io
