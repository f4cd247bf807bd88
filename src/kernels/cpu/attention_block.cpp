// Block attention for context parallelism (issue 27; contract in ops.h, "block attention"): the
// rows of one rank's queries against one block of keys/values that may come from another rank,
// masked by global positions, and the log-sum-exp merge of the blocks' partial results.
//
// Forward, per (batch row, query head), query tiles of 16 rows: the online softmax of flash
// attention over the block's key tiles of 16 (running max m, running sum l, accumulator acc),
// then out = acc / l and lse = m + log(l). A key tile none of whose keys any row of the query tile
// may see (before every row's document or window start, or after every row's position) is skipped.
// Backward, per (batch row, kv head) so that one thread owns a kv head's dk, dv and the dq of its
// query heads (fixed summation order, no atomics): P = exp(S - lse) with the FINAL lse, Di from the
// final out, then the usual dS = P * (dP - Di) * scale products, tile by tile.
//
// Plain loops over 16 x 16 tiles (the compiler vectorises the D-long inner loops): this is the
// correctness-first version; the register-blocked tile_gemm of attention.cpp is not reused here
// because that file is being changed concurrently (softcap) and its helpers are file-local.
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>

#include "core/error.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/vec_math.h"

namespace lathe::cpu {
namespace {

constexpr int64_t kTile = 16;
constexpr int64_t kMaxD = 512;  // stack tiles of [16, D]
constexpr int kParts16 = static_cast<int>(kTile) / vec::kW;  // hardware vectors per 16 floats
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
std::atomic<int64_t> g_block_fwd{0}, g_block_bwd{0};

void check_block(const char* fn, const BlockAttention& a) {
  LATHE_CHECK(a.B >= 1 && a.Tq >= 0 && a.Tk >= 0 && a.H >= 1 && a.KVH >= 1 && a.D >= 1,
              "{}: invalid shape B={} Tq={} Tk={} H={} KVH={} D={}", fn, a.B, a.Tq, a.Tk, a.H, a.KVH, a.D);
  LATHE_CHECK(a.H % a.KVH == 0, "{}: n_head {} is not a multiple of n_kv_head {}", fn, a.H, a.KVH);
  LATHE_CHECK(a.D <= kMaxD, "{}: head size {} above the block kernel's {} (attention_block.cpp kMaxD)", fn, a.D,
              kMaxD);
  LATHE_CHECK(a.window >= 0, "{}: window = {} must be >= 0 (0 = no sliding window)", fn, a.window);
  LATHE_CHECK((a.Tq == 0 || a.q_pos) && (a.Tk == 0 || a.k_pos), "{}: q_pos and k_pos are required", fn);
  for (int64_t i = 1; i < a.Tq; ++i)
    LATHE_CHECK(a.q_pos[i] > a.q_pos[i - 1], "{}: q_pos[{}] = {} after {}: positions must increase", fn, i,
                a.q_pos[i], a.q_pos[i - 1]);
  for (int64_t j = 1; j < a.Tk; ++j)
    LATHE_CHECK(a.k_pos[j] > a.k_pos[j - 1], "{}: k_pos[{}] = {} after {}: positions must increase", fn, j,
                a.k_pos[j], a.k_pos[j - 1]);
  if (a.q_doc)
    for (int64_t i = 0; i < a.B * a.Tq; ++i)
      LATHE_CHECK(a.q_doc[i] >= 0 && a.q_doc[i] <= a.q_pos[i % a.Tq],
                  "{}: q_doc[{}, {}] = {}: a document starts at or before its token's position {} (and >= 0)", fn,
                  i / a.Tq, i % a.Tq, a.q_doc[i], a.q_pos[i % a.Tq]);
}

// Visible key positions of the rows of one query tile: [lo[r], hi[r]].
struct RowBounds {
  int64_t lo[kTile], hi[kTile];
  int64_t nr = 0;
  RowBounds(const BlockAttention& a, int64_t b, int64_t i0) : nr(std::min(kTile, a.Tq - i0)) {
    for (int64_t r = 0; r < nr; ++r) {
      const int64_t i = i0 + r;
      hi[r] = a.q_pos[i];
      int64_t l = a.q_doc ? a.q_doc[b * a.Tq + i] : std::numeric_limits<int64_t>::min();
      if (a.window > 0) l = std::max(l, hi[r] - a.window + 1);
      lo[r] = l;
    }
  }
  bool visible(int64_t r, int64_t kp) const { return kp <= hi[r] && kp >= lo[r]; }
  // Every row sees every key position in [kmin, kmax] (a tile with nothing to mask).
  bool all(int64_t kmin, int64_t kmax) const {
    for (int64_t r = 0; r < nr; ++r)
      if (lo[r] > kmin || hi[r] < kmax) return false;
    return true;
  }
  // Some row sees some key position in [kmin, kmax] (exact for contiguous positions).
  bool any(int64_t kmin, int64_t kmax) const {
    for (int64_t r = 0; r < nr; ++r)
      if (lo[r] <= kmax && hi[r] >= kmin && lo[r] <= hi[r]) return true;
    return false;
  }
};

inline float dot(const float* x, const float* y, int64_t D) {
  float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
  for (int64_t d = 0; d < D; ++d) acc += x[d] * y[d];
  return acc;
}

// kt[d][c] = rows j0 + c of x (row stride ld), transposed: the products below then run along 16
// contiguous columns (vectorised) instead of one D-long reduction per score.
void pack_tile_t(float kt[][kTile], const float* x, int64_t ld, int64_t nc, int64_t D) {
  for (int64_t c = 0; c < kTile; ++c)
    for (int64_t d = 0; d < D; ++d) kt[d][c] = c < nc ? x[c * ld + d] : 0.0f;
}

// s[r][c] = alpha * sum_d x_r[d] * kt[d][c] for the nr rows of x (row stride ld), all 16 columns.
void tile_products(float s[kTile][kTile], const float* x, int64_t ld, int64_t nr, const float kt[][kTile], int64_t D,
                   float alpha) {
  for (int64_t r = 0; r < nr; ++r) {
    vec::vf acc[kParts16] = {};
    const float* xr = x + r * ld;
    for (int64_t d = 0; d < D; ++d) {
      const vec::vf xd = vec::splat(xr[d]);
      for (int p = 0; p < kParts16; ++p) acc[p] += xd * vec::load(kt[d] + p * vec::kW);
    }
    for (int p = 0; p < kParts16; ++p) vec::store(s[r] + p * vec::kW, acc[p] * alpha);
  }
}

// y_i[d] = y_i[d] * y_scale + sum_j w(i, j) * x_j[d] for rows i < ni of y (stride ldy) and j < nj of
// x (stride ldx), w(i, j) = w[i * w_is + j * w_js]; each row's columns in blocks of 16 held in
// registers across the sum over j (the sum runs in j order: the same bits as adding term by term).
void tile_axpy(float* y, int64_t ldy, int64_t ni, float y_scale, const float* w, int64_t w_is, int64_t w_js,
               const float* x, int64_t ldx, int64_t nj, int64_t D) {
  for (int64_t i = 0; i < ni; ++i) {
    float* yi = y + i * ldy;
    int64_t d0 = 0;
    for (; d0 + kTile <= D; d0 += kTile) {
      vec::vf r[kParts16];
      for (int p = 0; p < kParts16; ++p) r[p] = vec::load(yi + d0 + p * vec::kW) * y_scale;
      for (int64_t j = 0; j < nj; ++j) {
        const vec::vf wij = vec::splat(w[i * w_is + j * w_js]);
        const float* xj = x + j * ldx + d0;
        for (int p = 0; p < kParts16; ++p) r[p] += wij * vec::load(xj + p * vec::kW);
      }
      for (int p = 0; p < kParts16; ++p) vec::store(yi + d0 + p * vec::kW, r[p]);
    }
    for (int64_t d = d0; d < D; ++d) {  // head sizes not a multiple of 16
      float r = yi[d] * y_scale;
      for (int64_t j = 0; j < nj; ++j) r += w[i * w_is + j * w_js] * x[j * ldx + d];
      yi[d] = r;
    }
  }
}

// dst[c] = exp(src[c] - shift) for the 16 columns of a tile row (vec_math's polynomial, as the
// attention kernels use; -inf gives 0). shift must be finite.
inline void exp_row(float* dst, const float* src, float shift) {
  for (int p = 0; p < vec::kParts; ++p)
    vec::store(dst + p * vec::kW, vec::expv(vec::load(src + p * vec::kW) - vec::splat(shift)));
}

// Scores of one tile: s[r][c] = scale * q_r . k_c where visible, else -inf (kt: the K tile packed).
void tile_scores(const BlockAttention& a, const RowBounds& rb, const float* q0, const float kt[][kTile], int64_t j0,
                 int64_t nc, float scale, float s[kTile][kTile]) {
  tile_products(s, q0, a.ldq, rb.nr, kt, a.D, scale);
  if (nc == kTile && rb.all(a.k_pos[j0], a.k_pos[j0 + nc - 1])) return;
  for (int64_t r = 0; r < rb.nr; ++r)
    for (int64_t c = 0; c < kTile; ++c)
      if (c >= nc || !rb.visible(r, a.k_pos[j0 + c])) s[r][c] = kNegInf;
}

// One (batch row, query head) of the forward.
void forward_head(const BlockAttention& a, int64_t b, int64_t h, float* out, int64_t ldo, float* lse) {
  const int64_t D = a.D, g = h / (a.H / a.KVH);
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const float* q = a.q + b * a.Tq * a.ldq + h * D;
  const float* k = a.k + b * a.Tk * a.ldk + g * D;
  const float* v = a.v + b * a.Tk * a.ldv + g * D;
  float* o = out + b * a.Tq * ldo + h * D;
  float* l_out = lse + (b * a.H + h) * a.Tq;
  int64_t tiles = 0;
  for (int64_t i0 = 0; i0 < a.Tq; i0 += kTile) {
    const RowBounds rb(a, b, i0);
    float m[kTile], l[kTile], acc[kTile][kMaxD], s[kTile][kTile], kt[kMaxD][kTile];
    for (int64_t r = 0; r < rb.nr; ++r) {
      m[r] = kNegInf;
      l[r] = 0.0f;
      std::fill(acc[r], acc[r] + D, 0.0f);
    }
    for (int64_t j0 = 0; j0 < a.Tk; j0 += kTile) {
      const int64_t nc = std::min(kTile, a.Tk - j0);
      if (!rb.any(a.k_pos[j0], a.k_pos[j0 + nc - 1])) continue;
      ++tiles;
      pack_tile_t(kt, k + j0 * a.ldk, a.ldk, nc, D);
      tile_scores(a, rb, q + i0 * a.ldq, kt, j0, nc, scale, s);
      for (int64_t r = 0; r < rb.nr; ++r) {
        float mt = kNegInf;
        for (int64_t c = 0; c < nc; ++c) mt = std::max(mt, s[r][c]);
        if (mt == kNegInf) continue;  // no visible key of this tile for this row
        const float mn = std::max(m[r], mt);
        const float alpha = m[r] == kNegInf ? 0.0f : vec::exp1(m[r] - mn);
        float sum = 0.0f, e[kTile];
        exp_row(e, s[r], mn);  // masked scores (-inf) give exactly 0
        for (int64_t c = 0; c < nc; ++c) sum += e[c];
        // acc = acc * alpha + sum_c e[c] v_c
        tile_axpy(acc[r], kMaxD, 1, alpha, e, 0, 1, v + j0 * a.ldv, a.ldv, nc, D);
        l[r] = l[r] * alpha + sum;
        m[r] = mn;
      }
    }
    for (int64_t r = 0; r < rb.nr; ++r) {
      float* orow = o + (i0 + r) * ldo;
      if (l[r] > 0.0f) {
        const float inv = 1.0f / l[r];
        for (int64_t d = 0; d < D; ++d) orow[d] = acc[r][d] * inv;
        l_out[i0 + r] = m[r] + std::log(l[r]);
      } else {
        std::fill(orow, orow + D, 0.0f);
        l_out[i0 + r] = kNegInf;
      }
    }
  }
  g_block_fwd.fetch_add(tiles, std::memory_order_relaxed);
}

// Query head h of batch row b against the block's kv head g (the work of one head inside one
// backward task): dq rows += (summed over the block's key tiles first), dk, dv rows +=.
int64_t backward_head(const BlockAttention& a, int64_t b, int64_t h, const float* out, const float* dout, int64_t ldo,
                      const float* lse, float* dq, int64_t lddq, float* dk, int64_t lddk, float* dv, int64_t lddv) {
  const int64_t D = a.D, g = h / (a.H / a.KVH);
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const float* q = a.q + b * a.Tq * a.ldq + h * D;
  const float* k = a.k + b * a.Tk * a.ldk + g * D;
  const float* v = a.v + b * a.Tk * a.ldv + g * D;
  const float* o = out + b * a.Tq * ldo + h * D;
  const float* dO = dout + b * a.Tq * ldo + h * D;
  const float* l = lse + (b * a.H + h) * a.Tq;
  float* dqh = dq + b * a.Tq * lddq + h * D;
  float* dkg = dk + b * a.Tk * lddk + g * D;
  float* dvg = dv + b * a.Tk * lddv + g * D;
  int64_t tiles = 0;
  for (int64_t i0 = 0; i0 < a.Tq; i0 += kTile) {
    const RowBounds rb(a, b, i0);
    float Di[kTile], dqt[kTile][kMaxD], p[kTile][kTile], ds[kTile][kTile], kt[kMaxD][kTile], vt[kMaxD][kTile],
        dp[kTile][kTile];
    for (int64_t r = 0; r < rb.nr; ++r) {
      Di[r] = dot(dO + (i0 + r) * ldo, o + (i0 + r) * ldo, D);
      std::fill(dqt[r], dqt[r] + D, 0.0f);
    }
    bool touched = false;
    for (int64_t j0 = 0; j0 < a.Tk; j0 += kTile) {
      const int64_t nc = std::min(kTile, a.Tk - j0);
      if (!rb.any(a.k_pos[j0], a.k_pos[j0 + nc - 1])) continue;
      ++tiles;
      touched = true;
      pack_tile_t(kt, k + j0 * a.ldk, a.ldk, nc, D);
      pack_tile_t(vt, v + j0 * a.ldv, a.ldv, nc, D);
      tile_scores(a, rb, q + i0 * a.ldq, kt, j0, nc, scale, p);
      tile_products(dp, dO + i0 * ldo, ldo, rb.nr, vt, D, 1.0f);  // dP = dO V^T
      for (int64_t r = 0; r < rb.nr; ++r) {
        const float li = l[i0 + r];
        if (li == kNegInf) {  // a row that sees no key at all (not under a causal mask): no gradient
          std::fill(p[r], p[r] + kTile, 0.0f);
          std::fill(ds[r], ds[r] + kTile, 0.0f);
          continue;
        }
        exp_row(p[r], p[r], li);  // masked (-inf) scores give 0
        for (int64_t c = 0; c < kTile; ++c) ds[r][c] = p[r][c] * (dp[r][c] - Di[r]) * scale;
      }
      // dQ tile += dS K,  dK += dS^T Q,  dV += P^T dO  (rows of this tile)
      tile_axpy(&dqt[0][0], kMaxD, rb.nr, 1.0f, &ds[0][0], kTile, 1, k + j0 * a.ldk, a.ldk, nc, D);
      tile_axpy(dkg + j0 * lddk, lddk, nc, 1.0f, &ds[0][0], 1, kTile, q + i0 * a.ldq, a.ldq, rb.nr, D);
      tile_axpy(dvg + j0 * lddv, lddv, nc, 1.0f, &p[0][0], 1, kTile, dO + i0 * ldo, ldo, rb.nr, D);
    }
    if (!touched) continue;
    for (int64_t r = 0; r < rb.nr; ++r) {
      float* dqr = dqh + (i0 + r) * lddq;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) dqr[d] += dqt[r][d];
    }
  }
  return tiles;
}

}  // namespace

