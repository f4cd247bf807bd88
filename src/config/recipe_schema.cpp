#include "config/recipe_schema.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <set>

#include "core/error.h"
#include "io/json_fields.h"
#include "io/yaml.h"

namespace lathe::schema {

using json = nlohmann::json;

// ---------------------------------------------------------------------------------------------
// Errors

std::string describe(const json& v) {
  if (v.is_string()) return io::excerpt(v.get_ref<const std::string&>());
  if (v.is_null()) return "null";
  if (v.is_array()) return "a list";
  if (v.is_object()) return "a mapping";
  return v.dump();
}

std::string join(const std::vector<std::string>& v) {
  std::string o;
  for (auto& s : v) o += (o.empty() ? "" : ", ") + s;
  return o;
}

std::string Reporter::origin(const std::string& path) const {
  // The override wrote `path` itself or something below it (an unknown section).
  for (const auto& [p, ov] : set_)
    if (p == path || p.rfind(path + ".", 0) == 0) return fmt::format("--set {}: ", io::excerpt(ov));
  return {};
}

void Reporter::unknown(const std::string& path, const std::string& what,
                       const std::vector<std::string>& candidates) const {
  std::string near = closest_match(path, candidates);
  throw_error("{}: {}unknown {} '{}'{}", src_, origin(path), what, io::excerpt(path),
              near.empty() ? std::string() : fmt::format(" (did you mean '{}'?)", near));
}

void Reporter::bad(const std::string& path, const std::string& msg) const {
  throw_error("{}: {}{}: {}", src_, origin(path), io::excerpt(path), msg);
}

namespace {
// Typed reads of YAML values, worded "SRC: [--set ...: ]PATH: expected an integer, got '...'".
io::JsonFields reader(const Reporter& rep) {
  return io::JsonFields(
      io::JsonFields::Style::Expected, [&rep](const std::string& path, const std::string& what) { rep.bad(path, what); },
      describe);
}
}  // namespace

std::string text(const json& v, const std::string& path, const Reporter& rep) {
  if (v.is_null()) return "";
  if (v.is_number()) return v.dump();  // e.g. `dir: 2024` is a plain YAML int; treat it as the text
  return reader(rep).string(v, path);
}

// ---------------------------------------------------------------------------------------------
// Row builders

Field Field::in(int64_t lo_, int64_t hi_, std::string_view note_) const {
  Field f = *this;
  f.min = lo_, f.max = hi_, f.note = note_;
  return f;
}
Field Field::between(double lo_, bool lo_open_, double hi_, bool hi_open_, std::string_view note_) const {
  Field f = *this;
  f.lo = lo_, f.lo_open = lo_open_, f.hi = hi_, f.hi_open = hi_open_, f.note = note_;
  return f;
}
Field Field::one_of(std::vector<std::string_view> c, std::string_view refusal_) const {
  Field f = *this;
  f.choices = std::move(c), f.refusal = refusal_;
  return f;
}
Field Field::choice(std::vector<std::string_view> c) const {
  Field f = *this;
  f.kind = Kind::Choice, f.choices = std::move(c);
  return f;
}
Field Field::with(OnResume e) const {
  Field f = *this;
  f.on_resume = e;
  return f;
}
Field Field::since_later() const {
  Field f = *this;
  f.later = true;
  return f;
}
Field Field::only_if(std::string_view k) const {
  Field f = *this;
  f.json_if = k;
  return f;
}
Field Field::with_range(std::string_view text) const {
  Field f = *this;
  f.range = text;
  return f;
}
std::string Field::section() const {
  const size_t dot = path.rfind('.');
  return dot == std::string_view::npos ? std::string() : std::string(path.substr(0, dot));
}
std::string Field::name() const {
  const size_t dot = path.rfind('.');
  return std::string(dot == std::string_view::npos ? path : path.substr(dot + 1));
}

namespace {

// ---------------------------------------------------------------------------------------------
// The two keys whose values are more than a scalar

// data.blend: a list of {prefix, weight, epochs?}; errors name the entry index and key.
void parse_blend(const json& b, Recipe& r, const Reporter& rep) {
  if (!b.is_array())
    rep.bad("data.blend", fmt::format("expected a list of {{prefix, weight, epochs}} entries, got '{}'", describe(b)));
  if (b.empty()) rep.bad("data.blend", "is an empty list: give at least one {prefix, weight} entry (or use data.train)");
  static const std::vector<std::string> keys = {"prefix", "weight", "epochs"};
  for (size_t i = 0; i < b.size(); ++i) {
    const std::string at = fmt::format("data.blend[{}]", i);
    const json& e = b[i];
    if (!e.is_object()) rep.bad(at, fmt::format("expected a mapping {{prefix: PATH, weight: W}}, got '{}'", describe(e)));
    std::vector<std::string> full;
    for (auto& k : keys) full.push_back(at + "." + k);
    for (auto it = e.begin(); it != e.end(); ++it)
      if (std::find(keys.begin(), keys.end(), it.key()) == keys.end()) rep.unknown(at + "." + it.key(), "key", full);
    Recipe::Data::BlendEntry x;
    if (e.contains("prefix")) x.prefix = text(e["prefix"], at + ".prefix", rep);
    if (x.prefix.empty())
      rep.bad(at + ".prefix", "is missing: give the Megatron prefix of a tokenized dataset (path without .bin/.idx)");
    if (!e.contains("weight")) rep.bad(at + ".weight", "is missing: give a positive weight (weights need not sum to 1)");
    auto number = [&](const char* k, double* out) {  // as a Float row
      if (!e.contains(k)) return;
      *out = reader(rep).number(e[k], at + "." + k);
    };
    number("weight", &x.weight);
    if (!(x.weight > 0)) rep.bad(at + ".weight", fmt::format("{} must be > 0 (weights need not sum to 1)", x.weight));
    number("epochs", &x.epochs);
    if (x.epochs < 0)
      rep.bad(at + ".epochs", fmt::format("{} must be > 0 (a cap on passes over {}), or 0 for none", x.epochs, x.prefix));
    r.data.blend.push_back(std::move(x));
  }
}
json blend_json(const Recipe& r) {
  json b = json::array();
  for (const auto& e : r.data.blend) b.push_back({{"prefix", e.prefix}, {"weight", e.weight}, {"epochs", e.epochs}});
  return b;
}
const CustomIo kBlend{parse_blend, blend_json};

// parallel.stage_layers: decoder layers per virtual stage.
void parse_stage_layers(const json& sl, Recipe& r, const Reporter& rep) {
  if (!sl.is_array() || sl.size() > 4096)
    rep.bad("parallel.stage_layers",
            fmt::format("expected a list of at most 4096 layer counts (one per pipeline stage), got '{}'", describe(sl)));
  for (const json& v : sl) {
    if (!v.is_number_integer())
      rep.bad("parallel.stage_layers", fmt::format("entry '{}' is not an integer layer count", describe(v)));
    r.parallel.stage_layers.push_back(v.get<int64_t>());
  }
}
json stage_layers_json(const Recipe& r) { return r.parallel.stage_layers; }
const CustomIo kStageLayers{parse_stage_layers, stage_layers_json};

// ---------------------------------------------------------------------------------------------
// The table

using R = Recipe;
using T = Recipe::Training;
using A = Recipe::Training::Anomaly;
using O = optim::OptimConfig;
using S = optim::ScheduleSpec;
using L = optim::LossScaleSpec;
constexpr auto kInf = std::numeric_limits<double>::infinity();
constexpr bool kOpen = true, kClosed = false;
constexpr OnResume kHarmless = OnResume::Harmless;

std::vector<Field> model_and_data() {
  return {
      // model: the HF fields are ModelConfig's; these two are the recipe's (parsed with the model).
      // An HF field has no row: its class is the section's mixed one, Breaks (allowed with
      // --force-resume-changes: rope_theta, rope_scaling, ...), except the shape keys
      // (config/model_keys.h), which config/recipe_diff.cpp refuses even with the flag.
      key<&R::attention_kernel>("model.attention_kernel").choice({"lathe", "cudnn"}).only_if("model.attention_kernel"),
      key<&R::init_from>("model.init_from").with(kHarmless).only_if("model.init_from"),  // initialisation only
      key<&R::data, &R::Data::train>("data.train"),
      key<&R::data, &R::Data::valid>("data.valid"),
      key<&R::data, &R::Data::valid_fraction>("data.valid_fraction").between(0, kClosed, 1, kOpen),
      key<&R::data, &R::Data::tokenizer>("data.tokenizer").with(kHarmless),
      key<&R::data, &R::Data::prefetch>("data.prefetch").in(0, kMaxPrefetch).with(kHarmless),
      key<&R::data, &R::Data::blend>("data.blend", &kBlend).only_if("data.blend"),
      key<&R::data, &R::Data::attention>("data.attention")
          .one_of({"causal", "document"},
                  "is not known; use causal (attention across the whole sample) or document (each token attends "
                  "only to its own document, split after every EOD token)")
          .since_later(),
      key<&R::data, &R::Data::reset_position_ids>("data.reset_position_ids").since_later(),
      key<&R::data, &R::Data::mask_loss_after_eod>("data.mask_loss_after_eod").since_later(),
      key<&R::data, &R::Data::eod_token>("data.eod_token").since_later(),  // against the vocabulary: recipe.cpp
  };
}

std::vector<Field> optimizer_and_schedule() {
  return {
      key<&R::optimizer, &O::name>("optimizer.name").one_of({"adamw", "lamb"}),
      key<&R::optimizer, &O::lr>("optimizer.lr").between(0, kOpen, kInf, kOpen),  // every later update
      key<&R::optimizer, &O::beta1>("optimizer.beta1").between(0, kClosed, 1, kOpen),
      key<&R::optimizer, &O::beta2>("optimizer.beta2").between(0, kClosed, 1, kOpen),
      key<&R::optimizer, &O::eps>("optimizer.eps").between(0, kOpen, kInf, kOpen),
      key<&R::optimizer, &O::weight_decay>("optimizer.weight_decay").between(0, kClosed, kInf, kOpen),
      key<&R::optimizer, &O::grad_clip>("optimizer.grad_clip").between(0, kClosed, kInf, kOpen, " (0 = no clipping)"),
      key<&R::schedule, &S::name>("schedule.name").one_of({"cosine", "linear", "constant", "wsd"}),
      key<&R::schedule, &S::warmup_steps>("schedule.warmup_steps").in(0, kMaxSteps),
      key<&R::schedule, &S::min_lr>("schedule.min_lr").between(0, kClosed, kInf, kOpen),
      key<&R::schedule, &S::decay_fraction>("schedule.decay_fraction").between(0, kOpen, 1, kClosed),
      key<&R::schedule, &S::decay_shape>("schedule.decay_shape").one_of({"linear", "cosine", "1-sqrt"}),
  };
}

// training.steps is harmless by design although decaying schedules are recomputed for the new
// total; threads changes the float summation order (the trainer warns); evaluation only reads the
// weights; max_skipped_steps only decides when a run of skipped steps stops the run.
std::vector<Field> training() {
  return {
      key<&R::training, &T::micro_batch_size>("training.micro_batch_size")
          .in(1, kMaxMicroBatch)
          .with(OnResume::BatchSplit),
      key<&R::training, &T::seq_len>("training.seq_len").in(1, kMaxSeqLen),
      key<&R::training, &T::grad_accum_steps>("training.grad_accum_steps")
          .in(1, kMaxGradAccum)
          .with(OnResume::BatchSplit),
      key<&R::training, &T::steps>("training.steps").in(1, kMaxSteps).with(kHarmless),
      key<&R::training, &T::seed>("training.seed"),
      key<&R::training, &T::eval_interval>("training.eval_interval").in(0, kMaxSteps, " (0 = no eval)").with(kHarmless),
      key<&R::training, &T::eval_batches>("training.eval_batches").in(1, kMaxEvalBatches).with(kHarmless),
      key<&R::training, &T::log_interval>("training.log_interval").in(1, kMaxSteps).with(kHarmless),
      key<&R::training, &T::threads>("training.threads").in(0, kMaxThreads, " (0 = all cores)").with(kHarmless),
      key<&R::training, &T::peak_gflops>("training.peak_gflops")
          .between(0, kClosed, kInf, kOpen, " (0 = measure)")
          .with(kHarmless),
      key<&R::training, &T::resume>("training.resume").with(kHarmless),
      key<&R::training, &T::max_skipped_steps>("training.max_skipped_steps")
          .in(0, kMaxSteps, " (0 = never stop on skipped steps)")
          .with(kHarmless)
          .since_later(),
      key<&R::training, &T::eval_tasks>("training.eval_tasks").with(kHarmless).only_if("training.eval_tasks"),
      key<&R::training, &T::eval_tasks_interval>("training.eval_tasks_interval")
          .in(0, kMaxSteps, " (0 = training.eval_interval)")
          .with(kHarmless)
          .only_if("training.eval_tasks"),
  };
}

// training.anomaly decides what happens on an anomaly, not how a normal step computes. The bounds
// are checked whether or not it is enabled: a recipe that turns it on later must not start failing.
std::vector<Field> anomaly() {
  auto row = [](Field f) { return f.with(kHarmless).since_later(); };
  return {
      row(key<&R::training, &T::anomaly, &A::enabled>("training.anomaly.enabled")),
      // The z-scores need statistics: with 0 observed steps every step would be a spike.
      row(key<&R::training, &T::anomaly, &A::warmup_steps>("training.anomaly.warmup_steps")
              .in(1, kMaxSteps, " (steps observed before spikes are detected; default 100)")),
      row(key<&R::training, &T::anomaly, &A::ema_decay>("training.anomaly.ema_decay")
              .between(0, kOpen, 1, kOpen, " (default 0.99: statistics over about the last 100 steps)")),
      row(key<&R::training, &T::anomaly, &A::loss_z_threshold>("training.anomaly.loss_z_threshold")
              .between(0, kClosed, kInf, kOpen, " (0 = the loss is not watched; default 6)")),
      row(key<&R::training, &T::anomaly, &A::grad_norm_z_threshold>("training.anomaly.grad_norm_z_threshold")
              .between(0, kClosed, kInf, kOpen, " (0 = the gradient norm is not watched; default 6)")),
      // 0 lets a deviation of 0 (a few equal losses) turn any change into z ~ 1e12.
      row(key<&R::training, &T::anomaly, &A::min_rel_std>("training.anomaly.min_rel_std")
              .between(kMinRelStd, kClosed, 100, kClosed,
                       " (default 0.01: the deviation is at least 1% of the mean)")),
      row(key<&R::training, &T::anomaly, &A::skip>("training.anomaly.skip")),
      row(key<&R::training, &T::anomaly, &A::lr_factor>("training.anomaly.lr_factor")
              .between(0, kOpen, 1, kClosed, " (default 0.5; 1 = never lowered)")),
      row(key<&R::training, &T::anomaly, &A::lr_steps>("training.anomaly.lr_steps")
              .in(0, kMaxSteps, " (0 = never lowered)")),
      row(key<&R::training, &T::anomaly, &A::rollback_after>("training.anomaly.rollback_after")
              .in(0, kMaxSteps, " (0 = never roll back)")),
      row(key<&R::training, &T::anomaly, &A::rollback_window>("training.anomaly.rollback_window")
              .in(1, kMaxSteps, " (default 100)")),
      row(key<&R::training, &T::anomaly, &A::skip_samples>("training.anomaly.skip_samples")
              .in(-1, kMaxSteps, " (-1 = the samples consumed since the checkpoint)")),
      row(key<&R::training, &T::anomaly, &A::max_rollbacks>("training.anomaly.max_rollbacks")
              .in(0, kMaxSteps, " (default 3)")),
  };
}

// A checkpoint from before the precision section computed in fp32 without loss scaling. The loss
// scale's settings matter only where scaling is on (fp16, or enabled explicitly).
std::vector<Field> precision_and_top() {
  auto ls = [](Field f) { return f.with(OnResume::LossScale).since_later(); };
  using P = Recipe::Precision;
  return {
      key<&R::precision, &P::compute>("precision.compute").one_of({"fp32", "bf16", "fp16"}).since_later(),
      ls(key<&R::precision, &P::loss_scale, &L::enabled>("precision.loss_scale.enabled")),
      // [2^-100, 2^100]: the scale and its reciprocal (the unscaling factor) are normal floats.
      ls(key<&R::precision, &P::loss_scale, &L::initial>("precision.loss_scale.initial")
             .between(0x1p-100, kClosed, 0x1p100, kClosed, " (default 65536 = 2^16)")
             .with_range("in [2^-100, 2^100]")),
      ls(key<&R::precision, &P::loss_scale, &L::growth_interval>("precision.loss_scale.growth_interval")
             .in(1, kMaxSteps, " (default 2000)")),
      ls(key<&R::precision, &P::loss_scale, &L::backoff>("precision.loss_scale.backoff")
             .between(0, kOpen, 1, kOpen, " (default 0.5)")),
      ls(key<&R::precision, &P::loss_scale, &L::growth>("precision.loss_scale.growth")
             .between(1, kOpen, 65536, kClosed, " (default 2)")),
      ls(key<&R::precision, &P::loss_scale, &L::min>("precision.loss_scale.min")),  // against initial: recipe.cpp
      // Top-level values: recompute changes memory, not results (bit-identical: tests/models);
      // checkpoints are host fp32 whatever the device, so a GPU run resumes on CPU and back.
      key<&R::recompute>("recompute").choice({"none", "selective", "full"}).with(kHarmless),
      key<&R::device>("device").choice({"cpu", "cuda"}).with(kHarmless).since_later(),
  };
}

// The layout of processes changes neither the data order nor the math beyond float summation order
// (the loader's order is global), so parallel.* may change on resume, as may output.*.
std::vector<Field> output_and_parallel() {
  using Ou = Recipe::Output;
  using Pa = Recipe::Parallel;
  auto row = [](Field f) { return f.with(kHarmless); };
  return {
      row(key<&R::output, &Ou::dir>("output.dir")),
      row(key<&R::output, &Ou::save_every>("output.save_every").in(0, kMaxSteps, " (0 = only at the end)")),
      row(key<&R::output, &Ou::checkpoint_every>("output.checkpoint_every")
              .in(0, kMaxSteps, " (0 = no periodic checkpoints)")),
      row(key<&R::output, &Ou::keep_last>("output.keep_last").in(0, kMaxKeepLast, " (0 = keep every checkpoint)")),
      // Only in the resolved recipe when set: the recipes (and checkpoints) of runs without it stay as they were.
      row(key<&R::output, &Ou::tensorboard>("output.tensorboard").since_later().only_if("output.tensorboard")),
      row(key<&R::parallel, &Pa::data>("parallel.data")
              .in(0, kMaxRanks, " (0 = all processes not used by tensor/pipeline)")),
      row(key<&R::parallel, &Pa::tensor>("parallel.tensor").in(1, kMaxRanks, " (1 = no tensor parallelism)")),
      row(key<&R::parallel, &Pa::sequence>("parallel.sequence")),
      row(key<&R::parallel, &Pa::pipeline>("parallel.pipeline").in(1, kMaxRanks, " (1 = no pipeline parallelism)")),
      row(key<&R::parallel, &Pa::virtual_stages>("parallel.virtual_stages")
              .in(1, 1024, " (1 = one model chunk per pipeline rank)")
              .since_later()),
      row(key<&R::parallel, &Pa::stage_layers>("parallel.stage_layers", &kStageLayers).since_later()),
      row(key<&R::parallel, &Pa::zero>("parallel.zero")
              .in(0, 3, " (0: replicated optimizer, 1: sharded moments, 2: also gradients, 3: also weights)")),
      row(key<&R::parallel, &Pa::prefetch>("parallel.prefetch")
              .in(0, 2, " (ZeRO 3: blocks gathered ahead of the one computing; 0 = none)")
              .since_later()
              .only_if("parallel.prefetch")),
      row(key<&R::parallel, &Pa::shard_group>("parallel.shard_group")
              .in(0, kMaxRanks, " (ZeRO 3: weights sharded within groups of this many data ranks; 0 = all)")
              .since_later()
              .only_if("parallel.shard_group")),
      row(key<&R::parallel, &Pa::bucket_mb>("parallel.bucket_mb").between(0, kOpen, 65536, kClosed)),
      row(key<&R::parallel, &Pa::timeout_s>("parallel.timeout_s")),  // 0 or [1 s, 1e7 s]: recipe.cpp
      row(key<&R::parallel, &Pa::context>("parallel.context")
              .in(1, kMaxRanks, " (1 = no context parallelism)")
              .only_if("parallel.context")
              .since_later()),
      row(key<&R::parallel, &Pa::context_impl>("parallel.context_impl")
              .choice({"ring", "allgather"})
              .only_if("parallel.context")
              .since_later()),
      row(key<&R::parallel, &Pa::expert>("parallel.expert")
              .in(1, kMaxRanks, " (1 = no expert parallelism)")
              .only_if("parallel.expert")
              .since_later()),
  };
}

const Recipe& defaults() {
  static const Recipe d;
  return d;
}

template <class V>
V& at(const Field& f, const Recipe& r) {
  return *static_cast<V*>(f.ref(const_cast<Recipe&>(r)));
}

}  // namespace

const std::vector<Field>& fields() {
  static const std::vector<Field> all = [] {
    std::vector<Field> v;
    for (auto part : {model_and_data(), optimizer_and_schedule(), training(), anomaly(), precision_and_top(),
                      output_and_parallel()})
      v.insert(v.end(), part.begin(), part.end());
    return v;
  }();
  return all;
}

const Field* find(std::string_view path) {
  for (const Field& f : fields())
    if (f.path == path) return &f;
  return nullptr;
}

std::vector<std::string> keys_of(const std::string& section) {
  std::vector<std::string> out;
  const std::string prefix = section + ".";
  for (const Field& f : fields()) {
    if (f.path.substr(0, prefix.size()) != prefix) continue;
    std::string_view rest = f.path.substr(prefix.size());
    std::string k(rest.substr(0, rest.find('.')));
    if (std::find(out.begin(), out.end(), k) == out.end()) out.push_back(k);
  }
  return out;
}

std::vector<std::string> sections() {
  std::set<std::string> s;
  for (const Field& f : fields())
    if (!f.section().empty() && f.section() != "model") s.insert(f.section());
  return {s.begin(), s.end()};
}

// ---------------------------------------------------------------------------------------------
// Parsing

namespace {

void check_keys(const std::string& sec, const json& obj, const Reporter& rep) {
  const std::vector<std::string> keys = keys_of(sec);
  std::vector<std::string> full;
  for (auto& k : keys) full.push_back(sec + "." + k);
  for (auto it = obj.begin(); it != obj.end(); ++it)
    if (std::find(keys.begin(), keys.end(), it.key()) == keys.end()) rep.unknown(sec + "." + it.key(), "key", full);
}

// The mapping of `sec` in the YAML tree ("" = the top level); absent or null = empty. A nested
// section (training.anomaly) is checked for unknown keys here, when its first key is parsed.
json section_at(const json& root, const std::string& sec, const Reporter& rep) {
  if (sec.empty()) return root.is_null() ? json::object() : root;
  const size_t dot = sec.rfind('.');
  const json parent = dot == std::string::npos ? section_at(root, "", rep) : section_at(root, sec.substr(0, dot), rep);
  const std::string name = dot == std::string::npos ? sec : sec.substr(dot + 1);
  if (!parent.contains(name) || parent[name].is_null()) return json::object();
  const json& s = parent[name];
  if (dot == std::string::npos) {
    if (!s.is_object()) rep.bad(sec, fmt::format("expected a mapping of keys, got '{}'", describe(s)));
    return s;
  }
  if (!s.is_object())
    rep.bad(sec, fmt::format("expected a mapping of keys ({}), got '{}'", join(keys_of(sec)), describe(s)));
  check_keys(sec, s, rep);
  return s;
}

}  // namespace

void parse_field(const Field& f, const json& obj, Recipe& r, const Reporter& rep) {
  const std::string name = f.name(), path(f.path);
  if (!obj.contains(name)) return;
  const json& v = obj[name];
  switch (f.kind) {
    case Kind::Int:
    case Kind::Int32:
      if (v.is_string() && io::yaml_int_out_of_range(v.get_ref<const std::string&>()))  // kept as text by load_yaml
        rep.bad(path, fmt::format("{} does not fit a 64-bit integer", describe(v)));
      if (f.kind == Kind::Int)
        at<int64_t>(f, r) = reader(rep).integer(v, path);
      else
        at<int>(f, r) = static_cast<int>(reader(rep).integer(v, path, INT32_MIN, INT32_MAX));
      return;
    case Kind::Float:  // every float must be finite: 1e999 reads as inf, which passes "> 0" and "<= x" checks
      at<double>(f, r) = reader(rep).number(v, path);
      return;
    case Kind::Bool:
      at<bool>(f, r) = reader(rep).boolean(v, path);
      return;
    case Kind::Text:
      at<std::string>(f, r) = text(v, path, rep);
      return;
    case Kind::Choice: {
      if (v.is_null()) return;
      if (!v.is_string() || std::find(f.choices.begin(), f.choices.end(), v.get<std::string>()) == f.choices.end()) {
        std::vector<std::string> c(f.choices.begin(), f.choices.end());
        rep.bad(path, fmt::format("must be one of {} (default {}), got '{}'", join(c), at<std::string>(f, defaults()),
                                  describe(v)));
      }
      at<std::string>(f, r) = v.get<std::string>();
      return;
    }
    case Kind::Custom:
      if (!v.is_null()) f.custom->parse(v, r, rep);
      return;
  }
}

void parse(const json& root, Recipe& r, const Reporter& rep) {
  for (const std::string& sec : sections())  // the sections' shapes and unknown keys, by name
    if (sec.find('.') == std::string::npos) check_keys(sec, section_at(root, sec, rep), rep);
  std::string current = "?";
  json obj;
  for (const Field& f : fields()) {
    if (f.section() == "model") continue;  // parsed with the model (config/recipe.cpp)
    if (f.section() != current) {
      current = f.section();
      obj = section_at(root, current, rep);
    }
    parse_field(f, obj, r, rep);
  }
}

// ---------------------------------------------------------------------------------------------
// Bounds

namespace {

std::string float_range(const Field& f) {
  if (!f.range.empty()) return std::string(f.range);
  if (std::isinf(f.hi)) return fmt::format("{} {}", f.lo_open ? ">" : ">=", f.lo);
  return fmt::format("in {}{}, {}{}", f.lo_open ? '(' : '[', f.lo, f.hi, f.hi_open ? ')' : ']');
}

void check_int(const Field& f, int64_t v, const Reporter& rep) {
  if (v < f.min) rep.bad(std::string(f.path), fmt::format("{} must be >= {}{}", v, f.min, f.note));
  if (v > f.max) rep.bad(std::string(f.path), fmt::format("{} exceeds the maximum {}{}", v, f.max, f.note));
}

}  // namespace

void check_bounds(const Recipe& r, const Reporter& rep, const std::string& section) {
  for (const Field& f : fields()) {
    if (f.section() != section) continue;
    switch (f.kind) {
      case Kind::Int:
        check_int(f, at<int64_t>(f, r), rep);
        break;
      case Kind::Int32:
        check_int(f, at<int>(f, r), rep);
        break;
      case Kind::Float: {
        const double v = at<double>(f, r);
        const bool above = f.lo_open ? v > f.lo : v >= f.lo, below = f.hi_open ? v < f.hi : v <= f.hi;
        if (!(std::isinf(f.lo) && std::isinf(f.hi)) && !(above && below))
          rep.bad(std::string(f.path), fmt::format("{} must be {}{}", v, float_range(f), f.note));
        break;
      }
      case Kind::Text: {
        const std::string& v = at<std::string>(f, r);
        if (f.choices.empty() || std::find(f.choices.begin(), f.choices.end(), v) != f.choices.end()) break;
        std::vector<std::string> c(f.choices.begin(), f.choices.end());
        rep.bad(std::string(f.path), f.refusal.empty()
                                         ? fmt::format("'{}' is not supported (supported: {})", v, join(c))
                                         : fmt::format("'{}' {}", v, f.refusal));
      }
      default:
        break;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// JSON and resume

json value_json(const Field& f, const Recipe& r) {
  switch (f.kind) {
    case Kind::Int:
      return at<int64_t>(f, r);
    case Kind::Int32:
      return at<int>(f, r);
    case Kind::Float:
      return at<double>(f, r);
    case Kind::Bool:
      return at<bool>(f, r);
    case Kind::Text:
    case Kind::Choice:
      return at<std::string>(f, r);
    case Kind::Custom:
      return f.custom->to_json(r);
  }
  return nullptr;
}

void write_json(const Recipe& r, json& j) {
  for (const Field& f : fields()) {
    if (!f.json_if.empty()) {  // only when set: recipes (and checkpoints) without it stay as they were
      const Field* g = find(f.json_if);
      if (value_json(*g, r) == value_json(*g, defaults())) continue;
    }
    std::string pointer(1, '/');
    pointer.append(f.path);
    std::replace(pointer.begin(), pointer.end(), '.', '/');
    j[json::json_pointer(pointer)] = value_json(f, r);
  }
}

OnResume on_resume(const std::string& key) {
  if (const Field* f = find(key)) return f->on_resume;
  for (std::string sec = key; sec.find('.') != std::string::npos;) {
    sec = sec.substr(0, sec.rfind('.'));
    std::set<OnResume> effects;
    for (const Field& f : fields())
      if (f.path.substr(0, sec.size() + 1) == sec + ".") effects.insert(f.on_resume);
    if (!effects.empty()) return effects.size() == 1 ? *effects.begin() : OnResume::Breaks;
  }
  return OnResume::Breaks;
}

const std::vector<std::pair<std::string, json>>& later_defaults() {
  static const std::vector<std::pair<std::string, json>> d = [] {
    std::vector<std::pair<std::string, json>> v;
    for (const Field& f : fields())
      if (f.later) v.emplace_back(std::string(f.path), value_json(f, defaults()));
    return v;
  }();
  return d;
}

}  // namespace lathe::schema
