// The CPU bf16 and fp16 op tables (issue 9): 16-bit activations, fp32 math inside every kernel.
//
// One template per op, instantiated for the two storage types of kernels/cpu/storage.h:
//  * GEMMs: bf16 on oneDNN (kernels/cpu/ops_bf16.h: bf16 operands, fp32 accumulation, each output
//    rounded once from its fp32 sum). fp16: oneDNN 2.6.3 has no f16 matmul on CPUs without
//    AVX512-FP16 (probed 2026-11-30 on this machine's AVX512-BF16 Xeon: "could not create a
//    primitive descriptor" for f16 x f16 -> f32, brg:avx512_core_bf16 for bf16), so fp16 operands
//    are widened to fp32 and run on the fp32 sgemm: a CORRECTNESS path (fp16 storage, fp32
//    compute), not a speed path.
//  * Norms, attention, softmax/cross-entropy: statistics, running max/sum and the loss in fp32 on
//    rows widened from 16 bits (norm statistics, lse and losses are fp32 outputs).
//  * Pointwise (GELU, SwiGLU, residual, RoPE, embedding): widen a block, the fp32 formula of the
//    fp32 kernels (pointwise_math.h), round once.
//  * Parameter gradients are fp32 and accumulate (+=) into the fp32 gradient buffer in every op.
//  * "+=" into a 16-bit input gradient (norm backwards, the accumulate flags of the matmuls) adds
//    in fp32 and rounds the sum once.
// Scratch: the *_scratch_bytes of these tables include the fp32 rows the kernels widen into; ops
// whose signature has no scratch use per-thread rows grown once (half.h, thread_rows), so a
// training step allocates nothing after the first.
#include "kernels/cpu/ops_half.h"

#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/error.h"
#include "kernels/cpu/storage.h"
#include "kernels/cpu/lm_head_tiles.h"
#include "kernels/cpu/op_slots.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/ops_bf16.h"
#include "kernels/cpu/pointwise_math.h"
#include "kernels/cpu/tables.h"
#include "kernels/cpu/vec_math.h"

namespace lathe::cpu {
namespace {

using u16 = uint16_t;
constexpr int64_t kParallelMin = 1 << 15;
constexpr int64_t kBlock = 1024;  // elements per widened block of the pointwise ops

const u16* h(const void* p) { return static_cast<const u16*>(p); }
u16* h(void* p) { return static_cast<u16*>(p); }

// Parallel whole-buffer conversions (outside the kernels' own parallel regions).
template <class P>
void widen(float* dst, const u16* src, int64_t n) {
  const int64_t nb = (n + kBlock * 16 - 1) / (kBlock * 16);
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t i0 = b * kBlock * 16;
    P::to_f32(dst + i0, src + i0, std::min(kBlock * 16, n - i0));
  }
}
template <class P>
void narrow(u16* dst, const float* src, int64_t n) {
  const int64_t nb = (n + kBlock * 16 - 1) / (kBlock * 16);
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t i0 = b * kBlock * 16;
    P::from_f32(dst + i0, src + i0, std::min(kBlock * 16, n - i0));
  }
}

// ---- GEMM backends per storage type ----------------------------------------------------------
struct Bf16Mm {
  static void fwd_f32(float* out, const u16* x, const u16* w, const float* b, int64_t M, int64_t K, int64_t N,
                      bool acc) {
    matmul_forward_bf16(out, x, w, b, M, K, N, acc);
  }
  static void fwd_h(u16* out, const u16* x, const u16* w, const float* b, int64_t M, int64_t K, int64_t N) {
    matmul_forward_bf16_out_bf16(out, x, w, b, M, K, N);
  }
  static void bwd_f32(float* dx, float* dw, float* db, const u16* g, const u16* x, const u16* w, int64_t M, int64_t K,
                      int64_t N, bool acc) {
    matmul_backward_bf16(dx, dw, db, g, x, w, M, K, N, acc);
  }
  static void bwd_h(u16* dx, float* dw, float* db, const u16* g, const u16* x, const u16* w, int64_t M, int64_t K,
                    int64_t N) {
    if (dx == nullptr)
      matmul_backward_bf16(nullptr, dw, db, g, x, w, M, K, N, false);
    else
      matmul_backward_bf16_dinp_bf16(dx, dw, db, g, x, w, M, K, N);
  }
};