void attention_block_forward(const BlockAttention& a, float* out, int64_t ldo, float* lse) {
  check_block("attention_block_forward", a);
  const int max_thr = omp_get_max_threads();
#pragma omp parallel for schedule(static) num_threads(max_thr)
  for (int64_t bh = 0; bh < a.B * a.H; ++bh) forward_head(a, bh / a.H, bh % a.H, out, ldo, lse);
}

void attention_block_backward(const BlockAttention& a, const float* out, const float* dout, int64_t ldo,
                              const float* lse, float* dq, int64_t lddq, float* dk, int64_t lddk, float* dv,
                              int64_t lddv) {
  check_block("attention_block_backward", a);
  const int64_t rep = a.H / a.KVH;
  const int max_thr = omp_get_max_threads();
  // One task per (b, kv head): it alone writes that kv head's dk, dv and its query heads' dq.
#pragma omp parallel for schedule(static) num_threads(max_thr)
  for (int64_t bg = 0; bg < a.B * a.KVH; ++bg) {
    const int64_t b = bg / a.KVH, g = bg % a.KVH;
    int64_t tiles = 0;
    for (int64_t h = g * rep; h < (g + 1) * rep; ++h)
      tiles += backward_head(a, b, h, out, dout, ldo, lse, dq, lddq, dk, lddk, dv, lddv);
    g_block_bwd.fetch_add(tiles, std::memory_order_relaxed);
  }
}

