// Deterministic random numbers. Every random stream in lathe (init, data shuffle, sampling) is
// derived from the recipe seed, so the same seed and thread count give bit-identical runs.
// The state is two 64-bit words so checkpoints can save and restore it exactly.
#pragma once
#include <cmath>
#include <cstdint>

namespace lathe {

inline uint64_t splitmix64(uint64_t& x) {
  uint64_t z = (x += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// xoroshiro128+ seeded through splitmix64.
struct Rng {
  uint64_t s[2];
  explicit Rng(uint64_t seed = 0) { reseed(seed); }
  void reseed(uint64_t seed) {
    uint64_t x = seed;
    s[0] = splitmix64(x);
    s[1] = splitmix64(x);
  }
  uint64_t next_u64() {
    uint64_t s0 = s[0], s1 = s[1], r = s0 + s1;
    s1 ^= s0;
    s[0] = ((s0 << 24) | (s0 >> 40)) ^ s1 ^ (s1 << 16);
    s[1] = (s1 << 37) | (s1 >> 27);
    return r;
  }
  // Uniform in [0, 1) with 24 bits, exactly representable in float.
  float uniform() { return static_cast<float>(next_u64() >> 40) * (1.0f / 16777216.0f); }
  double uniform_double() { return static_cast<double>(next_u64() >> 11) * (1.0 / 9007199254740992.0); }
  // Uniform integer in [0, n).
  uint64_t below(uint64_t n) { return n ? next_u64() % n : 0; }
  // Standard normal by Box-Muller.
  float normal() {
    double u1 = uniform_double(), u2 = uniform_double();
    if (u1 < 1e-300) u1 = 1e-300;
    return static_cast<float>(std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
  }
};

}  // namespace lathe
