// The per-family parts of GGUF export (interop/gguf_export.h): which llama.cpp architecture a
// lathe model becomes, what llama.cpp cannot reproduce (refused naming the reason), the {arch}.*
// hyperparameter keys, and the value edits a family's tensors need on the way out.
#pragma once
#include <string>
#include <vector>

#include "config/model_config.h"
#include "io/gguf.h"

namespace lathe {

// Throws (naming the key and the way out) when llama.cpp would compute something else than lathe.
void check_gguf_exportable(const ModelConfig& c);

// llama.cpp's architecture for c: gpt2, gptneox, llama, qwen2, qwen3, phi3, gemma2 or olmo2.
std::string gguf_arch(const ModelConfig& c);

// The {arch}.* hyperparameters (sizes, norms, RoPE and its scaling, gemma2's soft caps and window).
// Returns a note for the export summary ("" = none): what a llama.cpp user must know to get lathe's results.
std::string add_gguf_hparams(io::GgufWriter& w, const ModelConfig& c, const std::string& arch);

// The values llama.cpp needs for tensor `gguf_name` (n floats at data) when they are not lathe's
// own; empty = write data as stored. gemma2: norm weights as 1 + w (convert_hf_to_gguf.py's
// Gemma2Model adds the 1; llama.cpp multiplies by the stored weight), attn_q scaled so that
// llama.cpp's fixed score scale gives 1/sqrt(query_pre_attn_scalar).
std::vector<float> gguf_tensor_values(const ModelConfig& c, const std::string& arch, const std::string& gguf_name,
                                      const float* data, int64_t n);

}  // namespace lathe
