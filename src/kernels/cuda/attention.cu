// Causal grouped-query attention on CUDA, forward and backward, flash-style (FlashAttention-2's
// loop order), fp32 math for fp32 and bf16 storage. Contract: kernels/cpu/ops.h (attention_*).
//
// Layout: qkv[B, T, (H + 2*KVH) * D] (per row: H query heads, KVH key heads, KVH value heads; query
// head h reads kv head h / (H / KVH)), out[B, T, H*D], lse[B, H, T] fp32, doc_start[B, T] or null.
// Tiles, block shapes and shared memory: kernels/cuda/attention_launch.h.
//
// Forward (one block per query tile and head): online softmax over key tiles [k0, i0 + nr) with
// running max m and sum l per row; O = (sum_j exp(s_j - m) v_j) / l; lse = m + log l.
// Backward recomputes P = exp(scale * q.k - lse) (no T x T matrix is stored) and
// D_i = sum_d dO[i,d] * O[i,d]; dP = dO V^T; dS = P * (dP - D_i) * scale; then
//   dK/dV kernel (one block per key tile and kv head, looping over the group's query heads and the
//   query tiles at or after the key tile): dV += P^T dO, dK += dS^T Q;
//   dQ kernel (one block per query tile and head, looping over key tiles): dQ = dS K.
// Every output element is written by exactly one block, summed in a fixed order: results are
// bit-reproducible (no atomics), and nothing needs scratch memory (attention_scratch_bytes = 0).
//
// Masks: query i sees keys [lo_i, i], lo_i = doc_start[b, i] (clamped into [0, i], so a malformed
// table cannot make a kernel read outside the sample) or 0, raised to i - window + 1 by a sliding
// window (window > 0, HF Mistral's keys j > i - window; window >= T is none). lo_i never decreases
// with i. Key tiles left of a query tile's first row's lo are not visited; a key tile whose keys
// all precede lo of a later query tile's first row ends the dK/dV kernel's query loop. The CPU
// kernels validate doc_start; here it is device memory and trusted as built by models/documents.h.
//
// Not done: a tensor-core (mma / wgmma) path for bf16 and the cuDNN SDPA option; this kernel runs
// on the CUDA cores (fp32 FMA), which keeps fp32 runs within fp32 rounding of the CPU reference.
// clang-format off
#include "kernels/cuda/device_util.cuh"  // first: it configures fmt for nvcc
// clang-format on
#include <cmath>
#include <cstdint>

#include "kernels/cuda/attention_launch.h"
#include "kernels/cuda/ops.h"

