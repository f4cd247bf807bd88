// TFRecord files (TensorFlow's record framing, what TensorBoard's event files are): each record is
//   uint64 length (little endian) | uint32 masked CRC32C of those 8 bytes | data | uint32 masked CRC32C of data
// CRC32C is the Castagnoli CRC (reflected polynomial 0x82F63B78); the mask rotates it right by 15
// bits and adds 0xa282ead8 (tensorflow/core/lib/hash/crc32c.h). Used by train/tensorboard.h.
#pragma once
#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>

namespace lathe::io {

uint32_t crc32c(const void* data, size_t n, uint32_t crc = 0);  // crc: that of the preceding bytes
uint32_t masked_crc32c(const void* data, size_t n);
// One record, framed: length, its masked CRC, the data, its masked CRC.
std::string tfrecord_frame(std::string_view data);

// Writes framed records to a new file, flushed after each (a crash loses at most the record being written).
class TfRecordWriter {
 public:
  explicit TfRecordWriter(const std::string& path);
  ~TfRecordWriter();
  TfRecordWriter(const TfRecordWriter&) = delete;
  TfRecordWriter& operator=(const TfRecordWriter&) = delete;
  void write(std::string_view data);
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::FILE* f_;
};

}  // namespace lathe::io
