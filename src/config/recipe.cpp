#include "config/recipe.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <map>
#include <set>

#include "config/recipe_schema.h"
#include "core/checked.h"
#include "core/error.h"
#include "core/utf8.h"  // header-only: the one UTF-8 validator
#include "io/fs.h"
#include "io/json.h"
#include "io/json_fields.h"
#include "io/yaml.h"

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

using io::excerpt;
using schema::describe;
using schema::join;

// The top-level sections, in the order to_yaml writes them; `recompute` and `device` are values.
const std::vector<std::string> kSections = {"model",    "data",      "optimizer", "schedule",
                                            "training", "precision", "parallel",  "output"};
const std::vector<std::string> kModelBaseKeys = {"preset", "init_from", "config"};

// YAML tree -> Recipe: the model section here, every other key through the schema's rows
// (config/recipe_schema.h), then the checks that relate keys to each other.
class Parser {
 public:
  Parser(const std::string& source, json root, std::map<std::string, std::string> set_paths)
      : src_(source), root_(std::move(root)), rep_(source, std::move(set_paths)) {}

  Recipe parse() {
    Recipe r;
    r.source = src_;
    check_unknown_sections();
    parse_model(section("model"), r);
    schema::parse(root_, r, rep_);
    resolve_loss_scale(r);
    check_data_training_schedule(r);
    check_output_parallel_precision(r);
    if (r.attention_kernel == "cudnn" && r.data.attention == "document")
      r.notes.push_back(
          "model.attention_kernel: cudnn with data.attention: document: document-masked passes run lathe's attention "
          "kernel (cuDNN's SDPA here is plain causal)");
    return r;
  }

 private:
  std::string src_;
  json root_;
  schema::Reporter rep_;

  [[noreturn]] void bad(const std::string& path, const std::string& msg) const { rep_.bad(path, msg); }
  // Typed reads worded as the schema's rows word them ("PATH: expected a string, got '...'").
  io::JsonFields reader() const {
    return io::JsonFields(
        io::JsonFields::Style::Expected, [this](const std::string& path, const std::string& what) { bad(path, what); },
        describe);
  }

  void check_unknown_sections() const {
    if (root_.is_null()) return;
    if (!root_.is_object()) throw_error("{}: a recipe must be a YAML mapping of sections ({})", src_, join(kSections));
    for (auto it = root_.begin(); it != root_.end(); ++it)
      if (std::find(kSections.begin(), kSections.end(), it.key()) == kSections.end() && it.key() != "recompute" &&
          it.key() != "device")
        rep_.unknown(it.key(), "section", [] {
          auto v = kSections;
          v.push_back("recompute");
          v.push_back("device");
          return v;
        }());
  }
  json section(const std::string& name) const {
    if (root_.is_null() || !root_.contains(name) || root_[name].is_null()) return json::object();
    const json& s = root_[name];
    if (!s.is_object()) bad(name, fmt::format("expected a mapping of keys, got '{}'", describe(s)));
    return s;
  }

