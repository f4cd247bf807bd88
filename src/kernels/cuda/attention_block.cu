// Block attention for context parallelism on CUDA: contract in kernels/cuda/attention_block.h and
// kernels/cpu/ops.h ("block attention"). Forward: one thread per (b, h, query row), online softmax
// over the block's keys (key tiles of 16 whose positions no row bound reaches are skipped).
// Backward: one thread per (b, kv head, key row) sums dK, dV over the group's query heads and the
// query rows in order; one thread per (b, h, query row) sums dQ over the keys in order.
// clang-format off
#include "kernels/cuda/device_util.cuh"  // first: it configures fmt for nvcc
// clang-format on
#include <cmath>
#include <cstdint>

#include "kernels/cuda/attention_block.h"
#include "kernels/cuda/runtime.h"

namespace lathe::cuda {
namespace {

using cpu::BlockAttention;
constexpr int kBlockThreads = 128;
constexpr int kMaxHead = 256;
constexpr int64_t kKeyTile = 16;

__device__ __forceinline__ void row_bounds(const BlockAttention& a, int64_t b, int64_t i, int64_t& lo, int64_t& hi) {
  hi = a.q_pos[i];
  lo = a.q_doc ? static_cast<int64_t>(a.q_doc[b * a.Tq + i]) : INT64_MIN;
  if (a.window > 0) lo = max(lo, hi - a.window + 1);
}

__device__ __forceinline__ float dotf(const float* x, const float* y, int64_t D) {
  float acc = 0.0f;
  for (int64_t d = 0; d < D; ++d) acc = fmaf(x[d], y[d], acc);
  return acc;
}

__global__ void block_forward_kernel(BlockAttention a, float* out, int64_t ldo, float* lse) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= a.B * a.H * a.Tq) return;
  const int64_t i = idx % a.Tq, bh = idx / a.Tq, h = bh % a.H, b = bh / a.H, g = h / (a.H / a.KVH), D = a.D;
  const float scale = rsqrtf(static_cast<float>(D));
  int64_t lo, hi;
  row_bounds(a, b, i, lo, hi);
  const float* q = a.q + (b * a.Tq + i) * a.ldq + h * D;
  float acc[kMaxHead];
  for (int64_t d = 0; d < D; ++d) acc[d] = 0.0f;
  float m = -INFINITY, l = 0.0f;
  for (int64_t j0 = 0; j0 < a.Tk; j0 += kKeyTile) {
    const int64_t j1 = min(a.Tk, j0 + kKeyTile);
    if (lo > a.k_pos[j1 - 1] || hi < a.k_pos[j0]) continue;
    for (int64_t j = j0; j < j1; ++j) {
      const int64_t kp = a.k_pos[j];
      if (kp > hi || kp < lo) continue;
      const float s = scale * dotf(q, a.k + (b * a.Tk + j) * a.ldk + g * D, D);
      const float mn = fmaxf(m, s);
      const float alpha = m == -INFINITY ? 0.0f : expf(m - mn), p = expf(s - mn);
      const float* v = a.v + (b * a.Tk + j) * a.ldv + g * D;
      for (int64_t d = 0; d < D; ++d) acc[d] = acc[d] * alpha + p * v[d];
      l = l * alpha + p;
      m = mn;
    }
  }
  float* o = out + (b * a.Tq + i) * ldo + h * D;
  const float inv = l > 0.0f ? 1.0f / l : 0.0f;
  for (int64_t d = 0; d < D; ++d) o[d] = acc[d] * inv;
  lse[(b * a.H + h) * a.Tq + i] = l > 0.0f ? m + logf(l) : -INFINITY;
}

// dS of query i (head h) and key j, with P: returns false when the pair is masked.
__device__ __forceinline__ bool pair_grad(const BlockAttention& a, int64_t b, int64_t h, int64_t g, int64_t i,
                                          int64_t j, const float* out, const float* dout, int64_t ldo,
                                          const float* lse, float& p, float& ds) {
  int64_t lo, hi;
  row_bounds(a, b, i, lo, hi);
  const int64_t kp = a.k_pos[j];
  const float li = lse[(b * a.H + h) * a.Tq + i];
  if (kp > hi || kp < lo || li == -INFINITY) return false;
  const int64_t D = a.D;
  const float scale = rsqrtf(static_cast<float>(D));
  const float* q = a.q + (b * a.Tq + i) * a.ldq + h * D;
  const float* dO = dout + (b * a.Tq + i) * ldo + h * D;
  const float* o = out + (b * a.Tq + i) * ldo + h * D;
  p = expf(scale * dotf(q, a.k + (b * a.Tk + j) * a.ldk + g * D, D) - li);
  ds = p * (dotf(dO, a.v + (b * a.Tk + j) * a.ldv + g * D, D) - dotf(dO, o, D)) * scale;
  return true;
}

__global__ void block_dkdv_kernel(BlockAttention a, const float* out, const float* dout, int64_t ldo,
                                  const float* lse, float* dk, int64_t lddk, float* dv, int64_t lddv) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= a.B * a.KVH * a.Tk) return;
  const int64_t j = idx % a.Tk, bg = idx / a.Tk, g = bg % a.KVH, b = bg / a.KVH, D = a.D, rep = a.H / a.KVH;
  float ak[kMaxHead], av[kMaxHead];
  for (int64_t d = 0; d < D; ++d) ak[d] = av[d] = 0.0f;
  for (int64_t h = g * rep; h < (g + 1) * rep; ++h)
    for (int64_t i = 0; i < a.Tq; ++i) {
      float p, ds;
      if (!pair_grad(a, b, h, g, i, j, out, dout, ldo, lse, p, ds)) continue;
      const float* q = a.q + (b * a.Tq + i) * a.ldq + h * D;
      const float* dO = dout + (b * a.Tq + i) * ldo + h * D;
      for (int64_t d = 0; d < D; ++d) {
        ak[d] = fmaf(ds, q[d], ak[d]);
        av[d] = fmaf(p, dO[d], av[d]);
      }
    }
  float* dkr = dk + (b * a.Tk + j) * lddk + g * D;
  float* dvr = dv + (b * a.Tk + j) * lddv + g * D;
  for (int64_t d = 0; d < D; ++d) {
    dkr[d] += ak[d];
    dvr[d] += av[d];
  }
}

