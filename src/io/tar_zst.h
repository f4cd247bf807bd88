// Reproducible .tar.zst archives (lathe archive): POSIX ustar members, regular files only, mode
// 0644, uid/gid 0, no user or group names, mtime 0, in the order they are added; the tar stream is
// one zstd frame (single-threaded, fixed level, content checksum on), so the same members give the
// same bytes. The reader streams the archive back member by member and checks each header's checksum.
#pragma once
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "io/fs.h"

struct ZSTD_CCtx_s;
struct ZSTD_DCtx_s;

namespace lathe::io {

// The 512-byte ustar header of a regular file (exposed for tests): a name over 100 bytes is split at
// a '/' into prefix and name (refused when it cannot be); a size of 8 GiB or more is written in
// base-256 (GNU tar, star and Python's tarfile read it). ustar_size reads either form back.
std::string ustar_header(const std::string& name, uint64_t size);
uint64_t ustar_size(const char* header);

class TarZstWriter {
 public:
  TarZstWriter(const std::string& path, int level = 6);  // written to a temporary file until finish()
  ~TarZstWriter();
  TarZstWriter(const TarZstWriter&) = delete;
  TarZstWriter& operator=(const TarZstWriter&) = delete;
  // A member of `size` bytes whose data `fill` supplies through `write` (exactly size bytes).
  void add(const std::string& name, uint64_t size,
           const std::function<void(const std::function<void(const void*, size_t)>& write)>& fill);
  void add(const std::string& name, std::string_view data);
  void finish();  // the end-of-archive blocks, the frame's end, fsync and rename

 private:
  void put(const void* data, size_t n);  // into the tar stream (compressed as it goes)
  void compress(const void* data, size_t n, bool end);
  AtomicFileWriter out_;
  ZSTD_CCtx_s* cctx_;
  std::string obuf_;
  uint64_t tar_bytes_ = 0;
};

// Reads `path` (a .tar.zst) and calls on_member(name, size) at each member's header, then
// on_data(chunk, n) with its data in order, then on_end() after its last byte. Errors name the
// archive and what is wrong (not zstd, damaged frame, a bad header checksum, truncated).
struct TarVisitor {
  std::function<void(const std::string& name, uint64_t size)> on_member;
  std::function<void(const char* data, size_t n)> on_data;
  std::function<void()> on_end;
};
void read_tar_zst(const std::string& path, const TarVisitor& v);

}  // namespace lathe::io
