// The pieces of the fused lm head + softmax + cross-entropy that every storage type's kernel
// (lm_head_loss.cpp, one template for fp32, bf16 and fp16) uses.
//
// One chunk of R rows is processed in column tiles of the vocabulary: tile b covers columns
// [b*Vb, b*Vb + vb) (vb = Vb except for the last) and its logits are stored contiguously as
// [R, vb] at float offset R * b*Vb of the chunk's scratch (so the tiles of a chunk fill exactly
// R x V floats). Why tiles: the logits of a whole chunk (256 x 50257 floats = 51 MB) do not fit
// any cache, so a per-row softmax after one big GEMM reads them back from memory; a tile (~512 KB)
// is still in the computing core's L2 when its softmax statistics are taken right after its GEMM,
// and again when its dlogits are formed right before its backward GEMMs.
//
// Per tile and row the shift is the tile's own max bm[r,b]: the tile keeps e = exp(logit - bm)
// and its sum bs[r,b]. Once every tile is done, combine() forms the row max M = max_b bm and the
// row sum S = sum_b bs * exp(bm - M) (double), and the per-(row, tile) factor
//   f[r,b] = grad_scale / S * exp(bm[r,b] - M)
// so that dlogits = e * f - grad_scale * onehot(target) equals (softmax - onehot) * grad_scale.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "kernels/backend.h"  // VocabParallel
#include "kernels/cpu/vec_math.h"