// fp16: operands widened into per-thread fp32 buffers (slots 0-2), then OpenBLAS sgemm.
struct Fp16Mm {
  static void fwd_f32(float* out, const u16* x, const u16* w, const float* b, int64_t M, int64_t K, int64_t N,
                      bool acc) {
    float* xf = thread_rows(0, static_cast<size_t>(M * K));
    float* wf = thread_rows(1, static_cast<size_t>(N * K));
    widen<Fp16>(xf, x, M * K);
    widen<Fp16>(wf, w, N * K);
    matmul_forward(out, xf, wf, b, M, K, N, acc);
  }
  static void fwd_h(u16* out, const u16* x, const u16* w, const float* b, int64_t M, int64_t K, int64_t N) {
    float* of = thread_rows(2, static_cast<size_t>(M * N));
    fwd_f32(of, x, w, b, M, K, N, false);
    narrow<Fp16>(out, of, M * N);
  }
  static void bwd_f32(float* dx, float* dw, float* db, const u16* g, const u16* x, const u16* w, int64_t M, int64_t K,
                      int64_t N, bool acc) {
    float* gf = thread_rows(0, static_cast<size_t>(M * N));
    float* xf = thread_rows(1, dw ? static_cast<size_t>(M * K) : 0);
    float* wf = thread_rows(2, dx ? static_cast<size_t>(N * K) : 0);
    widen<Fp16>(gf, g, M * N);
    if (dw) widen<Fp16>(xf, x, M * K);
    if (dx) widen<Fp16>(wf, w, N * K);
    matmul_backward(dx, dw, db, gf, xf, wf, M, K, N, acc);
  }
  static void bwd_h(u16* dx, float* dw, float* db, const u16* g, const u16* x, const u16* w, int64_t M, int64_t K,
                    int64_t N) {
    float* dxf = dx ? thread_rows(3, static_cast<size_t>(M * K)) : nullptr;
    bwd_f32(dxf, dw, db, g, x, w, M, K, N, false);
    if (dx) narrow<Fp16>(dx, dxf, M * K);
  }
};

// ---- matmul ------------------------------------------------------------------------------------
template <class P, class Mm>
void matmul_forward_h(void* out, const void* inp, const void* weight, const float* bias, int64_t M, int64_t K,
                      int64_t N, bool accumulate) {
  if (!accumulate) return Mm::fwd_h(h(out), h(inp), h(weight), bias, M, K, N);
  // out += ...: the sum is formed in fp32 (slot 3) and rounded once.
  float* t = thread_rows(3, static_cast<size_t>(M * N));
  widen<P>(t, h(out), M * N);
  Mm::fwd_f32(t, h(inp), h(weight), bias, M, K, N, true);
  narrow<P>(h(out), t, M * N);
}

template <class P, class Mm>
void matmul_backward_h(void* dinp, float* dweight, float* dbias, const void* dout, const void* inp, const void* weight,
                       int64_t M, int64_t K, int64_t N, bool accumulate_dinp) {
  if (dinp == nullptr || !accumulate_dinp)
    return Mm::bwd_h(h(dinp), dweight, dbias, h(dout), h(inp), h(weight), M, K, N);
  float* t = thread_rows(3, static_cast<size_t>(M * K));
  widen<P>(t, h(dinp), M * K);
  Mm::bwd_f32(t, dweight, dbias, h(dout), h(inp), h(weight), M, K, N, true);
  narrow<P>(h(dinp), t, M * K);
}

template <class P, class Mm>
void logits_forward_h(float* logits, const void* x, const void* w, int64_t M, int64_t C, int64_t V) {
  Mm::fwd_f32(logits, h(x), h(w), nullptr, M, C, V, false);
}

// ---- lm head + softmax + cross-entropy ----------------------------------------------------------
// As the fp32 kernel (lm_head_loss.cpp), per chunk of R rows in column tiles (lm_head_tiles.h),
// parallel over the tiles with each thread's GEMMs single-threaded: fp32 logits of a tile from
// 16-bit x and w, max / exp / sum / loss in fp32 (sums in double) while the tile is hot; backward
// per tile: dlogits in fp32, rounded once to 16 bits, then dw[tile rows] += dlogits^T @ x (fp32)
// and the thread's fp32 partial of dx += dlogits @ w[tile rows]; the partials are added in thread
// order and dx rounded once. Scratch: fp32 logits [R, V], then the 16-bit dlogits [R, V] (both in
// tile layout).
size_t lm_head_loss_scratch_bytes_h(int64_t chunk_rows, int64_t V) {
  const size_t n = static_cast<size_t>(chunk_rows) * static_cast<size_t>(V);
  return n * sizeof(float) + (n * sizeof(u16) + 63) / 64 * 64;
}

