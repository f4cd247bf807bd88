// bf16 GEMM throughput at GPT-2 124M training shapes (M = B*T = 1024 rows): for every linear layer
// the forward GEMM and both backward GEMMs, fp32 (OpenBLAS sgemm, cpu::matmul_*) against bf16
// (oneDNN, cpu::matmul_*_bf16) and, for the forward GEMM, an own AVX512-BF16 kernel (prototype
// below), GFLOP/s side by side; plus the fp32 <-> bf16 conversion rate and
// the bf16 instruction peak of one core (a register-only vdpbf16ps loop) times the thread count,
// so that the GEMM rates can be read as a share of what the hardware can do.
//
//   bench_matmul_bf16 [--json] [--quick]      (bench/bench_matmul_bf16.py adds torch to the table)
//
// --quick skips the 50257-wide lm head (most of the run time). Each figure is the best of
// several repetitions after a warm-up call (which also creates the cached oneDNN primitive).
#include <omp.h>

#include <algorithm>
#include <cmath>
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

#if defined(__AVX512BF16__)
// ---- own AVX512-BF16 GEMM, forward layout only: the measurement behind keeping oneDNN -----------
// Issue 9 asks for oneDNN "or an own AVX512-BF16 kernel if it is faster; measure". This is that
// kernel, tuned until it stopped improving (GotoBLAS blocking; a 14x32 micro-kernel of vdpbf16ps
// with 28 fp32 accumulators, A broadcast as bf16 pairs, B packed as [k/2][32 columns][2]; KC = K up
// to 3072, MC = 84, NC = 2304; OpenMP threads split N). It reached 93-100% of oneDNN's rate on one
// thread and never passed it, so lathe uses oneDNN; the column stays so that the comparison can be
// rerun. out[M,N] = inp[M,K] @ w[N,K]^T, fp32 out, no bias.
namespace own {
constexpr int MR = 14, NR = 32;
constexpr int64_t MC = 84, NC = 2304, KC_MAX = 3072;

// A rows [i0, i0+mr) at k in [k0, k0+kc) as bf16 pairs: dst[p][r] (zero padded to MR rows, even k).
void pack_a(uint32_t* dst, const uint16_t* a, int64_t lda, int64_t i0, int64_t mr, int64_t k0, int64_t kc) {
  for (int64_t p = 0; p < (kc + 1) / 2; ++p)
    for (int r = 0; r < MR; ++r) {
      uint32_t v = 0;
      if (r < mr) {
        const uint16_t* s = a + (i0 + r) * lda + k0 + 2 * p;
        v = s[0] | (2 * p + 1 < kc ? uint32_t{s[1]} << 16 : 0u);
      }
      dst[p * MR + r] = v;
    }
}
// B[k][n] = w[n][k] for columns [j0, j0+nr): dst[p][j][2] (zero padded to NR columns, even k).
void pack_b(uint16_t* dst, const uint16_t* w, int64_t ldw, int64_t j0, int64_t nr, int64_t k0, int64_t kc) {
  for (int j = 0; j < NR; ++j)
    for (int64_t p = 0; p < (kc + 1) / 2; ++p) {
      const uint16_t* s = w + (j0 + j) * ldw + k0 + 2 * p;
      dst[p * 64 + 2 * j] = j < nr ? s[0] : 0;
      dst[p * 64 + 2 * j + 1] = (j < nr && 2 * p + 1 < kc) ? s[1] : 0;
    }
}
void kernel(int64_t kp, const uint32_t* __restrict a, const uint16_t* __restrict b, float* c, int64_t ldc, bool first) {
  __m512 acc[MR][2];
  for (auto& r : acc) r[0] = r[1] = _mm512_setzero_ps();
  for (int64_t p = 0; p < kp; ++p) {
    const __m512bh b0 = (__m512bh)_mm512_load_si512(b + p * 64), b1 = (__m512bh)_mm512_load_si512(b + p * 64 + 32);
#pragma GCC unroll 14
    for (int r = 0; r < MR; ++r) {
      const __m512bh av = (__m512bh)_mm512_set1_epi32(static_cast<int>(a[p * MR + r]));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], av, b0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], av, b1);
    }
  }
  for (int r = 0; r < MR; ++r) {
    float* o = c + r * ldc;
    _mm512_storeu_ps(o, first ? acc[r][0] : _mm512_add_ps(_mm512_loadu_ps(o), acc[r][0]));
    _mm512_storeu_ps(o + 16, first ? acc[r][1] : _mm512_add_ps(_mm512_loadu_ps(o + 16), acc[r][1]));
  }
}
void gemm_columns(float* c, const uint16_t* a, const uint16_t* w, int64_t M, int64_t K, int64_t N, int64_t n0,
                  int64_t n1, uint32_t* ap, uint16_t* bp) {
  alignas(64) float tile[MR * NR];
  for (int64_t jc = n0; jc < n1; jc += NC) {
    const int64_t nc = std::min(NC, n1 - jc);
    for (int64_t pc = 0; pc < K; pc += KC_MAX) {
      const int64_t kc = std::min(KC_MAX, K - pc), kp = (kc + 1) / 2;
      for (int64_t jr = 0; jr < nc; jr += NR)
        pack_b(bp + jr / NR * kp * 64, w, K, jc + jr, std::min<int64_t>(NR, nc - jr), pc, kc);
      for (int64_t ic = 0; ic < M; ic += MC) {
        const int64_t mc = std::min(MC, M - ic);
        for (int64_t ir = 0; ir < mc; ir += MR)
          pack_a(ap + ir / MR * kp * MR, a, K, ic + ir, std::min<int64_t>(MR, mc - ir), pc, kc);
        for (int64_t jr = 0; jr < nc; jr += NR) {
          const int64_t nr = std::min<int64_t>(NR, nc - jr);
          for (int64_t ir = 0; ir < mc; ir += MR) {
            const int64_t mr = std::min<int64_t>(MR, mc - ir);
            float* o = c + (ic + ir) * N + jc + jr;
            const uint32_t* pa = ap + ir / MR * kp * MR;
            const uint16_t* pb = bp + jr / NR * kp * 64;
            if (mr == MR && nr == NR) {
              kernel(kp, pa, pb, o, N, pc == 0);
            } else {  // edge tile through a full-size buffer
              for (int r = 0; r < mr; ++r)
                for (int j = 0; j < nr; ++j) tile[r * NR + j] = pc == 0 ? 0.0f : o[r * N + j];
              kernel(kp, pa, pb, tile, NR, false);
              for (int r = 0; r < mr; ++r)
                for (int j = 0; j < nr; ++j) o[r * N + j] = tile[r * NR + j];
            }
          }
        }
      }
    }
  }
}
struct Scratch {
  Buffer<uint32_t> a{static_cast<size_t>(MC * (KC_MAX / 2 + 1))};
  Buffer<uint16_t> b{static_cast<size_t>((NC + NR) * (KC_MAX + 2))};
};
void matmul_forward(float* out, const uint16_t* inp, const uint16_t* w, int64_t M, int64_t K, int64_t N,
                    std::vector<Scratch>& scratch) {
#pragma omp parallel
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t blocks = (N + NR - 1) / NR, b0 = blocks * t / nt, b1 = blocks * (t + 1) / nt;
    if (b1 > b0)
      gemm_columns(out, inp, w, M, K, N, b0 * NR, std::min(N, b1 * NR), scratch[t].a.data(), scratch[t].b.data());
  }
}
}  // namespace own
#endif

