// Causal grouped-query self-attention, forward and backward, flash-style over query blocks.
//
// Layout (see ops.h): qkv[B, T, (H + 2*KVH) * D]; per row, H query heads, then KVH key heads, then
// KVH value heads. Query head h reads kv head h / (H / KVH).
//
// Work is split into query blocks of `Br` rows. For a block [i0, i1) only keys [0, i1) can be
// attended to (causal), so the block's score tile is [Br, i1] and the upper-right triangle beyond
// i1 is never computed. The tile products use a small register-blocked kernel (tile_gemm below)
// rather than cblas_sgemm: OpenBLAS packs both operands on every call, which dominates at these
// sizes, and its dynamic CPU detection can fall back to slow SSE3 kernels on unknown CPUs.
// Measured on 1 core (B=4, H=12, D=64): T=256 fwd 7.5 ms / bwd 17.6 ms vs 12.2 / 21.5 with sgemm.
//
// Forward saves lse[B, H, T] = logsumexp of each scaled score row. Backward recomputes the
// probabilities P = exp(S - lse) and uses D_i = sum_d dout[i,d] * out[i,d] (= sum_j P_ij dP_ij):
//   dV += P^T dO,  dP = dO V^T,  dS = P * (dP - D_i) * scale,  dQ = dS K,  dK += dS^T Q.
//
// Documents (doc_start, issue 11): query t attends to keys [doc_start[t], t]. Query blocks are 32
// rows and a block's keys start at its first row's document (rounded down to 16 keys), so tiles
// left of it are never computed; inside the block, tile_gemm also skips rows and sums outside each
// row's document (see `lo` below), and the softmax runs over the row's document only. Measured
// (bench_attention docs, 1 core, T=1024, H=12, D=64, documents of mean length 114): fwd+bwd
// 3.2-3.6x less time than causal attention over the whole sample.
//
// Sliding window (window > 0, issue 25): query t also sees only keys j > t - window, so its first
// key is max(doc_start[t], t - window + 1) (transformers 4.45.2 MistralModel._update_causal_mask
// excludes keys `arange(target_length) <= cache_position - sliding_window`, i.e. j <= t - window).
// That bound never decreases with t either, so it takes the documents' place everywhere above: a
// block's keys start at its first row's bound (rounded down to 16), so at T = 8192 and window 1024
// a query block computes about window + 32 keys instead of up to T. window >= T is no window.
//
// Score scale and soft-capping (Gemma 2, issue 25): scale (> 0; 0 = 1/sqrt(D)) replaces 1/sqrt(D),
// and softcap > 0 caps every visible score s = scale * q.k to softcap * tanh(s / softcap) before the
// softmax (transformers 4.45.2 Gemma2Attention: attn_weights / cap, tanh, * cap, then the mask).
// Backward: with t = tanh(s / softcap), d s = dS_capped * (1 - t^2); the tile of P holds the raw
// scores until dP is known, so the capped path needs no scratch beyond the uncapped one. softcap 0
// runs exactly the code of before (bit-identical).
//
// Scratch per thread: two [Br, T] tiles (Br = clamp(T/2, 1, 64), so together at most one T x T
// score tile for T >= 2), Br floats, and three [T, D] copies of one head (see tile_floats).
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>
#include <utility>

#include "core/error.h"
#include "kernels/cpu/attention_tiles.h"
#include "kernels/cpu/op_slots.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/storage.h"
#include "kernels/cpu/vec_math.h"

