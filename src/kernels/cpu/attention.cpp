// Causal grouped-query self-attention, forward and backward, flash-style over query blocks.
//
// Layout (see ops.h): qkv[B, T, (H + 2*KVH) * D]; per row, H query heads, then KVH key heads, then
// KVH value heads. Query head h reads kv head h / (H / KVH).
//
// Work is split into query blocks of `Br` rows. For a block [i0, i1) only keys [0, i1) can be
// attended to (causal), so the block's score tile is [Br, i1] and the upper-right triangle beyond
// i1 is never computed. The tile products go through cblas_sgemm, which runs single-threaded inside
// our OpenMP regions (OpenMP build of OpenBLAS), with strided leading dimensions straight into qkv.
//
// Forward saves lse[B, H, T] = logsumexp of each scaled score row. Backward recomputes the
// probabilities P = exp(S - lse) and uses D_i = sum_d dout[i,d] * out[i,d] (= sum_j P_ij dP_ij):
//   dV += P^T dO,  dP = dO V^T,  dS = P * (dP - D_i) * scale,  dQ = dS K,  dK += dS^T Q.
//
// Scratch per thread: two [Br, T] tiles plus Br floats, Br = clamp(T/2, 1, 64), so a thread never
// holds more than one (T x T) score tile's worth of memory (T >= 2).
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>

#include <cblas.h>
#include <omp.h>

#include "core/error.h"
#include "kernels/cpu/ops.h"

namespace lathe::cpu {
namespace {

// exp(x) for float, about 1-2 ulp (Cephes expf polynomial), written so that gcc vectorises loops
// calling it (no libm call, round-to-nearest via the 1.5*2^23 trick). Returns 0 below -87.3 where
// the float result would be denormal; inputs here are <= 0 after max subtraction.
inline float exp_approx(float x) {
  const float xc = std::min(std::max(x, -87.3f), 88.3f);
  const float big = 12582912.0f;  // 1.5 * 2^23
  const float n = (xc * 1.44269504088896341f + big) - big;
  float r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  const int32_t e = (static_cast<int32_t>(n) + 127) << 23;
  const float scale = std::bit_cast<float>(e);
  return x < -87.3f ? 0.0f : y * scale;
}

inline int64_t block_rows(int64_t T) { return std::clamp<int64_t>(T / 2, 1, 64); }
inline int64_t tile_floats(int64_t T) { return 2 * block_rows(T) * T + block_rows(T); }

void check_shapes(const char* fn, int64_t B, int64_t T, int64_t H, int64_t KVH, int64_t D) {
  LATHE_CHECK(B >= 1 && T >= 1 && H >= 1 && KVH >= 1 && D >= 1,
              "{}: invalid shape B={} T={} H={} KVH={} D={} (all must be >= 1)", fn, B, T, H, KVH, D);
  LATHE_CHECK(H % KVH == 0, "{}: n_head {} is not a multiple of n_kv_head {}; set n_kv_head to a divisor of n_head",
              fn, H, KVH);
}

}  // namespace

size_t attention_scratch_floats(int64_t T, int64_t D) {
  (void)D;
  return static_cast<size_t>(omp_get_max_threads()) * static_cast<size_t>(tile_floats(T));
}

void attention_forward(float* out, float* lse, const float* qkv, int64_t B, int64_t T, int64_t H, int64_t KVH,
                       int64_t D, float* scratch) {
  check_shapes("attention_forward", B, T, H, KVH, D);
  const int64_t ld = (H + 2 * KVH) * D;  // qkv row stride
  const int64_t ldo = H * D;             // out row stride
  const int64_t rep = H / KVH;
  const int64_t Br = block_rows(T);
  const int64_t per_thread = tile_floats(T);
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const int max_thr = omp_get_max_threads();

#pragma omp parallel for schedule(static) num_threads(max_thr)
  for (int64_t bh = 0; bh < B * H; ++bh) {
    const int64_t b = bh / H, h = bh % H, g = h / rep;
    float* S = scratch + static_cast<int64_t>(omp_get_thread_num()) * per_thread;  // [Br, T] tile
    const float* q = qkv + b * T * ld + h * D;
    const float* k = qkv + b * T * ld + (H + g) * D;
    const float* v = qkv + b * T * ld + (H + KVH + g) * D;
    float* o = out + b * T * ldo + h * D;
    float* l = lse + (b * H + h) * T;
    for (int64_t i0 = 0; i0 < T; i0 += Br) {
      const int64_t nr = std::min(Br, T - i0), nc = i0 + nr;  // tile [nr, nc], ld nc
      // S = scale * Q[i0:i0+nr] @ K[0:nc]^T
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, nr, nc, D, scale, q + i0 * ld, ld, k, ld, 0.0f, S, nc);
      for (int64_t r = 0; r < nr; ++r) {
        float* s = S + r * nc;
        const int64_t n = i0 + r + 1;  // keys 0..i inclusive
        float m = -INFINITY;
#pragma omp simd reduction(max : m)
        for (int64_t j = 0; j < n; ++j) m = std::max(m, s[j]);
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < n; ++j) {
          const float e = exp_approx(s[j] - m);
          s[j] = e;
          sum += e;
        }
        const float inv = 1.0f / sum;
#pragma omp simd
        for (int64_t j = 0; j < n; ++j) s[j] *= inv;
        for (int64_t j = n; j < nc; ++j) s[j] = 0.0f;
        l[i0 + r] = m + std::log(sum);
      }
      // O[i0:i0+nr] = P @ V[0:nc]
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, nr, D, nc, 1.0f, S, nc, v, ld, 0.0f, o + i0 * ldo, ldo);
    }
  }
}

