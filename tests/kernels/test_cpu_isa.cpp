// Runtime ISA dispatch of the hand-written conversions (core/cpu_isa.h, kernels/cpu/convert_bf16.cpp,
// storage.h): every path this CPU has gives bit-identical results, on inputs that include NaNs,
// infinities, subnormals, rounding ties and fp16 overflow. The AVX2 path always runs; the AVX-512
// paths are skipped (with the reason) on a CPU without them.
#include <gtest/gtest.h>

#include <bit>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "core/cpu_isa.h"
#include "core/dtype.h"
#include "core/error.h"
#include "kernels/cpu/ops_bf16.h"
#include "kernels/cpu/storage.h"

namespace lathe {
namespace {

// Special fp32 bit patterns: zeros, subnormals, NaNs (quiet, signalling, with payload), infinities,
// bf16 rounding ties (even and odd upper half), values that round up into the next binade or to
// infinity, fp16 ties, the fp16 subnormal range and fp16 overflow.
std::vector<uint32_t> special_bits() {
  return {0x00000000u, 0x80000000u, 0x00000001u, 0x80000001u, 0x00018000u, 0x00008000u, 0x007fffffu, 0x807fffffu,
          0x00400000u, 0x7f800000u, 0xff800000u, 0x7fc00000u, 0xffc00000u, 0x7f800001u, 0xff812345u, 0x7fa00000u,
          0x7fffffffu, 0x3f808000u, 0x3f818000u, 0x3f80c000u, 0x3f807fffu, 0x3fffffffu, 0x7f7fffffu, 0xff7fffffu,
          0x7f7f8000u, 0x3f800000u, 0xbf800000u, 0x477fefffu, 0x477ff000u, 0x477fffffu, 0x47800000u, 0x33800000u,
          0x33000000u, 0x38800000u, 0x387fc000u, 0x3f801000u, 0x3f803000u, 0xc7ffffffu, 0x00800000u, 0x80800000u};
}

// specials, then random bit patterns (every exponent), length not a multiple of any vector width
// and larger than the conversion's parallel threshold.
std::vector<float> inputs(size_t n) {
  std::vector<float> v;
  for (uint32_t b : special_bits()) v.push_back(std::bit_cast<float>(b));
  std::mt19937 rng(7);
  while (v.size() < n) v.push_back(std::bit_cast<float>(static_cast<uint32_t>(rng())));
  // Blocks of 32 with one subnormal each (the AVX512-BF16 path redoes such a block).
  for (size_t i = 100; i + 32 < v.size(); i += 997) v[i + 5] = std::bit_cast<float>(0x00018000u + (uint32_t)i);
  return v;
}

struct Results {
  std::vector<uint16_t> bf16, fp16;
  std::vector<float> bf16_back, fp16_back;
};

Results run_all(const std::vector<float>& x) {
  Results r;
  const int64_t n = static_cast<int64_t>(x.size());
  r.bf16.assign(n, 0);
  cpu::convert_fp32_to_bf16(r.bf16.data(), x.data(), n);
  r.bf16_back.assign(n, 0.f);
  cpu::convert_bf16_to_fp32(r.bf16_back.data(), r.bf16.data(), n);
  r.fp16.assign(n, 0);
  cpu::Fp16::from_f32(r.fp16.data(), x.data(), n);
  r.fp16_back.assign(n, 0.f);
  cpu::Fp16::to_f32(r.fp16_back.data(), r.fp16.data(), n);
  return r;
}

void expect_same_bits(const std::vector<float>& a, const std::vector<float>& b, const char* what) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i)
    ASSERT_EQ(std::bit_cast<uint32_t>(a[i]), std::bit_cast<uint32_t>(b[i])) << what << " at " << i;
}

class CpuIsaDispatch : public ::testing::TestWithParam<CpuIsa> {
 protected:
  void TearDown() override { set_cpu_isa(cpu_isa_supported()); }
};

