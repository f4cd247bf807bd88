// Runtime settings that must be in the environment before the process starts, because
// OpenBLAS and libgomp read them when they load. ensure_fast_runtime() sets what is missing and
// re-executes the binary once (a user's own settings are always respected):
//  * OPENBLAS_CORETYPE=SkylakeX where OpenBLAS 0.3.21 (Debian 12) does not recognise an AVX-512
//    CPU (e.g. Xeon family 6 model 207) and falls back to its generic "Prescott" kernels, which
//    run every GEMM ~5x slower.
//  * OMP_WAIT_POLICY=ACTIVE: a training step is hundreds of short parallel regions; when an idle
//    OpenMP worker sleeps, waking its (virtual) CPU took a full scheduler tick (4 ms) on the
//    development VMs, which made 2 threads 5x slower than 1 (measured: 1273 ms vs 247 ms per
//    step of the L=4 C=256 benchmark; 250-290 ms with 2 spinning threads under load). A finite
//    GOMP_SPINCOUNT measured no better. Set OMP_WAIT_POLICY=PASSIVE to share the cores politely.
#pragma once
#include <string>

namespace lathe {

// Call first thing in main(). Returns only if no re-exec was needed (or it failed).
void ensure_fast_runtime(int argc, char** argv);

// "SkylakeX", "Haswell", "Prescott", ... as OpenBLAS reports it.
std::string blas_kernel_name();

}  // namespace lathe
