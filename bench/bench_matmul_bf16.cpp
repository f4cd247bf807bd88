// bf16 GEMM throughput at GPT-2 124M training shapes (M = B*T = 1024 rows): for every linear layer
// the forward GEMM and both backward GEMMs, fp32 (OpenBLAS sgemm, cpu::matmul_*) against bf16
// (oneDNN, cpu::matmul_*_bf16), GFLOP/s side by side; plus the fp32 <-> bf16 conversion rate and
// the bf16 instruction peak of one core (a register-only vdpbf16ps loop) times the thread count,
// so that the GEMM rates can be read as a share of what the hardware can do.
//
//   bench_matmul_bf16 [--json] [--quick]      (bench/bench_matmul_bf16.py adds torch to the table)
//
// --quick skips the 50257-wide lm head (most of the run time). Each figure is the best of
// several repetitions after a warm-up call (which also creates the cached oneDNN primitive).
#include <omp.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "core/blas_env.h"
#include "core/buffer.h"
#include "core/dtype.h"
#include "core/rng.h"
#include "core/timer.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/ops_bf16.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

using namespace lathe;

namespace {

double best_seconds(const std::function<void()>& fn, int min_reps, double budget_s) {
  fn();
  double best = 1e30, spent = 0.0;
  for (int r = 0; r < min_reps || spent < budget_s; ++r) {
    const double t0 = now_seconds();
    fn();
    const double dt = now_seconds() - t0;
    best = std::min(best, dt);
    spent += dt;
    if (r >= 30) break;
  }
  return best;
}

// GFLOP/s of vdpbf16ps alone (32 multiply-adds = 64 FLOP each) on 16 independent accumulators
// per thread (enough to cover its latency at 2 per cycle), all OpenMP threads at once (so the
// clock is the all-core one): an upper bound no GEMM can pass. Best of 5 runs.
double bf16_instruction_peak() {
#if defined(__AVX512BF16__)
  double best = 0;
  for (int rep = 0; rep < 5; ++rep) {
    constexpr int kAcc = 16;
    const int64_t iters = 5'000'000;
    double slowest = 0;
    int nthr = 1;
#pragma omp parallel reduction(max : slowest)
    {
      nthr = omp_get_num_threads();
      __m512 acc[kAcc];
      for (auto& a : acc) a = _mm512_setzero_ps();
      const __m512bh x = (__m512bh)_mm512_set1_epi16(0x3f80), y = (__m512bh)_mm512_set1_epi16(0x3c00);
      const double t0 = now_seconds();
      for (int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 16
        for (int j = 0; j < kAcc; ++j) acc[j] = _mm512_dpbf16_ps(acc[j], x, y);
        asm volatile("" ::"v"(acc[0]));
      }
      slowest = now_seconds() - t0;
      alignas(64) float lanes[16];
      for (auto& a : acc) {
        _mm512_store_ps(lanes, a);
        if (lanes[0] == 12345.0f) std::printf(" ");  // keeps the loop
      }
    }
    best = std::max(best, nthr * kAcc * 64.0 * static_cast<double>(iters) / slowest * 1e-9);
  }
  return best;
#else
  return 0.0;
#endif
}

struct Shape {
  const char* name;
  int64_t K, N;
};

struct Row {
  std::string name, gemm;
  int64_t M, K, N;  // of the GEMM as the layer sees it
  double fp32, bf16;
};

}  // namespace

