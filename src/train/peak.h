#pragma once

namespace lathe {
// Measures the machine's sgemm throughput (GFLOP/s) with the current thread count: a few square
// GEMMs large enough to reach the BLAS kernel's steady state (~0.3 s). Used as the MFU denominator.
double measure_peak_gflops();
}  // namespace lathe
