// ONNX export of a decoder (lathe export --to-onnx): a graph of standard opset-17 operators
// (MatMul, Add, Softmax, LayerNormalization, ...; no contrib ops, so plain onnxruntime runs it)
// with the input/output layout optimum and onnxruntime-genai use for Llama, Qwen2 and GPT-2:
//   inputs   input_ids       int64 [batch_size, sequence_length]
//            attention_mask  int64 [batch_size, total_sequence_length]   (past + current; 1 = attend)
//            position_ids    int64 [batch_size, sequence_length]
//            past_key_values.{i}.key / .value   [batch_size, KV, past_sequence_length, D]
//   outputs  logits          [batch_size, sequence_length, V]
//            present.{i}.key / .value           [batch_size, KV, total_sequence_length, D]
// With static_seq_len N: inputs [1, N], no past or present, logits [1, N, V] (fixed shapes).
// Weights are read from the model's ParamTable by role (models/param_table.h) and stored as
// initializers, linear weights transposed to [in, out] for MatMul; a tied head reads the embedding
// through a Transpose node (stored once).
#pragma once
#include <cstdint>
#include <string>

#include "core/dtype.h"
#include "io/onnx_writer.h"
#include "models/model.h"

namespace lathe {

struct OnnxExportOptions {
  DType dtype = DType::F32;    // F32 or F16 (weights, activations, past/present and logits)
  int64_t static_seq_len = 0;  // > 0: fixed-shape graph [1, N] without past key/values
  bool external_data = false;  // weights in FILE.data even below 2 GiB
  // Above this size of the graph with its weights inline, the weights go to FILE.data by
  // themselves (the protobuf limit; lathe export lowers it only for its tests, on tiny models).
  uint64_t inline_limit = io::onnx::kProtoLimit;
};

// Writes `path` (and path + ".data" when external). Returns a one-line summary. Refuses a family,
// activation or dtype the graph builder does not cover, naming what is missing.
std::string save_onnx(const Model& model, const std::string& path, const OnnxExportOptions& opts);

}  // namespace lathe
