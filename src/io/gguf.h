// GGUF v3 writer (shared/reference/gguf.md): little-endian header, typed key/value metadata,
// tensor infos with dims in ggml order (reverse of the PyTorch shape), zero padding to
// general.alignment (32) before the data blob and after EVERY tensor (ggml's reader expects
// offset_{i+1} = offset_i + align(nbytes_i) and reads the padded total).
//
//   io::GgufWriter w;
//   w.add_string("general.architecture", "llama");
//   w.add_u32("llama.block_count", 2);
//   w.add_tensor("token_embd.weight", {V, C}, embedding, DType::F16);  // PyTorch shape
//   w.write("model.gguf");   // tmp + fsync + rename
//
// The writer holds pointers to tensor data until write() (or owns a copy with add_tensor_owned).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/tensor.h"

namespace lathe::io {

// gguf_type ids of metadata values.
enum class GgufValueType : uint32_t {
  U8 = 0,
  I8 = 1,
  U16 = 2,
  I16 = 3,
  U32 = 4,
  I32 = 5,
  F32 = 6,
  BOOL = 7,
  STRING = 8,
  ARRAY = 9,
  U64 = 10,
  I64 = 11,
  F64 = 12,
};
// ggml tensor type ids used here.
constexpr uint32_t kGgmlTypeF32 = 0, kGgmlTypeF16 = 1;
constexpr uint32_t kGgufAlignment = 32;

class GgufWriter {
 public:
  // Metadata. Keys must be unique and non-empty (ggml rejects duplicates): errors name the key.
  void add_string(const std::string& key, const std::string& v);
  void add_u32(const std::string& key, uint32_t v);
  void add_i32(const std::string& key, int32_t v);
  void add_f32(const std::string& key, float v);
  void add_bool(const std::string& key, bool v);
  void add_string_array(const std::string& key, const std::vector<std::string>& v);
  void add_f32_array(const std::string& key, const std::vector<float>& v);
  void add_i32_array(const std::string& key, const std::vector<int32_t>& v);

  // shape in PyTorch (row-major) order, <= 4 dims; data: numel fp32 values written as `type`
  // (F32 or F16). Names must be unique and at most 63 bytes.
  void add_tensor(const std::string& name, const Shape& shape, const float* data, DType type);
  void add_tensor_owned(const std::string& name, const Shape& shape, std::vector<float> data, DType type);

  // Writes the file atomically. Returns the number of bytes written.
  size_t write(const std::string& path) const;

  size_t num_tensors() const { return tensors_.size(); }
  size_t num_kv() const { return kv_count_; }

 private:
  void begin_kv(const std::string& key, GgufValueType t);
  struct TensorEntry {
    std::string name;
    Shape shape;
    const float* data;
    size_t owned;  // index into owned_ + 1, or 0
    DType type;
    size_t nbytes() const;
  };
  std::string kv_;  // serialized key/value section
  size_t kv_count_ = 0;
  std::vector<std::string> keys_;
  std::vector<TensorEntry> tensors_;
  std::vector<std::vector<float>> owned_;
};

}  // namespace lathe::io
