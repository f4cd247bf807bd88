// The instruction set lathe's own hand-written kernels use, chosen once per process at run time
// (the fp32 <-> bf16/fp16 conversions of kernels/cpu/convert_bf16.cpp and storage.h). Those kernels
// are compiled for AVX-512 / AVX512-BF16 with per-function target attributes whatever the build's
// LATHE_ARCH is, so one portable binary (-DLATHE_ARCH=x86-64-v3) runs them where the CPU has them
// and the AVX2 (x86-64-v3) code elsewhere; every path gives bit-identical results (they are exact
// conversions with one rounding rule). OpenBLAS and oneDNN dispatch on their own (OPENBLAS_CORETYPE,
// DNNL_MAX_CPU_ISA cap them).
//
// LATHE_CPU_ISA caps the choice: "native" (default: the best the CPU has), "avx512_bf16", "avx512",
// "avx2". A value above what the CPU has, or an unknown one, is an error naming the value.
#pragma once
#include <atomic>
#include <string_view>

namespace lathe {

enum class CpuIsa : int { Avx2 = 0, Avx512 = 1, Avx512Bf16 = 2 };

namespace detail {
extern std::atomic<int> g_cpu_isa;  // -1 until the first cpu_isa() call
CpuIsa detect_cpu_isa();
}  // namespace detail

// The best ISA of this CPU (cpuid), ignoring LATHE_CPU_ISA.
CpuIsa cpu_isa_supported();

// The ISA in use: cpu_isa_supported() capped by LATHE_CPU_ISA; cached after the first call.
// Throws lathe::Error for a bad LATHE_CPU_ISA.
inline CpuIsa cpu_isa() {
  const int v = detail::g_cpu_isa.load(std::memory_order_relaxed);
  return v >= 0 ? static_cast<CpuIsa>(v) : detail::detect_cpu_isa();
}

// Tests: force a path in-process (must be <= cpu_isa_supported(), else throws).
void set_cpu_isa(CpuIsa isa);

// "avx2", "avx512", "avx512_bf16".
std::string_view cpu_isa_name(CpuIsa isa);

}  // namespace lathe
