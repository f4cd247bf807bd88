#include "io/direct_writer.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "core/error.h"
#include "core/stop_signal.h"

namespace lathe::io {

DirectWriter::DirectWriter(const std::string& path) : path_(path) {
  fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_DIRECT, 0644);
  if (fd_ < 0 && errno == EINVAL) {
    direct_ = false;
    fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  }
  if (fd_ < 0) throw_error("{}: cannot create: {}", path, std::strerror(errno));
  for (auto& b : bufs_) {
    b = static_cast<char*>(std::aligned_alloc(kAlign, kStage));
    LATHE_CHECK(b != nullptr, "{}: out of memory for a {} byte staging buffer", path, kStage);
  }
}

DirectWriter::~DirectWriter() {
  if (pending_.valid()) pending_.wait();
  for (auto& b : bufs_) std::free(b);
  if (fd_ >= 0) ::close(fd_);
  if (!committed_) ::unlink(path_.c_str());
}

void DirectWriter::write(const void* p, size_t n) {
  const char* c = static_cast<const char*>(p);
  while (n > 0) {
    // Zero-copy when the address and the file position share their offset within a page and
    // the stretch is long enough to be worth it.
    const size_t head = (kAlign - position() % kAlign) % kAlign;
    if (n >= head + kDirectMin && (reinterpret_cast<uintptr_t>(c) + head) % kAlign == 0 && fill_ + head <= kStage) {
      stage(c, head);
      c += head;
      n -= head;
      if (fill_) submit(bufs_[cur_], fill_, true);  // fill_ is a multiple of kAlign here
      const size_t body = n / kAlign * kAlign;
      for (size_t i = 0; i < body; i += kDirectChunk) {
        const size_t m = std::min(kDirectChunk, body - i);
        h_.update(c + i, m);  // while the previous piece is being written
        submit(c + i, m, false);
      }
      c += body;
      n -= body;
      continue;
    }
    const size_t m = std::min(n, kStage - fill_);
    stage(c, m);
    c += m;
    n -= m;
    if (fill_ == kStage) submit(bufs_[cur_], kStage, true);
  }
}

WrittenFile DirectWriter::commit() {
  const size_t tail = fill_;
  if (tail) {
    const size_t padded = (tail + kAlign - 1) / kAlign * kAlign;
    std::memset(bufs_[cur_] + tail, 0, padded - tail);
    submit(bufs_[cur_], padded, true);
    total_ -= padded - tail;
  }
  wait();
  if (::ftruncate(fd_, static_cast<off_t>(total_)) != 0)
    throw_error("{}: ftruncate failed: {}", path_, std::strerror(errno));
  if (::fsync(fd_) != 0) throw_error("{}: fsync failed: {}", path_, std::strerror(errno));
  const int rc = ::close(fd_);
  fd_ = -1;
  if (rc != 0) throw_error("{}: close failed: {}", path_, std::strerror(errno));
  committed_ = true;
  return {total_, h_.digest()};
}

void DirectWriter::stage(const char* c, size_t m) {
  if (!m) return;
  std::memcpy(bufs_[cur_] + fill_, c, m);
  h_.update(bufs_[cur_] + fill_, m);
  fill_ += m;
}

// Hands n bytes (a multiple of kAlign, already hashed) to the writer thread. One write is in
// flight at a time, so a staging buffer is free again once the next submit() returns.
void DirectWriter::submit(const char* buf, size_t n, bool staging) {
  // Under a StopSignalGuard (lathe checkpoint reshard) a SIGINT/SIGTERM stops between pieces of
  // at most 32 MB; the destructor removes the file. lathe train has its own handler and finishes
  // the checkpoint it is writing (stop_signal() is 0 there).
  if (const int sig = stop_signal())
    throw_error("{}: interrupted by {} while writing it; the partial file is removed", path_, signal_name(sig));
  wait();
  const off_t at = static_cast<off_t>(offset_);
  pending_ = std::async(std::launch::async, [this, buf, n, at] { return pwrite_all(buf, n, at); });
  offset_ += n;
  total_ += n;
  if (staging) {
    cur_ ^= 1;
    fill_ = 0;
  }
}

void DirectWriter::wait() {
  if (!pending_.valid()) return;
  const std::string err = pending_.get();
  if (!err.empty()) throw Error(err);
}

std::string DirectWriter::pwrite_all(const char* p, size_t n, off_t at) {
  while (n > 0) {
    ssize_t w = ::pwrite(fd_, p, n, at);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0 && errno == EINVAL && direct_) {
      // The filesystem accepted O_DIRECT at open but refuses the I/O: continue buffered.
      direct_ = false;
      ::fcntl(fd_, F_SETFL, ::fcntl(fd_, F_GETFL) & ~O_DIRECT);
      continue;
    }
    if (w < 0) return fmt::format("{}: write failed: {}", path_, std::strerror(errno));
    p += w;
    n -= static_cast<size_t>(w);
    at += w;
  }
  return {};
}

}  // namespace lathe::io
