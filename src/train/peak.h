// The MFU denominator: the recipe's training.peak_gflops when set, else on the CPU a GEMM probe
// and on a GPU the dense peak of its name in a table (vendor datasheets, no sparsity), else an
// estimate from its SM count, clock and architecture (said as such in the log).
#pragma once
#include <string>
#include <string_view>
#include <vector>

#include "core/dtype.h"
#include "kernels/backend.h"

namespace lathe {

// Measures the machine's sgemm throughput (GFLOP/s) with the current thread count: a few square
// GEMMs large enough to reach the BLAS kernel's steady state (~0.3 s). Used as the MFU denominator.
double measure_peak_gflops();

// Dense peaks of one GPU model (TFLOP/s): `tensor16` for bf16/fp16 tensor-core GEMMs with fp32
// accumulation (what bf16/fp16 models run), `fp32` for plain fp32 FMA (no TF32: lathe's fp32
// GEMMs are asked for full fp32 accuracy). `tokens` must all appear among the device name's
// words (upper case, split at anything not a letter or digit): {"H100", "PCIE"} matches
// "NVIDIA H100 PCIe"; the entry matching the most tokens wins, so "H100" alone is the SXM part.
struct GpuPeak {
  std::vector<std::string> tokens;
  const char* label;  // "H100 SXM"
  double tensor16_tflops;
  double fp32_tflops;
};
const std::vector<GpuPeak>& gpu_peak_table();
// The table entry for a device name (cudaDeviceProp::name), or nullptr.
const GpuPeak* find_gpu_peak(std::string_view device_name);

// What the CUDA runtime says about a device (Backend::device_info() fills it on a CUDA build).
using GpuInfo = DeviceInfo;  // what the backend reports (kernels/backend.h Backend::device_info)
// Dense peak GFLOP/s from SMs x clock x FLOP per SM per clock of the architecture's data-centre
// part (sm_80: 2048 bf16 / 128 fp32; sm_90: 4096 / 256; ...); 0 when the architecture is unknown.
// GeForce parts of an architecture often have half the bf16 rate: an estimate, said as such.
double estimate_gpu_peak_gflops(const GpuInfo& gpu, DType compute);

struct PeakChoice {
  double gflops = 0;
  std::string source;      // "from recipe", "measured by GEMM probe", "H100 SXM dense bf16 from the GPU table", ...
  bool estimated = false;  // an estimate or unknown: the log says to set training.peak_gflops
};
// The MFU denominator of a run: recipe_gflops > 0 wins; then a GPU (gpu != nullptr) by table, then
// by estimate; without a GPU `measure()` (the CPU probe). A GPU neither in the table nor of a known
// architecture gives gflops 0 with a source saying so (MFU is then not reported).
PeakChoice choose_peak(double recipe_gflops, const GpuInfo* gpu, DType compute, double (*measure)());

}  // namespace lathe