namespace lathe::cpu {
namespace {

// ---- small GEMM for the attention tiles ------------------------------------------------------
// The register-blocked micro tiles (tiles::micro, attention_tiles.h) under the causal / document
// structure of one query block's tile products.
using tiles::kColsBig;
using tiles::micro_rows;
using tiles::pack_head;
using tiles::transpose_head;

// Which causal structure of a tile product may be exploited (off = first query row i0 of the block,
// so tile row r is query i0 + r and tile column j is key j; key j is visible to query i iff j <= i):
enum class Causal {
  kNone,
  kN,   // C[i, j] is only needed for j <= off + i; other entries are left unwritten (garbage).
  kK,   // A(i, k) == 0 for k > off + i (A = P or dS, k = key): sum stops there.
  kKT,  // A(i, k) == 0 for k < i - off (A = P^T or dS^T, i = key, k = query row): sum starts there.
};
// With documents, `lo` (nondecreasing, one entry per query row of the tile: the first tile column of
// that query's document; nullptr = 0 for every row) adds the other side of each mask:
//   kN:  C[i, j] is also not needed for j < lo[i]: rows whose document starts right of a column
//        block are skipped for that block.
//   kK:  A(i, k) == 0 for k < lo[i] too: the sum of rows [i, i + mr) starts at lo[i].
//   kKT: A(i, k) == 0 where lo[k] > i too (key i precedes query k's document): the sum stops at
//        the first query row whose document starts after the row block's last key.

void tile_gemm(int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t a_rs, int64_t a_cs, const float* B,
               int64_t ldb, bool accumulate, float* C, int64_t ldc, Causal causal = Causal::kNone, int64_t off = 0,
               const int32_t* lo = nullptr) {
  constexpr int64_t MR = 6;
  // k range of rows [i, i + mr) under the causal mode.
  auto k_range = [&](int64_t i, int64_t mr) -> std::pair<int64_t, int64_t> {
    if (causal == Causal::kK) return {lo ? std::min<int64_t>(lo[i], K) : 0, std::min(K, off + i + mr)};
    if (causal == Causal::kKT) {
      const int64_t k0 = std::clamp<int64_t>(i - off, 0, K);
      int64_t k1 = K;
      if (lo) k1 = std::upper_bound(lo, lo + K, static_cast<int32_t>(i + mr - 1)) - lo;
      return {k0, std::max(k0, k1)};
    }
    return {0, K};
  };
  auto block = [&]<int NV>(int64_t j) {
    const int64_t i_start = causal == Causal::kN ? std::max<int64_t>(0, j - off) : 0;
    // kN with documents: rows from the first whose document starts at or after the block's end
    // need nothing of this block.
    const int64_t i_end =
        causal == Causal::kN && lo ? std::lower_bound(lo, lo + M, static_cast<int32_t>(j + vec::kW * NV)) - lo : M;
    for (int64_t i = i_start; i < i_end; i += MR) {
      const int64_t mr = std::min(MR, i_end - i);
      const auto [k0, k1] = k_range(i, mr);
      micro_rows<NV>(mr, k1 - k0, alpha, A + i * a_rs + k0 * a_cs, a_rs, a_cs, B + k0 * ldb + j, ldb, accumulate,
                     C + i * ldc + j, ldc);
    }
  };
  int64_t j = 0;
  for (; j + kColsBig <= N; j += kColsBig) block.template operator()<kColsBig / vec::kW>(j);
  for (; j + 16 <= N; j += 16) block.template operator()<16 / vec::kW>(j);
  if (j == N) return;
  tiles::tail_cols(M, j, N, K, alpha, A, a_rs, a_cs, B, ldb, accumulate, C, ldc);
}

inline int64_t block_rows(int64_t T) { return std::clamp<int64_t>(T / 2, 1, 64); }
// Per thread: P and dS tiles [Br, T], D_i [Br], and three [T, D]-sized copies of one head (K^T and
// V^T [D, T] for the products that need rows along T; V or K [T, D] packed contiguously, because
// rows 9 KB apart in qkv defeat the hardware prefetcher inside the tile products).
inline int64_t tile_floats(int64_t T, int64_t D) { return 2 * block_rows(T) * T + block_rows(T) + 3 * D * T; }

// ---- documents ----------------------------------------------------------------------------------
// With documents (ds != nullptr) query i sees keys [ds[i], i]. Starts never decrease, so a query
// block [i0, i1) needs keys [ds[i0], i1) only: tiles left of the block's first document are never
// computed. The first key is rounded down to a multiple of kKeyTile so that tile rows stay whole
// 16-float vectors (the few keys of an earlier document inside that tile are masked to zero).
constexpr int64_t kKeyTile = 16;
// The lower bound of every query's keys in one batch row: its document start (ds, nullptr = 0)
// and the sliding window (0 = none). first(t) never decreases with t.
struct Mask {
  const int32_t* ds = nullptr;
  int64_t window = 0;
  bool plain() const { return ds == nullptr && window == 0; }
  int64_t first(int64_t t) const {
    const int64_t d = ds ? ds[t] : 0;
    return window > 0 ? std::max(d, t - window + 1) : d;
  }
};
inline int64_t key_begin(const Mask& m, int64_t i0) { return m.first(i0) / kKeyTile * kKeyTile; }
// [16 x 16] tiles of the score matrix a block of nr query rows and w key columns computes.
inline int64_t score_tiles(int64_t nr, int64_t w) { return (nr + 15) / 16 * ((w + kKeyTile - 1) / kKeyTile); }
constexpr int64_t kMaxBlockRows = 64;  // block_rows(T) <= 64
// Query blocks with documents: shorter ones start closer to each row's document.
constexpr int64_t kDocBlockRows = 32;
// lo[r] = first tile column of query i0 + r's keys (tile columns start at key k0) for the nr rows
// of a block; nullptr without documents or window (tile_gemm's plain causal path).
inline const int32_t* block_lo(int32_t* lo, const Mask& m, int64_t i0, int64_t nr, int64_t k0) {
  if (m.plain()) return nullptr;
  for (int64_t r = 0; r < nr; ++r) lo[r] = static_cast<int32_t>(m.first(i0 + r) - k0);
  return lo;
}
// The window of a call: negative is an error, window >= T is no window (every key is in it).
int64_t effective_window(const char* fn, int64_t window, int64_t T) {
  LATHE_CHECK(window >= 0, "{}: window = {} must be >= 0 (0 = no sliding window)", fn, window);
  return window >= T ? 0 : window;
}
// The score scale of a call (0 = 1/sqrt(D)) and the soft cap (0 = none); both finite and >= 0.
struct Scores {
  float scale = 0.0f, cap = 0.0f;
};
Scores check_scores(const char* fn, float scale, float softcap, int64_t D) {
  LATHE_CHECK(std::isfinite(scale) && scale >= 0.0f, "{}: scale = {} must be finite and >= 0 (0 = 1/sqrt(head_dim))",
              fn, scale);
  LATHE_CHECK(std::isfinite(softcap) && softcap >= 0.0f, "{}: softcap = {} must be finite and >= 0 (0 = no capping)",
              fn, softcap);
  return {scale > 0.0f ? scale : 1.0f / std::sqrt(static_cast<float>(D)), softcap};
}
// s <- cap * tanh(s / cap) over n scores (as transformers: a division, tanh, a product).
inline void cap_scores(float* s, int64_t n, float cap) {
  for (int64_t j = 0; j < n; ++j) s[j] = cap * std::tanh(s[j] / cap);
}
// [16 x 16] score tiles computed since the start of the process (tests and benches read them).
std::atomic<int64_t> g_tiles_forward{0}, g_tiles_backward{0};

// Every batch row's starts form a segmentation: ds[0] = 0, then each ds[t] is ds[t-1] (same
// document) or t (a new one). Anything else would read keys outside [0, t] or mix documents.
void check_documents(const char* fn, const int32_t* ds, int64_t B, int64_t T) {
  if (ds == nullptr) return;
  for (int64_t b = 0; b < B; ++b) {
    const int32_t* d = ds + b * T;
    LATHE_CHECK(d[0] == 0, "{}: doc_start[{}, 0] = {}: the first token of a sample starts its document (0)", fn, b,
                d[0]);
    for (int64_t t = 1; t < T; ++t)
      LATHE_CHECK(d[t] == d[t - 1] || d[t] == t,
                  "{}: doc_start[{}, {}] = {} after {}: a token's document starts where the previous token's does or "
                  "at the token itself",
                  fn, b, t, d[t], d[t - 1]);
  }
}

void check_shapes(const char* fn, int64_t B, int64_t T, int64_t H, int64_t KVH, int64_t D) {
  LATHE_CHECK(B >= 1 && T >= 1 && H >= 1 && KVH >= 1 && D >= 1,
              "{}: invalid shape B={} T={} H={} KVH={} D={} (all must be >= 1)", fn, B, T, H, KVH, D);
  LATHE_CHECK(H % KVH == 0, "{}: n_head {} is not a multiple of n_kv_head {}; set n_kv_head to a divisor of n_head", fn,
              H, KVH);
}

}  // namespace

AttentionTiles attention_tiles() {
  return {g_tiles_forward.load(std::memory_order_relaxed), g_tiles_backward.load(std::memory_order_relaxed)};
}

size_t attention_scratch_floats(int64_t T, int64_t D) {
  return static_cast<size_t>(omp_get_max_threads()) * static_cast<size_t>(tile_floats(T, D));
}

namespace {

// Query head h of batch row b: the work of one forward task (scratch S: this thread's tile_floats).
// m: the document starts of batch row b ([T], see ops.h; nullptr = none) and the window (0 = none).
void forward_head(float* out, float* lse, const float* qkv, int64_t T, int64_t H, int64_t KVH, int64_t D, int64_t b,
                  int64_t h, const Mask& m, const Scores& sc, float* S) {
  const int64_t ld = (H + 2 * KVH) * D;  // qkv row stride
  const int64_t ldo = H * D;             // out row stride
  const int64_t rep = H / KVH, g = h / rep;
  const int64_t Br = m.plain() ? block_rows(T) : std::min(block_rows(T), kDocBlockRows);
  const float scale = sc.scale;
  float* Kt = S + 2 * Br * T + Br;  // [D, T]
  float* Vc = Kt + D * T;           // [T, D]
  const float* q = qkv + b * T * ld + h * D;
  const float* k = qkv + b * T * ld + (H + g) * D;
  const float* v = qkv + b * T * ld + (H + KVH + g) * D;
  float* o = out + b * T * ldo + h * D;
  float* l = lse + (b * H + h) * T;
  transpose_head(Kt, k, T, D, ld);
  pack_head(Vc, v, T, D, ld);
  int64_t tiles = 0;
  for (int64_t i0 = 0; i0 < T; i0 += Br) {
    const int64_t nr = std::min(Br, T - i0), nc = i0 + nr;
    // Keys [k0, nc): k0 = 0 (causal), else the block's first row's first key (document start or
    // window) rounded down to a 16-key tile; the tile [nr, w] has ld w and column j is key k0 + j.
    const int64_t k0 = key_begin(m, i0), w = nc - k0, off = i0 - k0;
    tiles += score_tiles(nr, w);
    int32_t row_lo[kMaxBlockRows];  // per query row: its document's first tile column
    const int32_t* lo_p = block_lo(row_lo, m, i0, nr, k0);
    // S = scale * Q[i0:i0+nr] @ K[k0:nc]^T
    tile_gemm(nr, w, D, scale, q + i0 * ld, ld, 1, Kt + k0, T, false, S, w, Causal::kN, off, lo_p);
    for (int64_t r = 0; r < nr; ++r) {
      float* s = S + r * w;
      // keys [lo, hi) of the tile: the query's document (or 0) up to the query itself
      const int64_t lo = lo_p ? lo_p[r] : 0, hi = off + r + 1;
      if (sc.cap > 0.0f) cap_scores(s + lo, hi - lo, sc.cap);
      const float mx = vec::row_max(s + lo, hi - lo);
      const float sum = static_cast<float>(vec::exp_shift_sum(s + lo, hi - lo, mx));
      vec::scale(s + lo, hi - lo, 1.0f / sum);
      for (int64_t j = 0; j < lo; ++j) s[j] = 0.0f;
      for (int64_t j = hi; j < w; ++j) s[j] = 0.0f;
      l[i0 + r] = mx + std::log(sum);
    }
    // O[i0:i0+nr] = P @ V[k0:nc]
    tile_gemm(nr, D, w, 1.0f, S, w, 1, Vc + k0 * D, D, false, o + i0 * ldo, ldo, Causal::kK, off, lo_p);
  }
  g_tiles_forward.fetch_add(tiles, std::memory_order_relaxed);
}

// Soft-capped backward of one query block (sc.cap > 0): P holds the scaled raw scores s of rows
// [0, nr) and dS holds dP = dO V^T; per visible key t = tanh(s / cap), P <- exp(cap t - lse) and
// dS <- P (dP - D_i) (1 - t^2) scale, masked entries zeroed (as the uncapped path leaves them).
void capped_probs_and_dscores(float* P, float* dS, float* Di, int64_t nr, int64_t w, int64_t off, const int32_t* lo_p,
                              const float* l, const float* o, const float* dob, int64_t ldo, int64_t D,
                              const Scores& sc) {
  for (int64_t r = 0; r < nr; ++r) {
    float* p = P + r * w;
    float* dsr = dS + r * w;
    const int64_t lo = lo_p ? lo_p[r] : 0, hi = off + r + 1;
    const float* orow = o + r * ldo;
    const float* drow = dob + r * ldo;
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t d = 0; d < D; ++d) acc += orow[d] * drow[d];
    Di[r] = acc;
    for (int64_t j = 0; j < lo; ++j) p[j] = dsr[j] = 0.0f;
    for (int64_t j = lo; j < hi; ++j) {
      const float t = std::tanh(p[j] / sc.cap);
      const float pj = std::exp(sc.cap * t - l[r]);
      p[j] = pj;
      dsr[j] = pj * (dsr[j] - acc) * (1.0f - t * t) * sc.scale;
    }
    for (int64_t j = hi; j < w; ++j) p[j] = dsr[j] = 0.0f;
  }
}

// kv head g of batch row b and every query head of its group: one backward task (dK, dV of the kv
// head and dQ of its query heads, written by one thread in a fixed order; P: tile_floats).
// m: the mask of batch row b (as forward_head).
void backward_group(float* dqkv, const float* dout, const float* qkv, const float* out, const float* lse, int64_t T,
                    int64_t H, int64_t KVH, int64_t D, int64_t b, int64_t g, const Mask& m, const Scores& sc,
                    float* P) {
  const int64_t ld = (H + 2 * KVH) * D;
  const int64_t ldo = H * D;
  const int64_t rep = H / KVH;
  const int64_t Br = m.plain() ? block_rows(T) : std::min(block_rows(T), kDocBlockRows);
  const float scale = sc.scale;
  float* dS = P + Br * T;   // [Br, T]
  float* Di = dS + Br * T;  // [Br]
  float* Kt = Di + Br;      // [D, T]
  float* Vt = Kt + D * T;   // [D, T]
  float* Kc = Vt + D * T;   // [T, D]
  const float* k = qkv + b * T * ld + (H + g) * D;
  const float* v = qkv + b * T * ld + (H + KVH + g) * D;
  float* dk = dqkv + b * T * ld + (H + g) * D;
  float* dv = dqkv + b * T * ld + (H + KVH + g) * D;
  transpose_head(Kt, k, T, D, ld);
  transpose_head(Vt, v, T, D, ld);
  pack_head(Kc, k, T, D, ld);
  for (int64_t t = 0; t < T; ++t) {
    std::fill(dk + t * ld, dk + t * ld + D, 0.0f);
    std::fill(dv + t * ld, dv + t * ld + D, 0.0f);
  }
  int64_t tiles = 0;
  for (int64_t h = g * rep; h < (g + 1) * rep; ++h) {
    const float* q = qkv + b * T * ld + h * D;
    float* dq = dqkv + b * T * ld + h * D;
    const float* o = out + b * T * ldo + h * D;
    const float* dout_h = dout + b * T * ldo + h * D;
    const float* l = lse + (b * H + h) * T;
    for (int64_t i0 = 0; i0 < T; i0 += Br) {
      const int64_t nr = std::min(Br, T - i0), nc = i0 + nr;
      const int64_t k0 = key_begin(m, i0), w = nc - k0, off = i0 - k0;  // keys [k0, nc), as forward
      tiles += score_tiles(nr, w);
      int32_t row_lo[kMaxBlockRows];
      const int32_t* lo_p = block_lo(row_lo, m, i0, nr, k0);
      const float* qb = q + i0 * ld;
      const float* dob = dout_h + i0 * ldo;
      // P = exp(scale * Q K^T - lse), masked entries zeroed.
      tile_gemm(nr, w, D, scale, qb, ld, 1, Kt + k0, T, false, P, w, Causal::kN, off, lo_p);
      if (sc.cap > 0.0f) {  // soft cap: dP first, then P and dS together from the raw scores
        tile_gemm(nr, w, D, 1.0f, dob, ldo, 1, Vt + k0, T, false, dS, w, Causal::kN, off, lo_p);
        capped_probs_and_dscores(P, dS, Di, nr, w, off, lo_p, l + i0, o + i0 * ldo, dob, ldo, D, sc);
        tile_gemm(w, D, nr, 1.0f, P, 1, w, dob, ldo, true, dv + k0 * ld, ld, Causal::kKT, off, lo_p);
        tile_gemm(nr, D, w, 1.0f, dS, w, 1, Kc + k0 * D, D, false, dq + i0 * ld, ld, Causal::kK, off, lo_p);
        tile_gemm(w, D, nr, 1.0f, dS, 1, w, qb, ld, true, dk + k0 * ld, ld, Causal::kKT, off, lo_p);
        continue;
      }
      for (int64_t r = 0; r < nr; ++r) {
        float* p = P + r * w;
        const int64_t lo = lo_p ? lo_p[r] : 0, hi = off + r + 1;
        const float li = l[i0 + r];
        vec::exp_shift(p + lo, hi - lo, li);
        for (int64_t j = 0; j < lo; ++j) p[j] = 0.0f;
        for (int64_t j = hi; j < w; ++j) p[j] = 0.0f;
        const float* orow = o + (i0 + r) * ldo;
        const float* drow = dob + r * ldo;
        float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
        for (int64_t d = 0; d < D; ++d) acc += orow[d] * drow[d];
        Di[r] = acc;
      }
      // dV[k0:nc] += P^T dO
      tile_gemm(w, D, nr, 1.0f, P, 1, w, dob, ldo, true, dv + k0 * ld, ld, Causal::kKT, off, lo_p);
      // dP = dO V^T
      tile_gemm(nr, w, D, 1.0f, dob, ldo, 1, Vt + k0, T, false, dS, w, Causal::kN, off, lo_p);
      for (int64_t r = 0; r < nr; ++r) {
        const float* p = P + r * w;
        float* dsr = dS + r * w;
        const float di = Di[r];
        // dS outside [lo, hi) is zero (beyond hi it is unwritten: Causal::kN)
        const int64_t lo = lo_p ? lo_p[r] : 0, hi = off + r + 1;
        for (int64_t j = 0; j < lo; ++j) dsr[j] = 0.0f;
#pragma omp simd
        for (int64_t j = lo; j < hi; ++j) dsr[j] = p[j] * (dsr[j] - di) * scale;
        for (int64_t j = hi; j < w; ++j) dsr[j] = 0.0f;
      }
      // dQ[i0:i0+nr] = dS K[k0:nc]  (overwrite),  dK[k0:nc] += dS^T Q[i0:i0+nr]
      tile_gemm(nr, D, w, 1.0f, dS, w, 1, Kc + k0 * D, D, false, dq + i0 * ld, ld, Causal::kK, off, lo_p);
      tile_gemm(w, D, nr, 1.0f, dS, 1, w, qb, ld, true, dk + k0 * ld, ld, Causal::kKT, off, lo_p);
    }
  }
  g_tiles_backward.fetch_add(tiles, std::memory_order_relaxed);
}

// ---- 16-bit storage (bf16 / fp16 tables): fp32 math on widened copies of one head --------------
// Per thread, after the fp32 tile_floats: a packed fp32 q|k|v of one query head [T, 3D], its
// gradient [T, 3D], the head's out and dout [T, D] each, and fp32 dK, dV accumulators [T, D]
// (a kv head shared by several query heads sums their contributions before its one rounding).
inline int64_t half_extra_floats(int64_t T, int64_t D) { return 10 * T * D; }

// dst[T, ncols] (packed fp32) <- columns [col, col + ncols) of src rows of stride ld.
template <class P>
void widen_cols(float* dst, const uint16_t* src, int64_t T, int64_t ncols, int64_t ld) {
  for (int64_t t = 0; t < T; ++t) P::to_f32(dst + t * ncols, src + t * ld, ncols);
}
template <class P>
void narrow_cols(uint16_t* dst, const float* src, int64_t T, int64_t ncols, int64_t ld) {
  for (int64_t t = 0; t < T; ++t) P::from_f32(dst + t * ld, src + t * ncols, ncols);
}

template <class P>
void attention_forward_half(void* out_v, float* lse, const void* qkv_v, int64_t B, int64_t T, int64_t H, int64_t KVH,
                            int64_t D, void* scratch_v, const int32_t* doc_start, int64_t window, float scale,
                            float softcap) {
  check_shapes("attention_forward", B, T, H, KVH, D);
  check_documents("attention_forward", doc_start, B, T);
  const int64_t win = effective_window("attention_forward", window, T);
  const Scores sc = check_scores("attention_forward", scale, softcap, D);
  auto* out = static_cast<uint16_t*>(out_v);
  const auto* qkv = static_cast<const uint16_t*>(qkv_v);
  const int64_t ld = (H + 2 * KVH) * D, ldo = H * D, rep = H / KVH;
  const int64_t per_thread = tile_floats(T, D) + half_extra_floats(T, D);
  const int max_thr = omp_get_max_threads();
#pragma omp parallel for schedule(static) num_threads(max_thr)
  for (int64_t bh = 0; bh < B * H; ++bh) {
    const int64_t b = bh / H, h = bh % H, g = h / rep;
    float* S = static_cast<float*>(scratch_v) + static_cast<int64_t>(omp_get_thread_num()) * per_thread;
    float* mini = S + tile_floats(T, D);  // [T, 3D]: this head's q | k | v, as H = KVH = 1
    float* mo = mini + 6 * T * D;         // [T, D]
    const uint16_t* row = qkv + b * T * ld;
    for (int64_t t = 0; t < T; ++t) {
      P::to_f32(mini + t * 3 * D, row + t * ld + h * D, D);
      P::to_f32(mini + t * 3 * D + D, row + t * ld + (H + g) * D, D);
      P::to_f32(mini + t * 3 * D + 2 * D, row + t * ld + (H + KVH + g) * D, D);
    }
    forward_head(mo, lse + (b * H + h) * T, mini, T, 1, 1, D, 0, 0, Mask{doc_start ? doc_start + b * T : nullptr, win},
                 sc, S);
    narrow_cols<P>(out + b * T * ldo + h * D, mo, T, D, ldo);
  }
}

template <class P>
void attention_backward_half(void* dqkv_v, const void* dout_v, const void* qkv_v, const void* out_v, const float* lse,
                             int64_t B, int64_t T, int64_t H, int64_t KVH, int64_t D, void* scratch_v,
                             const int32_t* doc_start, int64_t window, float scale, float softcap) {
  check_shapes("attention_backward", B, T, H, KVH, D);
  check_documents("attention_backward", doc_start, B, T);
  const int64_t win = effective_window("attention_backward", window, T);
  const Scores sc = check_scores("attention_backward", scale, softcap, D);
  auto* dqkv = static_cast<uint16_t*>(dqkv_v);
  const auto* dout = static_cast<const uint16_t*>(dout_v);
  const auto* qkv = static_cast<const uint16_t*>(qkv_v);
  const auto* out = static_cast<const uint16_t*>(out_v);
  const int64_t ld = (H + 2 * KVH) * D, ldo = H * D, rep = H / KVH;
  const int64_t per_thread = tile_floats(T, D) + half_extra_floats(T, D);
  const int max_thr = omp_get_max_threads();
#pragma omp parallel for schedule(static) num_threads(max_thr)
  for (int64_t bg = 0; bg < B * KVH; ++bg) {
    const int64_t b = bg / KVH, g = bg % KVH;
    float* P_ = static_cast<float*>(scratch_v) + static_cast<int64_t>(omp_get_thread_num()) * per_thread;
    float* mini = P_ + tile_floats(T, D);  // [T, 3D] q | k | v of one query head
    float* dmini = mini + 3 * T * D;       // [T, 3D]
    float* mo = dmini + 3 * T * D;         // [T, D]
    float* mdo = mo + T * D;               // [T, D]
    float* dk = mdo + T * D;               // [T, D]
    float* dv = dk + T * D;                // [T, D]
    const uint16_t* row = qkv + b * T * ld;
    std::fill(dk, dk + 2 * T * D, 0.0f);
    for (int64_t h = g * rep; h < (g + 1) * rep; ++h) {
      for (int64_t t = 0; t < T; ++t) {
        P::to_f32(mini + t * 3 * D, row + t * ld + h * D, D);
        P::to_f32(mini + t * 3 * D + D, row + t * ld + (H + g) * D, D);
        P::to_f32(mini + t * 3 * D + 2 * D, row + t * ld + (H + KVH + g) * D, D);
      }
      widen_cols<P>(mo, out + b * T * ldo + h * D, T, D, ldo);
      widen_cols<P>(mdo, dout + b * T * ldo + h * D, T, D, ldo);
      backward_group(dmini, mdo, mini, mo, lse + (b * H + h) * T, T, 1, 1, D, 0, 0,
                     Mask{doc_start ? doc_start + b * T : nullptr, win}, sc, P_);
      for (int64_t t = 0; t < T; ++t)  // dq: this head's only (columns [0, D) of the [T, 3D] gradient)
        P::from_f32(dqkv + (b * T + t) * ld + h * D, dmini + t * 3 * D, D);
      for (int64_t t = 0; t < T; ++t)
        for (int64_t d = 0; d < D; ++d) {
          dk[t * D + d] += dmini[t * 3 * D + D + d];
          dv[t * D + d] += dmini[t * 3 * D + 2 * D + d];
        }
    }
    narrow_cols<P>(dqkv + b * T * ld + (H + g) * D, dk, T, D, ld);
    narrow_cols<P>(dqkv + b * T * ld + (H + KVH + g) * D, dv, T, D, ld);
  }
}

}  // namespace

