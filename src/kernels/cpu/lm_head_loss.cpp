// Fused lm head + softmax + cross-entropy, chunked over rows (contract in ops.h), one template for
// every storage type (kernels/cpu/storage.h): the logits, max / exp / sum and the loss are fp32
// (sums in double) whatever the storage; a 16-bit table rounds each tile's dlogits once to 16 bits
// for its GEMMs (gemm.h) and rounds dx once from its fp32 sum.
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
//      one), and dx_part += dlogits @ w[v0:v0+vb] into the thread's partial [R,C] (thread 0's:
//      dx itself for F32, an fp32 row block otherwise); the partials are then added in thread
//      order. Deterministic for a fixed thread count.
// Scratch: fp32 logits [R, V], then for 16-bit storage the 16-bit dlogits [R, V] (both in tile
// layout).
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
#include "core/parallel.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/lm_head_tiles.h"
#include "kernels/cpu/op_slots.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/storage.h"

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

namespace {

// The dlogits tile as the GEMMs of S read it: the fp32 tile itself, or rounded once into dl16.
template <class S>
const typename S::T* tile_storage(const float* tile, typename S::T* dl16, int64_t n) {
  if constexpr (S::kFp32) {
    return tile;
  } else {
    S::from_f32(dl16, tile, n);
    return dl16;
  }
}

template <class S>
double loss_tiled(float* losses, void* dx_v, float* dw, const void* x_v, const void* w_v, const int32_t* targets,
                  int64_t N, int64_t C, int64_t V, float grad_scale, bool backward, void* scratch_v, int64_t chunk_rows,
                  int64_t tile_width, float softcap) {
  using St = typename S::T;
  check_lm_head_args(targets, N, C, V, backward, dx_v, dw, chunk_rows);
  LATHE_CHECK(tile_width >= 1, "lm_head_loss: tile width must be >= 1, got {}", tile_width);
  LATHE_CHECK(std::isfinite(softcap) && softcap >= 0.0f,
              "lm_head_loss: softcap = {} must be finite and >= 0 (0 = no final logit soft-capping)", softcap);
  const bool capped = softcap > 0.0f;
  const auto *x = as<S>(x_v), *w = as<S>(w_v);
  auto* dx = as<S>(dx_v);
  const int64_t R_max = std::min(chunk_rows, std::max<int64_t>(N, 1));
  float* logits = static_cast<float*>(scratch_v);
  St* dlog = S::kFp32 ? nullptr
                      : reinterpret_cast<St*>(static_cast<char*>(scratch_v) +
                                              static_cast<size_t>(R_max) * static_cast<size_t>(V) * sizeof(float));
  // The calling thread's buffers, grown once; bound to references here because inside the
  // parallel regions a thread_local name would resolve to each worker's own instance.
  static thread_local head::Stats tls_stats;
  // [threads-1][R*C] dx partials of threads 1.., then (16-bit storage) thread 0's fp32 dx [R*C].
  static thread_local std::vector<float> tls_partials;
  head::Stats& st = tls_stats;
  std::vector<float>& partials = tls_partials;
  // dx partial sums: part p owns a fixed run of the tiles, whichever thread runs it (core/parallel.h).
  const int64_t parts = reduction_parts();
  const int64_t nparts = S::kFp32 ? parts - 1 : parts;

  double total = 0.0;
  for (int64_t n0 = 0; n0 < N; n0 += chunk_rows) {
    const int64_t R = std::min(chunk_rows, N - n0);
    const head::Tiling tl(R, V, std::min(tile_width, V));
    const St* xc = x + n0 * C;
    const int32_t* tg = targets + n0;
    st.resize(R, tl.nb);
    const int64_t RC = R * C;
    const bool par = head::parallel_worth(tl, C);
    if (backward && partials.size() < static_cast<size_t>(nparts * RC))
      partials.resize(static_cast<size_t>(nparts * RC));

#pragma omp parallel for schedule(static) if (par)
    for (int64_t b = 0; b < tl.nb; ++b) {
      float* tile = logits + tl.offset(b);
      Gemm<S>::logits(tile, xc, w + tl.v0(b) * C, R, C, tl.vb(b));
      if (capped) head::softcap_logits(tile, R * tl.vb(b), softcap);
      head::tile_stats(tile, tl, b, tg, backward && !capped, st);  // capped: the tile keeps the logits
    }
    head::combine(tl, tg, grad_scale, backward, st, losses + n0);
    double chunk_total = 0.0;
    for (int64_t r = 0; r < R; ++r) chunk_total += losses[n0 + r];
    total += chunk_total;
    if (!backward) continue;

    St* dxc = dx + n0 * C;
    float* dx0 = out_row<S>(partials.data() + (parts - 1) * RC, dxc);  // part 0's partial
#pragma omp parallel if (par)
    {
#pragma omp for schedule(static)
      for (int64_t p = 0; p < parts; ++p) {
        float* acc = p == 0 ? dx0 : partials.data() + (p - 1) * RC;
        std::fill(acc, acc + RC, 0.0f);
        for (int64_t b = tl.nb * p / parts; b < tl.nb * (p + 1) / parts; ++b) {
          float* tile = logits + tl.offset(b);
          const int64_t vb = tl.vb(b);
          if (capped)
            head::tile_dlogits_capped(tile, tl, b, tg, grad_scale, st, softcap);
          else
            head::tile_dlogits(tile, tl, b, tg, grad_scale, st);
          const St* dl = tile_storage<S>(tile, dlog + tl.offset(b), R * vb);
          Gemm<S>::bwd_f32(acc, dw + tl.v0(b) * C, nullptr, dl, xc, w + tl.v0(b) * C, R, C, vb, true);
        }
      }  // implicit barrier: every partial is complete
      // dx = the partials summed in part order (16-bit: rounded once).
      if (parts > 1 || !S::kFp32) {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < RC; i += 1024) {
          const int64_t n = std::min<int64_t>(1024, RC - i);
          float* sum = dx0 + i;
          for (int64_t p = 0; p + 1 < parts; ++p) {
            const float* src = partials.data() + p * RC + i;
            for (int64_t j = 0; j < n; ++j) sum[j] += src[j];
          }
          write_row<S>(dxc + i, sum, n);
        }
      }
    }
  }
  return total;
}

