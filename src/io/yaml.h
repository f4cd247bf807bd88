// YAML text -> JSON, for untrusted input (recipes and their --set values). YAML 1.2 core-schema
// typing of plain scalars (null, true/false, integers, floats); quoted scalars stay strings; an
// integer beyond int64 stays as its text (yaml_int_out_of_range tells such a string apart).
// The conversion is bounded (depth, total nodes after alias expansion, alias cycles) and refuses
// what a recipe never needs but could silently change its meaning: duplicate keys, a second
// document, explicit tags, non-scalar keys, text that is not UTF-8. Every error starts with `what`
// ("recipe.yaml" or "recipe.yaml: --set k=v") and names the line and the key path.
#pragma once
#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

namespace lathe::io {

// A recipe nests 3 levels (section, key, rope_parameters.rope_theta); anything deeper is not one.
constexpr int kMaxYamlDepth = 32;
// Nodes after alias expansion: a recipe has ~100; "billion laughs" expands 10 aliases of 10.
constexpr int64_t kMaxYamlNodes = 100000;

// The one entry point for YAML text: one document, bounded, converted as described above.
nlohmann::json load_yaml(const std::string& text, const std::string& what);

// True for an integer literal beyond int64 (load_yaml keeps it as a string).
bool yaml_int_out_of_range(const std::string& s);

// YAML text of a JSON value (flow style for lists and maps); doubles keep a '.' or an exponent so
// that they re-load as numbers of the same type, with the shortest round-trip digits.
std::string yaml_flow(const nlohmann::json& v);

// Text quoted in an error message, cut so that a 100 KB scalar does not flood the terminal.
std::string excerpt(std::string_view s, size_t max_chars = 80);

}  // namespace lathe::io
