// Phi-3 / 3.5 / 4 (transformers 4.45.2 Phi3Config): the config.json fields read on top of the llama
// family's (config/model_config.cpp's llama reader calls read_phi3).
#include <fmt/format.h>

#include "config/hf_reader.h"
#include "config/model_config.h"

namespace lathe {

using hf_config::Reader;
using hf_config::value_str;
using json = nlohmann::json;

// Phi3Config / Phi3ForCausalLM of transformers 4.45.2 (models/phi3), on top of the llama fields:
//  - rope_scaling: exactly {type, short_factor, long_factor}; type "su" and "yarn" are renamed
//    "longrope" by the config class (_rope_scaling_adjustment), anything else is refused by it.
//    Phi3LongRoPEScaledRotaryEmbedding reads the top-level original_max_position_embeddings
//    (class default 4096) and picks the factors per pass length (rope_frequencies).
//  - partial_rotary_factor (Phi-4-mini: 0.75): read as later transformers' Phi3 does (4.45's
//    rotates the whole head): the first int(head_dim x factor) dims rotate, longrope's factors
//    have one entry per rotated pair (validate_rope); the rest pass.
//  - no attention_bias or head_dim: the projections are sized hidden_size / num_attention_heads per
//    head; those keys are refused unless they change nothing.
//  - sliding_window (null = none): see ModelConfig::layer_window.
void read_phi3(const Reader& r, ModelConfig& c) {
  const json& j = r.j;
  c.rope_scaling.config_original_max_position_embeddings =
      r.has("original_max_position_embeddings")
          ? r.f.integer(j["original_max_position_embeddings"], "original_max_position_embeddings", 1, kMaxPositions)
          : 4096;
  if (r.has("rope_scaling") && !j["rope_scaling"].is_null()) {
    const json& rs = j["rope_scaling"];
    auto fail = [&](const std::string& k, const std::string& what) { r.fail("rope_scaling" + k, what); };
    if (!rs.is_object()) fail("", fmt::format("expected an object or null, got '{}'", value_str(rs)));
    const json* t = io::JsonFields::find(rs, "type");
    if (!t) t = io::JsonFields::find(rs, "rope_type");
    if (!t || !t->is_string())
      fail(".type", "missing: phi3 needs {\"type\": \"longrope\", \"short_factor\": [...], \"long_factor\": [...]}");
    const std::string type = t->get<std::string>();
    if (type != "longrope" && type != "su" && type != "yarn")
      fail(".type", fmt::format("'{}' is not supported by transformers 4.45's phi3 (longrope, or its old names su / "
                                "yarn)",
                                value_str(*t)));
    for (auto it = rs.begin(); it != rs.end(); ++it)
      if (it.key() != "type" && it.key() != "rope_type" && it.key() != "short_factor" && it.key() != "long_factor")
        fail("." + value_str(it.key()),
             "is not read by transformers 4.45's phi3, whose config class refuses a rope_scaling other than exactly "
             "{type, short_factor, long_factor}; remove it");
    json ls = {{"rope_type", "longrope"}};
    for (const char* k : {"short_factor", "long_factor"}) {
      if (!io::JsonFields::find(rs, k))
        fail(std::string(".") + k, "missing: phi3's longrope needs short_factor and long_factor");
      ls[k] = rs[k];
    }
    c.rope_scaling = RopeScaling::from_json(ls, r.source, r.prefix);
    c.rope_scaling.old_type_key = true;  // Phi3Config reads rope_scaling["type"]
    c.rope_scaling.config_original_max_position_embeddings =
        r.has("original_max_position_embeddings")
            ? r.f.integer(j["original_max_position_embeddings"], "original_max_position_embeddings", 1, kMaxPositions)
            : 4096;
  }
  if (r.has("partial_rotary_factor")) c.partial_rotary_factor = r.get_double("partial_rotary_factor");
  if (r.has("attention_bias") && r.get_bool("attention_bias"))
    r.fail("attention_bias", "phi3 has no attention biases; true is not supported");
  if (r.has("head_dim") && !j["head_dim"].is_null() &&
      r.get_int("head_dim") != c.hidden_size / std::max<int64_t>(c.num_attention_heads, 1))
    r.fail("head_dim", fmt::format("{}: transformers 4.45's phi3 always uses hidden_size / num_attention_heads = {}",
                                   r.get_int("head_dim"), c.hidden_size / std::max<int64_t>(c.num_attention_heads, 1)));
  c.attention_bias = false;
  c.sliding_window = r.has("sliding_window") && !j["sliding_window"].is_null() ? r.get_int("sliding_window") : 0;
  if (c.sliding_window < 0)
    r.fail("sliding_window", fmt::format("{} must be >= 0 (or null: full attention)", c.sliding_window));
}

}  // namespace lathe