void attention_forward(float* out, float* lse, const float* qkv, int64_t B, int64_t T, int64_t H, int64_t KVH,
                       int64_t D, float* scratch, const int32_t* doc_start, int64_t window, float scale,
                       float softcap) {
  check_shapes("attention_forward", B, T, H, KVH, D);
  check_documents("attention_forward", doc_start, B, T);
  const int64_t win = effective_window("attention_forward", window, T);
  const Scores sc = check_scores("attention_forward", scale, softcap, D);
  const int64_t per_thread = tile_floats(T, D);
  const int max_thr = omp_get_max_threads();
#pragma omp parallel for schedule(static) num_threads(max_thr)
  for (int64_t bh = 0; bh < B * H; ++bh)
    forward_head(out, lse, qkv, T, H, KVH, D, bh / H, bh % H, Mask{doc_start ? doc_start + bh / H * T : nullptr, win},
                 sc, scratch + static_cast<int64_t>(omp_get_thread_num()) * per_thread);
}

void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out, const float* lse, int64_t B,
                        int64_t T, int64_t H, int64_t KVH, int64_t D, float* scratch, const int32_t* doc_start,
                        int64_t window, float scale, float softcap) {
  check_shapes("attention_backward", B, T, H, KVH, D);
  check_documents("attention_backward", doc_start, B, T);
  const int64_t win = effective_window("attention_backward", window, T);
  const Scores sc = check_scores("attention_backward", scale, softcap, D);
  const int64_t per_thread = tile_floats(T, D);
  const int max_thr = omp_get_max_threads();
  // One task per (b, kv head): it owns dK, dV of that kv head and dQ of every query head of its
  // group, so everything is written by one thread in a fixed order (deterministic, no atomics).
#pragma omp parallel for schedule(static) num_threads(max_thr)
  for (int64_t bg = 0; bg < B * KVH; ++bg)
    backward_group(dqkv, dout, qkv, out, lse, T, H, KVH, D, bg / KVH, bg % KVH,
                   Mask{doc_start ? doc_start + bg / KVH * T : nullptr, win}, sc,
                   scratch + static_cast<int64_t>(omp_get_thread_num()) * per_thread);
}

