#include "config/rope_scaling.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <set>

#include "config/model_config.h"
#include "core/error.h"
#include "io/json.h"
#include "io/json_fields.h"

namespace lathe {

namespace {

using json = nlohmann::json;

// Keys each type reads in transformers 4.45 (required, optional), besides rope_type / type.
struct TypeKeys {
  std::set<std::string> required, optional;
};
const std::map<std::string, TypeKeys>& type_keys() {
  static const std::map<std::string, TypeKeys> k = {
      {"default", {{}, {}}},
      {"linear", {{"factor"}, {}}},
      {"dynamic", {{"factor"}, {"original_max_position_embeddings"}}},
      {"yarn",
       {{"factor"},
        {"attention_factor", "beta_fast", "beta_slow", "original_max_position_embeddings", "mscale", "mscale_all_dim"}}},
      {"llama3", {{"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}, {}}},
      {"longrope", {{"short_factor", "long_factor"}, {"attention_factor", "factor", "original_max_position_embeddings"}}},
  };
  return k;
}

std::string join(const std::set<std::string>& s) {
  std::string r;
  for (const auto& x : s) r += (r.empty() ? "" : ", ") + x;
  return r.empty() ? "none" : r;
}

// fp32 steps of torch: float(theta) ** (float(2i) / float(dim)) in fp32 (evaluated in double,
// rounded once), then the fp32 reciprocal.
float default_inv(int64_t i, int64_t dim, float theta) {
  const float e = static_cast<float>(2 * i) / static_cast<float>(dim);
  const float p = static_cast<float>(std::pow(static_cast<double>(theta), static_cast<double>(e)));
  return 1.0f / p;
}
float pos_freq(int64_t i, int64_t dim, float theta) {
  const float e = static_cast<float>(2 * i) / static_cast<float>(dim);
  return static_cast<float>(std::pow(static_cast<double>(theta), static_cast<double>(e)));
}

}  // namespace

RopeScaling RopeScaling::from_json(const json& j, std::string_view source, std::string_view prefix,
                                   std::string_view object) {
  RopeScaling r;
  if (j.is_null()) return r;
  auto fail = [&](const std::string& key, const std::string& what) {
    throw_error("{}: {}{}{}{}: {}", source, prefix, object, key.empty() ? "" : ".", key, what);
  };
  io::JsonFields f{io::JsonFields::Style::Expected, [&](const std::string& key, const std::string& what) {
                     fail(key, what);
                   }};
  if (!j.is_object()) fail("", fmt::format("expected an object or null, got '{}'", io::json_excerpt(j)));
  const json* rt = io::JsonFields::find(j, "rope_type");
  const json* ot = io::JsonFields::find(j, "type");
  if (!rt && !ot)
    fail("rope_type", fmt::format("missing (give rope_type: default, linear, dynamic, yarn, llama3 or longrope, "
                                  "or set {} to null)",
                                  object));
  const std::string type = f.string(rt ? *rt : *ot, rt ? "rope_type" : "type");
  if (rt && ot && f.string(*ot, "type") != type)
    fail("type", fmt::format("'{}' conflicts with rope_type '{}' (remove the old key 'type')", f.string(*ot, "type"),
                             type));
  r.old_type_key = !rt;
  if (type == "su")
    fail(rt ? "rope_type" : "type", "'su' is Phi-3's old name of longrope, which only phi3's config class maps; "
                                    "transformers' llama/qwen2 refuse it: write \"longrope\"");
  auto it = type_keys().find(type);
  if (it == type_keys().end())
    fail(rt ? "rope_type" : "type",
         fmt::format("'{}' is not a RoPE type of transformers 4.45 (default, linear, dynamic, yarn, llama3, longrope)",
                     type.size() <= 60 ? type : type.substr(0, 60) + "..."));
  r.type = type;
  const TypeKeys& tk = it->second;
  for (auto e = j.begin(); e != j.end(); ++e) {
    const std::string& k = e.key();
    if (k == "rope_type" || k == "type") continue;
    if (!tk.required.count(k) && !tk.optional.count(k)) {
      if (k == "mscale" || k == "mscale_all_dim")
        fail(k, fmt::format("is read by rope_type 'yarn' only (DeepSeek's attention factor), not by '{}'; remove it",
                            type));
      fail(k, fmt::format("is not read by rope_type '{}' (it reads: {}); remove it", type,
                          join([&] {
                            std::set<std::string> all = tk.required;
                            all.insert(tk.optional.begin(), tk.optional.end());
                            return all;
                          }())));
    }
  }
  for (const auto& k : tk.required)
    if (!io::JsonFields::find(j, k))
      fail(k, fmt::format("missing: rope_type '{}' requires {}", type, join(tk.required)));
  auto num = [&](const char* k, double lo, bool lo_open) -> std::optional<double> {
    const json* v = io::JsonFields::find(j, k);
    if (!v) return std::nullopt;
    return f.number(*v, k, lo, lo_open);
  };
  // transformers warns (only) below these bounds; lathe refuses values whose formula breaks.
  r.factor = num("factor", 0.0, true);
  if (r.factor && type != "longrope" && *r.factor < 1.0)
    fail("factor", fmt::format("{} must be >= 1 (1 = no scaling)", *r.factor));
  r.attention_factor = num("attention_factor", 0.0, true);
  r.beta_fast = num("beta_fast", 0.0, true);
  r.beta_slow = num("beta_slow", 0.0, true);
  r.mscale = num("mscale", 0.0, true);
  r.mscale_all_dim = num("mscale_all_dim", 0.0, true);
  if (r.mscale.has_value() != r.mscale_all_dim.has_value())
    fail(r.mscale ? "mscale" : "mscale_all_dim",
         "transformers reads mscale and mscale_all_dim together (their ratio is the attention factor); give both, "
         "or neither for the default 0.1 ln(factor) + 1");
  if (r.mscale && r.attention_factor)
    fail("attention_factor", "conflicts with mscale / mscale_all_dim, which set the attention factor; give one");
  r.low_freq_factor = num("low_freq_factor", 0.0, true);
  r.high_freq_factor = num("high_freq_factor", 0.0, true);
  if (const json* v = io::JsonFields::find(j, "original_max_position_embeddings"))
    r.original_max_position_embeddings = f.integer(*v, "original_max_position_embeddings", 1, kMaxPositions);
  if (r.low_freq_factor && r.high_freq_factor && !(*r.high_freq_factor > *r.low_freq_factor))
    fail("high_freq_factor",
         fmt::format("{} must be > low_freq_factor {}", *r.high_freq_factor, *r.low_freq_factor));
  if (r.beta_fast && r.beta_slow && *r.beta_fast < *r.beta_slow)
    fail("beta_fast", fmt::format("{} must be >= beta_slow {}", *r.beta_fast, *r.beta_slow));
  for (auto [k, out] : {std::pair{"short_factor", &r.short_factor}, std::pair{"long_factor", &r.long_factor}}) {
    const json* v = io::JsonFields::find(j, k);
    if (!v) continue;
    const json& a = f.array(*v, k);
    for (size_t i = 0; i < a.size(); ++i) out->push_back(f.number(a[i], fmt::format("{}[{}]", k, i), 0.0, true));
  }
  return r;
}

json RopeScaling::to_json() const {
  if (type.empty()) return nullptr;
  json j;
  j[old_type_key ? "type" : "rope_type"] = type;
  for (auto [k, v] : {std::pair{"factor", factor}, std::pair{"attention_factor", attention_factor},
                      std::pair{"beta_fast", beta_fast}, std::pair{"beta_slow", beta_slow},
                      std::pair{"low_freq_factor", low_freq_factor}, std::pair{"high_freq_factor", high_freq_factor},
                      std::pair{"mscale", mscale}, std::pair{"mscale_all_dim", mscale_all_dim}})
    if (v) j[k] = *v;
  if (original_max_position_embeddings) j["original_max_position_embeddings"] = *original_max_position_embeddings;
  if (type == "longrope") {
    j["short_factor"] = short_factor;
    j["long_factor"] = long_factor;
  }
  return j;
}

std::vector<float> rope_default_inv_freq(int64_t dim, double theta) {
  std::vector<float> inv(static_cast<size_t>(dim / 2));
  for (int64_t i = 0; i < dim / 2; ++i) inv[static_cast<size_t>(i)] = default_inv(i, dim, static_cast<float>(theta));
  return inv;
}

void validate_rope(const ModelConfig& c, std::string_view source, std::string_view prefix) {
  const RopeScaling& r = c.rope_scaling;
  const int64_t D = c.head_dim(), rot = c.rotary_dim();
  LATHE_CHECK(c.partial_rotary_factor > 0 && c.partial_rotary_factor <= 1,
              "{}: {}partial_rotary_factor = {} must be in (0, 1]", source, prefix, c.partial_rotary_factor);
  LATHE_CHECK(rot >= 2 && rot % 2 == 0,
              "{}: {}partial_rotary_factor = {}: head_dim {} x {} gives {} rotated dims; that must be even and >= 2 "
              "(choose a factor that makes int(head_dim x factor) even)",
              source, prefix, c.partial_rotary_factor, D, c.partial_rotary_factor, rot);
  const int64_t P = c.max_position_embeddings;
  if (r.type == "yarn" && r.original_max_position_embeddings && *r.original_max_position_embeddings != P)
    throw_error("{}: {}rope_scaling.original_max_position_embeddings = {} differs from max_position_embeddings = {}: "
                "transformers 4.45 computes yarn from max_position_embeddings and ignores this key (later versions "
                "read it), so the two disagree; make them equal",
                source, prefix, *r.original_max_position_embeddings, P);
  if (r.type == "longrope") {
    for (auto [k, v] : {std::pair{"short_factor", &r.short_factor}, std::pair{"long_factor", &r.long_factor}})
      LATHE_CHECK(static_cast<int64_t>(v->size()) == rot / 2,
                  "{}: {}rope_scaling.{} has {} entries; it needs rotated dims / 2 = {} (one per frequency)", source,
                  prefix, k, v->size(), rot / 2);
    LATHE_CHECK(r.factor || r.config_original_max_position_embeddings,
                "{}: {}rope_scaling.factor: missing: longrope needs factor (or a top-level "
                "original_max_position_embeddings, as Phi-3 writes)",
                source, prefix);
    if (r.config_original_max_position_embeddings)
      LATHE_CHECK(*r.config_original_max_position_embeddings >= 1, "{}: {}original_max_position_embeddings = {} must be >= 1",
                  source, prefix, *r.config_original_max_position_embeddings);
  }
  if (r.type == "dynamic")
    LATHE_CHECK(rot > 2, "{}: {}rope_scaling: dynamic needs more than 2 rotated dims (its exponent is rot/(rot-2))",
                source, prefix);
  // Values too large for fp32 (a factor of 1e300, say) would put inf or NaN into the tables.
  const RopeFrequencies f = rope_frequencies(c, P);
  bool finite = std::isfinite(f.attention_factor);
  for (float x : f.inv_freq) finite = finite && std::isfinite(x);
  LATHE_CHECK(finite,
              "{}: {}rope_scaling {}: the RoPE frequencies or the attention factor are not finite in fp32 (attention "
              "factor {}); use values of a real model",
              source, prefix, io::json_excerpt(r.to_json()), f.attention_factor);
}

RopeFrequencies rope_frequencies(const ModelConfig& c, int64_t seq_len) {
  const RopeScaling& r = c.rope_scaling;
  const int64_t dim = c.rotary_dim(), half = dim / 2;
  const int64_t P = c.max_position_embeddings;
  RopeFrequencies out;
  const std::string& type = r.type.empty() ? std::string("default") : r.type;
  if (type == "default" || type == "linear" || type == "llama3") {
    out.inv_freq = rope_default_inv_freq(dim, c.rope_theta);
    if (type == "linear") {
      const float f = static_cast<float>(*r.factor);
      for (auto& x : out.inv_freq) x /= f;
    } else if (type == "llama3") {
      const double factor = *r.factor, lo = *r.low_freq_factor, hi = *r.high_freq_factor;
      const double old_len = static_cast<double>(*r.original_max_position_embeddings);
      const float lo_wl = static_cast<float>(old_len / lo), hi_wl = static_cast<float>(old_len / hi);
      const float ff = static_cast<float>(factor), two_pi = static_cast<float>(2 * M_PI);
      const float old_f = static_cast<float>(old_len), lo_f = static_cast<float>(lo),
                  span = static_cast<float>(hi - lo);
      for (auto& x : out.inv_freq) {
        const float wl = two_pi / x;
        const float il = wl > lo_wl ? x / ff : x;
        const float s = (old_f / wl - lo_f) / span;
        const float smoothed = (1.0f - s) * il / ff + s * il;
        const bool medium = !(wl < hi_wl) && !(wl > lo_wl);
        x = medium ? smoothed : il;
      }
    }
    return out;
  }
  if (type == "dynamic") {
    const double factor = *r.factor;
    double base = c.rope_theta;
    if (seq_len > P) {
      // transformers passes seq_len as a 0-dim int64 tensor here: the arithmetic is fp32.
      const float s = static_cast<float>(factor) * static_cast<float>(seq_len) / static_cast<float>(P) -
                      static_cast<float>(factor - 1);
      const float pw = static_cast<float>(
          std::pow(static_cast<double>(s), static_cast<double>(static_cast<float>(double(dim) / double(dim - 2)))));
      base = static_cast<double>(static_cast<float>(base) * pw);
    } else {  // at init: seq_len = P, python doubles
      base = base * std::pow(factor * double(P) / double(P) - (factor - 1), double(dim) / double(dim - 2));
    }
    out.inv_freq = rope_default_inv_freq(dim, base);
    return out;
  }
  if (type == "yarn") {
    const double base = c.rope_theta, factor = *r.factor;
    // transformers' get_mscale(scale, m) = 0.1 m ln(scale) + 1, or 1 when scale <= 1.
    auto get_mscale = [&](double m) { return factor <= 1.0 ? 1.0 : 0.1 * m * std::log(factor) + 1.0; };
    out.attention_factor = static_cast<float>(r.attention_factor ? *r.attention_factor
                                              : r.mscale         ? get_mscale(*r.mscale) / get_mscale(*r.mscale_all_dim)
                                                                 : 0.1 * std::log(factor) + 1.0);
    // transformers: `config.rope_scaling.get("beta_fast") or 32` (0 reads as absent).
    const double beta_fast = r.beta_fast && *r.beta_fast != 0 ? *r.beta_fast : 32;
    const double beta_slow = r.beta_slow && *r.beta_slow != 0 ? *r.beta_slow : 1;
    auto corr_dim = [&](double rot) {
      return (double(dim) * std::log(double(P) / (rot * 2 * M_PI))) / (2 * std::log(base));
    };
    const double low = std::max(std::floor(corr_dim(beta_fast)), 0.0);
    double high = std::min(std::ceil(corr_dim(beta_slow)), double(dim - 1));
    if (low == high) high += 0.001;
    const float lo_f = static_cast<float>(low), span = static_cast<float>(high - low);
    const float theta = static_cast<float>(base), ff = static_cast<float>(factor);
    out.inv_freq.resize(static_cast<size_t>(half));
    for (int64_t i = 0; i < half; ++i) {
      const float pf = pos_freq(i, dim, theta);
      const float extra = 1.0f / pf, inter = 1.0f / (ff * pf);
      const float ramp = std::clamp((static_cast<float>(i) - lo_f) / span, 0.0f, 1.0f);
      const float ef = 1.0f - ramp;
      out.inv_freq[static_cast<size_t>(i)] = inter * (1.0f - ef) + extra * ef;
    }
    return out;
  }
  // longrope
  double orig = static_cast<double>(P), expanded = 0, factor = 0;
  if (r.config_original_max_position_embeddings) {
    orig = static_cast<double>(*r.config_original_max_position_embeddings);
    expanded = static_cast<double>(P);
    factor = expanded / orig;
  } else {
    factor = *r.factor;
    expanded = orig * factor;
  }
  out.attention_factor = static_cast<float>(r.attention_factor ? *r.attention_factor
                                            : factor <= 1.0     ? 1.0
                                                                : std::sqrt(1 + std::log(factor) / std::log(orig)));
  // phi3 (transformers 4.45.2 Phi3LongRoPEScaledRotaryEmbedding, not the llama class): the long
  // factors when this pass is longer than original_max_position_embeddings (seq_len > P0, with
  // seq_len the keys' length: the whole sequence in training), else the short ones; its attention
  // factor is the one above (max_position_embeddings / P0).
  const bool phi3 = c.model_type == "phi3";
  const bool use_long = phi3 ? seq_len > static_cast<int64_t>(orig) : expanded > orig;
  const std::vector<double>& ext = use_long ? r.long_factor : r.short_factor;
  const float theta = static_cast<float>(c.rope_theta);
  out.inv_freq.resize(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i)
    out.inv_freq[static_cast<size_t>(i)] = 1.0f / (static_cast<float>(ext[static_cast<size_t>(i)]) * pos_freq(i, dim, theta));
  return out;
}

}  // namespace lathe
