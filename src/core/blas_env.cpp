#include "core/blas_env.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include <cblas.h>

namespace lathe {

std::string blas_kernel_name() {
  const char* name = openblas_get_corename();
  return name ? name : "unknown";
}

void ensure_fast_blas_kernel(int argc, char** argv) {
  (void)argc;
  if (std::getenv("OPENBLAS_CORETYPE") != nullptr) return;
  if (std::strcmp(openblas_get_corename(), "Prescott") != 0) return;
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx512f")) return;
  setenv("OPENBLAS_CORETYPE", "SkylakeX", 1);
  execv("/proc/self/exe", argv);
  std::fprintf(stderr, "lathe: note: could not re-execute with OPENBLAS_CORETYPE=SkylakeX; GEMMs will be slow\n");
}

}  // namespace lathe
