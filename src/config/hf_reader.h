// config.json field access shared by the model_type readers (config/model_config.cpp,
// config/gemma2_config.cpp): typed getters whose errors name the file and key.
#pragma once
#include <fmt/format.h>

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "core/error.h"
#include "io/json.h"
#include "io/json_fields.h"

namespace lathe::hf_config {

using json = nlohmann::json;

// A value quoted in an error message, bounded (config.json is untrusted: a 1 MB string or a deep
// array must not be copied into the message whole).
inline std::string value_str(const json& v) {
  if (!v.is_string()) return io::json_excerpt(v);
  const std::string& s = v.get_ref<const std::string&>();
  return s.size() <= 120 ? s : s.substr(0, 120) + "...";
}

// Typed access with errors "<source>: <prefix><key>: expected ..., got '...'".
struct Reader {
  const json& j;
  std::string_view source, prefix;
  io::JsonFields f{io::JsonFields::Style::Expected,
                   [source = source, prefix = prefix](const std::string& key, const std::string& what) {
                     throw_error("{}: {}{}: {}", source, prefix, key, what);
                   },
                   value_str};

  [[noreturn]] void fail(const std::string& key, const std::string& what) const { f.fail(key, what); }
  bool has(const std::string& k) const { return io::JsonFields::find(j, k) != nullptr; }
  int64_t get_int(const std::string& k) const { return f.integer(j.at(k), k); }
  double get_double(const std::string& k) const { return f.number(j.at(k), k); }
  // Size fields: null is not "absent" (HF would crash on it); say so rather than take a default.
  bool has_size(const std::string& k) const {
    if (j.contains(k) && j.at(k).is_null())
      fail(k, "expected an integer, got null (remove the key to use the default, or give the value)");
    return has(k);
  }
  bool get_bool(const std::string& k) const { return f.boolean(j.at(k), k); }
  // A boolean key whose other value lathe does not compute: refused naming it and why.
  void require_bool(const char* k, bool want, const char* why) const {
    if (has(k) && get_bool(k) != want) fail(k, fmt::format("{} is not supported: {}", want ? "false" : "true", why));
  }
  std::string get_string(const std::string& k) const { return f.string(j.at(k), k); }
  // Token ids: integer, null (absent) or a list of integers (first is used).
  // Ids are int32 tokens; -1 is the old "none" spelling (written back as null).
  int64_t get_token(const std::string& k) const {
    const json& v = j.at(k);
    if (v.is_null()) return -1;
    int64_t id = 0;
    if (v.is_number_integer()) {
      id = v.get<int64_t>();
    } else if (v.is_array() && !v.empty() && v[0].is_number_integer()) {
      for (auto& e : v)
        if (!e.is_number_integer()) fail(k, fmt::format("expected integers, got '{}'", value_str(v)));
      id = v[0].get<int64_t>();
    } else {
      fail(k, fmt::format("expected an integer token id, got '{}'", value_str(v)));
    }
    if (v.is_number_unsigned() || (v.is_array() && v[0].is_number_unsigned()))
      if (id < 0) id = INT64_MAX;  // above 2^63: reported below as out of range
    if (id < -1 || id > INT32_MAX)
      fail(k, fmt::format("token id {} is out of range (0 .. {}, or null for none)", value_str(v.is_array() ? v[0] : v),
                          INT32_MAX));
    return id;
  }
  // Set `out` from the first present key of `names`; two present with different values is an
  // error (e.g. gpt2 "n_embd" and its alias "hidden_size").
  bool int_alias(std::initializer_list<const char*> names, int64_t* out) const {
    const char* found = nullptr;
    for (const char* n : names) {
      if (!has_size(n)) continue;
      int64_t v = get_int(n);
      if (found && v != *out)
        fail(n, fmt::format("{} conflicts with {}{} = {}; give only one of them", v, prefix, found, *out));
      if (!found) *out = v;
      found = n;
    }
    return found != nullptr;
  }
};

}  // namespace lathe::hf_config

namespace lathe {
struct ModelConfig;
// config/gemma2_config.cpp: Gemma2Config's keys, its reader (class defaults, strict checks) and the
// gemma2 part of ModelConfig::to_hf_json.
const std::vector<std::string>& gemma2_keys();
void read_gemma2(const hf_config::Reader& r, ModelConfig& c);
// config/phi3_config.cpp: Phi3Config's fields over the llama reader's.
void read_phi3(const hf_config::Reader& r, ModelConfig& c);
void gemma2_to_hf_json(const ModelConfig& c, nlohmann::json& j);
// config/mixtral_config.cpp (issue 28): MixtralConfig's keys, its reader and the mixtral part of
// ModelConfig::to_hf_json.
const std::vector<std::string>& mixtral_keys();
void read_mixtral(const hf_config::Reader& r, ModelConfig& c);
void mixtral_to_hf_json(const ModelConfig& c, nlohmann::json& j);
// config/olmo2_config.cpp: Olmo2Config's defaults and checks over the llama reader's fields, and the
// olmo2-debug preset.
void read_olmo2(const hf_config::Reader& r, ModelConfig& c);
// config/qwen2_moe_config.cpp: Qwen2MoeConfig's keys, its reader and the qwen2_moe part of
// ModelConfig::to_hf_json.
const std::vector<std::string>& qwen2_moe_keys();
void read_qwen2_moe(const hf_config::Reader& r, ModelConfig& c);
void qwen2_moe_to_hf_json(const ModelConfig& c, nlohmann::json& j);
ModelConfig make_olmo2_debug();
}  // namespace lathe
