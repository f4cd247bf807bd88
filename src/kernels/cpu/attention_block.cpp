// Block attention for context parallelism (issue 27; contract in ops.h, "block attention"): the
// rows of one rank's queries against one block of keys/values that may come from another rank,
// masked by global positions, and the log-sum-exp merge of the blocks' partial results.
//
// The one-rank kernel's scheme (attention.cpp) on a general mask: per (batch row, query head),
// query blocks of Br rows (64; 32 with documents or a window). Positions increase along both the
// queries and the keys, so each query row sees one contiguous run of the block's keys, [lo, hi) in
// key index (hi: the keys at or before its position; lo: the first at or after its document start
// and window), and lo and hi never decrease from one row to the next. A query block computes its
// score tile over keys [k0, k1) only (k0: its first seeing row's lo rounded down to 16; k1: its
// last seeing row's hi): key tiles no row sees are never computed, and a block no row of which sees
// any key computes nothing (counted in [16 x 16] tiles by attention_block_tiles()). The tile
// products are the register-blocked micro tiles of attention_tiles.h (band_gemm below skips the
// rows, sums and column blocks outside every row's run, as attention.cpp's tile_gemm does for the
// causal and document masks); the softmax runs over each row's run, so the block's lse is exact
// (no online rescaling). Backward, per (batch row, kv head) so that one thread owns a kv head's dk,
// dv and the dq of its query heads (fixed summation order, no atomics): P = exp(S - lse) with the
// FINAL lse, Di from the final out, then dV += P^T dO, dS = P * (dO V^T - Di) * scale,
// dQ += dS K, dK += dS^T Q, each a tile product over the block.
//
// Scratch (allocated per call, per thread): two [Br, Tk16] tiles (Tk16: Tk rounded up to 16), Br
// floats, K^T and V^T of one kv head [D, Tk16] and K or V packed [Tk, D].
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>

#include "core/error.h"
#include "kernels/cpu/attention_tiles.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/vec_math.h"

