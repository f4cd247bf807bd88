// A file writer that hashes (XXH64) what it writes and bypasses the page cache (O_DIRECT): the
// writer of checkpoint data files (train/checkpoint.cpp, through io/safetensors.h's aligned mode).
//
// Speed (the disk, not the CPU, should be the limit): data goes through O_DIRECT, bypassing the
// page cache, which halves large-write throughput. Large page-aligned stretches of the caller's
// memory are written straight from it (zero-copy: the aligned safetensors writer lays the file out
// so that file offset and address agree modulo the page size); everything else goes through two
// 16 MB aligned staging buffers. One helper thread does the pwrite()s while the calling thread
// hashes the next piece, so hashing overlaps the disk. The tail is padded to the 4 KB block and the
// file truncated back to its length. Where the filesystem refuses O_DIRECT (tmpfs, some network
// mounts) the same code writes buffered.
//
// The file is written in place (no tmp + rename): callers write inside a directory whose rename is
// their atomic step. Destroyed without commit() (an exception unwound past it), it removes the
// file. Under a StopSignalGuard (core/stop_signal.h) a SIGINT/SIGTERM stops it between pieces of at
// most 32 MB with an error.
#pragma once
#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <future>
#include <string>

#include "io/xxh64.h"

namespace lathe::io {

// What commit() reports: the file's length and the XXH64 (seed 0) of its bytes.
struct WrittenFile {
  uint64_t bytes = 0;
  uint64_t xxh64 = 0;
};

class DirectWriter {
 public:
  static constexpr size_t kAlign = 4096;  // O_DIRECT block and page size the layout aims at

  explicit DirectWriter(const std::string& path);  // creates or truncates path
  ~DirectWriter();
  DirectWriter(const DirectWriter&) = delete;
  DirectWriter& operator=(const DirectWriter&) = delete;

  size_t position() const { return offset_ + fill_; }
  void write(const void* p, size_t n);
  // Flushes, truncates to the written length, fsyncs and closes. Errors name the path.
  WrittenFile commit();

 private:
  static constexpr size_t kStage = 16u << 20, kDirectChunk = 32u << 20, kDirectMin = 1u << 20;

  void stage(const char* c, size_t m);
  void submit(const char* buf, size_t n, bool staging);
  void wait();
  std::string pwrite_all(const char* p, size_t n, off_t at);

  std::string path_;
  int fd_ = -1;
  bool direct_ = true, committed_ = false;
  char* bufs_[2] = {nullptr, nullptr};
  int cur_ = 0;
  size_t fill_ = 0, offset_ = 0, total_ = 0;
  std::future<std::string> pending_;
  Xxh64 h_;
};

}  // namespace lathe::io
