#include "io/gguf.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>

#include "core/error.h"
#include "io/fs.h"

namespace lathe::io {

namespace {

template <typename T>
void put(std::string& out, T v) {
  char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));  // x86/arm little-endian hosts: the bytes are already LE
  out.append(b, sizeof(T));
}
void put_str(std::string& out, const std::string& s) {
  put<uint64_t>(out, s.size());
  out.append(s);
}
size_t align_up(size_t x) { return x + (kGgufAlignment - x % kGgufAlignment) % kGgufAlignment; }

}  // namespace

void GgufWriter::begin_kv(const std::string& key, GgufValueType t) {
  LATHE_CHECK(!key.empty(), "gguf: empty metadata key");
  LATHE_CHECK(std::find(keys_.begin(), keys_.end(), key) == keys_.end(),
              "gguf: metadata key '{}' added twice (ggml rejects duplicate keys)", key);
  keys_.push_back(key);
  put_str(kv_, key);
  put<uint32_t>(kv_, static_cast<uint32_t>(t));
  ++kv_count_;
}

void GgufWriter::add_string(const std::string& key, const std::string& v) {
  begin_kv(key, GgufValueType::STRING);
  put_str(kv_, v);
}
void GgufWriter::add_u32(const std::string& key, uint32_t v) {
  begin_kv(key, GgufValueType::U32);
  put<uint32_t>(kv_, v);
}
void GgufWriter::add_i32(const std::string& key, int32_t v) {
  begin_kv(key, GgufValueType::I32);
  put<int32_t>(kv_, v);
}
void GgufWriter::add_f32(const std::string& key, float v) {
  begin_kv(key, GgufValueType::F32);
  put<float>(kv_, v);
}
void GgufWriter::add_bool(const std::string& key, bool v) {
  begin_kv(key, GgufValueType::BOOL);
  put<uint8_t>(kv_, v ? 1 : 0);
}
void GgufWriter::add_string_array(const std::string& key, const std::vector<std::string>& v) {
  begin_kv(key, GgufValueType::ARRAY);
  put<uint32_t>(kv_, static_cast<uint32_t>(GgufValueType::STRING));
  put<uint64_t>(kv_, v.size());
  for (const auto& s : v) put_str(kv_, s);
}
void GgufWriter::add_f32_array(const std::string& key, const std::vector<float>& v) {
  begin_kv(key, GgufValueType::ARRAY);
  put<uint32_t>(kv_, static_cast<uint32_t>(GgufValueType::F32));
  put<uint64_t>(kv_, v.size());
  for (float x : v) put<float>(kv_, x);
}
void GgufWriter::add_i32_array(const std::string& key, const std::vector<int32_t>& v) {
  begin_kv(key, GgufValueType::ARRAY);
  put<uint32_t>(kv_, static_cast<uint32_t>(GgufValueType::I32));
  put<uint64_t>(kv_, v.size());
  for (int32_t x : v) put<int32_t>(kv_, x);
}

size_t GgufWriter::TensorEntry::nbytes() const {
  return static_cast<size_t>(lathe::numel(shape)) * (type == DType::F16 ? 2 : 4);
}

void GgufWriter::add_tensor(const std::string& name, const Shape& shape, const float* data, DType type) {
  LATHE_CHECK(!name.empty() && name.size() <= 63, "gguf: tensor name '{}' must be 1..63 bytes (GGML_MAX_NAME)", name);
  LATHE_CHECK(!shape.empty() && shape.size() <= 4, "gguf: tensor {} has {} dims; ggml allows 1..4", name, shape.size());
  LATHE_CHECK(type == DType::F32 || type == DType::F16, "gguf: tensor {}: only F32 and F16 are written, not {}", name,
              dtype_name(type));
  for (const auto& t : tensors_) LATHE_CHECK(t.name != name, "gguf: tensor '{}' added twice", name);
  tensors_.push_back({name, shape, data, 0, type});
}

void GgufWriter::add_tensor_owned(const std::string& name, const Shape& shape, std::vector<float> data, DType type) {
  LATHE_CHECK(static_cast<int64_t>(data.size()) == lathe::numel(shape), "gguf: tensor {}: {} values for shape {}", name,
              data.size(), shape_str(shape));
  owned_.push_back(std::move(data));
  add_tensor(name, shape, nullptr, type);
  tensors_.back().owned = owned_.size();
}

size_t GgufWriter::write(const std::string& path) const {
  std::string head;
  head.append("GGUF", 4);
  put<uint32_t>(head, 3);
  put<uint64_t>(head, tensors_.size());
  put<uint64_t>(head, kv_count_);
  head += kv_;
  size_t off = 0;
  for (const auto& t : tensors_) {
    put_str(head, t.name);
    put<uint32_t>(head, static_cast<uint32_t>(t.shape.size()));
    for (size_t i = 0; i < t.shape.size(); ++i)
      put<uint64_t>(head, static_cast<uint64_t>(t.shape[t.shape.size() - 1 - i]));
    put<uint32_t>(head, t.type == DType::F16 ? kGgmlTypeF16 : kGgmlTypeF32);
    put<uint64_t>(head, off);
    off += align_up(t.nbytes());
  }
  head.resize(align_up(head.size()), '\0');

  AtomicFileWriter w(path);
  w.write(head.data(), head.size());
  static const char zeros[kGgufAlignment] = {};
  std::vector<uint16_t> half;
  for (const auto& t : tensors_) {
    const float* src = t.owned ? owned_[t.owned - 1].data() : t.data;
    const size_t n = static_cast<size_t>(lathe::numel(t.shape));
    if (t.type == DType::F16) {
      half.resize(n);
      for (size_t i = 0; i < n; ++i) half[i] = fp32_to_fp16(src[i]);
      w.write(half.data(), n * 2);
    } else {
      w.write(src, n * 4);
    }
    const size_t pad = align_up(t.nbytes()) - t.nbytes();
    if (pad) w.write(zeros, pad);
  }
  w.commit();
  return head.size() + off;
}

}  // namespace lathe::io
