// XXH64 (Yann Collet's xxHash, 64-bit), streaming: the checksum of checkpoint files and state.json.
// Matches XXH64() of the reference library (tests/train/test_checkpoint.cpp).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace lathe::io {

class Xxh64 {
 public:
  explicit Xxh64(uint64_t seed = 0);
  void update(const void* data, size_t n);
  uint64_t digest() const;
  static uint64_t hash(const void* data, size_t n, uint64_t seed = 0);

 private:
  uint64_t v_[4];
  uint64_t seed_, total_ = 0;
  unsigned char buf_[32];
  size_t buf_len_ = 0;
};
std::string hex64(uint64_t v);  // 16 lowercase hex digits

}  // namespace lathe::io
