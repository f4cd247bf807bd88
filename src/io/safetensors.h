// safetensors reader (mmap) and writer (plain, or aligned for checkpoints' O_DIRECT writes). Format:
// shared/reference/safetensors.md — u64le N | N bytes JSON header (padded with spaces) | tensor
// bytes back to back.
// The reader enforces every check of the reference Rust reader (header bounds, duplicate keys,
// contiguous non-overlapping offsets covering the whole buffer, nbytes == numel * dtype size) and
// names the file and the tensor in every error.
#pragma once
#include <cstddef>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "core/dtype.h"
#include "core/tensor.h"
#include "io/direct_writer.h"

namespace lathe::io {

struct StTensorInfo {
  std::string name;
  DType dtype;
  Shape shape;
  size_t data_offset;  // relative to the start of the file's data section (file offset 8 + N)
  size_t nbytes;
  // Additions: the dtype code exactly as written in the file ("F32", "BOOL", "I8", ...).
  // Files may hold spec-valid dtypes that lathe's DType cannot represent (BOOL, I8, U32, F8_*,
  // ...): such tensors are listed with dtype_supported == false and `dtype` set to U8 as a
  // placeholder; data() and read_f32() refuse them with an error naming the tensor and dtype.
  std::string dtype_code;
  bool dtype_supported = true;
};

class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  // In file order (ascending data_offset, which is also the header order of every known writer).
  const std::vector<StTensorInfo>& tensors() const { return tensors_; }
  const StTensorInfo* find(std::string_view name) const;
  // Raw bytes of the tensor inside the mapping. NOT necessarily aligned to the element size
  // (other writers do not pad the header); copy or use memcpy for typed access.
  const void* data(const StTensorInfo&) const;
  // Copy a tensor into fp32 `out` (numel floats). F32 copied, BF16/F16 converted; other dtypes
  // -> error naming the tensor.
  void read_f32(const StTensorInfo&, float* out) const;
  // __metadata__ (string -> string); empty when the file has none.
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const std::string& path() const { return path_; }
  // Additions.
  size_t header_size() const { return header_len_; }  // N
  size_t file_size() const { return file_size_; }

 private:
  std::string path_;
  const unsigned char* base_ = nullptr;
  size_t file_size_ = 0;
  size_t header_len_ = 0;
  std::vector<StTensorInfo> tensors_;
  std::unordered_map<std::string, size_t> index_;
  std::map<std::string, std::string> metadata_;
};

struct StWriteEntry {
  std::string name;
  DType dtype;
  Shape shape;
  const void* data;  // numel * dtype_size(dtype) bytes, already in `dtype`
};

// Writes path (via path+".tmp", fsync, rename, fsync dir). Tensors keep the given order (data
// offsets ascend in that order); compact JSON header, key order dtype/shape/data_offsets,
// "__metadata__" first, padded with spaces to a multiple of 8. "format": "pt" is added to the
// metadata when absent (transformers refuses files without it). Duplicate names, the name
// "__metadata__" and negative dims are errors.
void write_safetensors(const std::string& path, const std::vector<StWriteEntry>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

// Aligned mode, for checkpoint data files (train/checkpoint.cpp): the same format and header, but
// written in place through io::DirectWriter (O_DIRECT, XXH64 on the way; the caller's directory
// rename is the atomic step, an unwound writer removes the file), returning the file's size and
// checksum. The JSON header is padded with spaces (its length stays a multiple of 8 when the first
// address is 8-aligned) so that the data section starts where the mode wants it:
//   Canonical  at a multiple of 4096, tensors back to back: the bytes depend on the tensors only
//              (offline writers, train/reshard.h).
//   Addresses  at a file offset congruent to the first tensor's address modulo 4096; where a tensor
//              does not follow the previous one in memory (exp_avg -> exp_avg_sq), a U8 tensor
//              "__lathe_pad__/<next name>" of < 4096 zero bytes restores that congruence, so that
//              DirectWriter writes large stretches straight from the caller's memory (zero-copy).
//              The bytes then depend on buffer addresses; the tensors do not. Readers of such files
//              skip the pads (is_st_pad).
// The checks of write_safetensors apply; a pad's name counts as a tensor name.
enum class StAlign { Canonical, Addresses };
inline constexpr std::string_view kStPadPrefix = "__lathe_pad__/";
inline bool is_st_pad(std::string_view name) { return name.substr(0, kStPadPrefix.size()) == kStPadPrefix; }
WrittenFile write_safetensors_aligned(const std::string& path, const std::vector<StWriteEntry>& tensors, StAlign align,
                                      const std::map<std::string, std::string>& metadata = {});

// fp32 sources converted on the fly to out_dtype (F32, BF16 round-to-nearest-even, or F16).
struct StWriteF32 {
  std::string name;
  Shape shape;
  const float* data;
};
// `on_tensor` (optional) is called after each tensor's bytes are written (progress display).
void write_safetensors_f32(const std::string& path, const std::vector<StWriteF32>& tensors,
                           DType out_dtype = DType::F32, const std::map<std::string, std::string>& metadata = {},
                           const std::function<void()>& on_tensor = {});

}  // namespace lathe::io