// The table slot: the tile width of the storage type, or the vocab-parallel twin.
template <class S>
double loss_t(float* losses, void* dx, float* dw, const void* x, const void* w, const int32_t* targets, int64_t N,
              int64_t C, int64_t V, float grad_scale, bool backward, void* scratch, int64_t chunk_rows,
              const VocabParallel* vp, float softcap) {
  if (vp != nullptr)
    return lm_head_loss_vp<S>(losses, dx, dw, x, w, targets, N, C, V, grad_scale, backward, scratch, chunk_rows, *vp,
                              softcap);
  const int64_t R = std::min(chunk_rows, std::max<int64_t>(N, 1));
  int64_t width =
      head::tile_width(R, V, reduction_parts(), S::kFp32 ? head::kTileFloatsF32 : head::kTileFloatsHalf);
  if (!S::kFp32 && head::bench_tile_width_override > 0) width = head::bench_tile_width_override;
  return loss_tiled<S>(losses, dx, dw, x, w, targets, N, C, V, grad_scale, backward, scratch, chunk_rows, width,
                       softcap);
}

// fp32 logits [R, V] (tile layout), then for 16-bit storage the 16-bit dlogits [R, V], 64-byte aligned.
template <class S>
size_t scratch_bytes(int64_t chunk_rows, int64_t V) {
  const size_t n = static_cast<size_t>(chunk_rows) * static_cast<size_t>(V);
  return n * sizeof(float) + (S::kFp32 ? 0 : (n * sizeof(typename S::T) + 63) / 64 * 64);
}

}  // namespace

double lm_head_loss_tiled(float* losses, float* dx, float* dw, const float* x, const float* w, const int32_t* targets,
                          int64_t N, int64_t C, int64_t V, float grad_scale, bool backward, float* scratch,
                          int64_t chunk_rows, int64_t tile_width, float softcap) {
  return loss_tiled<F32>(losses, dx, dw, x, w, targets, N, C, V, grad_scale, backward, scratch, chunk_rows, tile_width,
                         softcap);
}

double lm_head_loss(float* losses, float* dx, float* dw, const float* x, const float* w, const int32_t* targets,
                    int64_t N, int64_t C, int64_t V, float grad_scale, bool backward, float* scratch,
                    int64_t chunk_rows, float softcap) {
  return loss_t<F32>(losses, dx, dw, x, w, targets, N, C, V, grad_scale, backward, scratch, chunk_rows, nullptr,
                     softcap);
}

template <class S>
void add_lm_head_loss(Ops& o) {
  o.lm_head_loss = loss_t<S>;
  o.lm_head_loss_scratch_bytes = scratch_bytes<S>;
}
LATHE_CPU_ADD_SLOTS(add_lm_head_loss)

}  // namespace lathe::cpu