namespace lathe::cpu::head {

// Tile width for R rows: about `tile_floats` logits per tile (fp32 kernel: 128K floats = 512 KB,
// an L2-sized tile; the 16-bit kernels: 1M, since oneDNN's backward GEMMs run faster with a longer
// K = width than they lose to L3), within [64, 8192] columns, then evened out so that the number
// of tiles is a multiple of the thread count: the OpenMP static schedule gives each thread a run
// of whole tiles, and 99 tiles of 512 at V=50257 left one of two threads 4% more work.
inline int64_t tile_width(int64_t R, int64_t V, int threads, int64_t tile_floats) {
  const int64_t target = std::clamp<int64_t>(tile_floats / std::max<int64_t>(R, 1), 64, 8192);
  const int64_t t = std::max(threads, 1);
  const int64_t nb = ((V + target - 1) / target + t - 1) / t * t;
  return std::max<int64_t>((V + nb - 1) / nb, 1);
}
constexpr int64_t kTileFloatsF32 = int64_t{1} << 17, kTileFloatsHalf = int64_t{1} << 20;

// Benches only (bench_lm_head): when > 0, the tile width of the 16-bit tables' kernels instead of
// tile_width. Not for production code: the fp32 kernel takes its width as an argument instead.
inline int64_t bench_tile_width_override = 0;

struct Tiling {
  int64_t R, V, Vb, nb;
  Tiling(int64_t rows, int64_t vocab, int64_t width) : R(rows), V(vocab), Vb(width), nb((vocab + width - 1) / width) {}
  int64_t v0(int64_t b) const { return b * Vb; }
  int64_t vb(int64_t b) const { return std::min(Vb, V - b * Vb); }
  int64_t offset(int64_t b) const { return R * b * Vb; }  // floats (or 16-bit elements) into the chunk
};

// Small chunks (tests, tiny models) run on the calling thread: waking the OpenMP workers costs
// more than the GEMMs (a chunk of 1 x 4099 x 33 took 10 ms with two parallel regions on a loaded
// machine). Decided from the shape only, so results stay deterministic.
inline bool parallel_worth(const Tiling& tl, int64_t C) { return tl.nb > 1 && tl.R * tl.V * C >= (int64_t{1} << 22); }

// Per-chunk statistics, indexed [r * nb + b]; tlogit[r] is the target's logit.
struct Stats {
  std::vector<float> bmax, factor, tlogit;
  std::vector<double> bsum;
  void resize(int64_t R, int64_t nb) {
    const size_t n = static_cast<size_t>(R * nb);
    if (bmax.size() < n) bmax.resize(n), bsum.resize(n), factor.resize(n);
    if (tlogit.size() < static_cast<size_t>(R)) tlogit.resize(static_cast<size_t>(R));
  }
};

// Softmax statistics of tile b ([R, vb] logits at `tile`) for rows with targets[r] >= 0:
// bmax/bsum of the row within the tile, the target logit when the target falls in the tile, and
// with store_exp the tile row replaced by exp(logit - bmax). Ignored rows (target < 0) are zeroed
// when store_exp (their dlogits), else left alone. Call for every tile before combine().
inline void tile_stats(float* tile, const Tiling& tl, int64_t b, const int32_t* targets, bool store_exp, Stats& st) {
  const int64_t v0 = tl.v0(b), vb = tl.vb(b);
  for (int64_t r = 0; r < tl.R; ++r) {
    float* s = tile + r * vb;
    const int32_t t = targets[r];
    if (t < 0) {
      if (store_exp) std::fill(s, s + vb, 0.0f);
      continue;
    }
    if (t >= v0 && t < v0 + vb) st.tlogit[r] = s[t - v0];
    const float m = vec::row_max(s, vb);
    st.bmax[r * tl.nb + b] = m;
    st.bsum[r * tl.nb + b] = store_exp ? vec::exp_shift_sum(s, vb, m) : vec::exp_shift_sum_nostore(s, vb, m);
  }
}

// Row losses (0 for ignored rows) and, for backward, the per-(row, tile) dlogits factors.
inline void combine(const Tiling& tl, const int32_t* targets, float grad_scale, bool backward, Stats& st,
                    float* losses) {
  for (int64_t r = 0; r < tl.R; ++r) {
    const float* bm = st.bmax.data() + r * tl.nb;
    const double* bs = st.bsum.data() + r * tl.nb;
    float* f = st.factor.data() + r * tl.nb;
    if (targets[r] < 0) {
      losses[r] = 0.0f;
      if (backward) std::fill(f, f + tl.nb, 0.0f);
      continue;
    }
    float m = bm[0];
    for (int64_t b = 1; b < tl.nb; ++b) m = std::max(m, bm[b]);
    double sum = 0.0;
    for (int64_t b = 0; b < tl.nb; ++b) sum += bs[b] * std::exp(static_cast<double>(bm[b]) - m);
    losses[r] = static_cast<float>(static_cast<double>(m) + std::log(sum) - static_cast<double>(st.tlogit[r]));
    if (backward) {
      const double a = static_cast<double>(grad_scale) / sum;
      for (int64_t b = 0; b < tl.nb; ++b) f[b] = static_cast<float>(a * std::exp(static_cast<double>(bm[b]) - m));
    }
  }
}

// dlogits of tile b in place (fp32): row r <- e * f[r,b], minus grad_scale at the target.
inline void tile_dlogits(float* tile, const Tiling& tl, int64_t b, const int32_t* targets, float grad_scale,
                         const Stats& st) {
  const int64_t v0 = tl.v0(b), vb = tl.vb(b);
  for (int64_t r = 0; r < tl.R; ++r) {
    const int32_t t = targets[r];
    if (t < 0) continue;  // zeroed by tile_stats
    float* s = tile + r * vb;
    vec::scale(s, vb, st.factor[r * tl.nb + b]);
    if (t >= v0 && t < v0 + vb) s[t - v0] -= grad_scale;
  }
}

// Final-logit soft-capping (Gemma 2): l <- cap * tanh(l / cap) over n logits, in place.
inline void softcap_logits(float* s, int64_t n, float cap) {
  for (int64_t j = 0; j < n; ++j) s[j] = cap * std::tanh(s[j] / cap);
}

// tile_dlogits for soft-capped logits: the tile holds the capped logits c (tile_stats ran with
// store_exp = false; ignored rows are zeroed here). d c = exp(c - bmax) * f - grad_scale at the target,
// then d l = d c * (1 - (c / cap)^2) (tanh' through the cap).
inline void tile_dlogits_capped(float* tile, const Tiling& tl, int64_t b, const int32_t* targets, float grad_scale,
                                const Stats& st, float cap) {
  const int64_t v0 = tl.v0(b), vb = tl.vb(b);
  for (int64_t r = 0; r < tl.R; ++r) {
    float* s = tile + r * vb;
    const int32_t t = targets[r];
    if (t < 0) {
      std::fill(s, s + vb, 0.0f);
      continue;
    }
    const float m = st.bmax[r * tl.nb + b], f = st.factor[r * tl.nb + b];
    for (int64_t j = 0; j < vb; ++j) {
      const float th = s[j] / cap;
      float d = std::exp(s[j] - m) * f;
      if (j + v0 == t) d -= grad_scale;
      s[j] = d * (1.0f - th * th);
    }
  }
}

}  // namespace lathe::cpu::head

namespace lathe::cpu {
// Argument checks shared by every dtype's lm_head_loss (shape, chunk, backward buffers, targets).
void check_lm_head_args(const int32_t* targets, int64_t N, int64_t C, int64_t V, bool backward, const void* dx,
                        const void* dw, int64_t chunk_rows);
// lm_head_loss (ops.h) with an explicit tile width (columns per tile; tests use narrow tiles
// to exercise many tiles at small V). lm_head_loss uses head::tile_width(..., kTileFloatsF32).
double lm_head_loss_tiled(float* losses, float* dx, float* dw, const float* x, const float* w, const int32_t* targets,
                          int64_t N, int64_t C, int64_t V, float grad_scale, bool backward, float* scratch,
                          int64_t chunk_rows, int64_t tile_width, float softcap = 0.0f);
// The vocab-parallel lm_head_loss of storage type S (lm_head_loss_vocab_parallel.cpp; the contract
// is kernels/backend.h's Ops::lm_head_loss). Same scratch as S's lm_head_loss.
template <class S>
double lm_head_loss_vp(float* losses, void* dx, float* dw, const void* x, const void* w, const int32_t* targets,
                       int64_t N, int64_t C, int64_t V, float grad_scale, bool backward, void* scratch,
                       int64_t chunk_rows, const VocabParallel& vp, float softcap = 0.0f);
}  // namespace lathe::cpu
