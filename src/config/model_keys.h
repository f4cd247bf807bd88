// Which config.json (recipe `model` section) names set a weight's shape or presence. A change of one
// of them cannot continue from weights of the old shape: resuming a checkpoint refuses it even with
// --force-resume-changes (config/recipe_diff.h), while every other model key (rope_theta,
// rope_scaling, max_position_embeddings of a RoPE model, norm epsilon, sliding window, ...) only
// changes the math and is allowed with that flag (a long-context continuation changes them on
// purpose). GPT-2's n_positions / n_ctx size its learned position table, so they are shapes.
// model.init_from's override check (interop/hf_weights.cpp init_from_config) refuses the same names.
#pragma once
#include <algorithm>
#include <array>
#include <string_view>

namespace lathe {

inline bool is_model_shape_key(std::string_view hf_name) {
  static constexpr std::array<std::string_view, 17> kShapes = {
      "model_type",        "vocab_size", "hidden_size", "n_embd",         "num_hidden_layers", "n_layer",
      "num_attention_heads", "n_head",   "num_key_value_heads", "intermediate_size", "n_inner", "head_dim",
      "tie_word_embeddings", "attention_bias", "mlp_bias", "n_positions", "n_ctx"};
  return std::find(kShapes.begin(), kShapes.end(), hf_name) != kShapes.end();
}

}  // namespace lathe