namespace lathe::cuda {
namespace {

using attn::kScoreStride;
using attn::kThreads;
using attn::kTile;

// Shapes and strides of one call, passed by value to every kernel.
struct Geometry {
  int64_t T, H, KVH, D;
  int64_t ld;   // qkv row stride (H + 2*KVH) * D
  int64_t ldo;  // out row stride H * D
  int64_t ntiles;
  float scale;     // 1 / sqrt(D), or the caller's score scale (Gemma 2: 1 / sqrt(query_pre_attn_scalar))
  int64_t window;  // sliding window (0 = none)
  float softcap;   // > 0: scores s <- softcap * tanh(s / softcap) before the softmax (0 = none)
};

// The score of a visible entry from the raw product q.k: scale, then the soft cap (tanh) if any.
__device__ __forceinline__ float score(float qk, const Geometry& g) {
  const float s = g.scale * qk;
  return g.softcap > 0.0f ? g.softcap * tanhf(s / g.softcap) : s;
}

// dst[kTile, DP+1] <- rows [r0, r0 + n) of src (row stride ld, D columns), zero elsewhere.
template <int DP, typename St>
__device__ __forceinline__ void load_tile(float* dst, const St* src, int64_t r0, int64_t n, int64_t ld, int64_t D) {
  constexpr int S = DP + 1;
  for (int idx = threadIdx.x; idx < kTile * DP; idx += kThreads) {
    const int r = idx / DP, d = idx % DP;
    dst[r * S + d] = (r < n && d < D) ? load_f(src + (r0 + r) * ld + d) : 0.0f;
  }
}

__device__ __forceinline__ float reduce16_max(float v) {
#pragma unroll
  for (int off = 8; off >= 1; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}
__device__ __forceinline__ float reduce16_sum(float v) {
#pragma unroll
  for (int off = 8; off >= 1; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

// The first key of query i's document (0 without documents), clamped into [0, i].
__device__ __forceinline__ int64_t doc_lo(const int32_t* ds, int64_t i) {
  if (ds == nullptr) return 0;
  const int64_t s = ds[i];
  return s < 0 ? 0 : (s > i ? i : s);
}
// The first key query i sees: its document's, raised by the sliding window (window 0: none).
__device__ __forceinline__ int64_t key_lo(const int32_t* ds, int64_t window, int64_t i) {
  return attn::window_lo(doc_lo(ds, i), window, i);
}

// acc[i][j] = sum_d A[ty + 16 i][d] * Bm[tx + 16 j][d] over a [kTile, DP+1] pair of tiles.
template <int DP>
__device__ __forceinline__ void tile_dot(float (&acc)[4][4], const float* A, const float* Bm, int ty, int tx) {
  constexpr int S = DP + 1;
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[i][j] = 0.0f;
#pragma unroll 4
  for (int d = 0; d < DP; ++d) {
    float a[4], b[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) a[i] = A[(ty + 16 * i) * S + d];
#pragma unroll
    for (int j = 0; j < 4; ++j) b[j] = Bm[(tx + 16 * j) * S + d];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[i][j] += a[i] * b[j];
  }
}

// ---- forward ---------------------------------------------------------------------------------
template <int DP, typename St>
__global__ void __launch_bounds__(kThreads)
    attention_forward_kernel(St* __restrict__ out, float* __restrict__ lse, const St* __restrict__ qkv, Geometry g,
                             int64_t heads, const int32_t* __restrict__ doc_start) {
  constexpr int S = DP + 1, NJ = DP / 16;
  extern __shared__ float smem[];
  float* sQ = smem;
  float* sK = sQ + kTile * S;
  float* sV = sK + kTile * S;
  float* sP = sV + kTile * S;
  const attn::BlockWork w = attn::query_block(blockIdx.x, g.ntiles, heads);
  const int64_t b = w.slot / g.H, h = w.slot % g.H, kvh = h / (g.H / g.KVH);
  const int64_t i0 = w.tile * kTile, nr = min(static_cast<int64_t>(kTile), g.T - i0);
  const St* base = qkv + b * g.T * g.ld;
  const int32_t* ds = doc_start ? doc_start + b * g.T : nullptr;
  const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;

  load_tile<DP>(sQ, base + h * g.D, i0, nr, g.ld, g.D);
  // Keys row i of this thread may see: [lo[i], hi[i]] (hi = -1: padding row beyond T).
  int64_t lo[4], hi[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int r = ty + 16 * i;
    hi[i] = r < nr ? i0 + r : -1;
    lo[i] = r < nr ? key_lo(ds, g.window, i0 + r) : 0;
  }
  float m[4], l[4], o[4][NJ];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    m[i] = -INFINITY;
    l[i] = 0.0f;
#pragma unroll
    for (int jj = 0; jj < NJ; ++jj) o[i][jj] = 0.0f;
  }
  const int64_t k_end = i0 + nr;
  for (int64_t j0 = attn::first_key(key_lo(ds, g.window, i0), i0); j0 < k_end; j0 += kTile) {
    const int64_t nk = min(static_cast<int64_t>(kTile), k_end - j0);
    __syncthreads();  // the previous tile's readers of sK, sV, sP are done
    load_tile<DP>(sK, base + (g.H + kvh) * g.D, j0, nk, g.ld, g.D);
    load_tile<DP>(sV, base + (g.H + g.KVH + kvh) * g.D, j0, nk, g.ld, g.D);
    __syncthreads();
    float s[4][4];
    tile_dot<DP>(s, sQ, sK, ty, tx);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float mx = -INFINITY;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int64_t key = j0 + tx + 16 * j;
        s[i][j] = (key >= lo[i] && key <= hi[i]) ? score(s[i][j], g) : -INFINITY;
        mx = fmaxf(mx, s[i][j]);
      }
      mx = reduce16_max(mx);
      const float m_new = fmaxf(m[i], mx);
      // A row with no visible key yet keeps m = -inf and p = 0 (never exp(-inf - -inf)).
      const float shift = m_new == -INFINITY ? 0.0f : m_new;
      const float corr = expf(m[i] - shift);
      float rs = 0.0f;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float p = expf(s[i][j] - shift);
        rs += p;
        sP[(ty + 16 * i) * kScoreStride + tx + 16 * j] = p;
      }
      rs = reduce16_sum(rs);
      l[i] = l[i] * corr + rs;
      m[i] = m_new;
#pragma unroll
      for (int jj = 0; jj < NJ; ++jj) o[i][jj] *= corr;
    }
    __syncthreads();
    // O += P V (padding keys have p = 0 and zero V rows)
#pragma unroll 4
    for (int c = 0; c < kTile; ++c) {
      float v[NJ];
#pragma unroll
      for (int jj = 0; jj < NJ; ++jj) v[jj] = sV[c * S + tx + 16 * jj];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float p = sP[(ty + 16 * i) * kScoreStride + c];
#pragma unroll
        for (int jj = 0; jj < NJ; ++jj) o[i][jj] += p * v[jj];
      }
    }
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if (hi[i] < 0) continue;
    const int64_t row = hi[i];
    const float inv = 1.0f / l[i];
    St* orow = out + (b * g.T + row) * g.ldo + h * g.D;
#pragma unroll
    for (int jj = 0; jj < NJ; ++jj) {
      const int d = tx + 16 * jj;
      if (d < g.D) store_f(orow + d, o[i][jj] * inv);
    }
    if (tx == 0) lse[(b * g.H + h) * g.T + row] = m[i] + logf(l[i]);
  }
}

