#include "train/peak.h"

#include <cblas.h>
#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <vector>

#include "core/rng.h"
#include "core/timer.h"

namespace lathe {

double measure_peak_gflops() {
  const int n = 1536;
  std::vector<float> a(static_cast<size_t>(n) * n), b(a.size()), c(a.size());
  Rng rng(7);
  for (auto& x : a) x = rng.uniform() - 0.5f;
  for (auto& x : b) x = rng.uniform() - 0.5f;
  auto gemm = [&] {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f, c.data(), n);
  };
  gemm();  // warm-up: thread start, page faults
  double best = 0;
  for (int rep = 0; rep < 4; ++rep) {
    double t0 = now_seconds();
    gemm();
    double dt = now_seconds() - t0;
    best = std::max(best, 2.0 * n * n * static_cast<double>(n) / dt / 1e9);
  }
  return best;
}

const std::vector<GpuPeak>& gpu_peak_table() {
  // Dense figures from NVIDIA's datasheets / architecture whitepapers (the sparse figures are twice
  // these). tensor16: bf16 (= fp16) tensor cores with fp32 accumulation; GeForce parts run that at
  // half their fp16-accumulate rate, which is the figure here. fp32: non-tensor FP32.
  static const std::vector<GpuPeak> t = {
      {{"B200"}, "B200", 2250, 80},
      {{"B100"}, "B100", 1750, 60},
      {{"GH200"}, "GH200", 989.4, 66.9},
      {{"H200"}, "H200 SXM", 989.4, 66.9},
      {{"H200", "NVL"}, "H200 NVL", 835.5, 60.0},
      {{"H100"}, "H100 SXM", 989.4, 66.9},
      {{"H100", "PCIE"}, "H100 PCIe", 756.5, 51.2},
      {{"H100", "NVL"}, "H100 NVL", 835.5, 60.0},
      {{"H800"}, "H800 SXM", 989.4, 66.9},
      {{"H800", "PCIE"}, "H800 PCIe", 756.5, 51.2},
      {{"A100"}, "A100", 312, 19.5},
      {{"A800"}, "A800", 312, 19.5},
      {{"A40"}, "A40", 149.7, 37.4},
      {{"A30"}, "A30", 165, 10.3},
      {{"A10"}, "A10", 125, 31.2},
      {{"A10G"}, "A10G", 70, 31.2},
      {{"L40S"}, "L40S", 362.1, 91.6},
      {{"L40"}, "L40", 181.0, 90.5},
      {{"L4"}, "L4", 121, 30.3},
      {{"RTX", "6000", "ADA"}, "RTX 6000 Ada", 364.2, 91.1},
      {{"RTX", "A6000"}, "RTX A6000", 154.8, 38.7},
      {{"RTX", "5090"}, "RTX 5090", 209.5, 104.8},
      {{"RTX", "4090"}, "RTX 4090", 165.2, 82.6},
      {{"RTX", "4080"}, "RTX 4080", 97.5, 48.7},
      {{"RTX", "3090"}, "RTX 3090", 71, 35.6},
      {{"RTX", "3090", "TI"}, "RTX 3090 Ti", 80, 40},
  };
  return t;
}

namespace {
std::vector<std::string> words(std::string_view name) {
  std::vector<std::string> out;
  std::string w;
  for (char ch : name) {
    if (std::isalnum(static_cast<unsigned char>(ch))) {
      w += static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
    } else if (!w.empty()) {
      out.push_back(std::move(w));
      w.clear();
    }
  }
  if (!w.empty()) out.push_back(std::move(w));
  return out;
}
}  // namespace

const GpuPeak* find_gpu_peak(std::string_view device_name) {
  const auto have = words(device_name);
  const GpuPeak* best = nullptr;
  for (const GpuPeak& e : gpu_peak_table()) {
    bool all = true;
    for (const auto& t : e.tokens) all = all && std::find(have.begin(), have.end(), t) != have.end();
    if (all && (!best || e.tokens.size() > best->tokens.size())) best = &e;
  }
  return best;
}

double estimate_gpu_peak_gflops(const GpuInfo& gpu, DType compute) {
  // Dense FLOP per SM per clock of the data-centre part of each architecture (2 x FMA):
  // A100 108 SMs x 1.41 GHz x 2048 = 312 TF; H100 SXM 132 x 1.83 GHz x 4096 = 989 TF.
  const int cc = gpu.cc_major * 10 + gpu.cc_minor;
  double t16 = 0, f32 = 0;
  switch (cc) {
    case 70:
      t16 = 1024, f32 = 128;
      break;  // V100 (fp16 tensor cores; no bf16 in hardware)
    case 75:
      t16 = 512, f32 = 128;
      break;  // T4
    case 80:
      t16 = 2048, f32 = 128;
      break;  // A100
    case 86:
      t16 = 1024, f32 = 256;
      break;  // A10 / A40 (GeForce: half the tensor rate)
    case 89:
      t16 = 1024, f32 = 256;
      break;  // L40S / L4
    case 90:
      t16 = 4096, f32 = 256;
      break;  // H100 / H200
    case 100:
      t16 = 8192, f32 = 256;
      break;  // B200
    default:
      return 0;
  }
  const double per_clock = compute == DType::F32 ? f32 : t16;
  return per_clock * gpu.sm_count * (gpu.clock_khz * 1e3) / 1e9;
}

PeakChoice choose_peak(double recipe_gflops, const GpuInfo* gpu, DType compute, double (*measure)()) {
  PeakChoice c;
  if (recipe_gflops > 0) {
    c.gflops = recipe_gflops;
    c.source = "from recipe (training.peak_gflops)";
    return c;
  }
  if (!gpu) {
    c.gflops = measure ? measure() : 0;
    c.source = "measured by GEMM probe";
    return c;
  }
  const char* kind = compute == DType::F32 ? "fp32" : compute == DType::F16 ? "fp16" : "bf16";
  if (const GpuPeak* e = find_gpu_peak(gpu->name)) {
    c.gflops = 1000.0 * (compute == DType::F32 ? e->fp32_tflops : e->tensor16_tflops);
    c.source = fmt::format("{} dense {} peak from lathe's GPU table", e->label, kind);
    return c;
  }
  c.estimated = true;
  c.gflops = estimate_gpu_peak_gflops(*gpu, compute);
  if (c.gflops > 0)
    c.source = fmt::format(
        "'{}' is not in lathe's GPU table: estimated {} peak from {} SMs x {:.0f} MHz for sm_{}{} (set "
        "training.peak_gflops for exact MFU)",
        gpu->name, kind, gpu->sm_count, gpu->clock_khz / 1e3, gpu->cc_major, gpu->cc_minor);
  else
    c.source = fmt::format(
        "'{}' (sm_{}{}) is neither in lathe's GPU table nor of a known architecture: MFU is not reported (set "
        "training.peak_gflops)",
        gpu->name, gpu->cc_major, gpu->cc_minor);
  return c;
}

}  // namespace lathe
