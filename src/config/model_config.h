// Model architecture hyper-parameters, read from / written to HF transformers config.json.
// Two families share the code paths: "gpt2" (LayerNorm, learned positions, GELU-tanh MLP, Conv1D
// weights) and "llama" (RMSNorm, rotate_half RoPE, SwiGLU, GQA) which also covers qwen2 (q/k/v
// biases), mistral (sliding window) and phi3 (fused qkv_proj / gate_up_proj, Phi-3's longrope and
// window: read_phi3 in model_config.cpp). Field meanings: shared/reference/hf-model-configs.md.
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "config/rope_scaling.h"

namespace lathe {

// Documented bounds of the dimensions (validate() refuses larger values naming the field). They are
// far above any published model and keep every size product (parameter count, activations, the
// int32 token ids) inside 64 bits; whether a model fits the machine is models/memory.h's check.
constexpr int64_t kMaxVocabSize = INT32_MAX;          // token ids are int32
constexpr int64_t kMaxHiddenSize = int64_t{1} << 20;  // hidden_size / n_embd, heads
constexpr int64_t kMaxLayers = int64_t{1} << 16;      // num_hidden_layers / n_layer
constexpr int64_t kMaxIntermediateSize = int64_t{1} << 24;
constexpr int64_t kMaxPositions = int64_t{1} << 26;  // max_position_embeddings, sliding_window
constexpr int64_t kMaxMoeExperts = int64_t{1} << 16;  // num_local_experts (mixture of experts)

struct ModelConfig {
  std::string model_type;  // as in HF: "gpt2", "llama", "qwen2", "mistral", "qwen3", "phi3", "gpt_neox"
  std::string family;      // "gpt2", "llama" (qwen2, mistral, qwen3, phi3 -> llama) or "gpt_neox"
  int64_t vocab_size = 0, hidden_size = 0, num_hidden_layers = 0, num_attention_heads = 0,
          num_key_value_heads = 0;      // gpt2: num_key_value_heads == num_attention_heads
  int64_t intermediate_size = 0;        // gpt2: n_inner or 4*hidden
  int64_t max_position_embeddings = 0;  // gpt2: n_positions
  double norm_eps = 1e-5;               // gpt2 layer_norm_epsilon; llama rms_norm_eps
  double rope_theta = 10000.0;          // llama family
  // llama family: config.json rope_scaling (config/rope_scaling.h; type "" = null) and
  // partial_rotary_factor (rotate the first int(head_dim x factor) dims of each head, the rest pass
  // through; 1 = the whole head).
  RopeScaling rope_scaling;
  double partial_rotary_factor = 1.0;
  bool tie_word_embeddings = true;  // gpt2 always true
  // llama: attention_bias (q/k/v/o biases); qwen2: forced true and means q/k/v biases only (no
  // o_proj bias); mistral: false; gpt2: false here, but GPT-2 always has all its biases.
  bool attention_bias = false;
  double initializer_range = 0.02;
  // Normalized: gpt2 -> "gelu_new" (tanh GELU; HF's "gelu_pytorch_tanh" is the same function and
  // is read as "gelu_new"); llama family -> "silu" ("swish" is read as "silu").
  std::string hidden_act;
  // Addition. gpt_neox use_parallel_residual: x + attn(ln1(x)) + mlp(ln2(x)) (both branches read
  // the layer input) instead of the sequential pre-norm order. gpt_neox's rotary_pct is
  // partial_rotary_factor, its rotary_emb_base rope_theta, its attention_bias (q/k/v and dense
  // biases) attention_bias, its hidden_act "gelu" the exact (erf) GELU.
  bool parallel_residual = false;
  // Addition. gemma2 (config/gemma2_config.cpp): query_pre_attn_scalar (attention scores scaled by
  // 1/sqrt(it) instead of 1/sqrt(head_dim); 0 = absent), attn_logit_softcapping (scores s ->
  // cap * tanh(s / cap) before the softmax) and final_logit_softcapping (the same on the lm head's
  // logits); 0 = none. The gemma2 body (sandwich norms, (1 + w) RMSNorm, embedding x sqrt(hidden),
  // GeGLU) follows from model_type (Arch, models/model.h).
  double query_pre_attn_scalar = 0.0;
  double attn_logit_softcapping = 0.0, final_logit_softcapping = 0.0;
  // The attention kernels' score scale: 1/sqrt(query_pre_attn_scalar) (as transformers: a double
  // rounded to float once), or 0 = the kernels' 1/sqrt(head_dim).
  float attention_scale() const;
  float attn_softcap() const { return static_cast<float>(attn_logit_softcapping); }
  float final_softcap() const { return static_cast<float>(final_logit_softcapping); }
  // -1 = absent; a list (eos) -> its first id. gpt2 defaults 50256 only when vocab_size > 50256.
  int64_t bos_token_id = -1, eos_token_id = -1, pad_token_id = -1;
  // config.json's eos_token_id when it is a list of several ids (Llama 3.x Instruct: <|end_of_text|>,
  // <|eom_id|>, <|eot_id|>), in its order (eos_token_id is the first); written back as that list.
  // Empty for a single id.
  std::vector<int64_t> eos_token_ids;
  // Addition. mistral / qwen2 sliding-window attention width; 0 = none (full causal attention).
  // A layer with the window attends keys j > t - window only (HF Mistral); a window >= the
  // sequence length is full attention.
  int64_t sliding_window = 0;
  // Addition. Which layers use sliding_window when only some do (qwen2 max_window_layers: layers
  // >= it; or a layer_types list of sliding_attention / full_attention): one entry per layer,
  // 1 = sliding. Empty = every layer uses sliding_window (a list naming one kind only is stored
  // as empty, with sliding_window 0 when every layer is full_attention).
  std::vector<uint8_t> sliding_layers;
  // The attention window of layer l (0 = full attention).
  // phi3: config.json's sliding_window S reaches S + 1 keys (j >= t - S). transformers 4.45.2's
  // Phi3 applies the window only in Phi3FlashAttention2, as flash-attn's window_size=(S, S) (its
  // eager and sdpa masks ignore sliding_window); Phi-3-mini-4k's S = 2047 is a 2048-key window.
  int64_t layer_window(int64_t l) const {
    if (!(sliding_window > 0 && (sliding_layers.empty() || sliding_layers[static_cast<size_t>(l)]))) return 0;
    return model_type == "phi3" ? sliding_window + 1 : sliding_window;
  }
  // The keys one query position is counted as attending to, summed over the layers, for the FLOPs
  // convention 12 x (heads x head_dim) x keys per layer (PaLM's, which counts T keys for causal
  // attention): T for a full layer, min(T, window) for a sliding one.
  double attention_keys_over_layers(int64_t T) const {
    double keys = 0;
    for (int64_t l = 0; l < num_hidden_layers; ++l) {
      const int64_t w = layer_window(l);
      keys += static_cast<double>(w > 0 && w < T ? w : T);
    }
    return keys;
  }

