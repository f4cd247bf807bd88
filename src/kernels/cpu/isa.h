// The x86-64 instruction set lathe finds at start, and what may cap it (issue 22).
//
// cpu_isa() is the CPU's best level among those lathe tells apart, capped by
//  * LATHE_CPU_ISA (lathe's own switch, parsed and validated in core/cpu_isa.h: avx2, avx512,
//    avx512_bf16 or native), e.g.
//    LATHE_CPU_ISA=avx2 makes an AVX-512 machine take the paths an AVX2-only machine takes;
//  * ONEDNN_MAX_CPU_ISA / DNNL_MAX_CPU_ISA (oneDNN's own cap, which oneDNN applies to itself:
//    SSE41, AVX, AVX2, AVX2_VNNI, AVX512_CORE, AVX512_CORE_VNNI, AVX512_CORE_BF16,
//    AVX512_CORE_AMX, ALL), so the name lathe prints is the level oneDNN's kernels run at too.
// Decided once per process (the environment is read at the first call).
#pragma once
#include <string>

namespace lathe::cpu {

enum class Isa : int {
  Baseline = 0,    // x86-64 without AVX2 (SSE4.1 / AVX)
  Avx2 = 1,        // AVX2 + FMA
  Avx512 = 2,      // AVX-512 F/BW/VL/DQ (oneDNN's avx512_core)
  Avx512Bf16 = 3,  // + AVX512-BF16 (vdpbf16ps)
  Amx = 4,         // + AMX-BF16 tiles
};

// Lower-case name for logs and run_info.json: "x86-64", "avx2", "avx512", "avx512_bf16", "amx".
const char* isa_name(Isa isa);
// The CPU's own level (cpuid), ignoring every cap.
Isa cpu_isa_hardware();
// The level lathe uses: the hardware level capped as above. Throws on an LATHE_CPU_ISA value it
// does not know, naming the accepted ones.
Isa cpu_isa();
// Why cpu_isa() is below the hardware level ("DNNL_MAX_CPU_ISA=AVX2"), or "" when it is not.
std::string cpu_isa_cap_reason();

}  // namespace lathe::cpu
