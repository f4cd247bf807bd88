// The fused lm head + softmax + cross-entropy (forward + backward) against the kernel it replaced
// (one sgemm over the whole chunk, then per-row passes; kept here as `rows_lm_head_loss`) and an
// sgemm of the same FLOPs, alternated in one process so that a shared machine's load hits all
// of them alike. Prints per round ms of each and the ratios; at the end the medians.
//   bench_lm_head [N C V chunk rounds] [tile widths...]   default: 256 256 50257 256 7 (small config)
//   e.g. bench_lm_head 1024 768 50257 256 5               (GPT-2 124M, B=4 T=256)
// LATHE_BENCH_DTYPE=bf16: the bf16 table's kernel against its previous version and a oneDNN bf16
// GEMM of the same FLOPs. The previous kernels always run with `chunk` rows; LATHE_BENCH_CHUNK2
// (default: chunk) sets the chunk rows of the tiled kernels.
#include <cblas.h>
#include <omp.h>
#include <time.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/rng.h"
#include "core/timer.h"
#include "kernels/backend.h"
#include "kernels/cpu/lm_head_tiles.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/ops_bf16.h"
#include "kernels/cpu/tables.h"
#include "kernels/cpu/vec_math.h"

using namespace lathe;

namespace {

// The previous kernel (commit 1a0296c): logits of the whole chunk by one sgemm, then per row
// max / exp+sum / scale, then the two backward sgemms over the whole chunk.
double rows_lm_head_loss(float* losses, float* dx, float* dw, const float* x, const float* w, const int32_t* targets,
                         int64_t N, int64_t C, int64_t V, float grad_scale, float* scratch, int64_t chunk_rows) {
  double total = 0.0;
  for (int64_t n0 = 0; n0 < N; n0 += chunk_rows) {
    const int64_t R = std::min(chunk_rows, N - n0);
    const float* xc = x + n0 * C;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, R, V, C, 1.0f, xc, C, w, C, 0.0f, scratch, V);
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < R; ++r) {
      float* s = scratch + r * V;
      const int32_t t = targets[n0 + r];
      const float target_logit = s[t];
      const float m = cpu::vec::row_max(s, V);
      const double sum = cpu::vec::exp_shift_sum(s, V, m);
      losses[n0 + r] = static_cast<float>(static_cast<double>(m) + std::log(sum) - static_cast<double>(target_logit));
      cpu::vec::scale(s, V, static_cast<float>(static_cast<double>(grad_scale) / sum));
      s[t] -= grad_scale;
    }
    for (int64_t r = 0; r < R; ++r) total += losses[n0 + r];
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, R, C, V, 1.0f, scratch, V, w, C, 0.0f, dx + n0 * C, C);
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, V, C, R, 1.0f, scratch, V, xc, C, 1.0f, dw, C);
  }
  return total;
}

// CPU seconds of the whole process (all threads): on a machine shared with other jobs this is
// steadier than wall time (with OMP_WAIT_POLICY=PASSIVE it excludes spinning at barriers too).
double cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// The previous bf16 kernel (commit 1a0296c): fp32 logits of the whole chunk (oneDNN), per-row
// softmax, dlogits rounded to bf16 into the second half of the scratch, then the two backward
// GEMMs over the whole chunk (dx rounded to bf16 once).
double rows_lm_head_loss_bf16(float* losses, uint16_t* dx, float* dw, const uint16_t* x, const uint16_t* w,
                              const int32_t* targets, int64_t N, int64_t C, int64_t V, float grad_scale, float* logits,
                              uint16_t* dlog, int64_t chunk_rows) {
  double total = 0.0;
  for (int64_t n0 = 0; n0 < N; n0 += chunk_rows) {
    const int64_t R = std::min(chunk_rows, N - n0);
    const uint16_t* xc = x + n0 * C;
    cpu::matmul_forward_bf16(logits, xc, w, nullptr, R, C, V, false);
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < R; ++r) {
      float* s = logits + r * V;
      const int32_t t = targets[n0 + r];
      const float target_logit = s[t];
      const float m = cpu::vec::row_max(s, V);
      const double sum = cpu::vec::exp_shift_sum(s, V, m);
      losses[n0 + r] = static_cast<float>(static_cast<double>(m) + std::log(sum) - static_cast<double>(target_logit));
      cpu::vec::scale(s, V, static_cast<float>(static_cast<double>(grad_scale) / sum));
      s[t] -= grad_scale;
      for (int64_t j = 0; j < V; ++j) dlog[r * V + j] = fp32_to_bf16(s[j]);
    }
    for (int64_t r = 0; r < R; ++r) total += losses[n0 + r];
    cpu::matmul_backward_bf16_dinp_bf16(dx + n0 * C, dw, nullptr, dlog, xc, w, R, C, V);
  }
  return total;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}
