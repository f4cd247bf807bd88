// Fused lm head + softmax + cross-entropy, chunked over rows (contract in ops.h), fp32.
//
// Per chunk of R = chunk_rows rows (x[N,C], w[V,C], scratch[R,V] holding the chunk's column
// tiles, lm_head_tiles.h), parallel over the tiles (OpenMP, static: each thread owns a fixed run
// of tiles, and OpenBLAS runs single-threaded inside the parallel region):
//   1. per tile b (columns [v0, v0+vb)):  logits[R,vb] = x_chunk @ w[v0:v0+vb]^T (one sgemm), then
//      while the tile is in the core's L2: per row its max, e = exp(logit - max) in place, sum,
//      and the target's logit (head::tile_stats).
//   2. per row: max and sum over the tiles, loss = max + log(sum) - logit[target], and the
//      per-(row, tile) dlogits factor (head::combine).
//   3. backward, per tile, again while it is hot: dlogits = e * factor - grad_scale at the target,
//      dw[v0:v0+vb] += dlogits^T @ x_chunk (the tile's own rows of dw: no two threads share
//      one), and dx_part += dlogits @ w[v0:v0+vb] into the thread's partial [R,C]; the partials
//      are then added in thread order into dx (overwrite). Deterministic for a fixed thread count.
// Before (one sgemm over the whole chunk, then per-row passes) the 51 MB of logits of a 256-row
// chunk at V=50257 went to memory and back three times; now each tile is read from memory once
// between step 1 and step 3 and every other pass hits L2.
#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "core/error.h"
#include "kernels/cpu/lm_head_tiles.h"
#include "kernels/cpu/ops.h"

namespace lathe::cpu {

void check_lm_head_args(const int32_t* targets, int64_t N, int64_t C, int64_t V, bool backward, const void* dx,
                        const void* dw, int64_t chunk_rows) {
  LATHE_CHECK(N >= 0 && C >= 1 && V >= 1, "lm_head_loss: invalid shape N={} C={} V={}", N, C, V);
  LATHE_CHECK(chunk_rows >= 1, "lm_head_loss: chunk_rows must be >= 1, got {}", chunk_rows);
  LATHE_CHECK(!backward || (dx != nullptr && dw != nullptr), "lm_head_loss: backward needs dx and dw buffers");
  for (int64_t n = 0; n < N; ++n) {
    LATHE_CHECK(targets[n] < V,
                "lm_head_loss: target {} at row {} is out of range for vocab size {}; "
                "check that the tokenizer's vocabulary matches model.vocab_size",
                targets[n], n, V);
  }
}

double lm_head_loss_tiled(float* losses, float* dx, float* dw, const float* x, const float* w, const int32_t* targets,
                          int64_t N, int64_t C, int64_t V, float grad_scale, bool backward, float* scratch,
                          int64_t chunk_rows, int64_t tile_width) {
  check_lm_head_args(targets, N, C, V, backward, dx, dw, chunk_rows);
  LATHE_CHECK(tile_width >= 1, "lm_head_loss: tile width must be >= 1, got {}", tile_width);
  // The calling thread's buffers, grown once; bound to references here because inside the
  // parallel regions a thread_local name would resolve to each worker's own instance.
  static thread_local head::Stats tls_stats;
  static thread_local std::vector<float> tls_partials;  // [threads-1][R*C] dx partials of threads 1..
  head::Stats& st = tls_stats;
  std::vector<float>& partials = tls_partials;
  const int nthreads = omp_get_max_threads();

  double total = 0.0;
  for (int64_t n0 = 0; n0 < N; n0 += chunk_rows) {
    const int64_t R = std::min(chunk_rows, N - n0);
    const head::Tiling tl(R, V, std::min(tile_width, V));
    const float* xc = x + n0 * C;
    const int32_t* tg = targets + n0;
    st.resize(R, tl.nb);
    const int64_t RC = R * C;
    const bool par = head::parallel_worth(tl, C);
    if (backward && partials.size() < static_cast<size_t>((nthreads - 1) * RC))
      partials.resize(static_cast<size_t>((nthreads - 1) * RC));

#pragma omp parallel for schedule(static) if (par)
    for (int64_t b = 0; b < tl.nb; ++b) {
      float* tile = scratch + tl.offset(b);
      const int64_t vb = tl.vb(b);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, R, vb, C, 1.0f, xc, C, w + tl.v0(b) * C, C, 0.0f, tile, vb);
      head::tile_stats(tile, tl, b, tg, backward, st);
    }
    head::combine(tl, tg, grad_scale, backward, st, losses + n0);
    double chunk_total = 0.0;
    for (int64_t r = 0; r < R; ++r) chunk_total += losses[n0 + r];
    total += chunk_total;
    if (!backward) continue;

    float* dxc = dx + n0 * C;
#pragma omp parallel if (par)
    {
      const int t = omp_get_thread_num(), nt = omp_get_num_threads();
      float* acc = t == 0 ? dxc : partials.data() + (t - 1) * RC;
      std::fill(acc, acc + RC, 0.0f);
#pragma omp for schedule(static)
      for (int64_t b = 0; b < tl.nb; ++b) {
        float* tile = scratch + tl.offset(b);
        const int64_t vb = tl.vb(b);
        const float* wb = w + tl.v0(b) * C;
        head::tile_dlogits(tile, tl, b, tg, grad_scale, st);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, R, C, vb, 1.0f, tile, vb, wb, C, 1.0f, acc, C);
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, vb, C, R, 1.0f, tile, vb, xc, C, 1.0f, dw + tl.v0(b) * C,
                    C);
      }  // implicit barrier: every partial is complete
      if (nt > 1) {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < RC; i += 256) {
          const int64_t end = std::min(RC, i + 256);
          for (int p = 0; p + 1 < nt; ++p) {
            const float* src = partials.data() + p * RC;
            for (int64_t j = i; j < end; ++j) dxc[j] += src[j];
          }
        }
      }
    }
  }
  return total;
}

double lm_head_loss(float* losses, float* dx, float* dw, const float* x, const float* w, const int32_t* targets,
                    int64_t N, int64_t C, int64_t V, float grad_scale, bool backward, float* scratch,
                    int64_t chunk_rows) {
  const int64_t R = std::min(chunk_rows, std::max<int64_t>(N, 1));
  return lm_head_loss_tiled(losses, dx, dw, x, w, targets, N, C, V, grad_scale, backward, scratch, chunk_rows,
                            head::tile_width(R, V, omp_get_max_threads(), head::kTileFloatsF32));
}

}  // namespace lathe::cpu
