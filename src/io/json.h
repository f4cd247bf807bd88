// JSON from untrusted files (config.json, tokenizer.json, encoder.json, state.json, safetensors
// headers, JSONL lines). nlohmann::json parses iteratively, but copying, dumping and comparing a
// value recurse: a 60,000-level array overflows the stack in an error message or a checksum. So
// every untrusted document is checked for nesting depth before it is parsed, and values quoted in
// error messages are cut to a bounded excerpt.
#pragma once
#include <cstddef>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

namespace lathe::io {

// No file lathe reads legitimately nests deeper than a handful of levels; tokenizer.json's deepest
// (a Sequence of normalizers inside a Sequence) is under 10.
constexpr int kMaxJsonDepth = 64;

// Nesting depth of the first JSON value in `text` ({ and [ outside strings); stops counting (and
// returns a value > limit) as soon as `limit` is exceeded. Does not validate the JSON.
int json_nesting_depth(std::string_view text, int limit);

// Throws lathe::Error "WHAT: JSON nests deeper than LIMIT levels at byte OFFSET ..." when too deep.
void check_json_depth(std::string_view text, const std::string& what, int max_depth = kMaxJsonDepth);

// Parses an untrusted document: depth check, then nlohmann; a syntax error becomes lathe::Error
// "WHAT: not valid JSON: <nlohmann's message with the byte position>".
nlohmann::json parse_json(std::string_view text, const std::string& what, int max_depth = kMaxJsonDepth);

// Reads and parses a whole file (io::read_file, so only a regular file is accepted); errors name it.
nlohmann::json read_json_file(const std::string& path, int max_depth = kMaxJsonDepth);

// A value for an error message: compact JSON, at most max_chars characters (then "..."). Safe
// for any value that passed check_json_depth.
std::string json_excerpt(const nlohmann::json& v, size_t max_chars = 120);

// "a string", "an integer", "an array", ... for "must be X, got Y" messages.
const char* json_type_name(const nlohmann::json& v);

}  // namespace lathe::io
