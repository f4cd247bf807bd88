// Owning, 64-byte aligned, zero-initialised storage. Large buffers are touched once at allocation
// so that page faults happen at start-up, not inside the first training step.
#pragma once
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "core/error.h"

namespace lathe {

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

  void resize(size_t n) {
    std::free(ptr_);
    ptr_ = nullptr;
    n_ = n;
    if (n == 0) return;
    size_t bytes = ((n * sizeof(T) + 63) / 64) * 64;
    ptr_ = static_cast<T*>(std::aligned_alloc(64, bytes));
    LATHE_CHECK(ptr_ != nullptr, "out of memory allocating {} bytes", bytes);
    std::memset(static_cast<void*>(ptr_), 0, bytes);
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