double best(std::vector<double> v) { return *std::min_element(v.begin(), v.end()); }

}  // namespace

int main(int argc, char** argv) {
  const int64_t N = argc > 1 ? std::atoll(argv[1]) : 256, C = argc > 2 ? std::atoll(argv[2]) : 256,
                V = argc > 3 ? std::atoll(argv[3]) : 50257, chunk = argc > 4 ? std::atoll(argv[4]) : 256;
  const int rounds = argc > 5 ? std::atoi(argv[5]) : 7;
  std::vector<int64_t> widths;
  for (int i = 6; i < argc; ++i) widths.push_back(std::atoll(argv[i]));
  const char* chunk2_env = std::getenv("LATHE_BENCH_CHUNK2");
  const int64_t chunk2 = chunk2_env ? std::atoll(chunk2_env) : chunk;
  const int64_t R = std::max(std::min(chunk, N), std::min(chunk2, N));  // scratch rows for both
  if (widths.empty())
    widths.push_back(cpu::head::tile_width(
        std::min(chunk2, N), V, omp_get_max_threads(),
        std::getenv("LATHE_BENCH_DTYPE") ? cpu::head::kTileFloatsHalf : cpu::head::kTileFloatsF32));
  Rng rng(1);
  std::vector<float> x(N * C), w(V * C), dx(N * C), dw(V * C, 0.0f), losses(N), scratch(R * V);
  for (auto& v : x) v = rng.normal();
  for (auto& v : w) v = 0.05f * rng.normal();
  std::vector<int32_t> tg(N);
  for (auto& t : tg) t = static_cast<int32_t>(rng.next_u64() % V);
  const float gs = 1.0f / static_cast<float>(N);
  // Same FLOPs as the head's three GEMMs: one sgemm of M=N, N=V, K=3C... as three chunk-shaped calls.
  std::vector<float> ref_out(R * V);
  auto sgemm_ref = [&] {
    for (int64_t n0 = 0; n0 < N; n0 += chunk) {
      const int64_t r = std::min(chunk, N - n0);
      for (int k = 0; k < 3; ++k)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, r, V, C, 1.0f, x.data() + n0 * C, C, w.data(), C, 0.0f,
                    ref_out.data(), V);
    }
  };
  const char* dt_env = std::getenv("LATHE_BENCH_DTYPE");
  const bool bf16 = dt_env && std::string(dt_env) == "bf16";
  std::vector<uint16_t> xh(N * C), wh(V * C), dxh(N * C), dlog(R * V);
  std::vector<float> scratch_h(cpu::bf16_ops().lm_head_loss_scratch_bytes(R, V) / sizeof(float) + 1);
  if (bf16) {
    for (size_t i = 0; i < x.size(); ++i) xh[i] = fp32_to_bf16(x[i]);
    for (size_t i = 0; i < w.size(); ++i) wh[i] = fp32_to_bf16(w[i]);
  }
  auto bf16_ref = [&] {
    for (int64_t n0 = 0; n0 < N; n0 += chunk) {
      const int64_t r = std::min(chunk, N - n0);
      for (int k = 0; k < 3; ++k)
        cpu::matmul_forward_bf16(scratch.data(), xh.data() + n0 * C, wh.data(), nullptr, r, C, V, false);
    }
  };
  auto old_kernel = [&] {
    if (bf16)
      rows_lm_head_loss_bf16(losses.data(), dxh.data(), dw.data(), xh.data(), wh.data(), tg.data(), N, C, V, gs,
                             scratch.data(), dlog.data(), chunk);
    else
      rows_lm_head_loss(losses.data(), dx.data(), dw.data(), x.data(), w.data(), tg.data(), N, C, V, gs, scratch.data(),
                        chunk);
  };
  auto new_kernel = [&](int64_t width) {
    cpu::head::bench_tile_width_override = width;
    if (bf16)
      cpu::bf16_ops().lm_head_loss(losses.data(), dxh.data(), dw.data(), xh.data(), wh.data(), tg.data(), N, C, V, gs,
                                   true, scratch_h.data(), chunk2, nullptr, 0.0f);
    else
      cpu::lm_head_loss_tiled(losses.data(), dx.data(), dw.data(), x.data(), w.data(), tg.data(), N, C, V, gs, true,
                              scratch.data(), chunk2, width);
  };
  const double gflop = 3.0 * 2.0 * N * C * V / 1e9;
  std::printf("N=%lld C=%lld V=%lld chunk=%lld (tiled: %lld) threads=%d: %.2f GFLOP per call\n", (long long)N,
              (long long)C, (long long)V, (long long)chunk, (long long)chunk2, omp_get_max_threads(), gflop);
  // LATHE_BENCH_CLOCK=cpu: process CPU time instead of wall time.
  const char* clock_env = std::getenv("LATHE_BENCH_CLOCK");
  const bool use_cpu = clock_env && std::string(clock_env) == "cpu";
  auto clk = [&] { return use_cpu ? cpu_seconds() : now_seconds(); };
  std::printf("clock: %s, dtype %s (reference GEMM: %s)\n", use_cpu ? "process CPU time" : "wall",
              bf16 ? "bf16" : "fp32", bf16 ? "oneDNN bf16" : "sgemm");
  std::vector<double> t_ref, t_rows;
  std::vector<std::vector<double>> t_tiled(widths.size());
  for (int round = 0; round <= rounds; ++round) {
    double t0 = clk();
    if (bf16)
      bf16_ref();
    else
      sgemm_ref();
    const double a = clk() - t0;
    t0 = clk();
    old_kernel();
    const double b = clk() - t0;
    std::printf("round %d: sgemm %.1f ms  rows %.1f ms", round, 1e3 * a, 1e3 * b);
    for (size_t i = 0; i < widths.size(); ++i) {
      t0 = clk();
      new_kernel(widths[i]);
      const double c = clk() - t0;
      std::printf("  tiled(%lld) %.1f ms", (long long)widths[i], 1e3 * c);
      if (round > 0) t_tiled[i].push_back(c);
    }
    std::printf("\n");
    if (round > 0) t_ref.push_back(a), t_rows.push_back(b);
  }
  // The best round approximates an idle machine (load only ever adds time); the median is typical.
  using Stat = double (*)(std::vector<double>);
  const std::pair<const char*, Stat> stats[] = {{"best", best}, {"median", median}};
  for (const auto& [name, stat] : stats) {
    const double ref = stat(t_ref), rows = stat(t_rows);
    std::printf("%s: sgemm %.1f ms (%.0f GFLOP/s)  rows %.1f ms (%.2fx sgemm)", name, 1e3 * ref, gflop / ref,
                1e3 * rows, rows / ref);
    for (size_t i = 0; i < widths.size(); ++i) {
      const double t = stat(t_tiled[i]);
      std::printf("  tiled(%lld) %.1f ms (%.2fx sgemm, %.2fx faster than rows)", (long long)widths[i], 1e3 * t, t / ref,
                  rows / t);
    }
    std::printf("\n");
  }
}
