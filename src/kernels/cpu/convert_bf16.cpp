// fp32 <-> bf16 conversion, vectorised and OpenMP-parallel (see ops_bf16.h for the contract), and
// the AVX-512 row conversions of storage.h's Fp16.
//
// fp32 -> bf16 must give exactly what core/dtype.h's scalar fp32_to_bf16 gives, so that bf16
// weights, activations and exported checkpoints round the same way whichever path made them. The
// kernels' one scalar rounding is storage.h's Bf16::st (the same formula without a branch, so that
// it vectorises; test_cpu_isa checks it against core's); fp32_to_bf16_int16 below is it on AVX-512
// lanes.
// AVX512-BF16's vcvtne2ps2bf16 rounds to nearest even and quiets NaNs like the scalar code, but
// it treats subnormal inputs as zero (measured on Zen 4: 0x00018000 -> 0x0000, scalar gives
// 0x0002). So the hardware result is used and the rare block that holds a subnormal is redone
// with the integer rounding (same formula as the scalar code). Without AVX512-BF16 the integer
// rounding runs on AVX-512F lanes, and without AVX-512 the compiler vectorises the scalar loop.
// The AVX-512 variants carry target attributes, so they are compiled whatever LATHE_ARCH is and
// chosen at run time by core/cpu_isa.h (LATHE_CPU_ISA=avx2 forces the portable code).
#include "core/cpu_isa.h"
#include "core/dtype.h"
#include "kernels/cpu/ops_bf16.h"
#include "kernels/cpu/storage.h"  // <immintrin.h>, with GCC 12's AVX-512 false warning silenced (PR 105593)

namespace lathe::cpu {

namespace {

// Below this many elements an OpenMP fork costs more than the conversion itself.
constexpr int64_t kParallelMin = 1 << 15;
// Elements per parallel chunk: a multiple of every vector width used below.
constexpr int64_t kChunk = 1 << 12;

inline void fp32_to_bf16_scalar(uint16_t* dst, const float* src, int64_t n) { Bf16::from_f32(dst, src, n); }

#define LATHE_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))
#define LATHE_AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

// Bf16::st on 16 lanes (integer RNE): (u + 0x7fff + ((u >> 16) & 1)) >> 16, NaN -> (u >> 16) | 0x40.
LATHE_AVX512 inline __m256i fp32_to_bf16_int16(__m512i u) {
  const __m512i abs = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(abs, _mm512_set1_epi32(0x7f800000));
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
  const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, quiet));
}

// The block converters below convert [0, n) where n is a multiple of 32 (the caller converts the
// tail with the scalar code).
LATHE_AVX512BF16 void fp32_to_bf16_block_avx512bf16(uint16_t* dst, const float* src, int64_t n) {
  const __m512i exp_mask = _mm512_set1_epi32(0x7f800000);
  const __m512i man_mask = _mm512_set1_epi32(0x007fffff);
  for (int64_t i = 0; i < n; i += 32) {
    const __m512i lo = _mm512_loadu_si512(src + i);
    const __m512i hi = _mm512_loadu_si512(src + i + 16);
    // Lanes 0-15 of the result come from the second operand.
    __m512i r = (__m512i)_mm512_cvtne2ps_pbh(_mm512_castsi512_ps(hi), _mm512_castsi512_ps(lo));
    // Subnormal: exponent bits all zero and mantissa non-zero (zeros convert correctly).
    const __mmask16 sub_lo = _mm512_testn_epi32_mask(lo, exp_mask) & _mm512_test_epi32_mask(lo, man_mask);
    const __mmask16 sub_hi = _mm512_testn_epi32_mask(hi, exp_mask) & _mm512_test_epi32_mask(hi, man_mask);
    if (__builtin_expect((sub_lo | sub_hi) != 0, 0)) {
      r = _mm512_inserti64x4(_mm512_castsi256_si512(fp32_to_bf16_int16(lo)), fp32_to_bf16_int16(hi), 1);
    }
    _mm512_storeu_si512(dst + i, r);
  }
}

LATHE_AVX512 void fp32_to_bf16_block_avx512(uint16_t* dst, const float* src, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), fp32_to_bf16_int16(_mm512_loadu_si512(src + i)));
  }
}

// Portable (LATHE_ARCH) code: the compiler vectorises the scalar formula.
void fp32_to_bf16_block_portable(uint16_t* dst, const float* src, int64_t n) { fp32_to_bf16_scalar(dst, src, n); }

LATHE_AVX512 void bf16_to_fp32_block_avx512(float* dst, const uint16_t* src, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)));
    _mm512_storeu_si512(dst + i, _mm512_slli_epi32(w, 16));
  }
  for (; i < n; ++i) dst[i] = Bf16::ld(src[i]);
}

void bf16_to_fp32_block_portable(float* dst, const uint16_t* src, int64_t n) { Bf16::to_f32(dst, src, n); }

}  // namespace

void convert_fp32_to_bf16(uint16_t* dst, const float* src, int64_t n) {
  if (n <= 0) return;
  const CpuIsa isa = cpu_isa();
  auto* const fp32_to_bf16_block = isa == CpuIsa::Avx512Bf16 ? fp32_to_bf16_block_avx512bf16
                                   : isa == CpuIsa::Avx512   ? fp32_to_bf16_block_avx512
                                                             : fp32_to_bf16_block_portable;
  const int64_t nchunks = (n + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (int64_t c = 0; c < nchunks; ++c) {
    const int64_t i0 = c * kChunk;
    const int64_t len = (n - i0 < kChunk) ? n - i0 : kChunk;
    const int64_t body = len & ~int64_t{31};
    fp32_to_bf16_block(dst + i0, src + i0, body);
    fp32_to_bf16_scalar(dst + i0 + body, src + i0 + body, len - body);
  }
}

void convert_bf16_to_fp32(float* dst, const uint16_t* src, int64_t n) {
  if (n <= 0) return;
  auto* const bf16_to_fp32_block =
      cpu_isa() >= CpuIsa::Avx512 ? bf16_to_fp32_block_avx512 : bf16_to_fp32_block_portable;
  const int64_t nchunks = (n + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (int64_t c = 0; c < nchunks; ++c) {
    const int64_t i0 = c * kChunk;
    const int64_t len = (n - i0 < kChunk) ? n - i0 : kChunk;
    bf16_to_fp32_block(dst + i0, src + i0, len);
  }
}

LATHE_AVX512 void fp16_to_fp32_rows_avx512(float* __restrict dst, const uint16_t* __restrict src, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
  for (; i < n; ++i) dst[i] = _cvtsh_ss(src[i]);
}

LATHE_AVX512 void fp32_to_fp16_rows_avx512(uint16_t* __restrict dst, const float* __restrict src, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                        _mm512_cvtps_ph(_mm512_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  for (; i < n; ++i) dst[i] = static_cast<uint16_t>(_cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT));
}

bool cpu_has_avx512_bf16() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512bf16");
}

}  // namespace lathe::cpu