  // config.json `head_dim` (llama family): the width of one attention head when it is not
  // hidden_size / num_attention_heads (Mistral-Nemo: 5120 / 32 heads of 128; Qwen3-0.6B: 1024 / 16
  // heads of 128); q/k/v/o are sized heads x head_dim. 0 = absent: hidden_size / num_attention_heads.
  // A tensor-parallel shard's config keeps the whole model's head width here (its heads are heads/tp).
  int64_t explicit_head_dim = 0;
  // Addition. Qwen3: per-head RMSNorm of q and k (self_attn.q_norm / k_norm, weight [head_dim],
  // eps norm_eps) after the projections, before RoPE. Set by from_hf_json for model_type qwen3.
  bool qk_norm = false;
  // --- olmo2 (config/olmo2_config.cpp): set by from_hf_json and the preset for model_type olmo2 ---
  // post_norm: no input / pre-MLP norms; the attention's and the MLP's outputs are RMSNormed before
  // their residual adds (post_attention_layernorm, post_feedforward_layernorm): Arch::pre_norm false
  // with Arch::sandwich_norm. qk_norm_full: RMSNorm of the whole q projection (weight [heads x
  // head_dim]) and of the whole k projection ([kv_heads x head_dim]) before RoPE (Arch::qk_norm_full;
  // unlike qk_norm's per-head norm).
  bool post_norm = false;
  bool qk_norm_full = false;
  // --- end olmo2 ---

