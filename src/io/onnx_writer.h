// A small ONNX writer: the ModelProto/GraphProto/NodeProto/TensorProto messages of onnx.proto
// (proto2; field numbers from onnx.proto of the onnx PyPI package) encoded in the protobuf wire
// format by hand (varints, fixed32 floats, length-delimited bytes and sub-messages), so lathe needs
// no libprotobuf. Only what a decoder graph needs is modelled: tensors, value infos with symbolic or
// fixed dims, nodes with int/float/ints/string/tensor attributes, opset imports and metadata.
//
// Initializer bytes are referenced, never copied, while the file is written (a 2 GB model is not
// held twice). Above the 2 GiB a protobuf message can hold, or when asked, initializers go to one
// external data file beside the model (ONNX "external data": location/offset/length entries,
// data_location = EXTERNAL), as onnx.save_model(..., save_as_external_data=True) writes them.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace lathe::io::onnx {

// TensorProto.DataType values used here.
enum class ElemType : int32_t { Float = 1, Int32 = 6, Int64 = 7, Bool = 9, Float16 = 10 };
size_t elem_size(ElemType t);
const char* elem_name(ElemType t);

// An initializer (or a constant-tensor attribute): raw little-endian bytes in row-major order.
struct Tensor {
  std::string name;
  ElemType type = ElemType::Float;
  std::vector<int64_t> dims;
  std::string data;  // numel(dims) * elem_size(type) bytes
};

// One dimension of a graph input/output: a fixed size, or a symbolic name ("batch_size").
struct Dim {
  int64_t value = -1;  // >= 0: fixed
  std::string param;   // used when value < 0
  static Dim fixed(int64_t v) { return Dim{v, {}}; }
  static Dim named(std::string p) { return Dim{-1, std::move(p)}; }
};
struct ValueInfo {
  std::string name;
  ElemType type = ElemType::Float;
  std::vector<Dim> dims;
};

struct Attribute {
  enum Kind { Int, Float, Ints, String, TensorValue } kind = Int;
  std::string name;
  int64_t i = 0;
  float f = 0;
  std::vector<int64_t> ints;
  std::string s;
  Tensor t;
};
inline Attribute attr_int(std::string n, int64_t v) {
  Attribute a;
  a.kind = Attribute::Int;
  a.name = std::move(n);
  a.i = v;
  return a;
}
inline Attribute attr_float(std::string n, float v) {
  Attribute a;
  a.kind = Attribute::Float;
  a.name = std::move(n);
  a.f = v;
  return a;
}
inline Attribute attr_ints(std::string n, std::vector<int64_t> v) {
  Attribute a;
  a.kind = Attribute::Ints;
  a.name = std::move(n);
  a.ints = std::move(v);
  return a;
}

struct Node {
  std::string op_type;
  std::vector<std::string> inputs, outputs;
  std::string name;
  std::vector<Attribute> attributes;
};

struct Graph {
  std::string name;
  std::vector<Node> nodes;  // in topological order
  std::vector<Tensor> initializers;
  std::vector<ValueInfo> inputs, outputs;
};

struct ModelProtoInfo {
  int64_t ir_version = 8;  // IR 8 goes with opset 17 (onnx.helper.VERSION_TABLE)
  int64_t opset = 17;      // default ("ai.onnx") domain only: no contrib ops
  std::string producer_name = "lathe";
  std::string producer_version;
  std::string doc_string;
  std::vector<std::pair<std::string, std::string>> metadata;  // metadata_props
};

// Largest protobuf message (2 GiB - 1): above it the weights must be external.
constexpr uint64_t kProtoLimit = (uint64_t{1} << 31) - 1;

// The external-data file of model file M (a file name, no directory): "M.<xxh64 of its bytes, 16
// hex digits>.data", beside M. A new name for new contents lets the pair be published in an order
// a kill cannot mismatch (see write_model).
std::string external_data_name(const std::string& model_file, uint64_t hash);
// True for a name of that form (what an export to M may create and remove).
bool is_external_data_name(const std::string& model_file, const std::string& name);

struct WriteOptions {
  // Initializers of at least `external_min_bytes` go to the external-data file (external_data_name;
  // the name stored in the model is the file name only, so the pair can be moved together). Automatic when the model
  // with its weights inline would be larger than `inline_limit` (tests lower it to exercise the switch).
  bool external_data = false;
  size_t external_min_bytes = 1024;
  uint64_t inline_limit = kProtoLimit;
};

struct WriteResult {
  uint64_t model_bytes = 0, data_bytes = 0;
  std::string data_path;  // empty without external data
};

// Writes the model atomically: temporary files renamed at the end, the external data file first
// (under its content-hash name, so the previous graph's data file is untouched), then the model,
// whose rename is the single switch from the old pair to the new one; data files of the old
// naming left beside it are then removed, as are temporaries of an earlier killed export to the
// same path. Under a StopSignalGuard (core/stop_signal.h) a SIGINT/SIGTERM stops it at the next
// tensor and removes its temporaries. Errors name the path.
WriteResult write_model(const std::string& path, const Graph& graph, const ModelProtoInfo& info,
                        const WriteOptions& opts = {});

}  // namespace lathe::io::onnx
