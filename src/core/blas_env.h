// OpenBLAS 0.3.21 (Debian 12) does not recognise recent Intel Xeons (e.g. family 6 model 207)
// and falls back to its generic "Prescott" SSE3 kernels: every GEMM runs ~5x slower. The kernel
// is chosen when the library loads, from OPENBLAS_CORETYPE, so the fix has to happen before the
// process starts: re-execute ourselves with OPENBLAS_CORETYPE=SkylakeX when the CPU has AVX-512
// and OpenBLAS picked Prescott. A user's own OPENBLAS_CORETYPE is always respected.
#pragma once
#include <string>

namespace lathe {

// Call first thing in main(). Returns only if no re-exec was needed (or it failed).
void ensure_fast_blas_kernel(int argc, char** argv);

// "SkylakeX", "Haswell", "Prescott", ... as OpenBLAS reports it.
std::string blas_kernel_name();

}  // namespace lathe
