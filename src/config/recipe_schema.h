// The recipe's schema: one row per key of a recipe (config/recipe.h), and everything generated from
// the rows: parsing with type errors, the known keys of each section (and the suggestion for an
// unknown one), the bounds checks, Recipe::to_json, and how a change of the key between a
// checkpoint's recipe and the run resuming it is classified (config/recipe_diff.h).
//
// A row names the key's path ("optimizer.lr"), the Recipe member it fills (its type gives the
// kind), its bounds, its effect on a resume and when it appears in to_json. The key's default is
// the member's initializer (the optim sections' defaults live in optim/*.h). Checks that relate
// two keys (schedule.min_lr <= optimizer.lr, training.seq_len <= the model's positions, ...) are
// written out after the row checks (config/recipe.cpp). The model section's HF fields are not
// rows: they are ModelConfig's (config/model_config.h); model.attention_kernel and
// model.init_from are.
#pragma once
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "config/recipe.h"

namespace lathe::schema {

// Where a value came from and how to name it in an error: "recipe.yaml: --set k=v: key: message".
class Reporter {
 public:
  Reporter(std::string source, std::map<std::string, std::string> set_paths)
      : src_(std::move(source)), set_(std::move(set_paths)) {}
  const std::string& source() const { return src_; }
  [[noreturn]] void bad(const std::string& path, const std::string& msg) const;
  [[noreturn]] void unknown(const std::string& path, const std::string& what,
                            const std::vector<std::string>& candidates) const;

 private:
  std::string origin(const std::string& path) const;
  std::string src_;
  std::map<std::string, std::string> set_;  // key path -> the --set argument that wrote it
};

enum class Kind {
  Int,     // int64_t
  Int32,   // int (range-checked when parsed)
  Float,   // double, finite
  Bool,    // true | false
  Text,    // a string; a number is taken as its text (`dir: 2024`), null as ""
  Choice,  // a string from `choices`, refused when parsed (null keeps the default)
  Custom,  // parsed and written by the row's functions (data.blend, parallel.stage_layers)
};

// What a different value of the key does to a resumed run (config/recipe_diff.h).
enum class OnResume {
  Breaks,      // the run would not continue the same (every key not listed otherwise)
  Harmless,    // logging, evaluation, output, process layout, anomaly policy, ...
  BatchSplit,  // harmless while micro_batch_size x grad_accum_steps x parallel.data stays the same
  LossScale,   // matters only where loss scaling is on in either recipe
};

struct Field;
struct CustomIo {
  void (*parse)(const nlohmann::json& v, Recipe& r, const Reporter& rep);
  nlohmann::json (*to_json)(const Recipe& r);
};

struct Field {
  std::string_view path;  // "optimizer.lr", "training.anomaly.ema_decay", "device"
  Kind kind = Kind::Int;
  void* (*ref)(Recipe&) = nullptr;  // the member the key fills
  // Integer bounds [min, max] (the message says "(note)" after them). Float bounds lo/hi, each end
  // open or closed, written as "> 0", ">= 0", "in (0, 1]" or as `range` when given.
  int64_t min = std::numeric_limits<int64_t>::min(), max = std::numeric_limits<int64_t>::max();
  double lo = -std::numeric_limits<double>::infinity(), hi = std::numeric_limits<double>::infinity();
  bool lo_open = false, hi_open = false;
  std::string_view range;
  std::string_view note;
  // Text: one of these (checked with the bounds; `refusal`, when given, replaces "is not supported
  // (supported: ...)"); Choice: checked when parsed.
  std::vector<std::string_view> choices;
  std::string_view refusal;
  OnResume on_resume = OnResume::Breaks;
  bool later = false;  // added after checkpoints were first written: absent compares as its default
  std::string_view json_if;  // in to_json only when this key differs from its default ("": always)
  const CustomIo* custom = nullptr;

  // Row builders, e.g. key<&Recipe::training, &Recipe::Training::steps>("training.steps").in(1, kMaxSteps).
  Field in(int64_t lo_, int64_t hi_, std::string_view note_ = {}) const;
  Field between(double lo_, bool lo_open_, double hi_, bool hi_open_, std::string_view note_ = {}) const;
  Field one_of(std::vector<std::string_view> c, std::string_view refusal_ = {}) const;  // Text
  Field choice(std::vector<std::string_view> c) const;                                  // -> Choice
  Field with(OnResume e) const;
  Field since_later() const;
  Field only_if(std::string_view key) const;
  Field with_range(std::string_view text) const;

  std::string section() const;  // "training.anomaly" of "training.anomaly.ema_decay"; "" at the top
  std::string name() const;     // "ema_decay"
};

template <class T>
constexpr Kind kind_of() {
  if constexpr (std::is_same_v<T, int64_t>) return Kind::Int;
  else if constexpr (std::is_same_v<T, int>) return Kind::Int32;
  else if constexpr (std::is_same_v<T, double>) return Kind::Float;
  else if constexpr (std::is_same_v<T, bool>) return Kind::Bool;
  else if constexpr (std::is_same_v<T, std::string>) return Kind::Text;
  else return Kind::Custom;
}

// The row of the member reached from a Recipe through the member pointers Ms.
template <auto... Ms>
Field key(std::string_view path, const CustomIo* custom = nullptr) {
  using T = std::remove_reference_t<decltype((std::declval<Recipe&>() .* ... .* Ms))>;
  Field f;
  f.path = path;
  f.kind = kind_of<T>();
  f.ref = [](Recipe& r) -> void* { return &(r .* ... .* Ms); };
  f.custom = custom;
  return f;
}

// A value quoted in an error: strings cut (io::excerpt), "null", "a list", "a mapping", numbers.
std::string describe(const nlohmann::json& v);
std::string join(const std::vector<std::string>& v);
// A Text value: a string, a number as its text (`dir: 2024`), null as ""; else an error naming path.
std::string text(const nlohmann::json& v, const std::string& path, const Reporter& rep);

// Every row, in the order the keys are parsed.
const std::vector<Field>& fields();
const Field* find(std::string_view path);
// The keys directly under `section` ("training": micro_batch_size, ..., anomaly), in row order.
std::vector<std::string> keys_of(const std::string& section);
// The sections below the top level that hold rows ("data", ..., "training.anomaly"), sorted.
std::vector<std::string> sections();

// One row's key from the mapping `obj` of its section (absent: the value stays as it is).
void parse_field(const Field& f, const nlohmann::json& obj, Recipe& r, const Reporter& rep);
// The rows outside the model section from the YAML tree `root`: type errors, unknown keys of
// nested sections; absent keys keep the Recipe's defaults.
void parse(const nlohmann::json& root, Recipe& r, const Reporter& rep);
// The bounds and choices of the rows directly in `section` ("training": not training.anomaly).
void check_bounds(const Recipe& r, const Reporter& rep, const std::string& section);
// The value of a row as it appears in to_json, and to_json's rows (into j, model section included).
nlohmann::json value_json(const Field& f, const Recipe& r);
void write_json(const Recipe& r, nlohmann::json& j);

// The class of a key of a flattened to_json tree: its row's, or for a key without a row (an HF
// field of the model, a key of another version) that of its nearest section whose rows all agree,
// else Breaks.
OnResume on_resume(const std::string& key);
// Keys added after checkpoints were first written, with the value an older recipe implied.
const std::vector<std::pair<std::string, nlohmann::json>>& later_defaults();

}  // namespace lathe::schema