template <class P, class Mm>
double lm_head_loss_h(float* losses, void* dx_v, float* dw, const void* x_v, const void* w_v, const int32_t* targets,
                      int64_t N, int64_t C, int64_t V, float grad_scale, bool backward, void* scratch_v,
                      int64_t chunk_rows) {
  check_lm_head_args(targets, N, C, V, backward, dx_v, dw, chunk_rows);
  const u16 *x = h(x_v), *w = h(w_v);
  u16* dx = h(dx_v);
  const int64_t R_max = std::min(chunk_rows, std::max<int64_t>(N, 1));
  float* logits = static_cast<float*>(scratch_v);
  u16* dlog = reinterpret_cast<u16*>(static_cast<char*>(scratch_v) +
                                     static_cast<size_t>(R_max) * static_cast<size_t>(V) * sizeof(float));
  // The calling thread's buffers, bound to references (a thread_local name inside the parallel
  // regions would be each worker's own).
  static thread_local head::Stats tls_stats;
  static thread_local std::vector<float> tls_partials;  // [threads][R*C] fp32 dx partials
  head::Stats& st = tls_stats;
  std::vector<float>& partials = tls_partials;
  const int nthreads = omp_get_max_threads();
  const int64_t width = head::bench_tile_width_override > 0
                            ? head::bench_tile_width_override
                            : head::tile_width(R_max, V, nthreads, head::kTileFloatsHalf);
  double total = 0.0;
  for (int64_t n0 = 0; n0 < N; n0 += chunk_rows) {
    const int64_t R = std::min(chunk_rows, N - n0);
    const head::Tiling tl(R, V, std::min(width, V));
    const u16* xc = x + n0 * C;
    const int32_t* tg = targets + n0;
    st.resize(R, tl.nb);
    const int64_t RC = R * C;
    const bool par = head::parallel_worth(tl, C);
    if (backward && partials.size() < static_cast<size_t>(nthreads * RC))
      partials.resize(static_cast<size_t>(nthreads * RC));
#pragma omp parallel for schedule(static) if (par)
    for (int64_t b = 0; b < tl.nb; ++b) {
      float* tile = logits + tl.offset(b);
      Mm::fwd_f32(tile, xc, w + tl.v0(b) * C, nullptr, R, C, tl.vb(b), false);
      head::tile_stats(tile, tl, b, tg, backward, st);
    }
    head::combine(tl, tg, grad_scale, backward, st, losses + n0);
    double chunk_total = 0.0;
    for (int64_t r = 0; r < R; ++r) chunk_total += losses[n0 + r];
    total += chunk_total;
    if (!backward) continue;
#pragma omp parallel if (par)
    {
      const int t = omp_get_thread_num(), nt = omp_get_num_threads();
      float* acc = partials.data() + t * RC;
      std::fill(acc, acc + RC, 0.0f);
#pragma omp for schedule(static)
      for (int64_t b = 0; b < tl.nb; ++b) {
        float* tile = logits + tl.offset(b);
        u16* dl = dlog + tl.offset(b);
        const int64_t vb = tl.vb(b);
        head::tile_dlogits(tile, tl, b, tg, grad_scale, st);
        P::from_f32(dl, tile, R * vb);
        Mm::bwd_f32(acc, dw + tl.v0(b) * C, nullptr, dl, xc, w + tl.v0(b) * C, R, C, vb, true);
      }  // implicit barrier: every partial is complete
         // dx rows = the partials summed in thread order, rounded once.
#pragma omp for schedule(static)
      for (int64_t i = 0; i < RC; i += 1024) {
        const int64_t n = std::min<int64_t>(1024, RC - i);
        float sum[1024];
        std::copy(partials.data() + i, partials.data() + i + n, sum);
        for (int p = 1; p < nt; ++p) {
          const float* src = partials.data() + p * RC + i;
          for (int64_t j = 0; j < n; ++j) sum[j] += src[j];
        }
        P::from_f32(dx + n0 * C + i, sum, n);
      }
    }
  }
  return total;
}