  // Loss scaling is on for fp16 unless disabled, and only with `enabled: true` for fp32/bf16; other
  // loss_scale keys for those are noted, not refused (a recipe switched from fp16 to bf16 keeps
  // working).
  void resolve_loss_scale(Recipe& r) const {
    const json p = section("precision");
    const json ls = p.contains("loss_scale") && !p["loss_scale"].is_null() ? p["loss_scale"] : json::object();
    auto& pr = r.precision;
    auto& l = pr.loss_scale;
    if (!ls.contains("enabled")) l.enabled = pr.compute == "fp16";
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
      if (m.contains(k)) val = schema::text(m[k], "model." + k, rep_);
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
    // Not an HF field: a row of the schema (lathe | cudnn).
    schema::parse_field(*schema::find("model.attention_kernel"), m, r, rep_);
    json explicit_ = json::object();
    for (auto it = m.begin(); it != m.end(); ++it)
      if (std::find(kModelBaseKeys.begin(), kModelBaseKeys.end(), it.key()) == kModelBaseKeys.end() &&
          it.key() != "attention_kernel")
        explicit_[it.key()] = it.value();

    std::string mt;
    if (explicit_.contains("model_type")) {
      mt = reader().string(explicit_["model_type"], "model.model_type");
    } else if (!base.is_null()) {
      mt = base.value("model_type", "");
    } else {
      bad("model",
          "give model.preset, model.init_from, model.config, or model.model_type (gpt2, llama, qwen2, "
          "mistral, qwen3, phi3, gpt_neox, gemma2, mixtral, olmo2, qwen2_moe) with its HF fields");
    }
    static const std::vector<std::string> types = {"gpt2", "llama",    "qwen2",  "mistral", "qwen3",
                                                   "phi3", "gpt_neox", "gemma2", "mixtral", "olmo2",
                                                   "qwen2_moe"};
    if (std::find(types.begin(), types.end(), mt) == types.end())
      bad("model.model_type", fmt::format("'{}' is not supported (supported: {})", mt, join(types)));

    // Explicit keys are checked strictly against the model_type's field names.
    std::vector<std::string> known = ModelConfig::known_keys(mt);
    std::vector<std::string> full;
    for (auto& k : known) full.push_back("model." + k);
    for (auto& k : kModelBaseKeys) full.push_back("model." + k);
    for (auto it = explicit_.begin(); it != explicit_.end(); ++it) {
      if (std::find(known.begin(), known.end(), it.key()) == known.end())
        rep_.unknown("model." + it.key(), "key", full);
      static const std::set<std::string> dropout = {
          "resid_pdrop", "embd_pdrop", "attn_pdrop", "attention_dropout", "summary_first_dropout", "hidden_dropout"};
      if (dropout.count(it.key()) && !(it.value().is_number() && it.value().get<double>() == 0.0))
        bad("model." + it.key(),
            fmt::format("{} is not supported: lathe does not implement dropout (use 0)", describe(it.value())));
    }

    json merged = base.is_null() ? json::object() : base;
    if (!base.is_null() && merged.value("model_type", "") != mt) {
      std::string from = merged.value("model_type", "");
      if ((from == "gpt2") != (mt == "gpt2") || (from == "gpt_neox") != (mt == "gpt_neox") ||
          (from == "gemma2") != (mt == "gemma2") || (from == "mixtral") != (mt == "mixtral") ||
          (from == "olmo2") != (mt == "olmo2") || (from == "qwen2_moe") != (mt == "qwen2_moe"))
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
    // GPT-NeoX: rotary_pct / rotary_emb_base and the names transformers also saves them under.
    static const std::vector<std::vector<std::string>> neox_groups = {{"rotary_pct", "partial_rotary_factor"},
                                                                      {"rotary_emb_base", "rope_theta"}};
    for (const auto& g : mt == "gpt2" ? groups : mt == "gpt_neox" ? neox_groups : llama_groups)
      for (const auto& k : g)
        if (explicit_.contains(k))
          for (const auto& other : g) merged.erase(other);
    // A base's head_dim equal to its hidden_size / num_attention_heads is derived (transformers and
    // to_hf_json write it into every llama-family config.json): overriding the width or the heads
    // derives it again, unless model.head_dim is given too. (Not qwen3 / gemma2: their absent head_dim
    // is 128 / 256.)
    if (mt != "gpt2" && mt != "gpt_neox" && mt != "qwen3" && mt != "gemma2" && !explicit_.contains("head_dim") &&
        (explicit_.contains("hidden_size") || explicit_.contains("num_attention_heads"))) {
      const json *hd = io::JsonFields::find(merged, "head_dim"), *c = io::JsonFields::find(merged, "hidden_size"),
                 *h = io::JsonFields::find(merged, "num_attention_heads");
      if (hd && c && h && hd->is_number_integer() && c->is_number_integer() && h->is_number_integer() &&
          h->get<int64_t>() > 0 && hd->get<int64_t>() == c->get<int64_t>() / h->get<int64_t>() &&
          c->get<int64_t>() % h->get<int64_t>() == 0)
        merged.erase("head_dim");
    }
    for (auto it = explicit_.begin(); it != explicit_.end(); ++it) merged[it.key()] = it.value();
    merged["model_type"] = mt;
    r.model = ModelConfig::from_hf_json(merged, src_, "model.", false);
    // Unknown keys can only come from the base config.json (explicit ones were checked above).
  }

  // Each section's rows (schema::check_bounds) and the checks that relate keys to each other, in
  // the order a recipe with several errors has always reported the first one.
  void check_data_training_schedule(const Recipe& r) const {
    const auto& t = r.training;
    const auto& d = r.data;
    auto need = [&](bool ok, const std::string& path, const std::string& msg) {
      if (!ok) bad(path, msg);
    };
    need(!d.train.empty() || !d.blend.empty(), "data.train",
         "is missing: give the Megatron prefix of the tokenized training data (path without .bin/.idx), or a "
         "weighted data.blend of prefixes");
    need(d.train.empty() || d.blend.empty(), "data.blend",
         fmt::format("and data.train ({}) are both set: a run trains on one or the other; remove one", d.train));
    schema::check_bounds(r, rep_, "data");
    if (d.tokenizer == "byte")
      need(r.model.vocab_size >= 256, "data.tokenizer",
           fmt::format("'byte' needs model vocab_size >= 256, got {}", r.model.vocab_size));
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
    schema::check_bounds(r, rep_, "training");
    // Dynamic NTK RoPE scaling exists to run past max_position_embeddings (model_config.h).
    need(t.seq_len <= r.model.max_position_embeddings || r.model.rope_scaling.type == "dynamic", "training.seq_len",
         fmt::format("{} exceeds the model's max_position_embeddings{} = {}", t.seq_len,
                     r.model.is_gpt2() ? " (n_positions)" : "", r.model.max_position_embeddings));
    // Sample and token counters of the run (consumed_samples, tokens seen) must fit 64 bits.
    checked_product({t.steps, t.micro_batch_size, t.grad_accum_steps, t.seq_len,
                     std::max<int64_t>(1, std::min<int64_t>(r.parallel.data, kMaxRanks))},
                    fmt::format("{}: training.steps x micro_batch_size x grad_accum_steps x seq_len x parallel.data "
                                "(tokens of the run)",
                                src_));
    if (t.eval_interval > 0 && !d.blend.empty())
      need(!d.valid.empty(), "training.eval_interval",
           fmt::format("{} needs validation data: with data.blend set data.valid (valid_fraction does not apply to "
                       "a blend), or eval_interval 0",
                       t.eval_interval));
    if (t.eval_interval > 0)
      need(!d.valid.empty() || d.valid_fraction > 0, "training.eval_interval",
           fmt::format("{} needs validation data: set data.valid or data.valid_fraction > 0 (or eval_interval 0)",
                       t.eval_interval));
    schema::check_bounds(r, rep_, "optimizer");
    schema::check_bounds(r, rep_, "schedule");
    const auto& s = r.schedule;
    need(s.warmup_steps <= t.steps, "schedule.warmup_steps",
         fmt::format("{} exceeds training.steps = {}", s.warmup_steps, t.steps));
    need(s.min_lr <= r.optimizer.lr, "schedule.min_lr",
         fmt::format("{} exceeds optimizer.lr = {}", s.min_lr, r.optimizer.lr));
  }

  // parallel.zero = 3 (parallel/param_gather.h) runs with data, tensor and pipeline parallelism, on the CPU, so far.
  void check_zero3(const Recipe& r) const {
    const auto& p = r.parallel;
    if (p.zero != 3) {
      if (p.prefetch != 1)
        bad("parallel.prefetch",
            fmt::format("{} applies to parallel.zero = 3 only (this recipe has parallel.zero = {}); "
                        "remove it or set parallel.zero: 3",
                        p.prefetch, p.zero));
      if (p.shard_group != 0)
        bad("parallel.shard_group",
            fmt::format("{} applies to parallel.zero = 3 only (this recipe has parallel.zero = {}); remove it or set "
                        "parallel.zero: 3",
                        p.shard_group, p.zero));
      return;
    }
    if (p.shard_group > 0 && p.data > 0 && p.data % p.shard_group != 0)
      bad("parallel.shard_group", fmt::format("{} does not divide parallel.data = {}: choose a divisor of the data "
                                              "degree (0 = all data ranks)",
                                              p.shard_group, p.data));
    auto refuse = [&](const std::string& key, const std::string& value, const std::string& fix) {
      bad(key, fmt::format("{} with parallel.zero = 3 is not supported yet (ZeRO 3 shards the weights over data "
                           "(and tensor, pipeline) parallelism, on the CPU); {}",
                           value, fix));
    };
    if (p.context > 1)
      refuse("parallel.context", std::to_string(p.context), "set parallel.context: 1 or parallel.zero <= 2");
    if (r.device != "cpu") refuse("device", r.device, "use device: cpu or parallel.zero <= 2");
  }

  void check_output_parallel_precision(const Recipe& r) const {
    const auto& t = r.training;
    auto need = [&](bool ok, const std::string& path, const std::string& msg) {
      if (!ok) bad(path, msg);
    };
    need(!r.output.dir.empty(), "output.dir", "is empty");
    schema::check_bounds(r, rep_, "output");
    schema::check_bounds(r, rep_, "parallel");
    // parallel (the degrees against the world size: when training starts, train/session.cpp)
    const auto& p = r.parallel;
    // Sequence parallelism shards the N = micro_batch_size x seq_len rows over the tensor ranks.
    need(!p.sequence || p.tensor > 1, "parallel.sequence",
         "true needs parallel.tensor > 1 (it shards the sequence over the tensor-parallel ranks); set "
         "parallel.tensor or parallel.sequence: false");
    need(!p.sequence || p.tensor <= 1 || (t.micro_batch_size * t.seq_len) % p.tensor == 0, "parallel.sequence",
         fmt::format("true with parallel.tensor = {}: micro_batch_size {} x seq_len {} = {} rows do not split "
                     "evenly over the tensor-parallel ranks; choose a batch and seq_len whose product divides by {}",
                     p.tensor, t.micro_batch_size, t.seq_len, t.micro_batch_size * t.seq_len, p.tensor));
    check_zero3(r);
    // With context parallelism a rank's pass holds seq_len / context positions of each sample.
    need(!p.sequence || p.tensor <= 1 || p.context <= 1 || t.seq_len % (2 * p.context) != 0 ||
             (t.micro_batch_size * (t.seq_len / p.context)) % p.tensor == 0,
         "parallel.sequence",
         fmt::format("true with parallel.tensor = {} and parallel.context = {}: micro_batch_size {} x seq_len / "
                     "context {} = {} rows per rank do not split evenly over the tensor-parallel ranks",
                     p.tensor, p.context, t.micro_batch_size, t.seq_len / std::max<int64_t>(1, p.context),
                     t.micro_batch_size * (t.seq_len / std::max<int64_t>(1, p.context)), p.tensor));
    need(p.pipeline > 1 || (p.virtual_stages == 1 && p.stage_layers.empty()),
         p.virtual_stages != 1 ? "parallel.virtual_stages" : "parallel.stage_layers",
         "applies to pipeline parallelism only: set parallel.pipeline > 1 or remove it");
    // Context parallelism: 2 x context equal chunks of every sample (parallel/context_parallel.h).
    need(p.context <= 1 || t.seq_len % (2 * p.context) == 0, "parallel.context",
         fmt::format("{}: training.seq_len {} is not divisible by 2 x context = {} (each context rank holds two of "
                     "2 x context equal chunks); choose a seq_len that is a multiple of {}",
                     p.context, t.seq_len, 2 * p.context, 2 * p.context));
    // What context parallelism does not run yet: refused naming the key (never ignored).
    auto not_yet = [&](bool ok, const std::string& key, const std::string& what) {
      need(ok || p.context <= 1, key,
           fmt::format("{} with parallel.context = {} is not supported yet (issue 27); use parallel.context: 1", what,
                       p.context));
    };
    not_yet(r.device == "cpu", "device", fmt::format("device: {}", r.device));
    not_yet(
        t.eval_tasks.empty() || (p.tensor <= 1 && p.pipeline <= 1), "training.eval_tasks",
        fmt::format("training.eval_tasks with parallel.tensor = {} and parallel.pipeline = {}", p.tensor, p.pipeline));
    // A watchdog below 1 s aborts the first all-reduce of any real job (1e-300 passed before);
    // above ~116 days it is no watchdog at all (and the clock arithmetic overflows).
    need(p.timeout_s == 0 || (p.timeout_s >= kMinTimeoutS && p.timeout_s <= kMaxTimeoutS), "parallel.timeout_s",
         fmt::format("{} must be 0 (no watchdog) or in [{}, {}] seconds (default 300)", p.timeout_s, kMinTimeoutS,
                     kMaxTimeoutS));
    schema::check_bounds(r, rep_, "precision");
    schema::check_bounds(r, rep_, "training.anomaly");
    const auto& a = t.anomaly;
    if (a.enabled && a.rollback_after > 0)
      need(r.output.checkpoint_every > 0, "training.anomaly.rollback_after",
           fmt::format("{} needs checkpoints to roll back to: set output.checkpoint_every > 0, or "
                       "training.anomaly.rollback_after: 0 (never roll back)",
                       a.rollback_after));
    schema::check_bounds(r, rep_, "precision.loss_scale");
    const auto& l = r.precision.loss_scale;
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
  if (static_cast<int>(parts.size()) > io::kMaxYamlDepth)
    throw_error("{}: key '{}' has {} components; a recipe nests 3", what, excerpt(path), parts.size());
  json v = io::load_yaml(value, what);
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

}  // namespace

Recipe parse_recipe(const std::string& yaml_text, const std::string& source,
                    const std::vector<std::string>& overrides) {
  json root = io::load_yaml(yaml_text, source);
  std::map<std::string, std::string> set_paths;
  for (const auto& ov : overrides) set_paths[apply_override(root, source, ov)] = ov;
  return Parser(source, std::move(root), std::move(set_paths)).parse();
}

Recipe load_recipe(const std::string& path, const std::vector<std::string>& overrides) {
  return parse_recipe(io::read_file(path), path, overrides);
}

json Recipe::to_json() const {
  json j;
  j["model"] = model.to_hf_json();  // the model as HF fields; the recipe's own keys from the schema
  schema::write_json(*this, j);
  return j;
}

std::string Recipe::to_yaml() const {
  json j = to_json();
  std::string out = fmt::format("# resolved recipe (from {})\n", source);
  for (const auto& sec : kSections) {
    out += sec + ":\n";
    for (auto it = j[sec].begin(); it != j[sec].end(); ++it)
      out += fmt::format("  {}: {}\n", it.key(), io::yaml_flow(it.value()));
  }
  out += fmt::format("recompute: {}\n", recompute);
  out += fmt::format("device: {}\n", device);
  return out;
}

}  // namespace lathe
