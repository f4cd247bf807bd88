#include "config/recipe.h"

#include <yaml-cpp/depthguard.h>
#include <yaml-cpp/eventhandler.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <map>
#include <set>
#include <sstream>

#include "core/checked.h"
#include "core/error.h"
#include "core/utf8.h"  // header-only: the one UTF-8 validator
#include "io/fs.h"
#include "io/json.h"

namespace lathe {

using json = nlohmann::json;

std::string closest_match(std::string_view key, const std::vector<std::string>& candidates) {
  auto lower = [](std::string_view s) {
    std::string o(s);
    for (auto& c : o) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    return o;
  };
  const std::string k = lower(key);
  // "Close": at most 2 edits, or a third of the key's length for long keys.
  const size_t limit = std::max<size_t>(2, k.size() / 3);
  std::string best;
  size_t best_d = SIZE_MAX;
  for (const auto& cand : candidates) {
    const std::string c = lower(cand);
    // The distance is at least the length difference: skip hopeless pairs (a 100 KB key would
    // otherwise cost 100 KB x |candidate| steps per candidate).
    if (std::max(k.size(), c.size()) - std::min(k.size(), c.size()) > limit) continue;
    // Levenshtein distance, two rows.
    std::vector<size_t> prev(c.size() + 1), cur(c.size() + 1);
    for (size_t j = 0; j <= c.size(); ++j) prev[j] = j;
    for (size_t i = 1; i <= k.size(); ++i) {
      cur[0] = i;
      for (size_t j = 1; j <= c.size(); ++j)
        cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (k[i - 1] == c[j - 1] ? 0 : 1)});
      std::swap(prev, cur);
    }
    if (prev[c.size()] < best_d) {
      best_d = prev[c.size()];
      best = cand;
    }
  }
  return best_d <= limit ? best : std::string();
}

