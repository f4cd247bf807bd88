#include "interop/gguf_export.h"

#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <utility>
#include <vector>

#include "core/error.h"
#include "interop/gguf_arch.h"
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
  check_gguf_exportable(c);
  const std::string arch = gguf_arch(c);
  const bool gpt2 = arch == "gpt2", neox = arch == "gptneox";
  // llama.cpp: llama (and mistral, converted as llama) use NORM RoPE -> q/k rows permuted; the
  // others with RoPE use NEOX RoPE (HF's rotate_half) natively (gptneox: its q|k|v fused as
  // lathe's [3][H][D], which convert_hf_to_gguf.py makes of HF's per-head rows too).
  const bool permute = arch == "llama";
  const int64_t H = c.num_attention_heads, KV = c.num_key_value_heads, D = c.head_dim();

  io::GgufWriter w;
  w.add_string("general.architecture", arch);
  w.add_string("general.name", opts.name);
  w.add_u32("general.file_type", dtype == DType::F16 ? 1 : 0);
  const std::string note = add_gguf_hparams(w, c, arch);
  w.add_u32(arch + ".vocab_size", static_cast<uint32_t>(c.vocab_size));
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
  // gemma2 / olmo2: the norms after the attention (llama.cpp LLM_TENSOR_ATTN_POST_NORM) and the MLP
  // (LLM_TENSOR_FFN_POST_NORM);
  // gemma2's pre-MLP norm is ffn_norm. First match wins, so these come before llama_block's.
  static const NameMap sandwich_block = [] {
    NameMap m = {{"post_attention_layernorm.weight", "post_attention_norm.weight"},
                 {"pre_feedforward_layernorm.weight", "ffn_norm.weight"},
                 {"post_feedforward_layernorm.weight", "post_ffw_norm.weight"}};
    m.insert(m.end(), llama_block.begin(), llama_block.end());
    return m;
  }();
  const bool sandwich = arch == "gemma2" || arch == "olmo2";
  const float* embedding = nullptr;
  Shape embedding_shape;
  for (const ParamSpec& s : model.params().specs()) {
    const float* data = model.param_data() + s.offset;
    std::string suffix;
    const std::string gname = gpt2       ? gguf_name(s.name, gpt2_top, "transformer.h.", gpt2_block, &suffix)
                              : neox     ? gguf_name(s.name, neox_top, "gpt_neox.layers.", neox_block, &suffix)
                              : sandwich ? gguf_name(s.name, llama_top, "model.layers.", sandwich_block, &suffix)
                                         : gguf_name(s.name, llama_top, "model.layers.", llama_block, &suffix);
    if (gname == "token_embd.weight") embedding = data, embedding_shape = s.shape;
    const DType t = s.shape.size() >= 2 ? dtype : DType::F32;  // 1-D tensors stay F32
    const bool is_q = suffix.rfind("self_attn.q_proj.", 0) == 0, is_k = suffix.rfind("self_attn.k_proj.", 0) == 0;
    std::vector<float> edited = gguf_tensor_values(c, arch, gname, data, numel(s.shape));
    if (!edited.empty()) {
      w.add_tensor_owned(gname, s.shape, std::move(edited), t);
    } else if (permute && (is_q || is_k)) {
      const int64_t cols = s.shape.size() == 2 ? s.shape[1] : 1;
      w.add_tensor_owned(gname, s.shape, permute_rope_rows(data, is_q ? H : KV, D, c.rotary_dim(), cols), t);
    } else {
      w.add_tensor(gname, s.shape, data, t);
    }
  }
  // llama.cpp's olmo2 requires output.weight (it does not fall back to token_embd): a tied model
  // writes the embedding again.
  if (arch == "olmo2" && c.tie_word_embeddings && embedding)
    w.add_tensor("output.weight", embedding_shape, embedding, dtype);
  const size_t n = w.write(path);
  return fmt::format("wrote {} ({} tensors, {} metadata keys, {:.1f} MB, architecture {}{}, {}{}{})", path,
                     w.num_tensors(), w.num_kv(), n / 1e6, arch, permute ? ", q/k rows permuted for NORM RoPE" : "",
                     tok_desc, note.empty() ? "" : "; ", note);
}

}  // namespace lathe