namespace lathe::cpu {
namespace {

constexpr int64_t kKeyTile = 16;
constexpr int64_t kRows = 64;     // query rows of a block (causal)
constexpr int64_t kDocRows = 32;  // with documents or a window: blocks start closer to each row's run
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
std::atomic<int64_t> g_block_fwd{0}, g_block_bwd{0};

inline int64_t round16(int64_t n) { return (n + kKeyTile - 1) / kKeyTile * kKeyTile; }

void check_block(const char* fn, const BlockAttention& a) {
  LATHE_CHECK(a.B >= 1 && a.Tq >= 0 && a.Tk >= 0 && a.H >= 1 && a.KVH >= 1 && a.D >= 1,
              "{}: invalid shape B={} Tq={} Tk={} H={} KVH={} D={}", fn, a.B, a.Tq, a.Tk, a.H, a.KVH, a.D);
  LATHE_CHECK(a.H % a.KVH == 0, "{}: n_head {} is not a multiple of n_kv_head {}", fn, a.H, a.KVH);
  LATHE_CHECK(a.window >= 0, "{}: window = {} must be >= 0 (0 = no sliding window)", fn, a.window);
  LATHE_CHECK(std::isfinite(a.scale) && a.scale >= 0.0f,
              "{}: scale = {} must be finite and >= 0 (0 = 1/sqrt(head_dim))", fn, a.scale);
  LATHE_CHECK(std::isfinite(a.softcap) && a.softcap >= 0.0f,
              "{}: softcap = {} must be finite and >= 0 (0 = no capping)", fn, a.softcap);
  LATHE_CHECK((a.Tq == 0 || a.q_pos) && (a.Tk == 0 || a.k_pos), "{}: q_pos and k_pos are required", fn);
  for (int64_t i = 1; i < a.Tq; ++i)
    LATHE_CHECK(a.q_pos[i] > a.q_pos[i - 1], "{}: q_pos[{}] = {} after {}: positions must increase", fn, i,
                a.q_pos[i], a.q_pos[i - 1]);
  for (int64_t j = 1; j < a.Tk; ++j)
    LATHE_CHECK(a.k_pos[j] > a.k_pos[j - 1], "{}: k_pos[{}] = {} after {}: positions must increase", fn, j,
                a.k_pos[j], a.k_pos[j - 1]);
  if (a.q_doc)
    for (int64_t i = 0; i < a.B * a.Tq; ++i) {
      const int64_t t = i % a.Tq;
      LATHE_CHECK(a.q_doc[i] >= 0 && a.q_doc[i] <= a.q_pos[t],
                  "{}: q_doc[{}, {}] = {}: a document starts at or before its token's position {} (and >= 0)", fn,
                  i / a.Tq, t, a.q_doc[i], a.q_pos[t]);
      LATHE_CHECK(t == 0 || a.q_doc[i] >= a.q_doc[i - 1],
                  "{}: q_doc[{}, {}] = {} after {}: document starts never decrease along the rows", fn, i / a.Tq, t,
                  a.q_doc[i], a.q_doc[i - 1]);
    }
}

// One query block: rows [i0, i0 + nr), the block's keys [k0, k0 + w) (tile column c is key k0 + c;
// tiles have row stride wp = w rounded up to 16) and each row's visible tile columns [lo, hi)
// (lo == hi: none), both nondecreasing along the rows. w == 0: no row sees any key.
struct Band {
  int64_t nr = 0, k0 = 0, w = 0, wp = 0;
  int32_t lo[kRows], hi[kRows];
  Band(const BlockAttention& a, int64_t b, int64_t i0, int64_t br) : nr(std::min(br, a.Tq - i0)) {
    int64_t klo[kRows], khi[kRows], first = -1, last = -1;
    for (int64_t r = 0; r < nr; ++r) {
      const int64_t p = a.q_pos[i0 + r];
      int64_t lp = a.q_doc ? a.q_doc[b * a.Tq + i0 + r] : std::numeric_limits<int32_t>::min();
      if (a.window > 0) lp = std::max(lp, p - a.window + 1);
      khi[r] = std::upper_bound(a.k_pos, a.k_pos + a.Tk, p) - a.k_pos;
      klo[r] = lp <= a.k_pos[0] ? 0 : std::lower_bound(a.k_pos, a.k_pos + a.Tk, lp) - a.k_pos;
      if (klo[r] < khi[r]) {
        if (first < 0) first = r;
        last = r;
      }
    }
    if (first < 0) return;
    k0 = klo[first] / kKeyTile * kKeyTile;
    w = khi[last] - k0;
    wp = round16(w);
    for (int64_t r = 0; r < nr; ++r) {  // max(lo, hi) keeps hi nondecreasing with empty rows lo == hi
      lo[r] = static_cast<int32_t>(std::clamp<int64_t>(klo[r] - k0, 0, w));
      hi[r] = static_cast<int32_t>(std::clamp<int64_t>(std::max(klo[r], khi[r]) - k0, 0, w));
    }
  }
  int64_t tiles() const { return w == 0 ? 0 : (nr + 15) / 16 * (wp / kKeyTile); }
};

// The products of one band: C (= or +=) alpha * A B as tiles::micro computes them, skipping what
// the rows' runs [lo, hi) make zero or unneeded (lo, hi nondecreasing; tile row r = query row r,
// tile column c = key c):
//   kScores (M = rows, N = keys, C = Q K^T or dO V^T): C[r, c] is only needed for lo[r] <= c < hi[r];
//     a column block is computed for the rows whose run meets it (other entries left unwritten).
//   kRowsKeys (M = rows, k = keys, A = P or dS): A(r, c) == 0 outside [lo[r], hi[r]): the sum of
//     rows [r, r + mr) runs over [lo[r], hi[r + mr - 1]).
//   kKeysRows (M = keys, k = rows, A = P^T or dS^T): A(c, r) == 0 unless lo[r] <= c < hi[r]: the
//     sum of key rows [c, c + mr) runs over the query rows whose run meets them.
enum class Shape { kScores, kRowsKeys, kKeysRows };
void band_gemm(Shape shape, const Band& bd, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t a_rs,
               int64_t a_cs, const float* B, int64_t ldb, bool accumulate, float* C, int64_t ldc) {
  const int32_t *lo = bd.lo, *hi = bd.hi;
  auto k_range = [&](int64_t i, int64_t mr) -> std::pair<int64_t, int64_t> {
    if (shape == Shape::kRowsKeys) return {lo[i], std::max<int64_t>(lo[i], hi[i + mr - 1])};
    if (shape == Shape::kKeysRows) {
      const int64_t k0 = std::upper_bound(hi, hi + K, static_cast<int32_t>(i)) - hi;
      const int64_t k1 = std::upper_bound(lo, lo + K, static_cast<int32_t>(i + mr - 1)) - lo;
      return {k0, std::max(k0, k1)};
    }
    return {0, K};
  };
  auto block = [&]<int NV>(int64_t j) {
    int64_t i_begin = 0, i_end = M;
    if (shape == Shape::kScores) {
      i_begin = std::upper_bound(hi, hi + M, static_cast<int32_t>(j)) - hi;
      i_end = std::lower_bound(lo, lo + M, static_cast<int32_t>(j + vec::kW * NV)) - lo;
    }
    for (int64_t i = i_begin; i < i_end; i += tiles::kMR) {
      const int64_t mr = std::min(tiles::kMR, i_end - i);
      const auto [k0, k1] = k_range(i, mr);
      tiles::micro_rows<NV>(mr, k1 - k0, alpha, A + i * a_rs + k0 * a_cs, a_rs, a_cs, B + k0 * ldb + j, ldb, accumulate,
                            C + i * ldc + j, ldc);
    }
  };
  int64_t j = 0;
  for (; j + tiles::kColsBig <= N; j += tiles::kColsBig) block.template operator()<tiles::kColsBig / vec::kW>(j);
  for (; j + 16 <= N; j += 16) block.template operator()<16 / vec::kW>(j);
  if (j < N) tiles::tail_cols(M, j, N, K, alpha, A, a_rs, a_cs, B, ldb, accumulate, C, ldc);
}

// The score scale of a block: a.scale, or 1/sqrt(D) (0).
float score_scale(const BlockAttention& a) {
  return a.scale > 0.0f ? a.scale : 1.0f / std::sqrt(static_cast<float>(a.D));
}

int64_t block_rows(const BlockAttention& a) { return a.q_doc || a.window > 0 ? kDocRows : kRows; }

// Per-thread scratch floats (see the file comment) and its allocation for every thread.
int64_t scratch_floats(const BlockAttention& a) {
  const int64_t tkp = round16(a.Tk), br = block_rows(a);
  return 2 * br * tkp + br + 2 * a.D * tkp + a.Tk * a.D;
}
std::unique_ptr<float[]> scratch(const BlockAttention& a) {
  return std::unique_ptr<float[]>(new float[static_cast<size_t>(omp_get_max_threads() * scratch_floats(a))]);
}

// x[D, Tk16] <- rows of one head (stride ld) transposed, the padding columns zero.
void transpose_padded(float* x, const float* src, const BlockAttention& a, int64_t ld) {
  const int64_t tkp = round16(a.Tk);
  tiles::transpose_head(x, src, a.Tk, a.D, ld, tkp);
  for (int64_t d = 0; d < a.D; ++d) std::fill(x + d * tkp + a.Tk, x + (d + 1) * tkp, 0.0f);
}

// One (batch row, query head) of the forward (S: this thread's scratch).
void forward_head(const BlockAttention& a, int64_t b, int64_t h, float* out, int64_t ldo, float* lse, float* S) {
  const int64_t D = a.D, g = h / (a.H / a.KVH), tkp = round16(a.Tk), br = block_rows(a);
  const float scale = score_scale(a), cap = a.softcap;
  float* Kt = S + 2 * br * tkp + br;  // [D, Tk16]
  float* Vc = Kt + 2 * D * tkp;       // [Tk, D]
  const float* q = a.q + b * a.Tq * a.ldq + h * D;
  float* o = out + b * a.Tq * ldo + h * D;
  float* l = lse + (b * a.H + h) * a.Tq;
  transpose_padded(Kt, a.k + b * a.Tk * a.ldk + g * D, a, a.ldk);
  tiles::pack_head(Vc, a.v + b * a.Tk * a.ldv + g * D, a.Tk, D, a.ldv);
  int64_t tiles = 0;
  for (int64_t i0 = 0; i0 < a.Tq; i0 += br) {
    const Band bd(a, b, i0, br);
    if (bd.w == 0) {  // no row sees a key of this block: the merge's identity
      for (int64_t r = 0; r < bd.nr; ++r) std::fill(o + (i0 + r) * ldo, o + (i0 + r) * ldo + D, 0.0f);
      std::fill(l + i0, l + i0 + bd.nr, kNegInf);
      continue;
    }
    tiles += bd.tiles();
    // S = scale * Q K[k0:]^T, then each row's softmax over its run (zero elsewhere)
    band_gemm(Shape::kScores, bd, bd.nr, bd.wp, D, scale, q + i0 * a.ldq, a.ldq, 1, Kt + bd.k0, tkp, false, S, bd.wp);
    for (int64_t r = 0; r < bd.nr; ++r) {
      float* s = S + r * bd.wp;
      const int64_t lo = bd.lo[r], hi = bd.hi[r];
      if (lo == hi) {
        std::fill(s, s + bd.wp, 0.0f);
        l[i0 + r] = kNegInf;
        continue;
      }
      if (cap > 0.0f)  // as transformers' Gemma2Attention: a division, tanh, a product
        for (int64_t j = lo; j < hi; ++j) s[j] = cap * std::tanh(s[j] / cap);
      const float mx = vec::row_max(s + lo, hi - lo);
      const float sum = static_cast<float>(vec::exp_shift_sum(s + lo, hi - lo, mx));
      vec::scale(s + lo, hi - lo, 1.0f / sum);
      std::fill(s, s + lo, 0.0f);
      std::fill(s + hi, s + bd.wp, 0.0f);
      l[i0 + r] = mx + std::log(sum);
    }
    // O = P V[k0:k0+w] (rows that see nothing get 0)
    band_gemm(Shape::kRowsKeys, bd, bd.nr, D, bd.w, 1.0f, S, bd.wp, 1, Vc + bd.k0 * D, D, false, o + i0 * ldo, ldo);
  }
  g_block_fwd.fetch_add(tiles, std::memory_order_relaxed);
}

// dQ[i0:] += dS K[k0:],  dK[k0:] += dS^T Q[i0:] for one band (dq, dk: its first rows; Kc: [Tk, D]).
void grads_from_ds(const BlockAttention& a, const Band& bd, const float* dS, const float* Kc, const float* qb,
                   float* dq, int64_t lddq, float* dk, int64_t lddk) {
  band_gemm(Shape::kRowsKeys, bd, bd.nr, a.D, bd.w, 1.0f, dS, bd.wp, 1, Kc + bd.k0 * a.D, a.D, true, dq, lddq);
  band_gemm(Shape::kKeysRows, bd, bd.w, a.D, bd.nr, 1.0f, dS, 1, bd.wp, qb, a.ldq, true, dk, lddk);
}

// Soft-capped backward of one band: P holds the scaled raw scores s, dS holds dP = dO V^T; per
// visible key t = tanh(s / cap), P <- exp(cap t - lse), dS <- P (dP - Di) (1 - t^2) scale, the rest
// zero (as attention.cpp's capped path). l, o, dob: the band's first rows.
void capped_probs(const BlockAttention& a, const Band& bd, float* P, float* dS, const float* l, const float* o,
                  const float* dob, int64_t ldo, float scale) {
  const float cap = a.softcap;
  for (int64_t r = 0; r < bd.nr; ++r) {
    float* p = P + r * bd.wp;
    float* dsr = dS + r * bd.wp;
    const int64_t lo = bd.lo[r], hi = l[r] == kNegInf ? lo : bd.hi[r];
    float di = 0.0f;
    for (int64_t d = 0; d < a.D; ++d) di += o[r * ldo + d] * dob[r * ldo + d];
    for (int64_t j = lo; j < hi; ++j) {
      const float t = std::tanh(p[j] / cap);
      const float pj = vec::exp1(cap * t - l[r]);
      p[j] = pj;
      dsr[j] = pj * (dsr[j] - di) * (1.0f - t * t) * scale;
    }
    std::fill(p, p + lo, 0.0f), std::fill(dsr, dsr + lo, 0.0f);
    std::fill(p + hi, p + bd.wp, 0.0f), std::fill(dsr + hi, dsr + bd.wp, 0.0f);
  }
}

// The views of one backward task: the final out, dout (stride ldo), lse and the gradients.
struct Grads {
  const float *out, *dout, *lse;
  int64_t ldo;
  float *dq, *dk, *dv;
  int64_t lddq, lddk, lddv;
};

// Batch row b, kv head g and every query head of its group (one backward task; P: scratch).
void backward_group(const BlockAttention& a, int64_t b, int64_t g, const Grads& gr, float* P) {
  const int64_t D = a.D, rep = a.H / a.KVH, tkp = round16(a.Tk), br = block_rows(a);
  const float scale = score_scale(a);
  float* dS = P + br * tkp;   // [Br, Tk16]
  float* Di = dS + br * tkp;  // [Br]
  float* Kt = Di + br;        // [D, Tk16]
  float* Vt = Kt + D * tkp;   // [D, Tk16]
  float* Kc = Vt + D * tkp;   // [Tk, D]
  transpose_padded(Kt, a.k + b * a.Tk * a.ldk + g * D, a, a.ldk);
  transpose_padded(Vt, a.v + b * a.Tk * a.ldv + g * D, a, a.ldv);
  tiles::pack_head(Kc, a.k + b * a.Tk * a.ldk + g * D, a.Tk, D, a.ldk);
  float* dk = gr.dk + b * a.Tk * gr.lddk + g * D;
  float* dv = gr.dv + b * a.Tk * gr.lddv + g * D;
  int64_t tiles = 0;
  for (int64_t h = g * rep; h < (g + 1) * rep; ++h) {
    const float* q = a.q + b * a.Tq * a.ldq + h * D;
    const float* o = gr.out + b * a.Tq * gr.ldo + h * D;
    const float* dO = gr.dout + b * a.Tq * gr.ldo + h * D;
    const float* l = gr.lse + (b * a.H + h) * a.Tq;
    float* dq = gr.dq + b * a.Tq * gr.lddq + h * D;
    for (int64_t i0 = 0; i0 < a.Tq; i0 += br) {
      const Band bd(a, b, i0, br);
      if (bd.w == 0) continue;
      tiles += bd.tiles();
      const float* qb = q + i0 * a.ldq;
      const float* dob = dO + i0 * gr.ldo;
      // P = exp(scale * Q K^T - lse) over each row's run, zero elsewhere
      band_gemm(Shape::kScores, bd, bd.nr, bd.wp, D, scale, qb, a.ldq, 1, Kt + bd.k0, tkp, false, P, bd.wp);
      if (a.softcap > 0.0f) {  // dP first, then P and dS together from the raw scores
        band_gemm(Shape::kScores, bd, bd.nr, bd.wp, D, 1.0f, dob, gr.ldo, 1, Vt + bd.k0, tkp, false, dS, bd.wp);
        capped_probs(a, bd, P, dS, l + i0, o + i0 * gr.ldo, dob, gr.ldo, scale);
        band_gemm(Shape::kKeysRows, bd, bd.w, D, bd.nr, 1.0f, P, 1, bd.wp, dob, gr.ldo, true, dv + bd.k0 * gr.lddv,
                  gr.lddv);
        grads_from_ds(a, bd, dS, Kc, qb, dq + i0 * gr.lddq, gr.lddq, dk + bd.k0 * gr.lddk, gr.lddk);
        continue;
      }
      for (int64_t r = 0; r < bd.nr; ++r) {
        float* p = P + r * bd.wp;
        const float li = l[i0 + r];
        // a row with no key in any block (lse = -inf: not under a causal mask) has no gradient
        const int64_t lo = bd.lo[r], hi = li == kNegInf ? lo : bd.hi[r];
        vec::exp_shift(p + lo, hi - lo, li);
        std::fill(p, p + lo, 0.0f);
        std::fill(p + hi, p + bd.wp, 0.0f);
        const float* orow = o + (i0 + r) * gr.ldo;
        const float* drow = dob + r * gr.ldo;
        float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
        for (int64_t d = 0; d < D; ++d) acc += orow[d] * drow[d];
        Di[r] = acc;
      }
      // dV[k0:k0+w] += P^T dO
      band_gemm(Shape::kKeysRows, bd, bd.w, D, bd.nr, 1.0f, P, 1, bd.wp, dob, gr.ldo, true, dv + bd.k0 * gr.lddv,
                gr.lddv);
      // dP = dO V^T, then dS = P (dP - Di) scale (P is zero outside the runs)
      band_gemm(Shape::kScores, bd, bd.nr, bd.wp, D, 1.0f, dob, gr.ldo, 1, Vt + bd.k0, tkp, false, dS, bd.wp);
      for (int64_t r = 0; r < bd.nr; ++r) {
        const float* p = P + r * bd.wp;
        float* dsr = dS + r * bd.wp;
        const float di = Di[r];
        const int64_t lo = bd.lo[r], hi = bd.hi[r];
        std::fill(dsr, dsr + lo, 0.0f);
#pragma omp simd
        for (int64_t j = lo; j < hi; ++j) dsr[j] = p[j] * (dsr[j] - di) * scale;
        std::fill(dsr + hi, dsr + bd.wp, 0.0f);
      }
      grads_from_ds(a, bd, dS, Kc, qb, dq + i0 * gr.lddq, gr.lddq, dk + bd.k0 * gr.lddk, gr.lddk);
    }
  }
  g_block_bwd.fetch_add(tiles, std::memory_order_relaxed);
}

}  // namespace

void attention_block_forward(const BlockAttention& a, float* out, int64_t ldo, float* lse) {
  check_block("attention_block_forward", a);
  if (a.Tq == 0) return;
  if (a.Tk == 0) {  // nothing to see: the merge's identity
    for (int64_t n = 0; n < a.B * a.Tq; ++n) std::fill(out + n * ldo, out + n * ldo + a.H * a.D, 0.0f);
    std::fill(lse, lse + a.B * a.H * a.Tq, kNegInf);
    return;
  }
  const auto buf = scratch(a);
  const int64_t per = scratch_floats(a);
  const int max_thr = omp_get_max_threads();
#pragma omp parallel for schedule(static) num_threads(max_thr)
  for (int64_t bh = 0; bh < a.B * a.H; ++bh)
    forward_head(a, bh / a.H, bh % a.H, out, ldo, lse, buf.get() + omp_get_thread_num() * per);
}

void attention_block_backward(const BlockAttention& a, const float* out, const float* dout, int64_t ldo,
                              const float* lse, float* dq, int64_t lddq, float* dk, int64_t lddk, float* dv,
                              int64_t lddv) {
  check_block("attention_block_backward", a);
  if (a.Tq == 0 || a.Tk == 0) return;
  const auto buf = scratch(a);
  const int64_t per = scratch_floats(a);
  const Grads gr{out, dout, lse, ldo, dq, dk, dv, lddq, lddk, lddv};
  const int max_thr = omp_get_max_threads();
  // One task per (b, kv head): it alone writes that kv head's dk, dv and its query heads' dq.
#pragma omp parallel for schedule(static) num_threads(max_thr)
  for (int64_t bg = 0; bg < a.B * a.KVH; ++bg)
    backward_group(a, bg / a.KVH, bg % a.KVH, gr, buf.get() + omp_get_thread_num() * per);
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
