// Owning, 64-byte aligned, zero-initialised storage. Large buffers are touched once at allocation
// so that page faults happen at start-up, not inside the first training step (unless asked not to:
// resize(n, false)).
#pragma once
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "core/error.h"

namespace lathe {

// Zeroes [p, p + bytes) of host memory without making it resident: the partial pages at the edges
// are cleared, the whole pages inside handed back to the OS (madvise MADV_DONTNEED: anonymous
// private memory reads as zeros and costs nothing until written). ZeRO 3 reserves the whole flat
// buffers this way and touches only its shard (parallel/param_gather.h).
inline void zero_untouched(void* p, size_t bytes) {
  if (bytes == 0) return;
  static const uintptr_t kPage = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const uintptr_t a = reinterpret_cast<uintptr_t>(p), z = a + bytes;
  const uintptr_t pa = (a + kPage - 1) & ~(kPage - 1), pz = z & ~(kPage - 1);
  if (pz <= pa || ::madvise(reinterpret_cast<void*>(pa), pz - pa, MADV_DONTNEED) != 0) {
    std::memset(p, 0, bytes);
    return;
  }
  std::memset(p, 0, pa - a);
  std::memset(reinterpret_cast<void*>(pz), 0, z - pz);
}

template <typename T>
class Buffer {
 public:
  Buffer() = default;
  explicit Buffer(size_t n) { resize(n); }
  ~Buffer() { std::free(ptr_); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  Buffer(Buffer&& o) noexcept : ptr_(std::exchange(o.ptr_, nullptr)), n_(std::exchange(o.n_, 0)) {}
  Buffer& operator=(Buffer&& o) noexcept {
    std::swap(ptr_, o.ptr_);
    std::swap(n_, o.n_);
    return *this;
  }

  // touch false: zeroed by zero_untouched (nothing resident until written) instead of memset.
  void resize(size_t n, bool touch = true) {
    std::free(ptr_);
    ptr_ = nullptr;
    n_ = n;
    if (n == 0) return;
    size_t bytes = ((n * sizeof(T) + 63) / 64) * 64;
    ptr_ = static_cast<T*>(std::aligned_alloc(64, bytes));
    LATHE_CHECK(ptr_ != nullptr, "out of memory allocating {} bytes", bytes);
    if (touch)
      std::memset(static_cast<void*>(ptr_), 0, bytes);
    else
      zero_untouched(ptr_, bytes);
  }
  void zero() {
    if (n_) std::memset(static_cast<void*>(ptr_), 0, n_ * sizeof(T));
  }
  T* data() { return ptr_; }
  const T* data() const { return ptr_; }
  size_t size() const { return n_; }
  size_t bytes() const { return n_ * sizeof(T); }
  T& operator[](size_t i) { return ptr_[i]; }
  const T& operator[](size_t i) const { return ptr_[i]; }

 private:
  T* ptr_ = nullptr;
  size_t n_ = 0;
};

}  // namespace lathe