  // ---- mixture of experts (issue 28; config/mixtral_config.cpp, models/moe_layer.cpp) ----------
  // Addition. mixtral: every layer's MLP is a sparse MoE block of num_local_experts SwiGLU experts
  // of width intermediate_size, num_experts_per_tok of them per token (softmax -> top-k ->
  // renormalised when norm_topk_prob). 0 experts = the dense MLP. router_aux_loss_coef x the
  // load-balancing loss is added to the training loss when output_router_logits is true (as
  // transformers' MixtralForCausalLM does); router_z_loss_coef (lathe only, 0 = off) adds that
  // coefficient x the mean router z-loss (ST-MoE).
  int64_t num_local_experts = 0, num_experts_per_tok = 0;
  bool norm_topk_prob = true, output_router_logits = false;
  double router_aux_loss_coef = 0.0, router_z_loss_coef = 0.0;
  bool moe() const { return num_local_experts > 0; }
  // The coefficient of the aux loss in the training loss (0 unless output_router_logits).
  double moe_aux_coef() const { return output_router_logits ? router_aux_loss_coef : 0.0; }
  // qwen2_moe (config/qwen2_moe_config.cpp, models/moe_shared.cpp): each MoE layer also runs a
  // shared SwiGLU expert of width shared_expert_intermediate_size on every token, its output times
  // sigmoid(shared_expert_gate(x)) added to the routed output (0 = none). For qwen2_moe,
  // intermediate_size holds the routed experts' width (config.json moe_intermediate_size) and
  // dense_intermediate_size config.json's intermediate_size (the width of mlp_only_layers' dense
  // MLPs, which lathe refuses; kept for the config.json round trip).
  int64_t shared_expert_intermediate_size = 0, dense_intermediate_size = 0;
  // ---- end mixture of experts ----

  // The width of one attention head: explicit_head_dim, else hidden_size / num_attention_heads.
  int64_t head_dim() const {
    if (explicit_head_dim > 0) return explicit_head_dim;
    return num_attention_heads > 0 ? hidden_size / num_attention_heads : 0;
  }
  // Width of the attention's q rows and of o_proj's input: heads x head_dim (hidden_size unless
  // head_dim is explicit).
  int64_t attention_width() const { return num_attention_heads * head_dim(); }
  // Rotated dims of each head (RoPE tables are [T, rotary_dim() / 2]).
  int64_t rotary_dim() const {
    return partial_rotary_factor == 1.0 ? head_dim()
                                        : static_cast<int64_t>(static_cast<double>(head_dim()) * partial_rotary_factor);
  }
  bool is_gpt2() const { return family == "gpt2"; }
  bool is_llama() const { return family == "llama"; }
  bool is_gpt_neox() const { return family == "gpt_neox"; }  // addition
  // Addition. Rotary positions (llama family, gpt_neox) rather than gpt2's learned ones.
  bool rotary() const { return !is_gpt2(); }
  // Addition. The family's norms are LayerNorms with biases and its MLP a GELU one (c_fc, c_proj)
  // rather than RMSNorm and SwiGLU: gpt2 and gpt_neox.
  bool gelu_mlp() const { return is_gpt2() || is_gpt_neox(); }
  // Addition. The MLP's GELU is the exact (erf) one: hidden_act "gelu" (gpt_neox's default).
  bool gelu_exact() const { return hidden_act == "gelu"; }
  // Addition. q/k/v projections carry a bias (gpt2: inside c_attn; llama: attention_bias; qwen2).
  bool qkv_bias() const { return is_gpt2() || attention_bias; }  // gpt_neox: attention_bias
  // Addition. The attention output projection carries a bias (gpt2 c_proj; llama attention_bias;
  // never for qwen2).
  bool o_bias() const { return is_gpt2() || (attention_bias && model_type != "qwen2" && model_type != "qwen2_moe"); }
  // Addition. Number of trainable parameters (tied lm_head counted once). Checked arithmetic:
  // throws lathe::Error instead of wrapping.
  int64_t num_parameters() const;

