// The storage types of the CPU op tables (F32, Bf16, Fp16): every kernel is one `template <class S>`
// in its op's file, instantiated for the three, that computes in fp32 on rows read through the
// helpers below: an F32 row is used in place, a 16-bit row is widened into a per-thread fp32 row
// and its result rounded once, round-to-nearest-even, bit-identical to core/dtype.h's
// fp32_to_bf16/fp32_to_fp16. The conversions are serial (called inside the kernels' own OpenMP
// regions, so no nested parallelism).
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
#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/cpu_isa.h"
#include "core/dtype.h"

namespace lathe::cpu {

struct F32 {
  using T = float;
  static constexpr DType kDtype = DType::F32;
  static constexpr bool kFp32 = true;  // rows are read and written in place, nothing is converted
};

struct Bf16 {
  using T = uint16_t;
  static constexpr DType kDtype = DType::BF16;
  static constexpr bool kFp32 = false;
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

// AVX-512 row conversions of Fp16 (kernels/cpu/convert_bf16.cpp); call only when cpu_isa() >= Avx512.
void fp16_to_fp32_rows_avx512(float* __restrict dst, const uint16_t* __restrict src, int64_t n);
void fp32_to_fp16_rows_avx512(uint16_t* __restrict dst, const float* __restrict src, int64_t n);

struct Fp16 {
  using T = uint16_t;
  static constexpr DType kDtype = DType::F16;
  static constexpr bool kFp32 = false;
  static float ld(uint16_t h) { return _cvtsh_ss(h); }
  static uint16_t st(float f) { return static_cast<uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT)); }
  // Rows: AVX-512 where cpu_isa() allows it (convert_bf16.cpp, compiled for it whatever LATHE_ARCH
  // is), else F16C on 8 lanes (x86-64-v3); the same hardware rounding, so bit-identical.
  static void to_f32(float* __restrict dst, const uint16_t* __restrict src, int64_t n) {
    if (lathe::cpu_isa() >= CpuIsa::Avx512) return fp16_to_fp32_rows_avx512(dst, src, n);
    int64_t i = 0;
#if defined(__F16C__) && defined(__AVX__)
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
    for (; i < n; ++i) dst[i] = ld(src[i]);
  }
  static void from_f32(uint16_t* __restrict dst, const float* __restrict src, int64_t n) {
    if (lathe::cpu_isa() >= CpuIsa::Avx512) return fp32_to_fp16_rows_avx512(dst, src, n);
    int64_t i = 0;
#if defined(__F16C__) && defined(__AVX__)
    for (; i + 8 <= n; i += 8)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                       _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
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

// ---- rows of a storage type as fp32 ------------------------------------------------------------
// The buffer pointers of the op tables are void*; these give them their storage type.
template <class S>
const typename S::T* as(const void* p) {
  return static_cast<const typename S::T*>(p);
}
template <class S>
typename S::T* as(void* p) {
  return static_cast<typename S::T*>(p);
}

// A per-thread fp32 work row of `floats` for a 16-bit storage type (thread_rows); none for F32,
// whose rows are used in place.
template <class S>
float* work_row(int slot, size_t floats) {
  if constexpr (S::kFp32)
    return nullptr;
  else
    return thread_rows(slot, floats);
}

// src[0, n) as fp32: src itself for F32, else widened into buf.
template <class S>
const float* read_row(float* buf, const typename S::T* src, int64_t n) {
  if constexpr (S::kFp32) {
    return src;
  } else {
    S::to_f32(buf, src, n);
    return buf;
  }
}
// The fp32 row a result for dst is computed in: dst itself for F32, else buf (then write_row).
template <class S>
float* out_row(float* buf, typename S::T* dst) {
  if constexpr (S::kFp32)
    return dst;
  else
    return buf;
}
// dst[0, n) as an fp32 row to update (+=): dst itself for F32, else widened into buf (then write_row).
template <class S>
float* update_row(float* buf, typename S::T* dst, int64_t n) {
  if constexpr (S::kFp32) {
    return dst;
  } else {
    S::to_f32(buf, dst, n);
    return buf;
  }
}
// Stores the row of out_row / update_row into dst: nothing to do for F32, else rounded once.
template <class S>
void write_row(typename S::T* dst, const float* row, int64_t n) {
  if constexpr (!S::kFp32) S::from_f32(dst, row, n);
}

}  // namespace lathe::cpu