namespace {

// ---------------------------------------------------------------------------------------------
// YAML -> JSON with YAML 1.2 core-schema typing of plain scalars; quoted scalars stay strings.
// The input is untrusted: the conversion is bounded (depth, total nodes after alias expansion,
// alias cycles) and refuses what a recipe never needs but could silently change its meaning
// (duplicate keys, a second document, explicit tags, non-scalar keys).

// A recipe nests 3 levels (section, key, rope_parameters.rope_theta); anything deeper is not one.
constexpr int kMaxYamlDepth = 32;
// Nodes after alias expansion: a recipe has ~100; "billion laughs" expands 10 aliases of 10.
constexpr int64_t kMaxYamlNodes = 100000;

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
bool int_out_of_range(const std::string& s) {
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

// Text quoted in an error message, cut so that a 100 KB scalar does not flood the terminal.
std::string excerpt(std::string_view s, size_t max_chars = 80) {
  if (s.size() <= max_chars) return std::string(s);
  return fmt::format("{}... ({} characters)", s.substr(0, max_chars), s.size());
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

// The one entry point for YAML text (recipe files and --set values): one document, bounded.
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

std::string value_str(const json& v) {
  if (v.is_string()) return excerpt(v.get_ref<const std::string&>());
  if (v.is_null()) return "null";
  if (v.is_array()) return "a list";
  if (v.is_object()) return "a mapping";
  return v.dump();
}

// ---------------------------------------------------------------------------------------------

const std::vector<std::string> kSections = {"model",    "data",      "optimizer", "schedule",
                                            "training", "precision", "parallel",  "output"};
const std::map<std::string, std::vector<std::string>> kSectionKeys = {
    {"data",
     {"train", "valid", "valid_fraction", "tokenizer", "prefetch", "blend", "attention", "reset_position_ids",
      "mask_loss_after_eod", "eod_token"}},
    {"optimizer", {"name", "lr", "beta1", "beta2", "eps", "weight_decay", "grad_clip"}},
    {"schedule", {"name", "warmup_steps", "min_lr", "decay_fraction", "decay_shape"}},
    {"training",
     {"micro_batch_size", "seq_len", "grad_accum_steps", "steps", "seed", "eval_interval", "eval_batches",
      "log_interval", "threads", "peak_gflops", "resume", "max_skipped_steps", "anomaly", "eval_tasks",
      "eval_tasks_interval"}},
    {"precision", {"compute", "loss_scale"}},
    {"output", {"dir", "save_every", "checkpoint_every", "keep_last"}},
    {"parallel",
     {"data", "tensor", "pipeline", "virtual_stages", "stage_layers", "zero", "bucket_mb", "timeout_s", "sequence"}},
};
const std::vector<std::string> kModelBaseKeys = {"preset", "init_from", "config"};
// model.attention_kernel: lathe's attention kernels or cuDNN's fused SDPA (CUDA, bf16/fp16).
const std::vector<std::string> kAttentionKernels = {"lathe", "cudnn"};
const std::vector<std::string> kSchedules = {"cosine", "linear", "constant", "wsd"};
const std::vector<std::string> kDecayShapes = {"linear", "cosine", "1-sqrt"};
const std::vector<std::string> kOptimizers = {"adamw", "lamb"};
const std::vector<std::string> kComputeDtypes = {"fp32", "bf16", "fp16"};
const std::vector<std::string> kRecomputeModes = {"none", "selective", "full"};
const std::vector<std::string> kDevices = {"cpu", "cuda"};
const std::vector<std::string> kLossScaleKeys = {"enabled", "initial", "growth_interval", "backoff", "growth", "min"};
const std::vector<std::string> kAnomalyKeys = {
    "enabled",   "warmup_steps", "ema_decay",      "loss_z_threshold", "grad_norm_z_threshold", "min_rel_std",  "skip",
    "lr_factor", "lr_steps",     "rollback_after", "rollback_window",  "skip_samples",          "max_rollbacks"};

std::string join(const std::vector<std::string>& v) {
  std::string o;
  for (auto& s : v) o += (o.empty() ? "" : ", ") + s;
  return o;
}

class Parser {
 public:
  Parser(const std::string& source, json root, std::map<std::string, std::string> set_paths)
      : src_(source), root_(std::move(root)), set_(std::move(set_paths)) {}

  Recipe parse() {
    Recipe r;
    r.source = src_;
    check_unknown_sections();
    json model = section("model");
    parse_model(model, r);
    for (auto& [sec, keys] : kSectionKeys) check_keys(sec, section(sec), keys);

    json d = section("data");
    get_str(d, "data", "train", &r.data.train);
    get_str(d, "data", "valid", &r.data.valid);
    get_double(d, "data", "valid_fraction", &r.data.valid_fraction);
    get_str(d, "data", "tokenizer", &r.data.tokenizer);
    get_int32(d, "data", "prefetch", &r.data.prefetch);
    if (d.contains("blend") && !d["blend"].is_null()) parse_blend(d["blend"], r);
    get_str(d, "data", "attention", &r.data.attention);
    get_bool(d, "data", "reset_position_ids", &r.data.reset_position_ids);
    get_bool(d, "data", "mask_loss_after_eod", &r.data.mask_loss_after_eod);
    get_int(d, "data", "eod_token", &r.data.eod_token);

    json o = section("optimizer");
    get_str(o, "optimizer", "name", &r.optimizer.name);
    get_double(o, "optimizer", "lr", &r.optimizer.lr);
    get_double(o, "optimizer", "beta1", &r.optimizer.beta1);
    get_double(o, "optimizer", "beta2", &r.optimizer.beta2);
    get_double(o, "optimizer", "eps", &r.optimizer.eps);
    get_double(o, "optimizer", "weight_decay", &r.optimizer.weight_decay);
    get_double(o, "optimizer", "grad_clip", &r.optimizer.grad_clip);

    json s = section("schedule");
    get_str(s, "schedule", "name", &r.schedule.name);
    get_int(s, "schedule", "warmup_steps", &r.schedule.warmup_steps);
    get_double(s, "schedule", "min_lr", &r.schedule.min_lr);
    get_double(s, "schedule", "decay_fraction", &r.schedule.decay_fraction);
    get_str(s, "schedule", "decay_shape", &r.schedule.decay_shape);

    json t = section("training");
    auto& tr = r.training;
    get_int(t, "training", "micro_batch_size", &tr.micro_batch_size);
    get_int(t, "training", "seq_len", &tr.seq_len);
    get_int(t, "training", "grad_accum_steps", &tr.grad_accum_steps);
    get_int(t, "training", "steps", &tr.steps);
    get_int(t, "training", "seed", &tr.seed);
    get_int(t, "training", "eval_interval", &tr.eval_interval);
    get_int(t, "training", "eval_batches", &tr.eval_batches);
    get_int(t, "training", "log_interval", &tr.log_interval);
    get_int32(t, "training", "threads", &tr.threads);
    get_double(t, "training", "peak_gflops", &tr.peak_gflops);
    get_str(t, "training", "resume", &tr.resume);
    get_int(t, "training", "max_skipped_steps", &tr.max_skipped_steps);
    get_str(t, "training", "eval_tasks", &tr.eval_tasks);
    get_int(t, "training", "eval_tasks_interval", &tr.eval_tasks_interval);
    parse_anomaly(t, r);

    parse_precision(section("precision"), r);
    // recompute: none | selective | full (a top-level value beside the sections, as in the issue's
    // recipes): which activations backward recomputes instead of keeping (models/recompute.h).
    if (!root_.is_null() && root_.contains("recompute") && !root_["recompute"].is_null()) {
      const json& rc = root_["recompute"];
      if (!rc.is_string() ||
          std::find(kRecomputeModes.begin(), kRecomputeModes.end(), rc.get<std::string>()) == kRecomputeModes.end())
        bad("recompute",
            fmt::format("must be one of {} (default none), got '{}'", join(kRecomputeModes), value_str(rc)));
      r.recompute = rc.get<std::string>();
    }
    // device: cpu | cuda (top-level, as recompute): whether this build and machine can run it is
    // checked where the backend is chosen (train/device_select.cpp), not here.
    if (!root_.is_null() && root_.contains("device") && !root_["device"].is_null()) {
      const json& dv = root_["device"];
      if (!dv.is_string() || std::find(kDevices.begin(), kDevices.end(), dv.get<std::string>()) == kDevices.end())
        bad("device", fmt::format("must be one of {} (default cpu), got '{}'", join(kDevices), value_str(dv)));
      r.device = dv.get<std::string>();
    }

    json out = section("output");
    get_str(out, "output", "dir", &r.output.dir);
    get_int(out, "output", "save_every", &r.output.save_every);
    get_int(out, "output", "checkpoint_every", &r.output.checkpoint_every);
    get_int(out, "output", "keep_last", &r.output.keep_last);

    json par = section("parallel");
    get_int(par, "parallel", "data", &r.parallel.data);
    get_int(par, "parallel", "tensor", &r.parallel.tensor);
    get_bool(par, "parallel", "sequence", &r.parallel.sequence);
    get_int(par, "parallel", "pipeline", &r.parallel.pipeline);
    get_int(par, "parallel", "virtual_stages", &r.parallel.virtual_stages);
    if (par.contains("stage_layers") && !par["stage_layers"].is_null()) {
      const json& sl = par["stage_layers"];
      if (!sl.is_array() || sl.size() > 4096)
        bad("parallel.stage_layers",
            fmt::format("expected a list of at most 4096 layer counts (one per pipeline stage), got '{}'",
                        value_str(sl)));
      for (const json& v : sl) {
        if (!v.is_number_integer())
          bad("parallel.stage_layers", fmt::format("entry '{}' is not an integer layer count", value_str(v)));
        r.parallel.stage_layers.push_back(v.get<int64_t>());
      }
    }
    get_int(par, "parallel", "zero", &r.parallel.zero);
    get_double(par, "parallel", "bucket_mb", &r.parallel.bucket_mb);
    get_double(par, "parallel", "timeout_s", &r.parallel.timeout_s);

    validate(r);
    if (r.attention_kernel == "cudnn" && r.data.attention == "document")
      r.notes.push_back(
          "model.attention_kernel: cudnn with data.attention: document: document-masked passes run lathe's attention "
          "kernel (cuDNN's SDPA here is plain causal)");
    return r;
  }

 private:
  std::string src_;
  json root_;
  std::map<std::string, std::string> set_;  // key path -> the --set argument that wrote it

  std::string origin(const std::string& path) const {
    // The override wrote `path` itself or something below it (an unknown section).
    for (const auto& [p, ov] : set_)
      if (p == path || p.rfind(path + ".", 0) == 0) return fmt::format("--set {}: ", excerpt(ov));
    return {};
  }
  [[noreturn]] void unknown(const std::string& path, const std::string& what,
                            const std::vector<std::string>& candidates) const {
    std::string near = closest_match(path, candidates);
    throw_error("{}: {}unknown {} '{}'{}", src_, origin(path), what, excerpt(path),
                near.empty() ? std::string() : fmt::format(" (did you mean '{}'?)", near));
  }
  [[noreturn]] void bad(const std::string& path, const std::string& msg) const {
    throw_error("{}: {}{}: {}", src_, origin(path), excerpt(path), msg);
  }

  void check_unknown_sections() const {
    if (root_.is_null()) return;
    if (!root_.is_object()) throw_error("{}: a recipe must be a YAML mapping of sections ({})", src_, join(kSections));
    for (auto it = root_.begin(); it != root_.end(); ++it)
      if (std::find(kSections.begin(), kSections.end(), it.key()) == kSections.end() && it.key() != "recompute" &&
          it.key() != "device")
        unknown(it.key(), "section", [] {
          auto v = kSections;
          v.push_back("recompute");
          v.push_back("device");
          return v;
        }());
  }
  json section(const std::string& name) const {
    if (root_.is_null() || !root_.contains(name) || root_[name].is_null()) return json::object();
    const json& s = root_[name];
    if (!s.is_object()) bad(name, fmt::format("expected a mapping of keys, got '{}'", value_str(s)));
    return s;
  }
  void check_keys(const std::string& sec, const json& obj, const std::vector<std::string>& keys) const {
    std::vector<std::string> full;
    for (auto& k : keys) full.push_back(sec + "." + k);
    for (auto it = obj.begin(); it != obj.end(); ++it)
      if (std::find(keys.begin(), keys.end(), it.key()) == keys.end()) unknown(sec + "." + it.key(), "key", full);
  }

  void get_int(const json& o, const std::string& sec, const char* k, int64_t* out) const {
    if (!o.contains(k)) return;
    const json& v = o[k];
    if (v.is_string() && int_out_of_range(v.get_ref<const std::string&>()))  // kept as text by scalar_to_json
      bad(sec + "." + k, fmt::format("{} does not fit a 64-bit integer", value_str(v)));
    if (!v.is_number_integer()) bad(sec + "." + k, fmt::format("expected an integer, got '{}'", value_str(v)));
    *out = v.get<int64_t>();
  }
  void get_int32(const json& o, const std::string& sec, const char* k, int* out) const {
    int64_t v = *out;
    get_int(o, sec, k, &v);
    if (v < INT32_MIN || v > INT32_MAX) bad(sec + "." + k, fmt::format("{} is out of range", v));
    *out = static_cast<int>(v);
  }
  // Every float field must be finite: 1e999 reads as inf, which passes "> 0" and "<= x" checks.
  void get_double(const json& o, const std::string& sec, const char* k, double* out) const {
    if (!o.contains(k)) return;
    const json& v = o[k];
    if (!v.is_number()) bad(sec + "." + k, fmt::format("expected a number, got '{}'", value_str(v)));
    const double d = v.get<double>();
    if (!std::isfinite(d)) bad(sec + "." + k, fmt::format("{} is not a finite number", d));
    *out = d;
  }
  void get_str(const json& o, const std::string& sec, const char* k, std::string* out) const {
    if (!o.contains(k)) return;
    const json& v = o[k];
    if (v.is_null()) {
      *out = "";
      return;
    }
    if (v.is_number()) {  // e.g. `dir: 2024` is a plain YAML int; treat it as the text
      *out = v.dump();
      return;
    }
    if (!v.is_string()) bad(sec + "." + k, fmt::format("expected a string, got '{}'", value_str(v)));
    *out = v.get<std::string>();
  }

  void get_bool(const json& o, const std::string& sec, const char* k, bool* out) const {
    if (!o.contains(k)) return;
    const json& v = o[k];
    if (!v.is_boolean()) bad(sec + "." + k, fmt::format("expected true or false, got '{}'", value_str(v)));
    *out = v.get<bool>();
  }

  // training.anomaly: {enabled, ...} (train/anomaly.h); absent or null = the defaults (off).
  void parse_anomaly(const json& t, Recipe& r) const {
    if (!t.contains("anomaly") || t["anomaly"].is_null()) return;
    const json& a = t["anomaly"];
    if (!a.is_object())
      bad("training.anomaly",
          fmt::format("expected a mapping of keys ({}), got '{}'", join(kAnomalyKeys), value_str(a)));
    check_keys("training.anomaly", a, kAnomalyKeys);
    auto& x = r.training.anomaly;
    const std::string sec = "training.anomaly";
    get_bool(a, sec, "enabled", &x.enabled);
    get_int(a, sec, "warmup_steps", &x.warmup_steps);
    get_double(a, sec, "ema_decay", &x.ema_decay);
    get_double(a, sec, "loss_z_threshold", &x.loss_z_threshold);
    get_double(a, sec, "grad_norm_z_threshold", &x.grad_norm_z_threshold);
    get_double(a, sec, "min_rel_std", &x.min_rel_std);
    get_bool(a, sec, "skip", &x.skip);
    get_double(a, sec, "lr_factor", &x.lr_factor);
    get_int(a, sec, "lr_steps", &x.lr_steps);
    get_int(a, sec, "rollback_after", &x.rollback_after);
    get_int(a, sec, "rollback_window", &x.rollback_window);
    get_int(a, sec, "skip_samples", &x.skip_samples);
    get_int(a, sec, "max_rollbacks", &x.max_rollbacks);
  }

  // precision: {compute, loss_scale: {...}}. Loss scaling is on for fp16 unless disabled, and
  // only with `enabled: true` for fp32/bf16; other loss_scale keys for those are noted, not refused
  // (a recipe switched from fp16 to bf16 keeps working).
  void parse_precision(const json& p, Recipe& r) const {
    auto& pr = r.precision;
    get_str(p, "precision", "compute", &pr.compute);
    json ls = json::object();
    if (p.contains("loss_scale") && !p["loss_scale"].is_null()) {
      ls = p["loss_scale"];
      if (!ls.is_object())
        bad("precision.loss_scale",
            fmt::format("expected a mapping of keys ({}), got '{}'", join(kLossScaleKeys), value_str(ls)));
    }
    check_keys("precision.loss_scale", ls, kLossScaleKeys);
    auto& l = pr.loss_scale;
    l.enabled = pr.compute == "fp16";
    get_bool(ls, "precision.loss_scale", "enabled", &l.enabled);
    get_double(ls, "precision.loss_scale", "initial", &l.initial);
    get_int(ls, "precision.loss_scale", "growth_interval", &l.growth_interval);
    get_double(ls, "precision.loss_scale", "backoff", &l.backoff);
    get_double(ls, "precision.loss_scale", "growth", &l.growth);
    get_double(ls, "precision.loss_scale", "min", &l.min);
    const bool given = std::any_of(ls.begin(), ls.end(), [](const json& v) { return !v.is_null(); });
    if (pr.compute != "fp16" && !l.enabled && given)
      r.notes.push_back(fmt::format(
          "precision.loss_scale is ignored: loss scaling is for precision.compute fp16, this recipe computes in {} "
          "(set precision.loss_scale.enabled: true to scale the loss anyway)",
          pr.compute));
    if (pr.compute == "fp16" && !l.enabled)
      r.notes.push_back(
          "precision.loss_scale.enabled is false with fp16 compute: gradients below fp16's range (~6e-8) become "
          "zero and overflows are only skipped, never corrected");
  }

  // model: base (preset | init_from | config) + explicit HF fields.
  void parse_model(const json& m, Recipe& r) {
    std::vector<std::string> bases;
    for (auto& k : kModelBaseKeys)
      if (m.contains(k) && !m[k].is_null()) bases.push_back(k);
    if (bases.size() > 1)
      bad("model", fmt::format("give only one of model.preset, model.init_from, model.config (got {})", join(bases)));
    json base;  // null = no base
    std::string base_desc;
    if (!bases.empty()) {
      const std::string& k = bases[0];
      std::string val;
      get_str(m, "model", k.c_str(), &val);
      if (val.empty()) bad("model." + k, "is empty");
      if (k == "preset") {
        try {
          base = ModelConfig::preset(val).to_hf_json();
        } catch (const Error& e) {
          bad("model.preset", e.what());
        }
        base_desc = "preset " + val;
      } else {
        std::string file = k == "init_from" ? val + "/config.json" : val;
        try {
          base = io::read_json_file(file);  // regular file only, depth-checked
        } catch (const Error& e) {
          bad("model." + k, e.what());
        }
        // Validate the file on its own so that its errors name it; unknown keys there are fine.
        ModelConfig::from_hf_json(base, file, false);
        base_desc = file;
        if (k == "init_from") r.init_from = val;
      }
    }
    if (m.contains("attention_kernel") && !m["attention_kernel"].is_null()) {  // not an HF field
      const json& ak = m["attention_kernel"];
      if (!ak.is_string() || std::find(kAttentionKernels.begin(), kAttentionKernels.end(), ak.get<std::string>()) ==
                                 kAttentionKernels.end())
        bad("model.attention_kernel",
            fmt::format("must be one of {} (default lathe), got '{}'", join(kAttentionKernels), value_str(ak)));
      r.attention_kernel = ak.get<std::string>();
    }
    json explicit_ = json::object();
    for (auto it = m.begin(); it != m.end(); ++it)
      if (std::find(kModelBaseKeys.begin(), kModelBaseKeys.end(), it.key()) == kModelBaseKeys.end() &&
          it.key() != "attention_kernel")
        explicit_[it.key()] = it.value();

    std::string mt;
    if (explicit_.contains("model_type")) {
      if (!explicit_["model_type"].is_string())
        bad("model.model_type", fmt::format("expected a string, got '{}'", value_str(explicit_["model_type"])));
      mt = explicit_["model_type"].get<std::string>();
    } else if (!base.is_null()) {
      mt = base.value("model_type", "");
    } else {
      bad("model",
          "give model.preset, model.init_from, model.config, or model.model_type (gpt2, llama, qwen2, "
          "mistral) with its HF fields");
    }
    static const std::vector<std::string> types = {"gpt2", "llama", "qwen2", "mistral"};
    if (std::find(types.begin(), types.end(), mt) == types.end())
      bad("model.model_type", fmt::format("'{}' is not supported (supported: {})", mt, join(types)));

    // Explicit keys are checked strictly against the model_type's field names.
    std::vector<std::string> known = ModelConfig::known_keys(mt);
    std::vector<std::string> full;
    for (auto& k : known) full.push_back("model." + k);
    for (auto& k : kModelBaseKeys) full.push_back("model." + k);
    for (auto it = explicit_.begin(); it != explicit_.end(); ++it) {
      if (std::find(known.begin(), known.end(), it.key()) == known.end()) unknown("model." + it.key(), "key", full);
      static const std::set<std::string> dropout = {"resid_pdrop", "embd_pdrop", "attn_pdrop", "attention_dropout",
                                                    "summary_first_dropout"};
      if (dropout.count(it.key()) && !(it.value().is_number() && it.value().get<double>() == 0.0))
        bad("model." + it.key(),
            fmt::format("{} is not supported: lathe does not implement dropout (use 0)", value_str(it.value())));
    }

    json merged = base.is_null() ? json::object() : base;
    if (!base.is_null() && merged.value("model_type", "") != mt) {
      std::string from = merged.value("model_type", "");
      if ((from == "gpt2") != (mt == "gpt2"))
        bad("model.model_type", fmt::format("'{}' cannot replace model_type '{}' of {} (different architecture "
                                            "family); drop the base or use a matching one",
                                            mt, from, base_desc));
      // Same family (llama <-> qwen2 <-> mistral): keep only the fields the new type knows.
      for (auto it = merged.begin(); it != merged.end();)
        if (std::find(known.begin(), known.end(), it.key()) == known.end() || it.key() == "attention_bias" ||
            it.key() == "architectures")
          it = merged.erase(it);
        else
          ++it;
    }
    // GPT-2 field names and their HF aliases: an explicit one replaces all spellings of the base.
    static const std::vector<std::vector<std::string>> groups = {{"n_positions", "max_position_embeddings", "n_ctx"},
                                                                 {"n_embd", "hidden_size"},
                                                                 {"n_layer", "num_hidden_layers"},
                                                                 {"n_head", "num_attention_heads"}};
    // Llama family: rope_theta also lives inside the v5 rope_parameters object.
    static const std::vector<std::vector<std::string>> llama_groups = {{"rope_theta", "rope_parameters"}};
    for (const auto& g : mt == "gpt2" ? groups : llama_groups)
      for (const auto& k : g)
        if (explicit_.contains(k))
          for (const auto& other : g) merged.erase(other);
    for (auto it = explicit_.begin(); it != explicit_.end(); ++it) merged[it.key()] = it.value();
    merged["model_type"] = mt;
    r.model = ModelConfig::from_hf_json(merged, src_, "model.", false);
    // Unknown keys can only come from the base config.json (explicit ones were checked above).
  }

  // data.blend: a list of {prefix, weight, epochs?}; errors name the entry index and key.
  void parse_blend(const json& b, Recipe& r) const {
    if (!b.is_array())
      bad("data.blend", fmt::format("expected a list of {{prefix, weight, epochs}} entries, got '{}'", value_str(b)));
    if (b.empty()) bad("data.blend", "is an empty list: give at least one {prefix, weight} entry (or use data.train)");
    static const std::vector<std::string> keys = {"prefix", "weight", "epochs"};
    for (size_t i = 0; i < b.size(); ++i) {
      const std::string at = fmt::format("data.blend[{}]", i);
      const json& e = b[i];
      if (!e.is_object())
        bad(at, fmt::format("expected a mapping {{prefix: PATH, weight: W}}, got '{}'", value_str(e)));
      std::vector<std::string> full;
      for (auto& k : keys) full.push_back(at + "." + k);
      for (auto it = e.begin(); it != e.end(); ++it)
        if (std::find(keys.begin(), keys.end(), it.key()) == keys.end()) unknown(at + "." + it.key(), "key", full);
      Recipe::Data::BlendEntry x;
      get_str(e, at, "prefix", &x.prefix);
      if (x.prefix.empty())
        bad(at + ".prefix", "is missing: give the Megatron prefix of a tokenized dataset (path without .bin/.idx)");
      if (!e.contains("weight")) bad(at + ".weight", "is missing: give a positive weight (weights need not sum to 1)");
      get_double(e, at, "weight", &x.weight);
      if (!(x.weight > 0)) bad(at + ".weight", fmt::format("{} must be > 0 (weights need not sum to 1)", x.weight));
      get_double(e, at, "epochs", &x.epochs);
      if (x.epochs < 0)
        bad(at + ".epochs", fmt::format("{} must be > 0 (a cap on passes over {}), or 0 for none", x.epochs, x.prefix));
      r.data.blend.push_back(std::move(x));
    }
  }

  void validate(const Recipe& r) const {
    const auto& t = r.training;
    const auto& o = r.optimizer;
    const auto& s = r.schedule;
    const auto& d = r.data;
    auto need = [&](bool ok, const std::string& path, const std::string& msg) {
      if (!ok) bad(path, msg);
    };
    auto in_range = [&](const std::string& path, int64_t v, int64_t lo, int64_t hi, const char* note = "") {
      if (v < lo) bad(path, fmt::format("{} must be >= {}{}", v, lo, note));
      if (v > hi) bad(path, fmt::format("{} exceeds the maximum {}{}", v, hi, note));
    };
    // data
    need(!d.train.empty() || !d.blend.empty(), "data.train",
         "is missing: give the Megatron prefix of the tokenized training data (path without .bin/.idx), or a "
         "weighted data.blend of prefixes");
    need(d.train.empty() || d.blend.empty(), "data.blend",
         fmt::format("and data.train ({}) are both set: a run trains on one or the other; remove one", d.train));
    need(d.valid_fraction >= 0 && d.valid_fraction < 1, "data.valid_fraction",
         fmt::format("{} must be in [0, 1)", d.valid_fraction));
    in_range("data.prefetch", d.prefetch, 0, kMaxPrefetch);
    if (d.tokenizer == "byte")
      need(r.model.vocab_size >= 256, "data.tokenizer",
           fmt::format("'byte' needs model vocab_size >= 256, got {}", r.model.vocab_size));
    need(d.attention == "causal" || d.attention == "document", "data.attention",
         fmt::format("'{}' is not known; use causal (attention across the whole sample) or document (each token "
                     "attends only to its own document, split after every EOD token)",
                     d.attention));
    need(d.eod_token >= -1 && d.eod_token < r.model.vocab_size, "data.eod_token",
         fmt::format("{} is outside the model's vocabulary [0, {}) (-1: the tokenizer's EOS id)", d.eod_token,
                     r.model.vocab_size));
    // model.attention_kernel: cudnn (whether this build has cuDNN is checked where the op table is
    // chosen, train/preflight.cpp's compute_spec)
    if (r.attention_kernel == "cudnn") {
      need(r.device == "cuda", "model.attention_kernel",
           fmt::format("cudnn runs on GPUs only and this recipe's device is {}: set device: cuda, or "
                       "model.attention_kernel: lathe",
                       r.device));
      need(r.precision.compute == "bf16" || r.precision.compute == "fp16", "model.attention_kernel",
           fmt::format("cudnn (cuDNN's fused SDPA) computes in bf16 or fp16 only and precision.compute is {}: set "
                       "precision.compute: bf16, or model.attention_kernel: lathe",
                       r.precision.compute));
    }
    // training
    in_range("training.micro_batch_size", t.micro_batch_size, 1, kMaxMicroBatch);
    in_range("training.grad_accum_steps", t.grad_accum_steps, 1, kMaxGradAccum);
    in_range("training.steps", t.steps, 1, kMaxSteps);
    in_range("training.seq_len", t.seq_len, 1, kMaxSeqLen);
    need(t.seq_len <= r.model.max_position_embeddings, "training.seq_len",
         fmt::format("{} exceeds the model's max_position_embeddings{} = {}", t.seq_len,
                     r.model.is_gpt2() ? " (n_positions)" : "", r.model.max_position_embeddings));
    need(r.model.sliding_window == 0 || t.seq_len <= r.model.sliding_window, "training.seq_len",
         fmt::format("{} exceeds model.sliding_window = {}; lathe implements full attention only, which differs "
                     "from sliding-window attention beyond the window",
                     t.seq_len, r.model.sliding_window));
    in_range("training.eval_interval", t.eval_interval, 0, kMaxSteps, " (0 = no eval)");
    in_range("training.eval_batches", t.eval_batches, 1, kMaxEvalBatches);
    in_range("training.log_interval", t.log_interval, 1, kMaxSteps);
    in_range("training.eval_tasks_interval", t.eval_tasks_interval, 0, kMaxSteps, " (0 = training.eval_interval)");
    in_range("training.threads", t.threads, 0, kMaxThreads, " (0 = all cores)");
    // Sample and token counters of the run (consumed_samples, tokens seen) must fit 64 bits.
    checked_product({t.steps, t.micro_batch_size, t.grad_accum_steps, t.seq_len,
                     std::max<int64_t>(1, std::min<int64_t>(r.parallel.data, kMaxRanks))},
                    fmt::format("{}: training.steps x micro_batch_size x grad_accum_steps x seq_len x parallel.data "
                                "(tokens of the run)",
                                src_));
    need(t.peak_gflops >= 0 && std::isfinite(t.peak_gflops), "training.peak_gflops",
         fmt::format("{} must be >= 0 (0 = measure)", t.peak_gflops));
    if (t.eval_interval > 0 && !d.blend.empty())
      need(!d.valid.empty(), "training.eval_interval",
           fmt::format("{} needs validation data: with data.blend set data.valid (valid_fraction does not apply to "
                       "a blend), or eval_interval 0",
                       t.eval_interval));
    if (t.eval_interval > 0)
      need(!d.valid.empty() || d.valid_fraction > 0, "training.eval_interval",
           fmt::format("{} needs validation data: set data.valid or data.valid_fraction > 0 (or eval_interval 0)",
                       t.eval_interval));
    // optimizer
    need(std::find(kOptimizers.begin(), kOptimizers.end(), o.name) != kOptimizers.end(), "optimizer.name",
         fmt::format("'{}' is not supported (supported: {})", o.name, join(kOptimizers)));
    need(o.lr > 0 && std::isfinite(o.lr), "optimizer.lr", fmt::format("{} must be > 0", o.lr));
    need(o.beta1 >= 0 && o.beta1 < 1, "optimizer.beta1", fmt::format("{} must be in [0, 1)", o.beta1));
    need(o.beta2 >= 0 && o.beta2 < 1, "optimizer.beta2", fmt::format("{} must be in [0, 1)", o.beta2));
    need(o.eps > 0 && std::isfinite(o.eps), "optimizer.eps", fmt::format("{} must be > 0", o.eps));
    need(o.weight_decay >= 0 && std::isfinite(o.weight_decay), "optimizer.weight_decay",
         fmt::format("{} must be >= 0", o.weight_decay));
    need(o.grad_clip >= 0 && std::isfinite(o.grad_clip), "optimizer.grad_clip",
         fmt::format("{} must be >= 0 (0 = no clipping)", o.grad_clip));
    // schedule
    need(std::find(kSchedules.begin(), kSchedules.end(), s.name) != kSchedules.end(), "schedule.name",
         fmt::format("'{}' is not supported (supported: {})", s.name, join(kSchedules)));
    need(std::find(kDecayShapes.begin(), kDecayShapes.end(), s.decay_shape) != kDecayShapes.end(),
         "schedule.decay_shape",
         fmt::format("'{}' is not supported (supported: {})", s.decay_shape, join(kDecayShapes)));
    in_range("schedule.warmup_steps", s.warmup_steps, 0, kMaxSteps);
    need(s.warmup_steps <= t.steps, "schedule.warmup_steps",
         fmt::format("{} exceeds training.steps = {}", s.warmup_steps, t.steps));
    need(s.min_lr >= 0, "schedule.min_lr", fmt::format("{} must be >= 0", s.min_lr));
    need(s.min_lr <= o.lr, "schedule.min_lr", fmt::format("{} exceeds optimizer.lr = {}", s.min_lr, o.lr));
    need(s.decay_fraction > 0 && s.decay_fraction <= 1, "schedule.decay_fraction",
         fmt::format("{} must be in (0, 1]", s.decay_fraction));
    // output
    need(!r.output.dir.empty(), "output.dir", "is empty");
    in_range("output.save_every", r.output.save_every, 0, kMaxSteps, " (0 = only at the end)");
    in_range("output.checkpoint_every", r.output.checkpoint_every, 0, kMaxSteps, " (0 = no periodic checkpoints)");
    in_range("output.keep_last", r.output.keep_last, 0, kMaxKeepLast, " (0 = keep every checkpoint)");
    // parallel (the degrees against the world size: when training starts, train/trainer.cpp)
    const auto& p = r.parallel;
    in_range("parallel.data", p.data, 0, kMaxRanks, " (0 = all processes not used by tensor/pipeline)");
    in_range("parallel.tensor", p.tensor, 1, kMaxRanks, " (1 = no tensor parallelism)");
    // Sequence parallelism shards the N = micro_batch_size x seq_len rows over the tensor ranks.
    need(!p.sequence || p.tensor > 1, "parallel.sequence",
         "true needs parallel.tensor > 1 (it shards the sequence over the tensor-parallel ranks); set "
         "parallel.tensor or parallel.sequence: false");
    need(!p.sequence || p.tensor <= 1 || (t.micro_batch_size * t.seq_len) % p.tensor == 0, "parallel.sequence",
         fmt::format("true with parallel.tensor = {}: micro_batch_size {} x seq_len {} = {} rows do not split "
                     "evenly over the tensor-parallel ranks; choose a batch and seq_len whose product divides by {}",
                     p.tensor, t.micro_batch_size, t.seq_len, t.micro_batch_size * t.seq_len, p.tensor));
    in_range("parallel.pipeline", p.pipeline, 1, kMaxRanks, " (1 = no pipeline parallelism)");
    in_range("parallel.virtual_stages", p.virtual_stages, 1, 1024, " (1 = one model chunk per pipeline rank)");
    need(p.pipeline > 1 || (p.virtual_stages == 1 && p.stage_layers.empty()),
         p.virtual_stages != 1 ? "parallel.virtual_stages" : "parallel.stage_layers",
         "applies to pipeline parallelism only: set parallel.pipeline > 1 or remove it");
    in_range("parallel.zero", p.zero, 0, 2, " (0: replicated optimizer, 1: sharded moments, 2: also gradients)");
    need(p.bucket_mb > 0 && p.bucket_mb <= 65536, "parallel.bucket_mb",
         fmt::format("{} must be in (0, 65536]", p.bucket_mb));
    // A watchdog below 1 s aborts the first all-reduce of any real job (1e-300 passed before);
    // above ~116 days it is no watchdog at all (and the clock arithmetic overflows).
    need(p.timeout_s == 0 || (p.timeout_s >= kMinTimeoutS && p.timeout_s <= kMaxTimeoutS), "parallel.timeout_s",
         fmt::format("{} must be 0 (no watchdog) or in [{}, {}] seconds (default 300)", p.timeout_s, kMinTimeoutS,
                     kMaxTimeoutS));
    // precision (the same bounds as optim::validate(LossScaleConfig), named with the file here)
    const auto& pr = r.precision;
    need(std::find(kComputeDtypes.begin(), kComputeDtypes.end(), pr.compute) != kComputeDtypes.end(),
         "precision.compute", fmt::format("'{}' is not supported (supported: {})", pr.compute, join(kComputeDtypes)));
    in_range("training.max_skipped_steps", t.max_skipped_steps, 0, kMaxSteps, " (0 = never stop on skipped steps)");
    // training.anomaly (the bounds are checked whether or not it is enabled: a recipe that turns it
    // on later must not start failing then)
    const auto& a = t.anomaly;
    // The z-scores need statistics: with 0 observed steps the deviation is 0 and every step would be
    // a spike (z ~ 1e12).
    in_range("training.anomaly.warmup_steps", a.warmup_steps, 1, kMaxSteps,
             " (steps observed before spikes are detected; default 100)");
    need(a.ema_decay > 0 && a.ema_decay < 1, "training.anomaly.ema_decay",
         fmt::format("{} must be in (0, 1) (default 0.99: statistics over about the last 100 steps)", a.ema_decay));
    need(a.loss_z_threshold >= 0, "training.anomaly.loss_z_threshold",
         fmt::format("{} must be >= 0 (0 = the loss is not watched; default 6)", a.loss_z_threshold));
    need(a.grad_norm_z_threshold >= 0, "training.anomaly.grad_norm_z_threshold",
         fmt::format("{} must be >= 0 (0 = the gradient norm is not watched; default 6)", a.grad_norm_z_threshold));
    // 0 lets a deviation of 0 (a few equal losses) turn any change into z ~ 1e12.
    need(a.min_rel_std >= kMinRelStd && a.min_rel_std <= 100, "training.anomaly.min_rel_std",
         fmt::format("{} must be in [{}, 100] (default 0.01: the deviation is at least 1% of the mean)", a.min_rel_std,
                     kMinRelStd));
    need(a.lr_factor > 0 && a.lr_factor <= 1, "training.anomaly.lr_factor",
         fmt::format("{} must be in (0, 1] (default 0.5; 1 = never lowered)", a.lr_factor));
    in_range("training.anomaly.lr_steps", a.lr_steps, 0, kMaxSteps, " (0 = never lowered)");
    in_range("training.anomaly.rollback_after", a.rollback_after, 0, kMaxSteps, " (0 = never roll back)");
    in_range("training.anomaly.rollback_window", a.rollback_window, 1, kMaxSteps, " (default 100)");
    in_range("training.anomaly.skip_samples", a.skip_samples, -1, kMaxSteps,
             " (-1 = the samples consumed since the checkpoint)");
    in_range("training.anomaly.max_rollbacks", a.max_rollbacks, 0, kMaxSteps, " (default 3)");
    if (a.enabled && a.rollback_after > 0)
      need(r.output.checkpoint_every > 0, "training.anomaly.rollback_after",
           fmt::format("{} needs checkpoints to roll back to: set output.checkpoint_every > 0, or "
                       "training.anomaly.rollback_after: 0 (never roll back)",
                       a.rollback_after));
    const auto& l = pr.loss_scale;
    // [2^-100, 2^100]: the scale and its reciprocal (the unscaling factor) are normal floats; below
    // float's range 1 / scale is inf and the weights become NaN.
    need(l.initial >= 0x1p-100 && l.initial <= 0x1p100, "precision.loss_scale.initial",
         fmt::format("{} must be in [2^-100, 2^100] (default 65536 = 2^16)", l.initial));
    in_range("precision.loss_scale.growth_interval", l.growth_interval, 1, kMaxSteps, " (default 2000)");
    need(l.backoff > 0 && l.backoff < 1, "precision.loss_scale.backoff",
         fmt::format("{} must be in (0, 1) (default 0.5)", l.backoff));
    need(l.growth > 1 && l.growth <= 65536, "precision.loss_scale.growth",
         fmt::format("{} must be in (1, 65536] (default 2)", l.growth));
    need(l.min >= 0x1p-100 && l.min <= l.initial, "precision.loss_scale.min",
         fmt::format("{} must be >= 2^-100 and <= precision.loss_scale.initial = {} (default 1)", l.min, l.initial));
  }
};

// "a.b.c=value" applied to the JSON tree; returns the key path.
std::string apply_override(json& root, const std::string& source, const std::string& ov) {
  const std::string what = fmt::format("{}: --set {}", source, excerpt(ov));
  auto eq = ov.find('=');
  if (eq == std::string::npos || eq == 0) throw_error("{}: expected KEY=VALUE, e.g. training.steps=10", what);
  std::string path = ov.substr(0, eq), value = ov.substr(eq + 1);
  std::vector<std::string> parts;
  size_t start = 0;
  for (;;) {
    auto dot = path.find('.', start);
    parts.push_back(path.substr(start, dot == std::string::npos ? std::string::npos : dot - start));
    if (dot == std::string::npos) break;
    start = dot + 1;
  }
  for (auto& p : parts)
    if (p.empty()) throw_error("{}: empty component in key '{}'", what, excerpt(path));
  if (parts.size() < 2 && path != "recompute" && path != "device")
    throw_error("{}: key '{}' needs a section, e.g. training.{}", what, excerpt(path), excerpt(path));
  // The key path nests like the YAML it overrides, under the same bound.
  if (static_cast<int>(parts.size()) > kMaxYamlDepth)
    throw_error("{}: key '{}' has {} components; a recipe nests 3", what, excerpt(path), parts.size());
  json v = load_yaml(value, what);
  if (!root.is_object()) root = json::object();
  json* node = &root;
  for (size_t i = 0; i + 1 < parts.size(); ++i) {
    json& child = (*node)[parts[i]];
    if (!child.is_object()) child = json::object();
    node = &child;
  }
  (*node)[parts.back()] = v;
  return path;
}

// YAML text of a JSON value (flow style for lists/maps); doubles keep a '.' or exponent so that
// they re-load as numbers of the same type, with the shortest round-trip digits.
std::string yaml_value(const json& v) {
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
    for (size_t i = 0; i < v.size(); ++i) o += (i ? ", " : "") + yaml_value(v[i]);
    return o + "]";
  }
  std::string o = "{";
  bool first = true;
  for (auto it = v.begin(); it != v.end(); ++it) {
    o += (first ? "" : ", ") + json(it.key()).dump() + ": " + yaml_value(it.value());
    first = false;
  }
  return o + "}";
}

}  // namespace

Recipe parse_recipe(const std::string& yaml_text, const std::string& source,
                    const std::vector<std::string>& overrides) {
  json root = load_yaml(yaml_text, source);
  std::map<std::string, std::string> set_paths;
  for (const auto& ov : overrides) set_paths[apply_override(root, source, ov)] = ov;
  return Parser(source, std::move(root), std::move(set_paths)).parse();
}

Recipe load_recipe(const std::string& path, const std::vector<std::string>& overrides) {
  return parse_recipe(io::read_file(path), path, overrides);
}

json Recipe::to_json() const {
  json j;
  j["recompute"] = recompute;
  j["device"] = device;
  json m = model.to_hf_json();
  if (!init_from.empty()) m["init_from"] = init_from;
  if (attention_kernel != "lathe") m["attention_kernel"] = attention_kernel;
  j["model"] = m;
  j["data"] = {{"train", data.train},
               {"valid", data.valid},
               {"valid_fraction", data.valid_fraction},
               {"tokenizer", data.tokenizer},
               {"prefetch", data.prefetch},
               {"attention", data.attention},
               {"reset_position_ids", data.reset_position_ids},
               {"mask_loss_after_eod", data.mask_loss_after_eod},
               {"eod_token", data.eod_token}};
  if (!data.blend.empty()) {  // only when set: recipes (and checkpoints) without a blend stay as they were
    json b = json::array();
    for (const auto& e : data.blend) b.push_back({{"prefix", e.prefix}, {"weight", e.weight}, {"epochs", e.epochs}});
    j["data"]["blend"] = b;
  }
  j["optimizer"] = {{"name", optimizer.name},          {"lr", optimizer.lr},   {"beta1", optimizer.beta1},
                    {"beta2", optimizer.beta2},        {"eps", optimizer.eps}, {"weight_decay", optimizer.weight_decay},
                    {"grad_clip", optimizer.grad_clip}};
  j["schedule"] = {{"name", schedule.name},
                   {"warmup_steps", schedule.warmup_steps},
                   {"min_lr", schedule.min_lr},
                   {"decay_fraction", schedule.decay_fraction},
                   {"decay_shape", schedule.decay_shape}};
  j["training"] = {{"micro_batch_size", training.micro_batch_size},
                   {"seq_len", training.seq_len},
                   {"grad_accum_steps", training.grad_accum_steps},
                   {"steps", training.steps},
                   {"seed", training.seed},
                   {"eval_interval", training.eval_interval},
                   {"eval_batches", training.eval_batches},
                   {"log_interval", training.log_interval},
                   {"threads", training.threads},
                   {"peak_gflops", training.peak_gflops},
                   {"resume", training.resume},
                   {"max_skipped_steps", training.max_skipped_steps}};
  if (!training.eval_tasks.empty()) {  // only when set: recipes of earlier runs stay unchanged
    j["training"]["eval_tasks"] = training.eval_tasks;
    j["training"]["eval_tasks_interval"] = training.eval_tasks_interval;
  }
  const auto& an = training.anomaly;
  j["training"]["anomaly"] = {{"enabled", an.enabled},
                              {"warmup_steps", an.warmup_steps},
                              {"ema_decay", an.ema_decay},
                              {"loss_z_threshold", an.loss_z_threshold},
                              {"grad_norm_z_threshold", an.grad_norm_z_threshold},
                              {"min_rel_std", an.min_rel_std},
                              {"skip", an.skip},
                              {"lr_factor", an.lr_factor},
                              {"lr_steps", an.lr_steps},
                              {"rollback_after", an.rollback_after},
                              {"rollback_window", an.rollback_window},
                              {"skip_samples", an.skip_samples},
                              {"max_rollbacks", an.max_rollbacks}};
  const auto& ls = precision.loss_scale;
  j["precision"] = {{"compute", precision.compute},
                    {"loss_scale",
                     {{"enabled", ls.enabled},
                      {"initial", ls.initial},
                      {"growth_interval", ls.growth_interval},
                      {"backoff", ls.backoff},
                      {"growth", ls.growth},
                      {"min", ls.min}}}};
  j["parallel"] = {{"data", parallel.data}, {"tensor", parallel.tensor},       {"pipeline", parallel.pipeline},
                   {"zero", parallel.zero}, {"bucket_mb", parallel.bucket_mb}, {"timeout_s", parallel.timeout_s}};
  j["parallel"]["virtual_stages"] = parallel.virtual_stages;
  j["parallel"]["stage_layers"] = parallel.stage_layers;
  j["parallel"]["sequence"] = parallel.sequence;
  j["output"] = {{"dir", output.dir},
                 {"save_every", output.save_every},
                 {"checkpoint_every", output.checkpoint_every},
                 {"keep_last", output.keep_last}};
  return j;
}

std::string Recipe::to_yaml() const {
  json j = to_json();
  std::string out = fmt::format("# resolved recipe (from {})\n", source);
  for (const auto& sec : kSections) {
    out += sec + ":\n";
    for (auto it = j[sec].begin(); it != j[sec].end(); ++it)
      out += fmt::format("  {}: {}\n", it.key(), yaml_value(it.value()));
  }
  out += fmt::format("recompute: {}\n", recompute);
  out += fmt::format("device: {}\n", device);
  return out;
}

}  // namespace lathe
