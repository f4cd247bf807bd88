#include "io/json_fields.h"

#include <fmt/format.h>

#include <cmath>

#include "core/error.h"
#include "io/json.h"

namespace lathe::io {

using json = nlohmann::json;

void JsonFields::fail(const std::string& field, const std::string& what) const {
  sink_(field, what);
  throw Error(field + ": " + what);
}

std::string JsonFields::quoted(const json& v) const { return describe_ ? describe_(v) : json_excerpt(v); }

void JsonFields::wrong(const std::string& field, const json& v, std::string_view want) const {
  switch (style_) {
    case Style::Expected:
      fail(field, fmt::format("expected {}, got '{}'", want, quoted(v)));
    case Style::MustBe:
      fail(field, fmt::format("must be {}, got {}{}{}", want, json_type_name(v), v.is_null() ? "" : ": ",
                              v.is_null() ? "" : json_excerpt(v, 60)));
    case Style::Field:
      break;
  }
  fail(field, fmt::format("must be {}, got {} {}", want, json_type_name(v), json_excerpt(v, 60)));
}

const json* JsonFields::find(const json& obj, std::string_view key) {
  if (!obj.is_object()) return nullptr;
  auto it = obj.find(std::string(key));
  if (it == obj.end() || it->is_null()) return nullptr;
  return &*it;
}

const json& JsonFields::at(const json& obj, std::string_view key, const std::string& field,
                           std::string_view want) const {
  if (style_ == Style::MustBe) {
    const json* v = find(obj, key);
    if (!v) fail(field, fmt::format("is missing (it must be {})", want));
    return *v;
  }
  auto it = obj.find(std::string(key));
  if (it == obj.end()) fail(field, "is missing");
  return *it;
}

int64_t JsonFields::integer(const json& v, const std::string& field, int64_t lo, int64_t hi) const {
  const bool is_int = v.is_number_integer();
  const bool above = v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(hi);
  const auto outside = [&] { return v.get<int64_t>() < lo || v.get<int64_t>() > hi; };
  switch (style_) {
    case Style::Expected:
      if (!is_int) wrong(field, v, "an integer");
      if (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX))
        fail(field, fmt::format("{} does not fit a 64-bit integer", quoted(v)));
      if (outside()) fail(field, fmt::format("{} is out of range", v.get<int64_t>()));
      return v.get<int64_t>();
    case Style::MustBe:
      if (!is_int || above || outside()) wrong(field, v, fmt::format("an integer in [{}, {}]", lo, hi));
      return v.get<int64_t>();
    case Style::Field:
      break;
  }
  if (!is_int) wrong(field, v, "an integer");
  if (above) fail(field, fmt::format("is {}, above the largest allowed {}", v.get<uint64_t>(), hi));
  if (outside()) fail(field, fmt::format("is {}, outside [{}, {}]", v.get<int64_t>(), lo, hi));
  return v.get<int64_t>();
}

uint64_t JsonFields::uint64(const json& v, const std::string& field) const {
  if (!v.is_number_unsigned()) wrong(field, v, "an unsigned 64-bit integer");
  return v.get<uint64_t>();
}

double JsonFields::number(const json& v, const std::string& field, double lo, bool lo_open) const {
  if (!v.is_number()) wrong(field, v, "a number");
  const double x = v.get<double>();
  const bool below = x < lo || (lo_open && x == lo);
  if (style_ == Style::Field) {
    if (!std::isfinite(x) || below)
      fail(field, fmt::format("is {}, must be finite and {} {}", x, lo_open ? ">" : ">=", lo));
    return x;
  }
  // A recipe's 1e999 arrives as inf; it would pass every "> 0" check.
  if (!std::isfinite(x)) fail(field, fmt::format("{} is not a finite number", x));
  if (below) fail(field, fmt::format("{} must be {} {}", x, lo_open ? ">" : ">=", lo));
  return x;
}

bool JsonFields::boolean(const json& v, const std::string& field) const {
  if (!v.is_boolean()) wrong(field, v, style_ == Style::Expected ? "true or false" : "a boolean (true or false)");
  return v.get<bool>();
}

std::string JsonFields::string(const json& v, const std::string& field) const {
  if (!v.is_string()) wrong(field, v, "a string");
  return v.get<std::string>();
}

const json& JsonFields::object(const json& v, const std::string& field) const {
  if (!v.is_object()) wrong(field, v, "an object");
  return v;
}

const json& JsonFields::array(const json& v, const std::string& field) const {
  if (!v.is_array()) wrong(field, v, style_ == Style::Field ? "an array" : "a list");
  return v;
}

}  // namespace lathe::io