int main(int argc, char** argv) {
  ensure_fast_runtime(argc, argv);
  bool json = false, quick = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--json") == 0) {
      json = true;
    } else if (std::strcmp(argv[i], "--quick") == 0) {
      quick = true;
    } else {
      std::fprintf(stderr, "bench_matmul_bf16: unknown argument '%s' (only --json, --quick)\n", argv[i]);
      return 2;
    }
  }
  const int threads = omp_get_max_threads();
  std::printf("bench_matmul_bf16: %d OpenMP threads; OpenBLAS core %s; bf16: %s\n", threads, blas_kernel_name().c_str(),
              cpu::bf16_matmul_backend_info().c_str());
  const double peak = bf16_instruction_peak();
  if (peak > 0)
    std::printf("vdpbf16ps instruction peak: %.0f GFLOP/s (%d threads, register-only loop)\n", peak, threads);

  const int64_t M = 1024;
  std::vector<Shape> shapes = {{"attn.qkv", 768, 2304},
                               {"attn.proj", 768, 768},
                               {"mlp.fc", 768, 3072},
                               {"mlp.proj", 3072, 768},
                               {"lm_head", 768, 50257}};
  if (quick) shapes.pop_back();
  Rng rng(7);
  std::vector<Row> rows;
  std::printf("%-10s %-5s %5s %5s %6s | %9s %9s | %6s\n", "layer", "gemm", "M", "K", "N", "fp32 GF/s", "bf16 GF/s",
              "ratio");
  for (const Shape& s : shapes) {
    const int64_t K = s.K, N = s.N;
    Buffer<float> x(M * K), w(N * K), b(N), out(M * N), dout(M * N), dx(M * K), dw(N * K), db(N);
    for (size_t i = 0; i < x.size(); ++i) x[i] = rng.normal();
    for (size_t i = 0; i < w.size(); ++i) w[i] = rng.normal() * 0.02f;
    for (size_t i = 0; i < dout.size(); ++i) dout[i] = rng.normal();
    Buffer<uint16_t> xh(M * K), wh(N * K), douth(M * N);
    cpu::convert_fp32_to_bf16(xh.data(), x.data(), M * K);
    cpu::convert_fp32_to_bf16(wh.data(), w.data(), N * K);
    cpu::convert_fp32_to_bf16(douth.data(), dout.data(), M * N);
    const double flops = 2.0 * M * K * N;
    const int reps = flops > 2e10 ? 2 : 3;
    const double budget = flops > 2e10 ? 0.0 : 0.3;
    auto add = [&](const char* gemm, const std::function<void()>& f32, const std::function<void()>& h) {
      const double t32 = best_seconds(f32, reps, budget), t16 = best_seconds(h, reps, budget);
      rows.push_back({s.name, gemm, M, K, N, flops / t32 * 1e-9, flops / t16 * 1e-9});
      const Row& r = rows.back();
      std::printf("%-10s %-5s %5lld %5lld %6lld | %9.1f %9.1f | %5.2fx\n", r.name.c_str(), gemm,
                  static_cast<long long>(M), static_cast<long long>(K), static_cast<long long>(N), r.fp32, r.bf16,
                  r.bf16 / r.fp32);
      std::fflush(stdout);
    };
    add(
        "fwd", [&] { cpu::matmul_forward(out.data(), x.data(), w.data(), b.data(), M, K, N); },
        [&] { cpu::matmul_forward_bf16(out.data(), xh.data(), wh.data(), b.data(), M, K, N); });
    add(
        "dinp", [&] { cpu::matmul_backward(dx.data(), nullptr, nullptr, dout.data(), x.data(), w.data(), M, K, N); },
        [&] { cpu::matmul_backward_bf16(dx.data(), nullptr, nullptr, douth.data(), xh.data(), wh.data(), M, K, N); });
    add(
        "dw", [&] { cpu::matmul_backward(nullptr, dw.data(), nullptr, dout.data(), x.data(), w.data(), M, K, N); },
        [&] { cpu::matmul_backward_bf16(nullptr, dw.data(), nullptr, douth.data(), xh.data(), wh.data(), M, K, N); });
  }
  double sum32 = 0, sum16 = 0;  // time-weighted: total FLOP / total time of all GEMMs
  for (const Row& r : rows) {
    const double f = 2.0 * r.M * r.K * r.N;
    sum32 += f / r.fp32, sum16 += f / r.bf16;
  }
  double total = 0;
  for (const Row& r : rows) total += 2.0 * r.M * r.K * r.N;
  std::printf("all GEMMs (time-weighted): fp32 %.1f GFLOP/s, bf16 %.1f GFLOP/s (%.2fx)\n", total / sum32, total / sum16,
              sum32 / sum16);

  // Conversion rate on a weight-sized array (124M parameters would be ~10x this).
  const int64_t n = 16 << 20;
  Buffer<float> f(n);
  Buffer<uint16_t> h(n);
  for (int64_t i = 0; i < n; ++i) f[i] = rng.normal();
  const double tc = best_seconds([&] { cpu::convert_fp32_to_bf16(h.data(), f.data(), n); }, 5, 0.3);
  const double tb = best_seconds([&] { cpu::convert_bf16_to_fp32(f.data(), h.data(), n); }, 5, 0.3);
  std::printf("convert 16M: fp32->bf16 %.2f ms (%.1f GB/s), bf16->fp32 %.2f ms (%.1f GB/s)\n", tc * 1e3,
              6.0 * n / tc * 1e-9, tb * 1e3, 6.0 * n / tb * 1e-9);

  if (json) {
    std::string s =
        "{\"threads\": " + std::to_string(threads) + ", \"peak_bf16\": " + std::to_string(peak) + ", \"rows\": [";
    for (size_t i = 0; i < rows.size(); ++i) {
      const Row& r = rows[i];
      s += (i ? ", " : "") + std::string("{\"name\": \"") + r.name + "\", \"gemm\": \"" + r.gemm +
           "\", \"M\": " + std::to_string(r.M) + ", \"K\": " + std::to_string(r.K) + ", \"N\": " + std::to_string(r.N) +
           ", \"fp32\": " + std::to_string(r.fp32) + ", \"bf16\": " + std::to_string(r.bf16) + "}";
    }
    std::printf("%s]}\n", s.c_str());
  }
  return 0;
}