// ---- backward: shared pieces -------------------------------------------------------------------
// Loads the query-side tiles of query tile [i0, i0 + nr) of head h: Q and dO [kTile, DP+1], and per
// row lse, D_i = dO . O and the document's first key (sLo; padding rows get lo = 0 and lse = 0).
template <int DP, typename St>
__device__ void load_query_side(float* sQ, float* sdO, float* sL, float* sDi, float* sLo, const St* qkv_b,
                                const St* out_b, const St* dout_b, const float* lse_bh, const int32_t* ds,
                                const Geometry& g, int64_t h, int64_t i0, int64_t nr) {
  constexpr int S = DP + 1;
  load_tile<DP>(sQ, qkv_b + h * g.D, i0, nr, g.ld, g.D);
  load_tile<DP>(sdO, dout_b + h * g.D, i0, nr, g.ldo, g.D);
  __syncthreads();  // sdO complete before the D_i dot products read it
  // D_i: 8 warps x 8 rows, lanes strided over d, then a warp sum (fixed order).
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int r = warp * 8; r < warp * 8 + 8; ++r) {
    float acc = 0.0f;
    if (r < nr)
      for (int d = lane; d < g.D; d += 32) acc += sdO[r * S + d] * load_f(out_b + (i0 + r) * g.ldo + h * g.D + d);
#pragma unroll
    for (int off = 16; off >= 1; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if (lane == 0) {
      sDi[r] = acc;
      sL[r] = r < nr ? lse_bh[i0 + r] : 0.0f;
      sLo[r] = r < nr ? static_cast<float>(key_lo(ds, g.window, i0 + r)) : 0.0f;
    }
  }
}

// P and dS of the [kTile x kTile] block (query rows i0 + ty + 16 i, keys j0 + tx + 16 j) from the
// loaded Q, dO, K, V tiles; masked entries (other document, future key, padding) are 0.
// Row lo is stored as float in sLo (exact: T < 2^24 is checked by the host).
template <int DP>
__device__ __forceinline__ void probs_and_dscores(float (&p)[4][4], float (&dsc)[4][4], const float* sQ,
                                                  const float* sdO, const float* sK, const float* sV, const float* sL,
                                                  const float* sDi, const float* sLo, int64_t i0, int64_t nr,
                                                  int64_t j0, int64_t nk, const Geometry& g, int ty, int tx) {
  float dp[4][4];
  tile_dot<DP>(p, sQ, sK, ty, tx);
  tile_dot<DP>(dp, sdO, sV, ty, tx);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int r = ty + 16 * i;
    const int64_t qi = i0 + r;
    const int64_t lo = static_cast<int64_t>(sLo[r]);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int c = tx + 16 * j;
      const int64_t key = j0 + c;
      const bool visible = r < nr && c < nk && key <= qi && key >= lo;
      const float s = score(p[i][j], g);
      const float pv = visible ? expf(s - sL[r]) : 0.0f;
      p[i][j] = pv;
      // soft cap: d s / d (scale q.k) = 1 - tanh^2, tanh = s / softcap
      const float th = g.softcap > 0.0f ? s / g.softcap : 0.0f;
      const float dcap = g.softcap > 0.0f ? 1.0f - th * th : 1.0f;
      dsc[i][j] = visible ? pv * (dp[i][j] - sDi[r]) * dcap * g.scale : 0.0f;
    }
  }
}