struct Shape {
  const char* name;
  int64_t K, N;
};

struct Row {
  std::string name, gemm;
  int64_t M, K, N;             // of the GEMM as the layer sees it
  double fp32, bf16, own = 0;  // own: the forward prototype above (0 where not run)
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
  std::printf("%-10s %-5s %5s %5s %6s | %9s %9s %9s | %6s\n", "layer", "gemm", "M", "K", "N", "fp32 GF/s", "bf16 GF/s",
              "own GF/s", "bf16/fp32");
#if defined(__AVX512BF16__)
  std::vector<own::Scratch> own_scratch(threads);
#endif
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
    auto add = [&](const char* gemm, const std::function<void()>& f32, const std::function<void()>& h,
                   const std::function<void()>& mine = nullptr) {
      const double t32 = best_seconds(f32, reps, budget), t16 = best_seconds(h, reps, budget);
      const double town = mine ? best_seconds(mine, reps, budget) : 0.0;
      rows.push_back({s.name, gemm, M, K, N, flops / t32 * 1e-9, flops / t16 * 1e-9, mine ? flops / town * 1e-9 : 0.0});
      const Row& r = rows.back();
      std::printf("%-10s %-5s %5lld %5lld %6lld | %9.1f %9.1f %9s | %8.2fx\n", r.name.c_str(), gemm,
                  static_cast<long long>(M), static_cast<long long>(K), static_cast<long long>(N), r.fp32, r.bf16,
                  mine ? std::to_string(static_cast<int>(r.own + 0.5)).c_str() : "-", r.bf16 / r.fp32);
      std::fflush(stdout);
    };
    std::function<void()> own_fwd = nullptr;
#if defined(__AVX512BF16__)
    // The prototype must compute what oneDNN computes (no bias): same inputs, compare outputs.
    Buffer<float> out_own(M * N);
    own_fwd = [&] { own::matmul_forward(out_own.data(), xh.data(), wh.data(), M, K, N, own_scratch); };
    own_fwd();
    cpu::matmul_forward_bf16(out.data(), xh.data(), wh.data(), nullptr, M, K, N);
    double diff = 0, mag = 0;
    for (int64_t i = 0; i < M * N; ++i)
      diff = std::max(diff, double(std::fabs(out[i] - out_own[i]))), mag = std::max(mag, double(std::fabs(out[i])));
    if (diff > 1e-5 * mag)
      std::printf("own kernel differs from oneDNN at %s: max |diff| %g of max |out| %g\n", s.name, diff, mag);
#endif
    add(
        "fwd", [&] { cpu::matmul_forward(out.data(), x.data(), w.data(), b.data(), M, K, N); },
        [&] { cpu::matmul_forward_bf16(out.data(), xh.data(), wh.data(), b.data(), M, K, N); }, own_fwd);
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
           ", \"fp32\": " + std::to_string(r.fp32) + ", \"bf16\": " + std::to_string(r.bf16) +
           ", \"own\": " + std::to_string(r.own) + "}";
    }
    std::printf("%s]}\n", s.c_str());
  }
  return 0;
}