void attention_lse_merge(float* out, float* lse, const float* out_b, const float* lse_b, int64_t B, int64_t T,
                         int64_t H, int64_t D, int64_t ldo) {
  const int max_thr = omp_get_max_threads();
#pragma omp parallel for schedule(static) num_threads(max_thr)
  for (int64_t bh = 0; bh < B * H; ++bh) {
    const int64_t b = bh / H, h = bh % H;
    for (int64_t t = 0; t < T; ++t) {
      float& la = lse[bh * T + t];
      const float lb = lse_b[bh * T + t];
      float* oa = out + (b * T + t) * ldo + h * D;
      const float* ob = out_b + (b * T + t) * ldo + h * D;
      if (lb == kNegInf) continue;
      if (la == kNegInf) {
        std::copy(ob, ob + D, oa);
        la = lb;
        continue;
      }
      const float mx = std::max(la, lb);
      const float wa = std::exp(la - mx), wb = std::exp(lb - mx), sum = wa + wb;
      const float ca = wa / sum, cb = wb / sum;
      for (int64_t d = 0; d < D; ++d) oa[d] = ca * oa[d] + cb * ob[d];
      la = mx + std::log(sum);
    }
  }
}

AttentionTiles attention_block_tiles() {
  return {g_block_fwd.load(std::memory_order_relaxed), g_block_bwd.load(std::memory_order_relaxed)};
}

}  // namespace lathe::cpu