// ---- backward dK, dV -------------------------------------------------------------------------------
template <int DP, typename St>
__global__ void __launch_bounds__(kThreads)
    attention_dkdv_kernel(St* __restrict__ dqkv, const St* __restrict__ dout, const St* __restrict__ qkv,
                          const St* __restrict__ out, const float* __restrict__ lse, Geometry g, int64_t heads,
                          const int32_t* __restrict__ doc_start) {
  constexpr int S = DP + 1, NJ = DP / 16;
  extern __shared__ float smem[];
  float* sK = smem;
  float* sV = sK + kTile * S;
  float* sQ = sV + kTile * S;
  float* sdO = sQ + kTile * S;
  float* sP = sdO + kTile * S;
  float* sdS = sP + kTile * kScoreStride;
  float* sL = sdS + kTile * kScoreStride;
  float* sDi = sL + kTile;
  float* sLo = sDi + kTile;
  const attn::BlockWork w = attn::key_block(blockIdx.x, heads);
  const int64_t b = w.slot / g.KVH, kvh = w.slot % g.KVH, rep = g.H / g.KVH;
  const int64_t j0 = w.tile * kTile, nk = min(static_cast<int64_t>(kTile), g.T - j0);
  const St* qkv_b = qkv + b * g.T * g.ld;
  const St* out_b = out + b * g.T * g.ldo;
  const St* dout_b = dout + b * g.T * g.ldo;
  const int32_t* ds = doc_start ? doc_start + b * g.T : nullptr;
  const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;

  load_tile<DP>(sK, qkv_b + (g.H + kvh) * g.D, j0, nk, g.ld, g.D);
  load_tile<DP>(sV, qkv_b + (g.H + g.KVH + kvh) * g.D, j0, nk, g.ld, g.D);
  // dK, dV of key rows j0 + ty + 16 i, columns tx + 16 jj.
  float dk[4][NJ], dv[4][NJ];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int jj = 0; jj < NJ; ++jj) dk[i][jj] = dv[i][jj] = 0.0f;

  for (int64_t h = kvh * rep; h < (kvh + 1) * rep; ++h) {
    const float* lse_bh = lse + (b * g.H + h) * g.T;
    for (int64_t qt = w.tile; qt < g.ntiles; ++qt) {
      const int64_t i0 = qt * kTile, nr = min(static_cast<int64_t>(kTile), g.T - i0);
      // Documents / window: every query from i0 on sees only keys after this key tile's last one.
      if ((ds || g.window > 0) && !attn::query_tile_sees_keys(key_lo(ds, g.window, i0), i0, j0, nk)) break;
      __syncthreads();  // the previous query tile's readers are done
      load_query_side<DP>(sQ, sdO, sL, sDi, sLo, qkv_b, out_b, dout_b, lse_bh, ds, g, h, i0, nr);
      __syncthreads();
      float p[4][4], dsc[4][4];
      probs_and_dscores<DP>(p, dsc, sQ, sdO, sK, sV, sL, sDi, sLo, i0, nr, j0, nk, g, ty, tx);
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          sP[(ty + 16 * i) * kScoreStride + tx + 16 * j] = p[i][j];
          sdS[(ty + 16 * i) * kScoreStride + tx + 16 * j] = dsc[i][j];
        }
      __syncthreads();
      // dV[c] += sum_r P[r][c] dO[r];  dK[c] += sum_r dS[r][c] Q[r]   (c = ty + 16 i)
#pragma unroll 2
      for (int r = 0; r < kTile; ++r) {
        float qv[NJ], dov[NJ];
#pragma unroll
        for (int jj = 0; jj < NJ; ++jj) {
          qv[jj] = sQ[r * S + tx + 16 * jj];
          dov[jj] = sdO[r * S + tx + 16 * jj];
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float pc = sP[r * kScoreStride + ty + 16 * i];
          const float dc = sdS[r * kScoreStride + ty + 16 * i];
#pragma unroll
          for (int jj = 0; jj < NJ; ++jj) {
            dv[i][jj] += pc * dov[jj];
            dk[i][jj] += dc * qv[jj];
          }
        }
      }
    }
  }
  // Every key row of the tile is written (zero where no query sees it): dqkv is overwritten.
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int c = ty + 16 * i;
    if (c >= nk) continue;
    St* row = dqkv + (b * g.T + j0 + c) * g.ld;