// Vocab-parallel twin (contract in kernels/backend.h; the fp32 one in lm_head_loss_vocab_parallel.cpp):
// fp32 local logits, the row statistics all-reduced by vocab_parallel_softmax_rows, dlogits rounded
// to 16 bits for the two backward GEMMs; dx is this shard's partial (the caller sums it).
template <class P, class Mm>
double lm_head_loss_vp_h(float* losses, void* dx_v, float* dw, const void* x_v, const void* w_v, const int32_t* targets,
                         int64_t N, int64_t C, int64_t V, float grad_scale, bool backward, void* scratch_v,
                         int64_t chunk_rows, const VocabParallel& vp) {
  check_vocab_parallel_args(targets, N, C, V, chunk_rows, backward, dx_v != nullptr && dw != nullptr, vp);
  const u16 *x = h(x_v), *w = h(w_v);
  u16* dx = h(dx_v);
  float* logits = static_cast<float*>(scratch_v);
  u16* dlog = reinterpret_cast<u16*>(static_cast<char*>(scratch_v) +
                                     static_cast<size_t>(std::min(chunk_rows, std::max<int64_t>(N, 1))) *
                                         static_cast<size_t>(V) * sizeof(float));
  double total = 0.0;
  for (int64_t n0 = 0; n0 < N; n0 += chunk_rows) {
    const int64_t R = std::min(chunk_rows, N - n0);
    const u16* xc = x + n0 * C;
    Mm::fwd_f32(logits, xc, w, nullptr, R, C, V, false);
    total += vocab_parallel_softmax_rows(logits, losses + n0, targets + n0, R, V, grad_scale, backward, vp);
    if (!backward) continue;
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < R; ++r) P::from_f32(dlog + r * V, logits + r * V, V);
    Mm::bwd_h(dx + n0 * C, dw, nullptr, dlog, xc, w, R, C, V);
  }
  return total;
}

template <class P, class Mm>
double lm_head_loss_any_h(float* losses, void* dx, float* dw, const void* x, const void* w, const int32_t* targets,
                          int64_t N, int64_t C, int64_t V, float grad_scale, bool backward, void* scratch,
                          int64_t chunk_rows, const VocabParallel* vp) {
  if (vp != nullptr)
    return lm_head_loss_vp_h<P, Mm>(losses, dx, dw, x, w, targets, N, C, V, grad_scale, backward, scratch, chunk_rows,
                                    *vp);
  return lm_head_loss_h<P, Mm>(losses, dx, dw, x, w, targets, N, C, V, grad_scale, backward, scratch, chunk_rows);
}

template <class P, class Mm>
Ops make_half_ops() {
  Ops o;
  o.backend = "cpu";
  o.dtype = P::kDtype;
  o.matmul_forward = matmul_forward_h<P, Mm>;
  o.matmul_backward = matmul_backward_h<P, Mm>;
  if constexpr (P::kDtype == DType::BF16)
    o.matmul_bias_gelu_forward = matmul_bias_gelu_unfused<bf16_ops>;
  else
    o.matmul_bias_gelu_forward = matmul_bias_gelu_unfused<fp16_ops>;
  add_embedding<P>(o);
  add_layernorm<P>(o);
  add_rmsnorm<P>(o);
  add_pointwise<P>(o);
  add_rope<P>(o);
  if constexpr (P::kDtype == DType::BF16) {
    o.attention_forward = attention_forward_bf16;
    o.attention_backward = attention_backward_bf16;
  } else {
    o.attention_forward = attention_forward_fp16;
    o.attention_backward = attention_backward_fp16;
  }
  o.attention_scratch_bytes = attention_scratch_bytes_half;
  o.lm_head_loss = lm_head_loss_any_h<P, Mm>;
  o.lm_head_loss_scratch_bytes = lm_head_loss_scratch_bytes_h;
  o.logits_forward = logits_forward_h<P, Mm>;
  return o;
}

}  // namespace

const Ops& bf16_ops() {
  static const Ops table = make_half_ops<Bf16, Bf16Mm>();
  return table;
}

const Ops& fp16_ops() {
  static const Ops table = make_half_ops<Fp16, Fp16Mm>();
  return table;
}

}  // namespace lathe::cpu
