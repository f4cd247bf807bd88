#include "core/blas_env.h"

#include <cblas.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace lathe {

std::string blas_kernel_name() {
  const char* name = openblas_get_corename();
  return name ? name : "unknown";
}

void ensure_fast_runtime(int argc, char** argv) {
  (void)argc;
  if (std::getenv("LATHE_RUNTIME_SET") != nullptr) return;  // already re-executed once
  bool changed = false;
  if (std::getenv("OPENBLAS_CORETYPE") == nullptr && std::strcmp(openblas_get_corename(), "Prescott") == 0) {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) {
      setenv("OPENBLAS_CORETYPE", "SkylakeX", 1);
      changed = true;
    }
  }
  if (std::getenv("OMP_WAIT_POLICY") == nullptr && std::getenv("GOMP_SPINCOUNT") == nullptr) {
    setenv("OMP_WAIT_POLICY", "ACTIVE", 1);
    changed = true;
  }
  if (!changed) return;
  setenv("LATHE_RUNTIME_SET", "1", 1);
  execv("/proc/self/exe", argv);
  std::fprintf(stderr, "lathe: note: could not re-execute with the tuned OpenBLAS/OpenMP settings; running as is\n");
}

}  // namespace lathe