  // Parse an HF config.json object. `source` names the file/section in errors ("<source>: <key>:
  // ..."). Missing keys take the HF class defaults of the model_type. Keys that change the math
  // and are not supported -> error naming the key. Known harmless keys (architectures,
  // torch_dtype, transformers_version, use_cache, dropout probabilities, token ids, ...) are
  // accepted. strict_unknown=true (recipes): an unknown key is an error naming it and the closest
  // valid key, and non-zero dropout is an error (lathe has no dropout); false (config.json files):
  // unknown keys are accepted and listed in `ignored_keys`.
  static ModelConfig from_hf_json(const nlohmann::json& j, std::string_view source, bool strict_unknown = false);
  // Same, with `key_prefix` put in front of key names in errors (recipes pass "model.").
  static ModelConfig from_hf_json(const nlohmann::json& j, std::string_view source, std::string_view key_prefix,
                                  bool strict_unknown);
  // config.json keys lathe reads and does not use, and why (same order): unknown keys (transformers
  // ignores keys its config class does not read too), non-zero dropout (lathe trains without it).
  // Listed once in the startup output of convert, train (init_from) and eval: ignored_note().
  std::vector<std::string> ignored_keys, ignored_reasons;
  // "config.json keys not used: k (why), ..." or "" when there are none.
  std::string ignored_note() const;

  // A complete HF config.json that transformers 4.x loads: model_type, architectures
  // (GPT2LMHeadModel / LlamaForCausalLM / Qwen2ForCausalLM / MistralForCausalLM / Phi3ForCausalLM), the family's
  // field names, torch_dtype "float32".
  nlohmann::json to_hf_json() const;
  // Heads divide hidden (unless head_dim is explicit), kv heads divide heads, sizes in (0, kMax...], head_dim even for
  // RoPE, finite positive floats, parameter count within 64 bits. Errors name the field and the values.
  void validate(std::string_view source) const;
  void validate(std::string_view source, std::string_view key_prefix) const;  // addition
  // Addition. seq_len <= max_position_embeddings (except with dynamic RoPE scaling, made for longer
  // sequences).
  void check_seq_len(int64_t seq_len, std::string_view source) const;

  // Presets (all validated):
  //   gpt2-debug        L=2  C=48  H=4        V=96    P=128           (tiny, tests)
  //   gpt2-124m         HF "gpt2": L=12 C=768 H=12 V=50257 P=1024
  //   gpt2-small-bench  L=4  C=256 H=4        V=50257 P=1024
  //   llama-debug       L=2  C=48  H=4 KV=2 I=96  V=96 P=128, untied
  //   qwen2-debug       as llama-debug, q/k/v biases, tied, rope_theta 1e6
  //   mistral-debug     as llama-debug, sliding_window 0 (none)
  //   qwen3-debug       as llama-debug, head_dim 16 (4 heads of 16 in hidden 48), q/k norms, tied
  //   llama-small-bench L=4  C=256 H=4 KV=2 I=688 V=32000 P=1024
  //   gpt-neox-debug    L=3  C=40  H=5 (D=8) I=72 V=83 P=96, rotary_pct 0.25, parallel residual,
  //                     exact GELU, untied (Pythia's shape, odd-ish sizes)
  //   phi3-debug        as llama-debug, fused qkv / gate_up, longrope (original 32), sliding_window 23
  //   mixtral-debug     L=2 C=48 H=4 KV=2, 5 experts of I=40, top-2, aux loss 0.02 on, V=96 P=128
  //   olmo2-debug       L=3 C=60 H=6 (D=10) KV=2 I=72 V=97 P=128, post norms, whole-projection q/k
  //                     norms, rope_theta 5e5, untied
  // Unknown name -> error listing the presets.
  static ModelConfig preset(std::string_view name);
  static std::vector<std::string> preset_names();

  // Addition. Valid recipe/config.json key names for a model_type (family names, HF aliases,
  // known harmless keys). Used for "did you mean" suggestions.
  static std::vector<std::string> known_keys(std::string_view model_type);
};

// Ignores ignored_keys, and compares head_dim() rather than explicit_head_dim (an explicit
// head_dim equal to hidden/heads is the same model: transformers writes it into every config.json).
bool operator==(const ModelConfig& a, const ModelConfig& b);

}  // namespace lathe