#pragma unroll
    for (int jj = 0; jj < NJ; ++jj) {
      const int d = tx + 16 * jj;
      if (d < g.D) {
        store_f(row + (g.H + kvh) * g.D + d, dk[i][jj]);
        store_f(row + (g.H + g.KVH + kvh) * g.D + d, dv[i][jj]);
      }
    }
  }
}

// ---- backward dQ -------------------------------------------------------------------------------
template <int DP, typename St>
__global__ void __launch_bounds__(kThreads)
    attention_dq_kernel(St* __restrict__ dqkv, const St* __restrict__ dout, const St* __restrict__ qkv,
                        const St* __restrict__ out, const float* __restrict__ lse, Geometry g, int64_t heads,
                        const int32_t* __restrict__ doc_start) {
  constexpr int S = DP + 1, NJ = DP / 16;
  extern __shared__ float smem[];
  float* sQ = smem;
  float* sdO = sQ + kTile * S;
  float* sK = sdO + kTile * S;
  float* sV = sK + kTile * S;
  float* sdS = sV + kTile * S;
  float* sL = sdS + kTile * kScoreStride;
  float* sDi = sL + kTile;
  float* sLo = sDi + kTile;
  const attn::BlockWork w = attn::query_block(blockIdx.x, g.ntiles, heads);
  const int64_t b = w.slot / g.H, h = w.slot % g.H, kvh = h / (g.H / g.KVH);
  const int64_t i0 = w.tile * kTile, nr = min(static_cast<int64_t>(kTile), g.T - i0);
  const St* qkv_b = qkv + b * g.T * g.ld;
  const int32_t* ds = doc_start ? doc_start + b * g.T : nullptr;
  const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;

  load_query_side<DP>(sQ, sdO, sL, sDi, sLo, qkv_b, out + b * g.T * g.ldo, dout + b * g.T * g.ldo,
                      lse + (b * g.H + h) * g.T, ds, g, h, i0, nr);
  float dq[4][NJ];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int jj = 0; jj < NJ; ++jj) dq[i][jj] = 0.0f;
  const int64_t k_end = i0 + nr;
  for (int64_t j0 = attn::first_key(key_lo(ds, g.window, i0), i0); j0 < k_end; j0 += kTile) {
    const int64_t nk = min(static_cast<int64_t>(kTile), k_end - j0);
    __syncthreads();  // previous readers of sK, sdS done (and the query side loaded)
    load_tile<DP>(sK, qkv_b + (g.H + kvh) * g.D, j0, nk, g.ld, g.D);
    load_tile<DP>(sV, qkv_b + (g.H + g.KVH + kvh) * g.D, j0, nk, g.ld, g.D);
    __syncthreads();
    float p[4][4], dsc[4][4];
    probs_and_dscores<DP>(p, dsc, sQ, sdO, sK, sV, sL, sDi, sLo, i0, nr, j0, nk, g, ty, tx);
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) sdS[(ty + 16 * i) * kScoreStride + tx + 16 * j] = dsc[i][j];
    __syncthreads();
    // dQ[r] += sum_c dS[r][c] K[c]   (r = ty + 16 i)
