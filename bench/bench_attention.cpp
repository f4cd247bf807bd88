// Benchmarks for attention forward+backward and the fused lm head / cross-entropy.
//   attention: B=4, H=12, D=64, T=64 and T=256 (GPT-2 124M heads), MHA.
//   document attention (issue 11): B=1, H=12, D=64, T=1024 with documents of mean length 128
//   (lengths uniform in [1, 255], seeded) against full causal attention on the same inputs, and the
//   [Br x 16] score tiles each computed. `bench_attention docs` runs only this part.
//   lm_head_loss: N=256, C=768, V=50257 with chunk_rows 64/128/256, against the plain sgemm time of
//   the same three GEMMs (logits, dx, dw) done once over all N rows.
// GFLOP/s counts causal attention as half of the dense products (what is actually needed):
//   forward 2 GEMMs, backward 4 GEMMs (+1 recomputed QK^T), each 2*T*T*D/2 per (b,h).
#include <cblas.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "core/buffer.h"
#include "core/parallel.h"
#include "core/timer.h"
#include "kernels/cpu/ops.h"

using namespace lathe;

namespace {

void fill(float* p, size_t n, uint32_t seed, float sd) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> d(0.0f, sd);
  for (size_t i = 0; i < n; ++i) p[i] = d(gen);
}

// Runs f once to warm up, then up to max_iter times (at least twice, stopping after min_s seconds);
// returns the fastest run in ms. The minimum is the figure least disturbed by other processes on a
// shared 2-core machine.
template <typename F>
double time_ms(F&& f, double min_s, int max_iter) {
  f();
  double best = 1e300;
  const double t0 = now_seconds();
  for (int it = 0; it < max_iter && (it < 2 || now_seconds() - t0 < min_s); ++it) {
    const double a = now_seconds();
    f();
    best = std::min(best, now_seconds() - a);
  }
  return best * 1e3;
}

void bench_attention(int64_t B, int64_t T, int64_t H, int64_t D) {
  const int64_t KVH = H, ld = (H + 2 * KVH) * D;
  Buffer<float> qkv(B * T * ld), out(B * T * H * D), lse(B * H * T), dout(B * T * H * D), dqkv(B * T * ld),
      scratch(cpu::attention_scratch_floats(T, D));
  fill(qkv.data(), qkv.size(), 1, 1.0f);
  fill(dout.data(), dout.size(), 2, 1.0f);
  const double fwd = time_ms(
      [&] { cpu::attention_forward(out.data(), lse.data(), qkv.data(), B, T, H, KVH, D, scratch.data()); }, 1.0, 50);
  const double bwd = time_ms(
      [&] {
        cpu::attention_backward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), B, T, H, KVH, D,
                                scratch.data());
      },
      1.0, 50);
  const double pair = 2.0 * T * T * D / 2.0 * B * H;  // one causal T x T x D product
  std::printf(
      "attention B=%ld T=%ld H=%ld D=%ld: fwd %.3f ms (%.1f GFLOP/s)  bwd %.3f ms (%.1f GFLOP/s)  "
      "fwd+bwd %.3f ms\n",
      (long)B, (long)T, (long)H, (long)D, fwd, 2 * pair / fwd * 1e-6, bwd, 5 * pair / bwd * 1e-6, fwd + bwd);
}