namespace {

size_t scratch_bytes_half(int64_t T, int64_t D) {
  return static_cast<size_t>(omp_get_max_threads()) * static_cast<size_t>(tile_floats(T, D) + half_extra_floats(T, D)) *
         sizeof(float);
}
void forward_f32(void* out, float* lse, const void* qkv, int64_t B, int64_t T, int64_t H, int64_t KVH, int64_t D,
                 void* scratch, const int32_t* doc_start, int64_t window, float scale, float softcap) {
  attention_forward(static_cast<float*>(out), lse, static_cast<const float*>(qkv), B, T, H, KVH, D,
                    static_cast<float*>(scratch), doc_start, window, scale, softcap);
}
void backward_f32(void* dqkv, const void* dout, const void* qkv, const void* out, const float* lse, int64_t B,
                  int64_t T, int64_t H, int64_t KVH, int64_t D, void* scratch, const int32_t* doc_start, int64_t window,
                  float scale, float softcap) {
  attention_backward(static_cast<float*>(dqkv), static_cast<const float*>(dout), static_cast<const float*>(qkv),
                     static_cast<const float*>(out), lse, B, T, H, KVH, D, static_cast<float*>(scratch), doc_start,
                     window, scale, softcap);
}
size_t scratch_bytes_f32(int64_t T, int64_t D) { return attention_scratch_floats(T, D) * sizeof(float); }

}  // namespace

// fp32 runs on the strided q|k|v directly, a 16-bit table on one widened head at a time (above):
// two drivers of the same per-head code, kept apart because the fp32 one sums a kv head's dK, dV
// over its query heads inside backward_group and the 16-bit one per head, in fp32 accumulators.
template <class S>
void add_attention(Ops& o) {
  if constexpr (S::kFp32) {
    o.attention_forward = forward_f32;
    o.attention_backward = backward_f32;
    o.attention_scratch_bytes = scratch_bytes_f32;
  } else {
    o.attention_forward = attention_forward_half<S>;
    o.attention_backward = attention_backward_half<S>;
    o.attention_scratch_bytes = scratch_bytes_half;
  }
}
LATHE_CPU_ADD_SLOTS(add_attention)

}  // namespace lathe::cpu