#pragma unroll 4
    for (int c = 0; c < kTile; ++c) {
      float kv[NJ];
#pragma unroll
      for (int jj = 0; jj < NJ; ++jj) kv[jj] = sK[c * S + tx + 16 * jj];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float d = sdS[(ty + 16 * i) * kScoreStride + c];
#pragma unroll
        for (int jj = 0; jj < NJ; ++jj) dq[i][jj] += d * kv[jj];
      }
    }
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int r = ty + 16 * i;
    if (r >= nr) continue;
    St* row = dqkv + (b * g.T + i0 + r) * g.ld + h * g.D;
#pragma unroll
    for (int jj = 0; jj < NJ; ++jj) {
      const int d = tx + 16 * jj;
      if (d < g.D) store_f(row + d, dq[i][jj]);
    }
  }
}

// ---- host side ---------------------------------------------------------------------------------
Geometry check_geometry(const char* fn, int64_t B, int64_t T, int64_t H, int64_t KVH, int64_t D, int64_t window,
                        float scale, float softcap) {
  LATHE_CU_CHECK(B >= 1 && T >= 1 && H >= 1 && KVH >= 1 && D >= 1,
                 "{}: invalid shape B={} T={} H={} KVH={} D={} (all must be >= 1)", fn, B, T, H, KVH, D);
  LATHE_CU_CHECK(H % KVH == 0, "{}: n_head {} is not a multiple of n_kv_head {}; set n_kv_head to a divisor of n_head",
                 fn, H, KVH);
  LATHE_CU_CHECK(attn::head_dim_bucket(D) != 0,
                 "{}: head dim {} is above the {} the CUDA attention kernel supports; use a model with n_embd / n_head "
                 "<= {} or the cpu backend",
                 fn, D, attn::kMaxHeadDim, attn::kMaxHeadDim);
  LATHE_CU_CHECK(window >= 0, "{}: window = {} must be >= 0 (0 = no sliding window)", fn, window);
  LATHE_CU_CHECK(std::isfinite(scale) && scale >= 0.0f, "{}: scale = {} must be finite and >= 0 (0 = 1/sqrt(head_dim))",
                 fn, scale);
  LATHE_CU_CHECK(std::isfinite(softcap) && softcap >= 0.0f, "{}: softcap = {} must be finite and >= 0 (0 = no capping)",
                 fn, softcap);
  LATHE_CU_CHECK(T < (int64_t{1} << 24), "{}: sequence length {} is above the CUDA attention kernel's limit 2^24", fn,
                 T);
  LATHE_CU_CHECK(attn::forward_blocks(B, T, H) <= attn::kMaxGrid && attn::dkdv_blocks(B, T, KVH) <= attn::kMaxGrid,
                 "{}: B={} T={} H={} needs more than 2^31-1 thread blocks; use a smaller micro-batch", fn, B, T, H);
  Geometry g;
  g.T = T;
  g.H = H;
  g.KVH = KVH;
  g.D = D;
  g.ld = (H + 2 * KVH) * D;
  g.ldo = H * D;
  g.ntiles = attn::num_tiles(T);
  g.scale = scale > 0.0f ? scale : 1.0f / std::sqrt(static_cast<float>(D));
  g.window = window >= T ? 0 : window;  // a window over the whole sample is none
  g.softcap = softcap;
  return g;
}

// Raises a kernel's dynamic shared-memory limit once (above 48 KiB needs the opt-in).
template <typename K>
void allow_smem(K kernel, size_t bytes, bool& done) {
  if (done) return;
  LATHE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
  done = true;
}

template <int DP, typename St>
void forward_dp(St* out, float* lse, const St* qkv, int64_t B, const Geometry& g, const int32_t* doc_start) {
  static bool ready = false;
  const size_t smem = attn::forward_smem_bytes(DP);
  allow_smem(attention_forward_kernel<DP, St>, smem, ready);
  const int64_t blocks = attn::forward_blocks(B, g.T, g.H);
  attention_forward_kernel<DP, St>
      <<<static_cast<unsigned>(blocks), kThreads, smem, stream()>>>(out, lse, qkv, g, B * g.H, doc_start);
  check_launch("attention_forward");
}

