// Typed reads of the fields of untrusted JSON (config.json, recipes as YAML trees, tokenizer.json,
// state.json): one place for the checks every format makes (the type, the 64-bit range, integer
// bounds, finiteness), so no nlohmann type error and no wrapped integer reaches the caller. The
// words of the errors are each format's own and stay so: a JsonFields carries the format's Style
// (how a wrong value is worded) and its sink (how the error names the file and the field).
#pragma once
#include <cstdint>
#include <functional>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

namespace lathe::io {

class JsonFields {
 public:
  // How the reader words what is wrong with a field (the `what` it hands to the sink).
  enum class Style {
    // config.json and recipes: "expected an integer, got 'VALUE'", "VALUE does not fit a 64-bit
    // integer", "X is out of range", "X is not a finite number" (VALUE as `describe` quotes it).
    Expected,
    // tokenizer.json: "must be an integer in [LO, HI], got TYPE: EXCERPT" ("got null"), "is missing
    // (it must be WANT)"; absent and null are the same.
    MustBe,
    // state.json: "must be an integer, got TYPE EXCERPT", "is X, outside [LO, HI]", "is X, above the
    // largest allowed HI", "is X, must be finite and >= LO", "is missing"; null is a value.
    Field,
  };
  // Throws the format's error: `field` names the value, `what` says what is wrong with it. A sink
  // that returns is followed by a plain lathe::Error "FIELD: WHAT".
  using Sink = std::function<void(const std::string& field, const std::string& what)>;
  // Quotes a wrong value in Expected messages (default: io::json_excerpt).
  using Describe = std::string (*)(const nlohmann::json&);

  JsonFields(Style style, Sink sink, Describe describe = nullptr)
      : style_(style), sink_(std::move(sink)), describe_(describe) {}

  [[noreturn]] void fail(const std::string& field, const std::string& what) const;
  // "`field` is not WANT" in the style's words ("a string", "an object", ...).
  [[noreturn]] void wrong(const std::string& field, const nlohmann::json& v, std::string_view want) const;

  // The member `key` of `obj`, or nullptr when `obj` is no object, has no such key or it is null.
  static const nlohmann::json* find(const nlohmann::json& obj, std::string_view key);
  // The member `key` of `obj` (named `field` in the error when missing; `want` says what it must be
  // in MustBe's "is missing (it must be WANT)").
  const nlohmann::json& at(const nlohmann::json& obj, std::string_view key, const std::string& field,
                           std::string_view want = {}) const;

  // An integer in [lo, hi]; integers beyond int64 are refused, never wrapped.
  int64_t integer(const nlohmann::json& v, const std::string& field,
                  int64_t lo = std::numeric_limits<int64_t>::min(),
                  int64_t hi = std::numeric_limits<int64_t>::max()) const;
  // A non-negative integer up to 2^64 - 1.
  uint64_t uint64(const nlohmann::json& v, const std::string& field) const;
  // A finite number >= lo (> lo when lo_open).
  double number(const nlohmann::json& v, const std::string& field,
                double lo = -std::numeric_limits<double>::infinity(), bool lo_open = false) const;
  bool boolean(const nlohmann::json& v, const std::string& field) const;
  std::string string(const nlohmann::json& v, const std::string& field) const;
  const nlohmann::json& object(const nlohmann::json& v, const std::string& field) const;
  const nlohmann::json& array(const nlohmann::json& v, const std::string& field) const;

 private:
  std::string quoted(const nlohmann::json& v) const;
  Style style_;
  Sink sink_;
  Describe describe_;
};

}  // namespace lathe::io