__global__ void block_dq_kernel(BlockAttention a, const float* out, const float* dout, int64_t ldo, const float* lse,
                                float* dq, int64_t lddq) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= a.B * a.H * a.Tq) return;
  const int64_t i = idx % a.Tq, bh = idx / a.Tq, h = bh % a.H, b = bh / a.H, g = h / (a.H / a.KVH), D = a.D;
  float acc[kMaxHead];
  for (int64_t d = 0; d < D; ++d) acc[d] = 0.0f;
  for (int64_t j = 0; j < a.Tk; ++j) {
    float p, ds;
    if (!pair_grad(a, b, h, g, i, j, out, dout, ldo, lse, p, ds)) continue;
    const float* k = a.k + (b * a.Tk + j) * a.ldk + g * D;
    for (int64_t d = 0; d < D; ++d) acc[d] = fmaf(ds, k[d], acc[d]);
  }
  float* dqr = dq + (b * a.Tq + i) * lddq + h * D;
  for (int64_t d = 0; d < D; ++d) dqr[d] += acc[d];
}

__global__ void lse_merge_kernel(float* out, float* lse, const float* out_b, const float* lse_b, int64_t B, int64_t T,
                                 int64_t H, int64_t D, int64_t ldo) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= B * H * T) return;
  const int64_t t = idx % T, bh = idx / T, h = bh % H, b = bh / H;
  const float la = lse[idx], lb = lse_b[idx];
  float* oa = out + (b * T + t) * ldo + h * D;
  const float* ob = out_b + (b * T + t) * ldo + h * D;
  if (lb == -INFINITY) return;
  if (la == -INFINITY) {
    for (int64_t d = 0; d < D; ++d) oa[d] = ob[d];
    lse[idx] = lb;
    return;
  }
  const float mx = fmaxf(la, lb), wa = expf(la - mx), wb = expf(lb - mx), sum = wa + wb;
  const float ca = wa / sum, cb = wb / sum;
  for (int64_t d = 0; d < D; ++d) oa[d] = ca * oa[d] + cb * ob[d];
  lse[idx] = mx + logf(sum);
}

unsigned grid(int64_t n) { return static_cast<unsigned>((n + kBlockThreads - 1) / kBlockThreads); }

void check(const char* fn, const BlockAttention& a) {
  LATHE_CU_CHECK(a.B >= 1 && a.Tq >= 0 && a.Tk >= 0 && a.H >= 1 && a.KVH >= 1 && a.H % a.KVH == 0,
                 "{}: invalid shape B={} Tq={} Tk={} H={} KVH={}", fn, a.B, a.Tq, a.Tk, a.H, a.KVH);
  LATHE_CU_CHECK(a.D >= 1 && a.D <= kMaxHead, "{}: head size {} outside [1, {}] (attention_block.cu kMaxHead)", fn,
                 a.D, kMaxHead);
  LATHE_CU_CHECK(a.window >= 0, "{}: window = {} must be >= 0", fn, a.window);
  LATHE_CU_CHECK(a.scale == 0.0f && a.softcap == 0.0f,
                 "{}: score scale {} / soft cap {}: the CUDA block kernel applies neither yet (the CPU one does)", fn,
                 a.scale, a.softcap);
}

}  // namespace

void attention_block_forward(const BlockAttention& a, float* out, int64_t ldo, float* lse) {
  check("attention_block_forward", a);
  if (a.Tq == 0) return;
  block_forward_kernel<<<grid(a.B * a.H * a.Tq), kBlockThreads, 0, stream()>>>(a, out, ldo, lse);
  check_launch("attention_block_forward");
}

void attention_block_backward(const BlockAttention& a, const float* out, const float* dout, int64_t ldo,
                              const float* lse, float* dq, int64_t lddq, float* dk, int64_t lddk, float* dv,
                              int64_t lddv) {
  check("attention_block_backward", a);
  if (a.Tq == 0 || a.Tk == 0) return;
  block_dkdv_kernel<<<grid(a.B * a.KVH * a.Tk), kBlockThreads, 0, stream()>>>(a, out, dout, ldo, lse, dk, lddk, dv,
                                                                             lddv);
  check_launch("attention_block_backward (dK, dV)");
  block_dq_kernel<<<grid(a.B * a.H * a.Tq), kBlockThreads, 0, stream()>>>(a, out, dout, ldo, lse, dq, lddq);
  check_launch("attention_block_backward (dQ)");
}

void attention_lse_merge(float* out, float* lse, const float* out_b, const float* lse_b, int64_t B, int64_t T,
                         int64_t H, int64_t D, int64_t ldo) {
  if (B * H * T == 0) return;
  lse_merge_kernel<<<grid(B * H * T), kBlockThreads, 0, stream()>>>(out, lse, out_b, lse_b, B, T, H, D, ldo);
  check_launch("attention_lse_merge");
}

}  // namespace lathe::cuda
