#include "interop/gguf_export.h"

#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <utility>
#include <vector>

#include "core/error.h"
#include "interop/gguf_tokenizer.h"
#include "io/gguf.h"

namespace lathe {

namespace {

// HF rotate_half order -> llama.cpp interleaved order, per head: new row 2j = old row j,
// new row 2j+1 = old row j + rot/2 for j < rot/2 (rot = the rotated rows of a head, hd unless
// partial rotary; rows from rot on stay). W: [n_head*hd, cols] (cols = 1 for a bias).
std::vector<float> permute_rope_rows(const float* w, int64_t n_head, int64_t hd, int64_t rot, int64_t cols) {
  std::vector<float> out(w, w + n_head * hd * cols);
  for (int64_t h = 0; h < n_head; ++h)
    for (int64_t j = 0; j < rot / 2; ++j)
      for (int64_t half = 0; half < 2; ++half) {
        const float* src = w + ((h * hd) + half * (rot / 2) + j) * cols;
        std::copy(src, src + cols, out.begin() + ((h * hd) + 2 * j + half) * cols);
      }
  return out;
}

// RoPE scaling as llama.cpp reads it (convert_hf_to_gguf.py's keys): linear and yarn as
// {arch}.rope.scaling.*, llama3 (and longrope without an attention factor) as the rope_freqs
// tensor of per-frequency divisors (llama.cpp: freq_i = base^(-2i/n_rot) / rope_freqs[i]). What
// llama.cpp cannot reproduce is refused naming the key.
void add_rope_scaling(io::GgufWriter& w, const ModelConfig& c, const std::string& arch) {
  LATHE_CHECK(c.rotary_dim() == c.head_dim(),
              "gguf export: partial_rotary_factor = {} ({} of {} dims rotate): llama.cpp's {} architecture requires "
              "rope.dimension_count = head_dim (it refuses to load the file otherwise); export a model without it",
              c.partial_rotary_factor, c.rotary_dim(), c.head_dim(), arch);
  const RopeScaling& r = c.rope_scaling;
  if (!r.active()) return;
  auto refuse = [&](const std::string& why) {
    throw_error("gguf export: rope_scaling type '{}': {}; export a model without it (rope_scaling null)", r.type, why);
  };
  if (r.type == "dynamic") refuse("llama.cpp has no dynamic NTK scaling (frequencies that follow the length)");
  if (r.type == "linear") {
    w.add_string(arch + ".rope.scaling.type", "linear");
    w.add_f32(arch + ".rope.scaling.factor", static_cast<float>(*r.factor));
    return;
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
    return;
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
}

using NameMap = std::vector<std::pair<std::string, std::string>>;

// Parameter name -> GGUF tensor name: whole-model names, then "<prefix>N.<suffix>" per block.
// (No std::regex: GCC 12 warns about its internals under -fsanitize.)
std::string gguf_name(const std::string& name, const NameMap& top, const std::string& prefix, const NameMap& block,
                      std::string* suffix) {
  for (const auto& [hf, gg] : top)
    if (hf == name) return gg;
  if (name.rfind(prefix, 0) == 0) {
    const size_t dot = name.find('.', prefix.size());
    const std::string layer = name.substr(prefix.size(), dot == std::string::npos ? 0 : dot - prefix.size());
    if (!layer.empty() && layer.find_first_not_of("0123456789") == std::string::npos) {
      *suffix = name.substr(dot + 1);
      for (const auto& [hf, gg] : block)
        if (hf == *suffix) return fmt::format("blk.{}.{}", layer, gg);
    }
  }
  throw_error("internal: no GGUF name for parameter {}", name);
}

}  // namespace

std::string gguf_tokenizer_in(const std::string& dir) {
  std::error_code ec;
  for (const char* f : {"tokenizer.json", "tokenizer.model", "encoder.json", "vocab.json"})
    if (std::filesystem::exists(std::filesystem::path(dir) / f, ec)) return dir;
  return "";
}

std::string save_gguf(const Model& model, const std::string& path, DType dtype, const std::string& tokenizer_json,
                      const std::string& name) {
  GgufExportOptions o;
  o.dtype = dtype;
  o.tokenizer = tokenizer_json;
  o.name = name;
  return save_gguf(model, path, o);
}

std::string save_gguf(const Model& model, const std::string& path, const GgufExportOptions& opts) {
  const ModelConfig& c = model.config();
  const DType dtype = opts.dtype;
  LATHE_CHECK(dtype == DType::F32 || dtype == DType::F16, "--to-gguf: dtype must be f32 or f16, not {}",
              dtype_name(dtype));
  const bool gpt2 = c.is_gpt2();
  const bool neox = c.is_gpt_neox();
  // llama.cpp has a gemma2 architecture, but it picks the score scale from its model size (1/sqrt(head_dim),
  // or hidden/heads for 27B) instead of query_pre_attn_scalar, and the writer here has none of its
  // tensors (post norms, 1 + w norm weights) yet.
  LATHE_CHECK(c.model_type != "gemma2",
              "--to-gguf: gemma2 GGUF export is not implemented yet (llama.cpp's gemma2 architecture needs the "
              "post-attention / post-feedforward norms, 1 + w norm weights and soft-cap metadata, and derives the "
              "score scale from the model size rather than query_pre_attn_scalar); export the HF directory instead");
  LATHE_CHECK(!c.moe(),
              "--to-gguf: {} (mixture of experts) GGUF export is not implemented yet (llama.cpp's stacked-expert "
              "tensors ffn_gate_exps / ffn_up_exps / ffn_down_exps and the expert metadata are not written); export the "
              "HF directory instead",
              c.model_type);
  LATHE_CHECK(c.model_type != "olmo2",  // olmo2
              "--to-gguf: olmo2 GGUF export is not implemented yet (llama.cpp's olmo2 architecture needs its "
              "post-attention / post-feedforward norms and whole-projection attn_q_norm / attn_k_norm tensors); export "
              "the HF directory instead");
  LATHE_CHECK(gpt2 || neox || c.is_llama(),
              "--to-gguf: GGUF export supports gpt2, gpt_neox and the llama family (llama, qwen2, mistral, qwen3, "
              "phi3), not {}",
              c.model_type);
  if (neox)
    LATHE_CHECK(c.attention_bias,
                "--to-gguf: gpt_neox without attention biases: llama.cpp's gptneox architecture "
                "requires attn_qkv.bias and attn_output.bias");
  const bool phi3 = c.model_type == "phi3";
  // phi3 goes to llama.cpp's phi3 architecture (fused attn_qkv, ffn_up = gate|up, NEOX RoPE);
  // longrope is refused: llama.cpp picks its short / long factors by the context size, not by the
  // pass length as transformers' Phi3 (and lathe) do.
  LATHE_CHECK(!phi3 || !c.rope_scaling.active(),
              "--to-gguf: this phi3 has rope_scaling longrope: llama.cpp chooses its short or long factors by the "
              "context size, transformers' Phi3 (and lathe) by each pass's length, so the GGUF would compute "
              "something else; export it with --to-hf");
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
  else
    LATHE_CHECK(c.hidden_act == "silu", "--to-gguf: activation {}: llama.cpp's {} architecture computes SwiGLU (silu)",
                c.hidden_act, c.model_type);
  // (A phi3 window reaches sliding_window + 1 keys, ModelConfig::layer_window. llama.cpp 0.3.36's
  // phi3 attended to the full context with phi3.attention.sliding_window set, measured.)
  LATHE_CHECK(c.sliding_window == 0 || c.sliding_window + (phi3 ? 1 : 0) >= c.max_position_embeddings,
              "--to-gguf: sliding_window {} < context {}: llama.cpp's {} architecture would attend to the full "
              "context; refusing rather than writing a model that computes something else",
              c.sliding_window, c.max_position_embeddings, phi3 ? "phi3" : "llama");
  // llama.cpp's qwen3 (the q/k norms, Arch::qk_norm) reads no attention biases.
  LATHE_CHECK(!c.qk_norm || !c.attention_bias,
              "--to-gguf: {} with attention_bias true: llama.cpp's qwen3 architecture has no q/k/v/o biases; "
              "export the Hugging Face directory only (drop --to-gguf)",
              c.model_type);
  // llama.cpp: llama (and mistral, converted as llama) use NORM RoPE -> q/k rows permuted;
  // qwen2, phi3 and qwen3 (per-head q/k norms: attn_q_norm / attn_k_norm) use NEOX RoPE (HF's rotate_half)
  // natively; gpt2 has no RoPE.
  const bool qwen = c.model_type == "qwen2";
  // gptneox: NEOX RoPE (rotate_half) natively, its q|k|v fused as lathe's ([3][H][D], which
  // convert_hf_to_gguf.py makes of HF's per-head rows too), the parallel residual a key.
  const std::string arch = gpt2        ? "gpt2"
                           : neox      ? "gptneox"
                           : c.qk_norm ? "qwen3"
                           : qwen      ? "qwen2"
                           : phi3      ? "phi3"
                                       : "llama";
  const bool permute = arch == "llama";
  const int64_t H = c.num_attention_heads, KV = c.num_key_value_heads, D = c.head_dim(), C = c.hidden_size;

  io::GgufWriter w;
  w.add_string("general.architecture", arch);
  w.add_string("general.name", opts.name);
  w.add_u32("general.file_type", dtype == DType::F16 ? 1 : 0);
  auto u32 = [](int64_t v) { return static_cast<uint32_t>(v); };
  w.add_u32(arch + ".context_length", u32(c.max_position_embeddings));
  w.add_u32(arch + ".embedding_length", u32(C));
  w.add_u32(arch + ".block_count", u32(c.num_hidden_layers));
  w.add_u32(arch + ".feed_forward_length", u32(c.intermediate_size));
  w.add_u32(arch + ".attention.head_count", u32(H));
  if (gpt2) {
    w.add_f32(arch + ".attention.layer_norm_epsilon", static_cast<float>(c.norm_eps));
  } else if (neox) {
    w.add_f32(arch + ".attention.layer_norm_epsilon", static_cast<float>(c.norm_eps));
    w.add_f32(arch + ".rope.freq_base", static_cast<float>(c.rope_theta));
    w.add_u32(arch + ".rope.dimension_count", u32(c.rotary_dim()));
    w.add_bool(arch + ".use_parallel_residual", c.parallel_residual);
  } else {
    w.add_u32(arch + ".attention.head_count_kv", u32(KV));
    w.add_f32(arch + ".rope.freq_base", static_cast<float>(c.rope_theta));
    w.add_f32(arch + ".attention.layer_norm_rms_epsilon", static_cast<float>(c.norm_eps));
    w.add_u32(arch + ".rope.dimension_count", u32(c.rotary_dim()));
    add_rope_scaling(w, c, arch);
    // llama.cpp takes n_embd / n_head as the head width unless these are given (as its
    // convert_hf_to_gguf.py writes them for an explicit head_dim): Mistral-Nemo's 5120 / 32 heads of 128.
    // (Qwen3's config.json always has head_dim: written whatever its value, as convert_hf_to_gguf.py does.)
    if (H * D != C || arch == "qwen3") {
      w.add_u32(arch + ".attention.key_length", u32(D));
      w.add_u32(arch + ".attention.value_length", u32(D));
    }
  }
  w.add_u32(arch + ".vocab_size", u32(c.vocab_size));
  std::string tok_desc = "no tokenizer (tokenizer.ggml.model = no_vocab)";
  if (!opts.tokenizer.empty()) {
    GgufTokenizerOptions to;
    to.path = opts.tokenizer;
    to.pre = opts.pre;
    to.model_dir = opts.model_dir;
    tok_desc = "tokenizer: " + add_gguf_tokenizer(w, c, to);
  } else {
    LATHE_CHECK(opts.pre.empty(), "--gguf-pre {} given but there is no tokenizer to export", opts.pre);
    w.add_string("tokenizer.ggml.model", "no_vocab");
  }

  // Parameter -> GGUF tensor name. lathe keeps every weight as [out, in] (GPT-2's Conv1D weights
  // too), which is the PyTorch Linear shape GGUF's reversed dims expect.
  static const NameMap llama_top = {{"model.embed_tokens.weight", "token_embd.weight"},
                                    {"model.norm.weight", "output_norm.weight"},
                                    {"lm_head.weight", "output.weight"}};
  static const NameMap llama_block = {
      {"input_layernorm.weight", "attn_norm.weight"},
      {"self_attn.q_proj.weight", "attn_q.weight"},
      {"self_attn.k_proj.weight", "attn_k.weight"},
      {"self_attn.v_proj.weight", "attn_v.weight"},
      {"self_attn.q_proj.bias", "attn_q.bias"},
      {"self_attn.k_proj.bias", "attn_k.bias"},
      {"self_attn.v_proj.bias", "attn_v.bias"},
      {"self_attn.o_proj.weight", "attn_output.weight"},
      {"self_attn.o_proj.bias", "attn_output.bias"},
      {"post_attention_layernorm.weight", "ffn_norm.weight"},
      {"mlp.gate_proj.weight", "ffn_gate.weight"},
      {"mlp.up_proj.weight", "ffn_up.weight"},
      {"mlp.down_proj.weight", "ffn_down.weight"},
      {"self_attn.q_norm.weight", "attn_q_norm.weight"},
      {"self_attn.k_norm.weight", "attn_k_norm.weight"},
      // phi3's fused tensors, as llama.cpp's phi3 architecture reads them (ffn_up: gate rows first).
      {"self_attn.qkv_proj.weight", "attn_qkv.weight"},
      {"mlp.gate_up_proj.weight", "ffn_up.weight"},
  };
  // gpt2 is always tied: no output.weight, llama.cpp uses token_embd for the head.
  static const NameMap gpt2_top = {{"transformer.wte.weight", "token_embd.weight"},
                                   {"transformer.wpe.weight", "position_embd.weight"},
                                   {"transformer.ln_f.weight", "output_norm.weight"},
                                   {"transformer.ln_f.bias", "output_norm.bias"}};
  static const NameMap gpt2_block = {
      {"ln_1.weight", "attn_norm.weight"},          {"ln_1.bias", "attn_norm.bias"},
      {"attn.c_attn.weight", "attn_qkv.weight"},    {"attn.c_attn.bias", "attn_qkv.bias"},
      {"attn.c_proj.weight", "attn_output.weight"}, {"attn.c_proj.bias", "attn_output.bias"},
      {"ln_2.weight", "ffn_norm.weight"},           {"ln_2.bias", "ffn_norm.bias"},
      {"mlp.c_fc.weight", "ffn_up.weight"},         {"mlp.c_fc.bias", "ffn_up.bias"},
      {"mlp.c_proj.weight", "ffn_down.weight"},     {"mlp.c_proj.bias", "ffn_down.bias"},
  };
  static const NameMap neox_top = {{"gpt_neox.embed_in.weight", "token_embd.weight"},
                                   {"gpt_neox.final_layer_norm.weight", "output_norm.weight"},
                                   {"gpt_neox.final_layer_norm.bias", "output_norm.bias"},
                                   {"embed_out.weight", "output.weight"}};
  static const NameMap neox_block = {
      {"input_layernorm.weight", "attn_norm.weight"},          {"input_layernorm.bias", "attn_norm.bias"},
      {"attention.query_key_value.weight", "attn_qkv.weight"}, {"attention.query_key_value.bias", "attn_qkv.bias"},
      {"attention.dense.weight", "attn_output.weight"},        {"attention.dense.bias", "attn_output.bias"},
      {"post_attention_layernorm.weight", "ffn_norm.weight"},  {"post_attention_layernorm.bias", "ffn_norm.bias"},
      {"mlp.dense_h_to_4h.weight", "ffn_up.weight"},           {"mlp.dense_h_to_4h.bias", "ffn_up.bias"},
      {"mlp.dense_4h_to_h.weight", "ffn_down.weight"},         {"mlp.dense_4h_to_h.bias", "ffn_down.bias"},
  };
  for (const ParamSpec& s : model.params().specs()) {
    const float* data = model.param_data() + s.offset;
    std::string suffix;
    const std::string gname = gpt2   ? gguf_name(s.name, gpt2_top, "transformer.h.", gpt2_block, &suffix)
                              : neox ? gguf_name(s.name, neox_top, "gpt_neox.layers.", neox_block, &suffix)
                                     : gguf_name(s.name, llama_top, "model.layers.", llama_block, &suffix);
    const DType t = s.shape.size() >= 2 ? dtype : DType::F32;  // 1-D tensors stay F32
    const bool is_q = suffix.rfind("self_attn.q_proj.", 0) == 0, is_k = suffix.rfind("self_attn.k_proj.", 0) == 0;
    if (permute && (is_q || is_k)) {
      const int64_t cols = s.shape.size() == 2 ? s.shape[1] : 1;
      w.add_tensor_owned(gname, s.shape, permute_rope_rows(data, is_q ? H : KV, D, c.rotary_dim(), cols), t);
    } else {
      w.add_tensor(gname, s.shape, data, t);
    }
  }
  const size_t n = w.write(path);
  return fmt::format("wrote {} ({} tensors, {} metadata keys, {:.1f} MB, architecture {}{}, {})", path, w.num_tensors(),
                     w.num_kv(), n / 1e6, arch, permute ? ", q/k rows permuted for NORM RoPE" : "", tok_desc);
}

}  // namespace lathe
