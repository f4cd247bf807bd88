// Throughput of the basic CPU kernels at GPT-2-small shapes (N = B*T = 256 rows, C = 768).
// Prints GFLOP/s of matmul forward/backward per transformer GEMM shape, the sgemm peak on a square
// 2048^3 problem with the current OpenMP thread count (the ceiling the matmuls can reach), and
// milliseconds for the memory-bound kernels. Each figure is the best of several repetitions.
// Runtime: ~10-30 s depending on the machine.
//
// OpenBLAS 0.3.21 (Debian 12) with DYNAMIC_ARCH does not recognise recent Intel CPUs (e.g.
// Sapphire Rapids under a hypervisor) and falls back to its generic "Prescott" SSE3 kernels, which
// are ~5x slower than the AVX-512 "SkylakeX" ones (OpenBLAS issue #4267, fixed in 0.3.25). The
// kernel table is chosen when the library loads, so the only clean fix is the documented
// OPENBLAS_CORETYPE environment variable: when the CPU has AVX-512 but OpenBLAS picked Prescott and
// the user did not set OPENBLAS_CORETYPE, this benchmark says so and re-executes itself with
// OPENBLAS_CORETYPE=SkylakeX. Pass --no-coretype-fix to measure the misdetected configuration.
#include <cblas.h>
#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>

#include "config/rope_scaling.h"
#include "core/buffer.h"
#include "core/rng.h"
#include "core/timer.h"
#include "kernels/cpu/ops.h"

using namespace lathe;

namespace {

void fill(Buffer<float>& b, Rng& rng, float scale = 1.0f) {
  for (size_t i = 0; i < b.size(); ++i) b[i] = rng.normal() * scale;
}

// Best wall time of fn over at least min_reps runs and about budget_s seconds (after one warm-up).
double best_seconds(const std::function<void()>& fn, int min_reps = 3, double budget_s = 0.5) {
  fn();
  double best = 1e30, spent = 0.0;
  for (int r = 0; r < min_reps || spent < budget_s; ++r) {
    const double t0 = now_seconds();
    fn();
    const double dt = now_seconds() - t0;
    best = std::min(best, dt);
    spent += dt;
    if (r >= 50) break;
  }
  return best;
}

void bench_matmul(const char* name, int64_t M, int64_t K, int64_t N, Rng& rng) {
  Buffer<float> x(M * K), w(N * K), b(N), out(M * N), dout(M * N), dx(M * K), dw(N * K), db(N);
  fill(x, rng);
  fill(w, rng, 0.02f);
  fill(b, rng);
  fill(dout, rng);
  const double flops_f = 2.0 * M * K * N;
  // Large shapes get a smaller time budget so the whole bench stays short.
  const double budget = flops_f > 5e9 ? 0.0 : 0.4;
  const int reps = flops_f > 5e9 ? 2 : 3;
  const double tf =
      best_seconds([&] { cpu::matmul_forward(out.data(), x.data(), w.data(), b.data(), M, K, N); }, reps, budget);
  const double tb = best_seconds(
      [&] { cpu::matmul_backward(dx.data(), dw.data(), db.data(), dout.data(), x.data(), w.data(), M, K, N); }, reps,
      budget);
  std::printf("matmul %-10s M=%-4lld K=%-4lld N=%-6lld  fwd %8.2f ms %7.1f GFLOP/s   bwd %8.2f ms %7.1f GFLOP/s\n",
              name, static_cast<long long>(M), static_cast<long long>(K), static_cast<long long>(N), tf * 1e3,
              flops_f / tf * 1e-9, tb * 1e3, 2.0 * flops_f / tb * 1e-9);
}

}  // namespace