void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out, const float* lse,
                        int64_t B, int64_t T, int64_t H, int64_t KVH, int64_t D, float* scratch) {
  check_shapes("attention_backward", B, T, H, KVH, D);
  const int64_t ld = (H + 2 * KVH) * D;
  const int64_t ldo = H * D;
  const int64_t rep = H / KVH;
  const int64_t Br = block_rows(T);
  const int64_t per_thread = tile_floats(T);
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const int max_thr = omp_get_max_threads();

  // One task per (b, kv head): it owns dK, dV of that kv head and dQ of every query head of its
  // group, so everything is written by one thread in a fixed order (deterministic, no atomics).
#pragma omp parallel for schedule(static) num_threads(max_thr)
  for (int64_t bg = 0; bg < B * KVH; ++bg) {
    const int64_t b = bg / KVH, g = bg % KVH;
    float* P = scratch + static_cast<int64_t>(omp_get_thread_num()) * per_thread;  // [Br, T]
    float* dS = P + Br * T;                                                        // [Br, T]
    float* Di = dS + Br * T;                                                       // [Br]
    const float* k = qkv + b * T * ld + (H + g) * D;
    const float* v = qkv + b * T * ld + (H + KVH + g) * D;
    float* dk = dqkv + b * T * ld + (H + g) * D;
    float* dv = dqkv + b * T * ld + (H + KVH + g) * D;
    for (int64_t t = 0; t < T; ++t) {
      std::fill(dk + t * ld, dk + t * ld + D, 0.0f);
      std::fill(dv + t * ld, dv + t * ld + D, 0.0f);
    }
    for (int64_t h = g * rep; h < (g + 1) * rep; ++h) {
      const float* q = qkv + b * T * ld + h * D;
      float* dq = dqkv + b * T * ld + h * D;
      const float* o = out + b * T * ldo + h * D;
      const float* dout_h = dout + b * T * ldo + h * D;
      const float* l = lse + (b * H + h) * T;
      for (int64_t i0 = 0; i0 < T; i0 += Br) {
        const int64_t nr = std::min(Br, T - i0), nc = i0 + nr;
        const float* qb = q + i0 * ld;
        const float* dob = dout_h + i0 * ldo;
        // P = exp(scale * Q K^T - lse), causal entries zeroed.
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, nr, nc, D, scale, qb, ld, k, ld, 0.0f, P, nc);
        for (int64_t r = 0; r < nr; ++r) {
          float* p = P + r * nc;
          const int64_t n = i0 + r + 1;
          const float li = l[i0 + r];
#pragma omp simd
          for (int64_t j = 0; j < n; ++j) p[j] = exp_approx(p[j] - li);
          for (int64_t j = n; j < nc; ++j) p[j] = 0.0f;
          const float* orow = o + (i0 + r) * ldo;
          const float* drow = dob + r * ldo;
          float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
          for (int64_t d = 0; d < D; ++d) acc += orow[d] * drow[d];
          Di[r] = acc;
        }
        // dV[0:nc] += P^T dO
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, nc, D, nr, 1.0f, P, nc, dob, ldo, 1.0f, dv, ld);
        // dP = dO V^T
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, nr, nc, D, 1.0f, dob, ldo, v, ld, 0.0f, dS, nc);
        for (int64_t r = 0; r < nr; ++r) {
          const float* p = P + r * nc;
          float* ds = dS + r * nc;
          const float di = Di[r];
#pragma omp simd
          for (int64_t j = 0; j < nc; ++j) ds[j] = p[j] * (ds[j] - di) * scale;
        }
        // dQ[i0:i0+nr] = dS K[0:nc]  (overwrite),  dK[0:nc] += dS^T Q[i0:i0+nr]
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, nr, D, nc, 1.0f, dS, nc, k, ld, 0.0f, dq + i0 * ld, ld);
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, nc, D, nr, 1.0f, dS, nc, qb, ld, 1.0f, dk, ld);
      }
    }
  }
}

}  // namespace lathe::cpu
