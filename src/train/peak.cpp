#include "train/peak.h"

#include <cblas.h>

#include <algorithm>
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

}  // namespace lathe