// Document-causal attention (doc_start) against plain causal attention, fwd+bwd, same inputs.
void bench_documents(int64_t B, int64_t T, int64_t H, int64_t D, int64_t mean_len) {
  const int64_t KVH = H, ld = (H + 2 * KVH) * D;
  Buffer<float> qkv(B * T * ld), out(B * T * H * D), lse(B * H * T), dout(B * T * H * D), dqkv(B * T * ld),
      scratch(cpu::attention_scratch_floats(T, D));
  fill(qkv.data(), qkv.size(), 1, 1.0f);
  fill(dout.data(), dout.size(), 2, 1.0f);
  std::mt19937 gen(3);
  std::vector<int32_t> ds(B * T);
  int64_t docs = 0;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++docs) {
      const int64_t len = 1 + static_cast<int64_t>(gen() % (2 * mean_len - 1));  // uniform [1, 2*mean-1]
      for (int64_t i = t; i < std::min(T, t + len); ++i) ds[b * T + i] = static_cast<int32_t>(t);
      t += len;
    }
  auto fb = [&](const int32_t* d) {
    cpu::attention_forward(out.data(), lse.data(), qkv.data(), B, T, H, KVH, D, scratch.data(), d);
    cpu::attention_backward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), B, T, H, KVH, D,
                            scratch.data(), d);
  };
  auto tiles = [&](const int32_t* d) {
    const cpu::AttentionTiles a = cpu::attention_tiles();
    fb(d);
    return cpu::attention_tiles().forward - a.forward;
  };
  // Alternated runs, fastest of each: other processes on a shared machine disturb both alike.
  double causal = 1e300, doc = 1e300;
  fb(nullptr);
  fb(ds.data());
  for (int it = 0; it < 15; ++it) {
    causal = std::min(causal, time_ms([&] { fb(nullptr); }, 0.0, 1));
    doc = std::min(doc, time_ms([&] { fb(ds.data()); }, 0.0, 3));
  }
  std::printf(
      "attention documents B=%ld T=%ld H=%ld D=%ld, %ld documents (mean length %.1f): fwd+bwd causal %.3f ms "
      "(%ld tiles), document %.3f ms (%ld tiles): %.2fx less time\n",
      (long)B, (long)T, (long)H, (long)D, (long)docs, static_cast<double>(B * T) / docs, causal, (long)tiles(nullptr),
      doc, (long)tiles(ds.data()), causal / doc);
}

void bench_loss(int64_t N, int64_t C, int64_t V) {
  Buffer<float> x(N * C), w(V * C), dx(N * C), dw(V * C), losses(N), scratch(N * V);
  std::vector<int32_t> tg(N);
  fill(x.data(), x.size(), 3, 1.0f);
  fill(w.data(), w.size(), 4, 0.02f);
  for (int64_t n = 0; n < N; ++n) tg[n] = static_cast<int32_t>((n * 7919) % V);
  const double flop = 3 * 2.0 * N * C * V;

  const double gemm = time_ms(
      [&] {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, V, C, 1.0f, x.data(), C, w.data(), C, 0.0f,
                    scratch.data(), V);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, N, C, V, 1.0f, scratch.data(), V, w.data(), C, 0.0f,
                    dx.data(), C);
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, V, C, N, 1.0f, scratch.data(), V, x.data(), C, 1.0f,
                    dw.data(), C);
      },
      2.0, 4);
  std::printf("lm_head N=%ld C=%ld V=%ld: plain 3 sgemms %.1f ms (%.1f GFLOP/s)\n", (long)N, (long)C, (long)V, gemm,
              flop / gemm * 1e-6);
  for (int64_t chunk : {64, 128, 256}) {
    const double fwd = time_ms(
        [&] {
          cpu::lm_head_loss(losses.data(), nullptr, nullptr, x.data(), w.data(), tg.data(), N, C, V, 1.0f / N, false,
                            scratch.data(), chunk);
        },
        1.0, 3);
    const double fb = time_ms(
        [&] {
          cpu::lm_head_loss(losses.data(), dx.data(), dw.data(), x.data(), w.data(), tg.data(), N, C, V, 1.0f / N, true,
                            scratch.data(), chunk);
        },
        2.0, 4);
    std::printf("  chunk_rows=%ld: fwd %.1f ms (%.1f GFLOP/s)  fwd+bwd %.1f ms (%.1f GFLOP/s, %.0f%% of plain sgemm)\n",
                (long)chunk, fwd, flop / 3 / fwd * 1e-6, fb, flop / fb * 1e-6, 100.0 * gemm / fb);
  }
}

}  // namespace

int main(int argc, char** argv) {
  const bool docs_only = argc > 1 && std::strcmp(argv[1], "docs") == 0;
  // Debian's DYNAMIC_ARCH OpenBLAS 0.3.21 does not know newer Intel models (e.g. family 6 model 207)
  // and falls back to the SSE3 "Prescott" kernels, about 8x slower: set OPENBLAS_CORETYPE=SkylakeX.
  std::printf("threads: %d, OpenBLAS core: %s (times are the fastest of several runs)\n", max_threads(),
              openblas_get_corename());
  if (std::strcmp(openblas_get_corename(), "Prescott") == 0)
    std::printf(
        "WARNING: OpenBLAS fell back to its SSE3 kernels; rerun with OPENBLAS_CORETYPE=SkylakeX (or Haswell)\n");
  bench_documents(1, 1024, 12, 64, 128);
  if (docs_only) return 0;
  bench_attention(4, 64, 12, 64);
  bench_attention(4, 256, 12, 64);
  bench_loss(256, 768, 50257);
  return 0;
}
