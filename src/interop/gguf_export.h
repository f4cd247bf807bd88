// GGUF export for llama.cpp (shared/reference/gguf.md): a lathe model as a GGUF v3 file that
// llama.cpp runs like lathe (tested against llama.cpp itself in tests/interop/test_gguf_llama_cpp.py).
//
//   llama, mistral -> architecture "llama": q/k rows permuted from HF's rotate_half order to
//                     llama.cpp's interleaved (NORM) RoPE order.
//   qwen2          -> "qwen2" (NEOX RoPE, no permutation, q/k/v biases).
//   qwen3          -> "qwen3" (NEOX RoPE, attn_q_norm / attn_k_norm, attention.key_length; no biases).
//   phi3           -> "phi3" (NEOX RoPE, fused attn_qkv, ffn_up = gate|up; partial rotary as
//                     rope.dimension_count; longrope as rope_factors_long / _short, which llama.cpp
//                     picks by its context size, not by the pass length: noted; no window).
//   gemma2         -> "gemma2" (norm weights written as 1 + w, post_attention_norm / post_ffw_norm,
//                     soft caps, sliding_window; attn_q scaled for query_pre_attn_scalar; its GeGLU
//                     reads llama.cpp's fp16 GELU table as gpt2's does).
//   olmo2          -> "olmo2" (post norms only, whole-projection attn_q_norm / attn_k_norm; a tied
//                     model writes output.weight too).
// The per-family parts (refusals, metadata, value edits) are interop/gguf_arch.h.
//   gpt2           -> "gpt2" (LayerNorm with biases, learned positions, fused qkv; llama.cpp's
//                     GELU reads a fp16 table, so its logits differ from lathe's by ~1e-3).
// dtype F32 or F16 (1-D tensors stay F32, as llama.cpp's converter does). The tokenizer is written
// as tokenizer.ggml.* by interop/gguf_tokenizer.h; none -> tokenizer.ggml.model = "no_vocab".
// What llama.cpp cannot represent (a sliding window shorter than the context, a GELU other than
// tanh, a tokenizer whose pre-tokenizer llama.cpp has no name for, ...) is refused with the reason.
#pragma once
#include <string>

#include "core/dtype.h"
#include "models/model.h"

namespace lathe {

struct GgufExportOptions {
  DType dtype = DType::F32;
  std::string name = "lathe";  // general.name
  std::string tokenizer;       // lathe tokenizer path ("byte", a directory or a file); "" = no_vocab
  std::string pre;             // tokenizer.ggml.pre override (--gguf-pre); "" = derived
  std::string model_dir;       // directory with generation_config.json, "" = none
};

// Writes `path` atomically. Returns a one-line summary (architecture, tensors, tokenizer, notes).
std::string save_gguf(const Model& model, const std::string& path, const GgufExportOptions& opts);

// `dir` when it holds tokenizer files lathe loads (tokenizer.json, tokenizer.model, encoder.json,
// vocab.json), else "" (the default tokenizer of a model directory's GGUF export).
std::string gguf_tokenizer_in(const std::string& dir);

// Older form: tokenizer_json is an HF tokenizer.json path or "".
std::string save_gguf(const Model& model, const std::string& path, DType dtype = DType::F32,
                      const std::string& tokenizer_json = "", const std::string& name = "lathe");

}  // namespace lathe
