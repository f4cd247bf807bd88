#include "io/xxh64.h"

#include <fmt/format.h>

#include <cstring>

namespace lathe::io {

// XXH64, from the xxHash specification (doc/xxhash_spec.md of github.com/Cyan4973/xxHash).

namespace {
constexpr uint64_t P1 = 0x9E3779B185EBCA87ull, P2 = 0xC2B2AE3D27D4EB4Full, P3 = 0x165667B19E3779F9ull,
                   P4 = 0x85EBCA77C2B2AE63ull, P5 = 0x27D4EB2F165667C5ull;
inline uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
inline uint64_t rd64(const unsigned char* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);  // little-endian hosts only (x86-64, aarch64)
  return v;
}
inline uint32_t rd32(const unsigned char* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
inline uint64_t xround(uint64_t acc, uint64_t in) { return rotl(acc + in * P2, 31) * P1; }
inline uint64_t xmerge(uint64_t acc, uint64_t v) { return (acc ^ xround(0, v)) * P1 + P4; }
}  // namespace

Xxh64::Xxh64(uint64_t seed) : seed_(seed) {
  v_[0] = seed + P1 + P2;
  v_[1] = seed + P2;
  v_[2] = seed;
  v_[3] = seed - P1;
}

void Xxh64::update(const void* data, size_t n) {
  const unsigned char* p = static_cast<const unsigned char*>(data);
  total_ += n;
  if (buf_len_ + n < 32) {
    if (n) std::memcpy(buf_ + buf_len_, p, n);
    buf_len_ += n;
    return;
  }
  if (buf_len_) {
    const size_t fill = 32 - buf_len_;
    std::memcpy(buf_ + buf_len_, p, fill);
    for (int i = 0; i < 4; ++i) v_[i] = xround(v_[i], rd64(buf_ + 8 * i));
    p += fill;
    n -= fill;
    buf_len_ = 0;
  }
  uint64_t a = v_[0], b = v_[1], c = v_[2], d = v_[3];
  for (; n >= 32; p += 32, n -= 32) {
    a = xround(a, rd64(p));
    b = xround(b, rd64(p + 8));
    c = xround(c, rd64(p + 16));
    d = xround(d, rd64(p + 24));
  }
  v_[0] = a, v_[1] = b, v_[2] = c, v_[3] = d;
  if (n) std::memcpy(buf_, p, n);
  buf_len_ = n;
}

uint64_t Xxh64::digest() const {
  uint64_t h;
  if (total_ >= 32) {
    h = rotl(v_[0], 1) + rotl(v_[1], 7) + rotl(v_[2], 12) + rotl(v_[3], 18);
    for (int i = 0; i < 4; ++i) h = xmerge(h, v_[i]);
  } else {
    h = seed_ + P5;
  }
  h += total_;
  const unsigned char* p = buf_;
  size_t n = buf_len_;
  for (; n >= 8; p += 8, n -= 8) h = rotl(h ^ xround(0, rd64(p)), 27) * P1 + P4;
  if (n >= 4) {
    h = rotl(h ^ (static_cast<uint64_t>(rd32(p)) * P1), 23) * P2 + P3;
    p += 4;
    n -= 4;
  }
  for (; n > 0; ++p, --n) h = rotl(h ^ (*p * P5), 11) * P1;
  h ^= h >> 33;
  h *= P2;
  h ^= h >> 29;
  h *= P3;
  h ^= h >> 32;
  return h;
}

uint64_t Xxh64::hash(const void* data, size_t n, uint64_t seed) {
  Xxh64 x(seed);
  x.update(data, n);
  return x.digest();
}

std::string hex64(uint64_t v) { return fmt::format("{:016x}", v); }

}  // namespace lathe::io
