// RoPE scaling (config.json `rope_scaling`) and partial rotary embedding (`partial_rotary_factor`):
// the one place that reads them and computes, for a sequence length, the inverse frequencies of the
// rotated dimensions and the factor on cos/sin. The oracle is transformers 4.45.2's
// modeling_rope_utils.py (ROPE_INIT_FUNCTIONS, used by LlamaRotaryEmbedding and Qwen2's):
//   default   inv_freq[i] = 1 / theta^(2i/rot)                               (rot = rotated dims)
//   linear    default / factor
//   dynamic   NTK: default with theta' = theta * (factor*L/P - (factor-1))^(rot/(rot-2)) where
//             L = the sequence length, only when L > P = max_position_embeddings (plain RoPE below)
//   yarn      ramp blend of default and default/factor between the beta_fast/beta_slow correction
//             dims of P; cos/sin x attention_factor (default 0.1 ln factor + 1, or DeepSeek's
//             mscale / mscale_all_dim ratio as later transformers compute it)
//   llama3    per wavelength: /factor, kept, or the smooth blend (low/high_freq_factor,
//             original_max_position_embeddings)
//   longrope  default / (long_factor or short_factor); cos/sin x attention_factor
//             (default sqrt(1 + ln s / ln P0)). As 4.45's LlamaRotaryEmbedding (not Phi-3's own
//             class) the choice is static: long factors when the expanded context P0 * factor (or
//             the top-level max_position_embeddings when config.json has a top-level
//             original_max_position_embeddings P0) exceeds P0, whatever the sequence length.
//             model_type phi3 follows Phi3LongRoPEScaledRotaryEmbedding instead: long factors when
//             the pass's sequence length exceeds P0, short ones otherwise.
// Every float step repeats torch's fp32 roundings so the default tables stay bit-identical to the
// kernels' former theta-based ones and the others agree with transformers to an ulp or so.
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace lathe {

struct ModelConfig;

struct RopeScaling {
  // "" = no rope_scaling (config.json null or absent); else default, linear, dynamic, yarn, llama3,
  // longrope.
  std::string type;
  bool old_type_key = false;  // spelled "type" (the old key) rather than "rope_type"; kept on write
  std::optional<double> factor, attention_factor, beta_fast, beta_slow, low_freq_factor, high_freq_factor;
  // yarn, DeepSeek's form (read by transformers after 4.45): with both, the cos/sin factor is
  // mscale(factor, mscale) / mscale(factor, mscale_all_dim), mscale(s, m) = 0.1 m ln s + 1 (1 for s <= 1).
  std::optional<double> mscale, mscale_all_dim;
  std::optional<int64_t> original_max_position_embeddings;  // inside rope_scaling
  std::vector<double> short_factor, long_factor;            // longrope, [rot/2] each
  // The top-level config.json key original_max_position_embeddings (Phi-3's spelling), which
  // transformers 4.45's longrope reads through hasattr(config, ...); no other type reads it.
  std::optional<int64_t> config_original_max_position_embeddings;

  bool active() const { return !type.empty() && type != "default"; }
  bool operator==(const RopeScaling&) const = default;

  // Parses a config.json rope_scaling object (null -> none). Errors "<source>: <prefix>rope_scaling.KEY:
  // ..." name the key and the fix. Unknown types and keys are refused (transformers warns and ignores).
  // `object` names the key in errors: rope_scaling, or rope_parameters (transformers v5's form, whose
  // rope_theta and partial_rotary_factor the caller takes out first).
  static RopeScaling from_json(const nlohmann::json& j, std::string_view source, std::string_view prefix,
                               std::string_view object = "rope_scaling");
  nlohmann::json to_json() const;  // null when type is ""
};

// The inverse frequencies [rot/2] of the rotated dimensions and the factor on cos/sin.
struct RopeFrequencies {
  std::vector<float> inv_freq;
  float attention_factor = 1.0f;
};

// For `cfg` (llama family) and a pass whose sequence is `seq_len` tokens long (only dynamic and
// phi3's longrope read it).
RopeFrequencies rope_frequencies(const ModelConfig& cfg, int64_t seq_len);
// Plain RoPE: inv_freq[i] = 1 / theta^(2i/dim), dim even, in torch's fp32 steps.
std::vector<float> rope_default_inv_freq(int64_t dim, double theta);
// Checks of rope_scaling against the rest of the config (the longrope factor lengths, yarn's
// original_max_position_embeddings, partial_rotary_factor); messages name the key and the fix.
void validate_rope(const ModelConfig& cfg, std::string_view source, std::string_view prefix);

}  // namespace lathe
