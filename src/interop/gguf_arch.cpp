#include "interop/gguf_arch.h"

#include <fmt/format.h>

#include <cmath>
#include <utility>

#include "core/error.h"

namespace lathe {

namespace {

uint32_t u32(int64_t v) { return static_cast<uint32_t>(v); }

// RoPE scaling as llama.cpp reads it (convert_hf_to_gguf.py's keys): linear and yarn as
// {arch}.rope.scaling.*, llama3 (and longrope without an attention factor) as the rope_freqs
// tensor of per-frequency divisors (llama.cpp: freq_i = base^(-2i/n_rot) / rope_freqs[i]). What
// llama.cpp cannot reproduce is refused naming the key.
// phi3's longrope as convert_hf_to_gguf.py's Phi3MiniModel writes it: rope_factors_long /
// rope_factors_short [rot/2], the attention factor and original_context_length (llama.cpp takes
// the long factors when its context n_ctx exceeds it, the short ones otherwise).
std::string add_phi3_longrope(io::GgufWriter& w, const ModelConfig& c, const std::string& arch) {
  const RopeScaling& r = c.rope_scaling;
  // As rope_frequencies: Phi-3's top-level original_max_position_embeddings, else the context.
  const int64_t orig = r.config_original_max_position_embeddings.value_or(c.max_position_embeddings);
  const float attn = rope_frequencies(c, c.max_position_embeddings).attention_factor;
  w.add_u32(arch + ".rope.scaling.original_context_length", u32(orig));
  w.add_f32(arch + ".rope.scaling.attn_factor", attn);
  for (const auto& [name, f] : {std::pair{"rope_factors_long.weight", &r.long_factor},
                                std::pair{"rope_factors_short.weight", &r.short_factor}}) {
    std::vector<float> v(f->begin(), f->end());
    const Shape shape = {static_cast<int64_t>(v.size())};
    w.add_tensor_owned(name, shape, std::move(v), DType::F32);
  }
  return fmt::format(
      "note: longrope: llama.cpp uses the long factors whenever its context n_ctx > {} and the short ones "
      "otherwise, where transformers' Phi3 (and lathe) choose by each pass's length: the same for every pass "
      "when n_ctx <= {}, for passes longer than {} otherwise (attention factor {})",
      orig, orig, orig, attn);
}

std::string add_rope_scaling(io::GgufWriter& w, const ModelConfig& c, const std::string& arch) {
  // (llama.cpp's phi3 rotates the first rope.dimension_count dims of a head, NEOX order, as
  // transformers' partial rotary; its llama refuses n_rot != head_dim.)
  LATHE_CHECK(c.rotary_dim() == c.head_dim() || arch == "phi3",
              "gguf export: partial_rotary_factor = {} ({} of {} dims rotate): llama.cpp's {} architecture requires "
              "rope.dimension_count = head_dim (it refuses to load the file otherwise); export a model without it",
              c.partial_rotary_factor, c.rotary_dim(), c.head_dim(), arch);
  const RopeScaling& r = c.rope_scaling;
  if (!r.active()) return "";
  if (arch == "phi3" && r.type == "longrope") return add_phi3_longrope(w, c, arch);
  auto refuse = [&](const std::string& why) {
    throw_error("gguf export: rope_scaling type '{}': {}; export a model without it (rope_scaling null)", r.type, why);
  };
  if (r.type == "dynamic") refuse("llama.cpp has no dynamic NTK scaling (frequencies that follow the length)");
  if (r.type == "linear") {
    w.add_string(arch + ".rope.scaling.type", "linear");
    w.add_f32(arch + ".rope.scaling.factor", static_cast<float>(*r.factor));
    return "";
  }
  if (r.type == "yarn") {
    if (r.attention_factor || r.beta_fast || r.beta_slow || r.mscale)
      refuse(
          "llama.cpp's yarn uses the default attention_factor (0.1 ln factor + 1) and beta_fast 32 / beta_slow "
          "1; this config sets attention_factor/beta_fast/beta_slow/mscale");
    w.add_string(arch + ".rope.scaling.type", "yarn");
    w.add_f32(arch + ".rope.scaling.factor", static_cast<float>(*r.factor));
    // transformers 4.45 computes yarn's correction range from max_position_embeddings.
    w.add_u32(arch + ".rope.scaling.original_context_length", static_cast<uint32_t>(c.max_position_embeddings));
    return "";
  }
  const RopeFrequencies f = rope_frequencies(c, c.max_position_embeddings);
  if (r.type == "longrope" && f.attention_factor != 1.0f)
    refuse(
        fmt::format("llama.cpp's {} graph applies no longrope attention factor (here {}; only its phi3 "
                    "architecture reads longrope)",
                    arch, f.attention_factor));
  // llama3, longrope: divisors of the plain frequencies, as an F32 tensor [rot/2].
  const std::vector<float> plain = rope_default_inv_freq(c.rotary_dim(), c.rope_theta);
  std::vector<float> div(plain.size());
  for (size_t i = 0; i < div.size(); ++i) div[i] = plain[i] / f.inv_freq[i];
  const Shape shape = {static_cast<int64_t>(div.size())};  // before div is moved from
  w.add_tensor_owned("rope_freqs.weight", shape, std::move(div), DType::F32);
  return "";
}

// gemma2: llama.cpp scales q by 1/sqrt(head_dim), or 1/sqrt(hidden / heads) when it takes the
// model for Gemma-2-27B (46 layers; llama_model_gemma2::load_arch_hparams), whatever the file
// says. The factor that makes that 1/sqrt(query_pre_attn_scalar): 1 for the released models.
double gemma2_q_factor(const ModelConfig& c) {
  const double denom = c.num_hidden_layers == 46 ? static_cast<double>(c.hidden_size / c.num_attention_heads)
                                                 : static_cast<double>(c.head_dim());
  return std::sqrt(denom / c.query_pre_attn_scalar);
}

void check_gemma2(const ModelConfig& c) {
  // llama.cpp's gemma2 always caps (its defaults 50 / 30 when the keys are absent).
  LATHE_CHECK(c.attn_logit_softcapping > 0 && c.final_logit_softcapping > 0,
              "--to-gguf: gemma2 with attn_logit_softcapping {} / final_logit_softcapping {} (0 = null, no cap): "
              "llama.cpp's gemma2 architecture always soft-caps (50 / 30 when the keys are absent); give both caps",
              c.attn_logit_softcapping, c.final_logit_softcapping);
  // llama.cpp's default layer pattern (period 2): even layers slide, as transformers 4.45's Gemma2.
  for (int64_t l = 0; l < c.num_hidden_layers; ++l)
    LATHE_CHECK((c.layer_window(l) > 0) == (l % 2 == 0),
                "internal: gemma2 layer {} {} but llama.cpp slides the even layers only", l,
                c.layer_window(l) > 0 ? "slides" : "does not slide");
}

void check_olmo2(const ModelConfig& c) {
  // llama_model_olmo2::load_arch_tensors takes hidden / heads as the head width.
  LATHE_CHECK(c.head_dim() * c.num_attention_heads == c.hidden_size,
              "--to-gguf: olmo2 with head_dim {} != hidden_size {} / num_attention_heads {}: llama.cpp's olmo2 "
              "architecture derives the head width from them; export the HF directory instead",
              c.head_dim(), c.hidden_size, c.num_attention_heads);
  // Its graph reads no rope_freqs tensor; linear / yarn are not checked against it.
  LATHE_CHECK(!c.rope_scaling.active(),
              "--to-gguf: olmo2 with rope_scaling '{}': not checked against llama.cpp's olmo2 graph (which reads no "
              "rope_freqs tensor); export a model without it or the HF directory",
              c.rope_scaling.type);
}

}  // namespace

std::string gguf_arch(const ModelConfig& c) {
  if (c.is_gpt2()) return "gpt2";
  if (c.is_gpt_neox()) return "gptneox";
  if (c.model_type == "gemma2" || c.model_type == "olmo2") return c.model_type;
  if (c.qk_norm) return "qwen3";
  if (c.model_type == "qwen2") return "qwen2";
  if (c.model_type == "phi3") return "phi3";
  return "llama";  // llama, mistral
}

void check_gguf_exportable(const ModelConfig& c) {
  const bool gpt2 = c.is_gpt2(), neox = c.is_gpt_neox(), gemma2 = c.model_type == "gemma2";
  LATHE_CHECK(
      !c.moe(),
      "--to-gguf: {} (mixture of experts) GGUF export is not implemented yet (llama.cpp's stacked-expert "
      "tensors ffn_gate_exps / ffn_up_exps / ffn_down_exps and the expert metadata are not written); export the "
      "HF directory instead",
      c.model_type);
  LATHE_CHECK(gpt2 || neox || c.is_llama() || gemma2 || c.model_type == "olmo2",
              "--to-gguf: GGUF export supports gpt2, gpt_neox, gemma2, olmo2 and the llama family (llama, qwen2, "
              "mistral, qwen3, phi3), not {}",
              c.model_type);
  if (gemma2) check_gemma2(c);
  if (c.model_type == "olmo2") check_olmo2(c);
  if (neox)
    LATHE_CHECK(c.attention_bias,
                "--to-gguf: gpt_neox without attention biases: llama.cpp's gptneox architecture "
                "requires attn_qkv.bias and attn_output.bias");
  const bool phi3 = c.model_type == "phi3";
  LATHE_CHECK(!neox || !c.rope_scaling.active(),
              "--to-gguf: this gpt_neox has rope_scaling '{}': lathe writes RoPE scaling for llama.cpp's llama "
              "architecture only (not checked against its gptneox graph); export a model without it",
              c.rope_scaling.type);
  if (gpt2 || neox)
    LATHE_CHECK(c.hidden_act == "gelu_new",
                "--to-gguf: activation {} of this {} model: llama.cpp's {} architecture computes the tanh GELU "
                "(gelu_new) only{}",
                c.hidden_act, c.model_type, gpt2 ? "gpt2" : "gptneox",
                neox ? " (its logits would differ from this exact-GELU model's by ~1e-3; train with hidden_act "
                       "gelu_new for a GGUF export, or export Hugging Face safetensors)"
                     : "");
  else if (!gemma2)  // gemma2's GeGLU: its config reader admits the tanh GELU only
    LATHE_CHECK(c.hidden_act == "silu", "--to-gguf: activation {}: llama.cpp's {} architecture computes SwiGLU (silu)",
                c.hidden_act, c.model_type);
  // (A phi3 window reaches sliding_window + 1 keys, ModelConfig::layer_window. llama.cpp 0.3.36's
  // phi3 attended to the full context with phi3.attention.sliding_window set, measured.)
  LATHE_CHECK(gemma2 || c.sliding_window == 0 || c.sliding_window + (phi3 ? 1 : 0) >= c.max_position_embeddings,
              "--to-gguf: sliding_window {} < context {}: llama.cpp's {} architecture would attend to the full "
              "context; refusing rather than writing a model that computes something else",
              c.sliding_window, c.max_position_embeddings, gguf_arch(c));
  // llama.cpp's qwen3 (the q/k norms, Arch::qk_norm) reads no attention biases.
  LATHE_CHECK(!c.qk_norm || !c.attention_bias,
              "--to-gguf: {} with attention_bias true: llama.cpp's qwen3 architecture has no q/k/v/o biases; "
              "export the Hugging Face directory only (drop --to-gguf)",
              c.model_type);
}

std::string add_gguf_hparams(io::GgufWriter& w, const ModelConfig& c, const std::string& arch) {
  std::string note;
  const int64_t H = c.num_attention_heads, D = c.head_dim(), C = c.hidden_size;
  w.add_u32(arch + ".context_length", u32(c.max_position_embeddings));
  w.add_u32(arch + ".embedding_length", u32(C));
  w.add_u32(arch + ".block_count", u32(c.num_hidden_layers));
  w.add_u32(arch + ".feed_forward_length", u32(c.intermediate_size));
  w.add_u32(arch + ".attention.head_count", u32(H));
  if (arch == "gpt2") {
    w.add_f32(arch + ".attention.layer_norm_epsilon", static_cast<float>(c.norm_eps));
  } else if (arch == "gptneox") {
    w.add_f32(arch + ".attention.layer_norm_epsilon", static_cast<float>(c.norm_eps));
    w.add_f32(arch + ".rope.freq_base", static_cast<float>(c.rope_theta));
    w.add_u32(arch + ".rope.dimension_count", u32(c.rotary_dim()));
    w.add_bool(arch + ".use_parallel_residual", c.parallel_residual);
  } else {
    w.add_u32(arch + ".attention.head_count_kv", u32(c.num_key_value_heads));
    w.add_f32(arch + ".rope.freq_base", static_cast<float>(c.rope_theta));
    w.add_f32(arch + ".attention.layer_norm_rms_epsilon", static_cast<float>(c.norm_eps));
    w.add_u32(arch + ".rope.dimension_count", u32(c.rotary_dim()));
    note = add_rope_scaling(w, c, arch);
    // llama.cpp takes n_embd / n_head as the head width unless these are given (as its
    // convert_hf_to_gguf.py writes them for an explicit head_dim): Mistral-Nemo's 5120 / 32 heads of 128.
    // (Qwen3's and Gemma 2's config.json always have head_dim: written whatever its value, as
    // convert_hf_to_gguf.py does.)
    if (H * D != C || arch == "qwen3" || arch == "gemma2") {
      w.add_u32(arch + ".attention.key_length", u32(D));
      w.add_u32(arch + ".attention.value_length", u32(D));
    }
  }
  if (arch == "gemma2") {
    // Keys as convert_hf_to_gguf.py's Gemma2Model writes them; the embedding scale sqrt(hidden)
    // and the sandwich norms are llama.cpp's gemma2 graph itself.
    w.add_f32(arch + ".attn_logit_softcapping", c.attn_softcap());
    w.add_f32(arch + ".final_logit_softcapping", c.final_softcap());
    w.add_u32(arch + ".attention.sliding_window", u32(c.sliding_window));
  }
  return note;
}

std::vector<float> gguf_tensor_values(const ModelConfig& c, const std::string& arch, const std::string& gguf_name,
                                      const float* data, int64_t n) {
  auto ends_with = [&](const std::string& s) {
    return gguf_name.size() >= s.size() && gguf_name.compare(gguf_name.size() - s.size(), s.size(), s) == 0;
  };
  if (arch != "gemma2") return {};
  if (ends_with("norm.weight")) {  // attn_norm, attn_post_norm, ffn_norm, ffn_post_norm, output_norm
    std::vector<float> out(data, data + n);
    for (float& v : out) v = 1.0f + v;  // as Gemma2RMSNorm's fp32 (1.0 + weight)
    return out;
  }
  const double f = gemma2_q_factor(c);
  if (ends_with("attn_q.weight") && f != 1.0) {  // no q bias, no q norm: the factor passes through RoPE
    std::vector<float> out(data, data + n);
    for (float& v : out) v = static_cast<float>(v * f);
    return out;
  }
  return {};
}

}  // namespace lathe
