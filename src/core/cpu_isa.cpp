#include "core/cpu_isa.h"

#include <cstdlib>
#include <string>

#include "core/error.h"

namespace lathe {

namespace detail {
std::atomic<int> g_cpu_isa{-1};
}  // namespace detail

CpuIsa cpu_isa_supported() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) {
    return __builtin_cpu_supports("avx512bf16") ? CpuIsa::Avx512Bf16 : CpuIsa::Avx512;
  }
  return CpuIsa::Avx2;
}

std::string_view cpu_isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::Avx2:
      return "avx2";
    case CpuIsa::Avx512:
      return "avx512";
    case CpuIsa::Avx512Bf16:
      return "avx512_bf16";
  }
  return "?";
}

void set_cpu_isa(CpuIsa isa) {
  const CpuIsa have = cpu_isa_supported();
  if (static_cast<int>(isa) > static_cast<int>(have)) {
    throw_error("CPU ISA '{}' requested, but this CPU supports at most '{}'", cpu_isa_name(isa), cpu_isa_name(have));
  }
  detail::g_cpu_isa.store(static_cast<int>(isa), std::memory_order_relaxed);
}

CpuIsa detail::detect_cpu_isa() {
  const CpuIsa have = cpu_isa_supported();
  CpuIsa use = have;
  const char* env = std::getenv("LATHE_CPU_ISA");
  if (env != nullptr && *env != '\0') {
    const std::string v = env;
    if (v == "native") {
      use = have;
    } else if (v == "avx2") {
      use = CpuIsa::Avx2;
    } else if (v == "avx512") {
      use = CpuIsa::Avx512;
    } else if (v == "avx512_bf16") {
      use = CpuIsa::Avx512Bf16;
    } else {
      throw_error("LATHE_CPU_ISA='{}' is not one of native, avx2, avx512, avx512_bf16 (unset it for native)", v);
    }
    if (static_cast<int>(use) > static_cast<int>(have)) {
      throw_error("LATHE_CPU_ISA='{}' but this CPU supports at most '{}': unset it or set LATHE_CPU_ISA={}", v,
                  cpu_isa_name(have), cpu_isa_name(have));
    }
  }
  g_cpu_isa.store(static_cast<int>(use), std::memory_order_relaxed);
  return use;
}

}  // namespace lathe