template <int DP, typename St>
void backward_dp(St* dqkv, const St* dout, const St* qkv, const St* out, const float* lse, int64_t B, const Geometry& g,
                 const int32_t* doc_start) {
  static bool ready_kv = false, ready_q = false;
  const size_t smem_kv = attn::dkdv_smem_bytes(DP), smem_q = attn::dq_smem_bytes(DP);
  allow_smem(attention_dkdv_kernel<DP, St>, smem_kv, ready_kv);
  allow_smem(attention_dq_kernel<DP, St>, smem_q, ready_q);
  const int64_t kv_blocks = attn::dkdv_blocks(B, g.T, g.KVH), q_blocks = attn::dq_blocks(B, g.T, g.H);
  attention_dkdv_kernel<DP, St><<<static_cast<unsigned>(kv_blocks), kThreads, smem_kv, stream()>>>(
      dqkv, dout, qkv, out, lse, g, B * g.KVH, doc_start);
  check_launch("attention_backward (dK, dV)");
  attention_dq_kernel<DP, St><<<static_cast<unsigned>(q_blocks), kThreads, smem_q, stream()>>>(
      dqkv, dout, qkv, out, lse, g, B * g.H, doc_start);
  check_launch("attention_backward (dQ)");
}

template <typename St>
void forward_any(void* out, float* lse, const void* qkv, int64_t B, int64_t T, int64_t H, int64_t KVH, int64_t D,
                 const int32_t* doc_start, int64_t window, float scale, float softcap) {
  const Geometry g = check_geometry("attention_forward", B, T, H, KVH, D, window, scale, softcap);
  auto* o = static_cast<St*>(out);
  const auto* x = static_cast<const St*>(qkv);
  switch (attn::head_dim_bucket(D)) {
    case 16:
      return forward_dp<16>(o, lse, x, B, g, doc_start);
    case 32:
      return forward_dp<32>(o, lse, x, B, g, doc_start);
    case 64:
      return forward_dp<64>(o, lse, x, B, g, doc_start);
    default:
      return forward_dp<128>(o, lse, x, B, g, doc_start);
  }
}

template <typename St>
void backward_any(void* dqkv, const void* dout, const void* qkv, const void* out, const float* lse, int64_t B,
                  int64_t T, int64_t H, int64_t KVH, int64_t D, const int32_t* doc_start, int64_t window, float scale,
                  float softcap) {
  const Geometry g = check_geometry("attention_backward", B, T, H, KVH, D, window, scale, softcap);
  auto* dx = static_cast<St*>(dqkv);
  const auto* dy = static_cast<const St*>(dout);
  const auto* x = static_cast<const St*>(qkv);
  const auto* y = static_cast<const St*>(out);
  switch (attn::head_dim_bucket(D)) {
    case 16:
      return backward_dp<16>(dx, dy, x, y, lse, B, g, doc_start);
    case 32:
      return backward_dp<32>(dx, dy, x, y, lse, B, g, doc_start);
    case 64:
      return backward_dp<64>(dx, dy, x, y, lse, B, g, doc_start);
    default:
      return backward_dp<128>(dx, dy, x, y, lse, B, g, doc_start);
  }
}

}  // namespace

template <DType D>
void attention_forward(void* out, float* lse, const void* qkv, int64_t B, int64_t T, int64_t H, int64_t KVH, int64_t Dh,
                       void*, const int32_t* doc_start, int64_t window, float scale, float softcap) {
  forward_any<typename Elem<D>::T>(out, lse, qkv, B, T, H, KVH, Dh, doc_start, window, scale, softcap);
}
template <DType D>
void attention_backward(void* dqkv, const void* dout, const void* qkv, const void* out, const float* lse, int64_t B,
                        int64_t T, int64_t H, int64_t KVH, int64_t Dh, void*, const int32_t* doc_start, int64_t window,
                        float scale, float softcap) {
  backward_any<typename Elem<D>::T>(dqkv, dout, qkv, out, lse, B, T, H, KVH, Dh, doc_start, window, scale, softcap);
}
size_t attention_scratch_bytes(int64_t, int64_t) { return 0; }

LATHE_CUDA_INSTANTIATE(attention_forward, (void*, float*, const void*, int64_t, int64_t, int64_t, int64_t, int64_t,
                                           void*, const int32_t*, int64_t, float, float))
LATHE_CUDA_INSTANTIATE(attention_backward,
                       (void*, const void*, const void*, const void*, const float*, int64_t, int64_t, int64_t, int64_t,
                        int64_t, void*, const int32_t*, int64_t, float, float))

}  // namespace lathe::cuda
