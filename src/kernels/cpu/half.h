// 16-bit storage types of the CPU bf16 and fp16 tables: serial row conversions to and from fp32
// (called inside the kernels' own OpenMP regions, so no nested parallelism) and the matmuls each
// table runs. Every half kernel computes in fp32 on rows widened from 16 bits and rounds its
// outputs once, round-to-nearest-even, bit-identical to core/dtype.h's fp32_to_bf16/fp32_to_fp16.
#pragma once
// GCC 12 warns about the deliberately undefined pass-through operand of AVX-512 intrinsics
// (GCC PR 105593), located in the header: as kernels/cpu/convert_bf16.cpp.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

#include <bit>
#include <cstdint>
#include <vector>

#include "core/dtype.h"

namespace lathe::cpu {

struct Bf16 {
  static constexpr DType kDtype = DType::BF16;
  static float ld(uint16_t h) { return std::bit_cast<float>(static_cast<uint32_t>(h) << 16); }
  // Branch-free fp32_to_bf16 (vectorises): NaN keeps its sign and upper payload, quiet bit set.
  static uint16_t st(float f) {
    const uint32_t u = std::bit_cast<uint32_t>(f);
    const uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const uint32_t q = (u >> 16) | 0x40u;
    return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? q : r);
  }
  static void to_f32(float* __restrict dst, const uint16_t* __restrict src, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) dst[i] = ld(src[i]);
  }
  static void from_f32(uint16_t* __restrict dst, const float* __restrict src, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) dst[i] = st(src[i]);
  }
};

struct Fp16 {
  static constexpr DType kDtype = DType::F16;
  static float ld(uint16_t h) { return _cvtsh_ss(h); }
  static uint16_t st(float f) { return static_cast<uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT)); }
  static void to_f32(float* __restrict dst, const uint16_t* __restrict src, int64_t n) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16)
      _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
#endif
    for (; i < n; ++i) dst[i] = ld(src[i]);
  }
  static void from_f32(uint16_t* __restrict dst, const float* __restrict src, int64_t n) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                          _mm512_cvtps_ph(_mm512_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
    for (; i < n; ++i) dst[i] = st(src[i]);
  }
};

// Per-thread fp32 work rows for the kernels whose signature has no scratch (norm forwards, the
// pointwise ops, the fp16 GEMM operands): grown on the first call that needs more, then reused,
// so a training step allocates nothing after the first. `slot` tells apart buffers used together.
inline float* thread_rows(int slot, size_t floats) {
  static thread_local std::vector<float> bufs[4];
  std::vector<float>& b = bufs[slot];
  if (b.size() < floats) b.resize(floats);
  return b.data();
}

}  // namespace lathe::cpu
