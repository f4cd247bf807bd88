// ISA detection and its caps (contract in isa.h).
#include "kernels/cpu/isa.h"

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <string>

#include "core/cpu_isa.h"
#include "core/error.h"

namespace lathe::cpu {

namespace {

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

// oneDNN's names for its cap (case-insensitive, as oneDNN compares them). An unknown value is
// one oneDNN ignores as well (it then runs at the CPU's level), so it caps nothing here either.
bool dnnl_cap(const std::string& v, Isa& out) {
  const std::string s = lower(v);
  if (s == "sse41" || s == "avx")
    out = Isa::Baseline;
  else if (s == "avx2" || s == "avx2_vnni" || s == "avx2_vnni_2")
    out = Isa::Avx2;
  else if (s == "avx512_core" || s == "avx512_core_vnni")
    out = Isa::Avx512;
  else if (s == "avx512_core_bf16" || s == "avx512_core_fp16")
    out = Isa::Avx512Bf16;
  else if (s == "avx512_core_amx" || s == "avx512_core_amx_fp16" || s == "all")
    out = Isa::Amx;
  else
    return false;
  return true;
}

struct Choice {
  Isa hardware, isa;
  std::string reason;
};

Choice decide() {
  Choice c;
  c.hardware = cpu_isa_hardware();
  c.isa = c.hardware;
  // LATHE_CPU_ISA is parsed and validated in one place, core/cpu_isa.h (which the hand-written
  // conversions dispatch on); its level caps the GEMM path here too.
  if (const char* v = std::getenv("LATHE_CPU_ISA"); v != nullptr && *v != '\0' && std::string(v) != "native") {
    const CpuIsa core = lathe::cpu_isa();
    const Isa cap = core == CpuIsa::Avx2 ? Isa::Avx2 : core == CpuIsa::Avx512 ? Isa::Avx512 : Isa::Avx512Bf16;
    if (cap < c.isa) c.isa = cap, c.reason = std::string("LATHE_CPU_ISA=") + v;
  }
  for (const char* var : {"ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"}) {
    const char* v = std::getenv(var);
    if (v == nullptr || *v == '\0') continue;
    Isa cap;
    if (dnnl_cap(v, cap) && cap < c.isa) {
      c.isa = cap;
      c.reason = std::string(var) + "=" + v;
    }
    break;  // oneDNN reads ONEDNN_MAX_CPU_ISA first and DNNL_MAX_CPU_ISA only without it
  }
  return c;
}

const Choice& choice() {
  static const Choice c = decide();
  return c;
}

}  // namespace

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::Baseline:
      return "x86-64";
    case Isa::Avx2:
      return "avx2";
    case Isa::Avx512:
      return "avx512";
    case Isa::Avx512Bf16:
      return "avx512_bf16";
    case Isa::Amx:
      return "amx";
  }
  return "?";
}

Isa cpu_isa_hardware() {
  __builtin_cpu_init();
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  if (avx512 && __builtin_cpu_supports("avx512bf16")) {
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11
    if (__builtin_cpu_supports("amx-bf16")) return Isa::Amx;
#endif
    return Isa::Avx512Bf16;
  }
  if (avx512) return Isa::Avx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::Avx2;
  return Isa::Baseline;
}

Isa cpu_isa() { return choice().isa; }

std::string cpu_isa_cap_reason() { return choice().reason; }

}  // namespace lathe::cpu
