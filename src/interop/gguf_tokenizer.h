// Tokenizer -> GGUF `tokenizer.ggml.*` metadata, so that llama.cpp tokenizes exactly as lathe does
// (shared/reference/gguf.md section 5; llama.cpp's src/llama-vocab.cpp for what each key does).
//
//   * byte-level BPE (tokenizer.json, or encoder.json + vocab.bpe / vocab.json + merges.txt):
//     tokenizer.ggml.model "gpt2" with tokens, token types and merges; tokenizer.ggml.pre is the
//     llama.cpp pre-tokenizer whose regexes and merge rule equal the tokenizer's (table in
//     gguf_tokenizer.cpp); an unknown one is refused unless the caller names one (--gguf-pre).
//   * SentencePiece tokenizer.model (BPE model type, identity normalization): "llama" (SPM) with
//     pieces, scores and piece types, add_space_prefix / remove_extra_whitespaces from its
//     normalizer spec.
//   * lathe's "byte" tokenizer (id = byte): "gpt2" with the 256 byte-level symbols and no merges.
// BOS/EOS/PAD/EOT ids: config.json's when set, else generation_config.json's (model directory),
// else the tokenizer's (tokenizer_config.json, the post-processor, well-known special tokens).
#pragma once
#include <nlohmann/json.hpp>
#include <string>

#include "config/model_config.h"
#include "io/gguf.h"

namespace lathe {

struct GgufTokenizerOptions {
  std::string path;       // as lathe::tok::load_tokenizer takes it: "byte", a directory or a file
  std::string pre;        // "" = derive tokenizer.ggml.pre; else this llama.cpp name (checked)
  std::string model_dir;  // directory with generation_config.json ("" = none)
};

// Adds the tokenizer.ggml.* keys. Throws lathe::Error naming the file, the field and what llama.cpp
// cannot represent. Returns a short description for the export summary (notes included).
std::string add_gguf_tokenizer(io::GgufWriter& w, const ModelConfig& cfg, const GgufTokenizerOptions& opts);

// The llama.cpp pre-tokenizer name equivalent to tokenizer.json's normalizer + pre_tokenizer +
// model.ignore_merges; throws naming what differs when none is (`where` names the file).
std::string gguf_pre_tokenizer_name(const nlohmann::json& tokenizer_json, const std::string& where);

}  // namespace lathe
