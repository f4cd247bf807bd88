// Hugging Face model directories in and out: config.json + model.safetensors with HF names and
// layouts (GPT-2 Conv1D weights transposed), so `transformers` loads what lathe writes and lathe
// loads what `transformers` saves. Loading is strict: every parameter must be found exactly once
// with the right shape, and every tensor of the file must be used.
#pragma once
#include <memory>
#include <string>

#include "core/dtype.h"
#include "models/model.h"

namespace lathe {

// Writes DIR/config.json and DIR/model.safetensors (each atomically). Tied lm_head is omitted,
// as HF does. Creates DIR if needed.
void save_hf_model(const Model& model, const std::string& dir, DType dtype = DType::F32);

// Writes any flat buffer laid out like the model's parameters (weights, gradients, optimizer
// moments) as a safetensors file with HF names and layouts.
void save_hf_tensors(const Model& model, const float* flat, const std::string& path, DType dtype = DType::F32);

// Reads DIR/config.json (errors name the file and key).
ModelConfig load_hf_config(const std::string& dir);

// Loads DIR/model.safetensors (or the shards listed in model.safetensors.index.json) into the
// model's parameters. Returns a one-line load report (tensors, bytes, dtype conversions).
std::string load_hf_weights(Model& model, const std::string& dir);

// config.json -> built model with the weights loaded.
std::unique_ptr<Model> load_hf_model(const std::string& dir, std::string* report = nullptr);

}  // namespace lathe
