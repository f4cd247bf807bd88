// src/interop/: lathe models in and out of other tools' formats. This room owns the Hugging Face
// directory import/export (this file), the GGUF export for llama.cpp with its tokenizer metadata
// (gguf_export.h, gguf_tokenizer.h) and the ONNX decoder export (onnx_export.h). It builds on
// models/ (the Model and its parameter table), io/ (the safetensors, GGUF and ONNX file writers)
// and tokenizer/ (the vocabulary GGUF carries); train/ and cli/ call it, models/ does not know it.
//
// Hugging Face model directories in and out: config.json + model.safetensors (or shards with
// model.safetensors.index.json) with HF names and layouts (GPT-2 Conv1D weights transposed), so
// `transformers` loads what lathe writes and lathe loads what `transformers` saves.
//
// Loading is strict: every parameter must be found exactly once with the right shape, and every
// tensor of the files must be used (or be a known non-parameter buffer, listed in the one name
// table in hf_weights.cpp). Otherwise the error lists the missing, unexpected and mis-shaped names.
// A tied model's file may carry lm_head.weight only as an exact copy of the embedding.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "models/model.h"

namespace lathe {

struct HfLoadOptions {
  // 0: the model's vocabulary is the file's. N > 0: build the model with vocab_size N and load the
  // file's V rows of the embedding (and untied lm_head) into the first V rows; rows V..N-1 are set
  // to the mean of the loaded rows. N < V is refused (it would drop tokens). Reported.
  int64_t resize_vocab = 0;
};

struct HfSaveOptions {
  DType dtype = DType::F32;                     // F32, BF16 or F16
  uint64_t max_shard_bytes = 5'000'000'000ull;  // above this: model-0000i-of-0000n.safetensors + index
  // Files copied into the directory next to the weights (tokenizer files); each must exist.
  std::vector<std::string> extra_files;
  // The source model's generation_config.json (generation_config_in): copied as it is (its stop ids,
  // e.g. Llama 3.x Instruct's <|eot_id|>, and sampling defaults) instead of the one written from
  // config.json's token ids. Empty: written from the config.
  std::string generation_config;
  // Called after each tensor is written with (tensors written, tensors in all) (progress display).
  std::function<void(int64_t done, int64_t total)> on_tensor;
};

// Writes DIR/config.json, DIR/model.safetensors (or shards + model.safetensors.index.json) and
// DIR/generation_config.json, each atomically. Tied lm_head is omitted, as HF does. Creates DIR.
// Stale weight files of the other layout (single vs sharded) in DIR are removed.
void save_hf_model(const Model& model, const std::string& dir, const HfSaveOptions& opts);
void save_hf_model(const Model& model, const std::string& dir, DType dtype = DType::F32);

// Writes any flat buffer laid out like the model's parameters (weights, gradients, optimizer
// moments) as one safetensors file with HF names and layouts.
void save_hf_tensors(const Model& model, const float* flat, const std::string& path, DType dtype = DType::F32);

// DIR/generation_config.json when DIR has one, else "" (HfSaveOptions::generation_config).
std::string generation_config_in(const std::string& dir);

// Reads DIR/config.json (errors name the file and key).
ModelConfig load_hf_config(const std::string& dir);

// model.init_from DIR with a recipe whose `model` section (`recipe_model`: DIR's config.json with
// the recipe's explicit keys merged over it) may override DIR's values: the config the run trains,
// checkpoints and exports. Keys that leave the parameter shapes alone (rope_theta, rope_scaling,
// max_position_embeddings of RoPE models, sliding_window, norm epsilon, token ids, ...) take the
// recipe's value; a key that would change a weight's shape (hidden_size, layers, heads, vocab_size,
// tying, biases, model_type, ...) is refused naming it, both values and the fix. `changes` receives
// "the recipe overrides key: DIR's value -> the recipe's" for each override and the config.json keys
// lathe does not use (ModelConfig::ignored_note), for the startup log.
ModelConfig init_from_config(const ModelConfig& recipe_model, const std::string& dir, std::string_view recipe_source,
                             std::vector<std::string>* changes = nullptr);

// The weight files of DIR: model.safetensors, or the shards of model.safetensors.index.json
// (every listed file must exist). pytorch_model.bin alone is refused with a conversion command.
std::vector<std::string> hf_weight_files(const std::string& dir);

// Loads the weights of DIR into the model's parameters. Returns the load report (tensors, bytes,
// files, dtype conversions, ignored buffers, tied-head check, vocabulary resize).
std::string load_hf_weights(Model& model, const std::string& dir, const HfLoadOptions& opts = {});

// config.json -> built model with the weights loaded.
std::unique_ptr<Model> load_hf_model(const std::string& dir, std::string* report = nullptr,
                                     const HfLoadOptions& opts = {});

}  // namespace lathe