int main(int argc, char** argv) {
  bool coretype_fix = true;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--no-coretype-fix") == 0) {
      coretype_fix = false;
    } else {
      std::fprintf(stderr, "bench_kernels: unknown argument '%s' (only --no-coretype-fix)\n", argv[i]);
      return 2;
    }
  }
  const char* core = openblas_get_corename();
  if (coretype_fix && std::getenv("OPENBLAS_CORETYPE") == nullptr && std::strcmp(core, "Prescott") == 0 &&
      __builtin_cpu_supports("avx512f")) {
    std::printf(
        "bench_kernels: OpenBLAS picked the generic Prescott kernels on an AVX-512 CPU; "
        "re-running with OPENBLAS_CORETYPE=SkylakeX\n");
    std::fflush(stdout);
    setenv("OPENBLAS_CORETYPE", "SkylakeX", 1);
    execv("/proc/self/exe", argv);
    std::perror("bench_kernels: execv /proc/self/exe failed");
    return 1;
  }
  const int threads = omp_get_max_threads();
  std::printf("bench_kernels: %d OpenMP threads, OpenBLAS core %s (%s)\n", threads, core, openblas_get_config());
  Rng rng(1234);

  {
    const int64_t S = 2048;
    Buffer<float> a(S * S), bm(S * S), c(S * S);
    fill(a, rng);
    fill(bm, rng);
    const double t =
        best_seconds([&] { cpu::matmul_forward(c.data(), a.data(), bm.data(), nullptr, S, S, S); }, 3, 0.0);
    std::printf("sgemm peak 2048^3 (NT)                        %8.2f ms %7.1f GFLOP/s  (%.1f GFLOP/s/thread)\n",
                t * 1e3, 2.0 * S * S * S / t * 1e-9, 2.0 * S * S * S / t * 1e-9 / threads);
  }

  const int64_t N = 256, C = 768;
  bench_matmul("qkv", N, C, 3 * C, rng);
  bench_matmul("mlp_up", N, C, 4 * C, rng);
  bench_matmul("attn_proj", N, C, C, rng);
  bench_matmul("mlp_down", N, 4 * C, C, rng);
  bench_matmul("lm_head", N, C, 50257, rng);

  // Memory-bound kernels at N=256, C=768 (GELU also at the MLP width 4C where the model uses it).
  const int64_t F = 2048;  // Llama-style SwiGLU width for C=768 (its input holds gate|up: 2F columns)
  const int64_t big = N * std::max(4 * C, 2 * F);
  Buffer<float> x(big), y(big), g(big), dx(big), w(C), bias(C), dw(C), db(C), mean(N), rstd(N);
  fill(x, rng);
  fill(g, rng);
  fill(w, rng);
  fill(bias, rng);
  Buffer<float> scratch(std::max(cpu::layernorm_scratch_floats(C), cpu::rmsnorm_scratch_floats(C)));
  auto ms = [](double s) { return s * 1e3; };
  const double ln_f = best_seconds([&] {
    cpu::layernorm_forward(y.data(), mean.data(), rstd.data(), x.data(), w.data(), bias.data(), N, C, 1e-5f);
  });
  const double ln_b = best_seconds([&] {
    cpu::layernorm_backward(dx.data(), dw.data(), db.data(), g.data(), x.data(), w.data(), mean.data(), rstd.data(), N,
                            C, scratch.data());
  });
  std::printf("layernorm N=256 C=768        fwd %7.3f ms   bwd %7.3f ms\n", ms(ln_f), ms(ln_b));
  const double rn_f =
      best_seconds([&] { cpu::rmsnorm_forward(y.data(), rstd.data(), x.data(), w.data(), N, C, 1e-6f); });
  const double rn_b = best_seconds([&] {
    cpu::rmsnorm_backward(dx.data(), dw.data(), g.data(), x.data(), w.data(), rstd.data(), N, C, scratch.data());
  });
  std::printf("rmsnorm   N=256 C=768        fwd %7.3f ms   bwd %7.3f ms\n", ms(rn_f), ms(rn_b));
  for (int64_t width : {C, 4 * C}) {
    const int64_t n = N * width;
    const double gf = best_seconds([&] { cpu::gelu_forward(y.data(), x.data(), n); });
    const double gb = best_seconds([&] { cpu::gelu_backward(dx.data(), x.data(), g.data(), n); });
    std::printf("gelu      N=256 C=%-4lld       fwd %7.3f ms   bwd %7.3f ms\n", static_cast<long long>(width), ms(gf),
                ms(gb));
  }
  {
    const double sf = best_seconds([&] { cpu::swiglu_forward(y.data(), x.data(), N, F); });
    const double sb = best_seconds([&] { cpu::swiglu_backward(dx.data(), x.data(), g.data(), N, F); });
    std::printf("swiglu    N=256 F=2048       fwd %7.3f ms   bwd %7.3f ms\n", ms(sf), ms(sb));
  }
  {
    const double rf = best_seconds([&] { cpu::residual_forward(y.data(), x.data(), g.data(), N * C); });
    std::printf("residual  N=256 C=768        fwd %7.3f ms\n", ms(rf));
  }
  {
    const int64_t B = 4, T = 64, H = 12, D = 64;
    Buffer<float> cs(T * D / 2), sn(T * D / 2);
    cpu::rope_tables(cs.data(), sn.data(), T, D / 2, rope_default_inv_freq(D, 10000.0).data(), 1.0f);
    const double rf = best_seconds([&] { cpu::rope_forward(x.data(), cs.data(), sn.data(), B, T, H, D, D, 3 * H * D); });
    const double rb = best_seconds([&] { cpu::rope_backward(x.data(), cs.data(), sn.data(), B, T, H, D, D, 3 * H * D); });
    std::printf("rope      B*T=256 H=12 D=64  fwd %7.3f ms   bwd %7.3f ms\n", ms(rf), ms(rb));
  }
  {
    const int64_t B = 4, T = 64, V = 50257;
    Buffer<float> wte(V * C), wpe(T * C), dwte(V * C), dwpe(T * C);
    Buffer<int32_t> tok(B * T);
    for (int64_t i = 0; i < B * T; ++i) tok[i] = static_cast<int32_t>(rng.below(V));
    fill(wte, rng);
    const double ef =
        best_seconds([&] { cpu::embedding_forward(y.data(), tok.data(), wte.data(), wpe.data(), B, T, C); });
    const double eb =
        best_seconds([&] { cpu::embedding_backward(dwte.data(), dwpe.data(), g.data(), tok.data(), B, T, C); });
    std::printf("embedding B*T=256 C=768      fwd %7.3f ms   bwd %7.3f ms\n", ms(ef), ms(eb));
  }
  return 0;
}