TEST_P(CpuIsaDispatch, ConversionsMatchScalarReferenceBitForBit) {
  const CpuIsa isa = GetParam();
  if (static_cast<int>(isa) > static_cast<int>(cpu_isa_supported()))
    GTEST_SKIP() << "this CPU has no " << cpu_isa_name(isa) << " (best: " << cpu_isa_name(cpu_isa_supported())
                 << "); that path is tested on a CPU that has it";
  set_cpu_isa(isa);
  ASSERT_EQ(cpu_isa(), isa);
  for (size_t n : {size_t{57}, size_t{1000}, size_t{(1 << 15) + 77}}) {
    const std::vector<float> x = inputs(n);
    const Results r = run_all(x);
    for (size_t i = 0; i < n; ++i) {
      ASSERT_EQ(r.bf16[i], fp32_to_bf16(x[i]))
          << cpu_isa_name(isa) << " bf16 of 0x" << std::hex << std::bit_cast<uint32_t>(x[i]);
      ASSERT_EQ(std::bit_cast<uint32_t>(r.bf16_back[i]), static_cast<uint32_t>(r.bf16[i]) << 16);
      ASSERT_EQ(r.fp16[i], fp32_to_fp16(x[i]))
          << cpu_isa_name(isa) << " fp16 of 0x" << std::hex << std::bit_cast<uint32_t>(x[i]);
      ASSERT_EQ(std::bit_cast<uint32_t>(r.fp16_back[i]), std::bit_cast<uint32_t>(fp16_to_fp32(r.fp16[i])));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Paths, CpuIsaDispatch, ::testing::Values(CpuIsa::Avx2, CpuIsa::Avx512, CpuIsa::Avx512Bf16),
                         [](const auto& info) { return std::string(cpu_isa_name(info.param)); });

TEST(CpuIsa, Avx2AndBestPathAgreeBitForBit) {
  const CpuIsa best = cpu_isa_supported();
  if (best == CpuIsa::Avx2) GTEST_SKIP() << "this CPU has no AVX-512: only the AVX2 path exists here";
  const std::vector<float> x = inputs((1 << 16) + 3);
  set_cpu_isa(CpuIsa::Avx2);
  const Results a = run_all(x);
  set_cpu_isa(best);
  const Results b = run_all(x);
  EXPECT_EQ(a.bf16, b.bf16);
  EXPECT_EQ(a.fp16, b.fp16);
  expect_same_bits(a.bf16_back, b.bf16_back, "bf16 -> fp32");
  expect_same_bits(a.fp16_back, b.fp16_back, "fp16 -> fp32");
}

// The kernels' one scalar bf16 rounding (storage.h's Bf16::st, branch-free so that it vectorises:
// the conversions' portable path and every 16-bit kernel use it) is core/dtype.h's fp32_to_bf16 on
// every upper half (sign, exponent, upper mantissa: NaNs, infinities, subnormals) with the lower
// halves that decide the rounding (0, 1, just below / at / just above the tie, all ones).
TEST(CpuIsa, Bf16StorageRoundingIsCoreRounding) {
  int64_t mismatches = 0;
  for (uint32_t hi = 0; hi <= 0xffffu; ++hi)
    for (uint32_t lo : {0x0000u, 0x0001u, 0x7fffu, 0x8000u, 0x8001u, 0xfffeu, 0xffffu}) {
      const float f = std::bit_cast<float>(hi << 16 | lo);
      if (cpu::Bf16::st(f) != fp32_to_bf16(f) && ++mismatches <= 5)
        ADD_FAILURE() << std::hex << "0x" << (hi << 16 | lo) << ": Bf16::st 0x" << cpu::Bf16::st(f)
                      << ", fp32_to_bf16 0x" << fp32_to_bf16(f);
      if (std::bit_cast<uint32_t>(cpu::Bf16::ld(static_cast<uint16_t>(hi))) !=
          std::bit_cast<uint32_t>(bf16_to_fp32(static_cast<uint16_t>(hi))))
        ++mismatches;
    }
  EXPECT_EQ(mismatches, 0);
}

TEST(CpuIsa, ForcingAnIsaAboveTheCpusIsRefused) {
  if (cpu_isa_supported() == CpuIsa::Avx512Bf16) GTEST_SKIP() << "this CPU has every ISA lathe dispatches to";
  EXPECT_THROW(set_cpu_isa(CpuIsa::Avx512Bf16), Error);
}

// LATHE_CPU_ISA as the process saw it at start (ctest runs this binary with and without it).
TEST(CpuIsa, EnvironmentCapIsHonoured) {
  const char* env = std::getenv("LATHE_CPU_ISA");
  if (env == nullptr || std::strcmp(env, "avx2") != 0) GTEST_SKIP() << "LATHE_CPU_ISA is not avx2 in this run";
  detail::g_cpu_isa.store(-1);  // re-read the environment
  EXPECT_EQ(cpu_isa(), CpuIsa::Avx2);
}

}  // namespace
}  // namespace lathe
