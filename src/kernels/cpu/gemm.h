// The GEMMs of each storage type (kernels/cpu/storage.h) as the matmul and lm-head templates call
// them; products are accumulated in fp32 in every storage type, parameter gradients are fp32:
//  * F32: OpenBLAS sgemm (matmul.cpp).
//  * Bf16: oneDNN bf16 GEMMs (kernels/cpu/ops_bf16.h: bf16 operands, fp32 accumulation, each
//    output rounded once from its fp32 sum).
//  * Fp16: oneDNN 2.6.3 has no f16 matmul on CPUs without AVX512-FP16 (probed 2026-11-30 on this
//    machine's AVX512-BF16 Xeon: "could not create a primitive descriptor" for f16 x f16 -> f32,
//    brg:avx512_core_bf16 for bf16), so fp16 operands are widened into per-thread fp32 buffers
//    (thread_rows slots 0-2) and run on the fp32 sgemm: a CORRECTNESS path (fp16 storage, fp32
//    compute), not a speed path.
// fwd / bwd write the storage type ("=", rounded once); fwd_f32 / bwd_f32 write fp32 (= or +=).
#pragma once
#include <cblas.h>

#include <algorithm>
#include <cstdint>

#include "kernels/cpu/ops.h"
#include "kernels/cpu/ops_bf16.h"
#include "kernels/cpu/storage.h"

namespace lathe::cpu {

namespace gemm_detail {
constexpr int64_t kParallelMin = 1 << 15;
constexpr int64_t kBlock = 1 << 14;
}  // namespace gemm_detail

// Whole-buffer conversions of a 16-bit storage type, OpenMP-parallel (outside the kernels' own
// parallel regions).
template <class S>
void widen_all(float* dst, const typename S::T* src, int64_t n) {
  using namespace gemm_detail;
  const int64_t nb = (n + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (int64_t b = 0; b < nb; ++b) S::to_f32(dst + b * kBlock, src + b * kBlock, std::min(kBlock, n - b * kBlock));
}
template <class S>
void narrow_all(typename S::T* dst, const float* src, int64_t n) {
  using namespace gemm_detail;
  const int64_t nb = (n + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (int64_t b = 0; b < nb; ++b) S::from_f32(dst + b * kBlock, src + b * kBlock, std::min(kBlock, n - b * kBlock));
}

// p[0, n) as an fp32 buffer to update (+=): p itself for F32, else widened into thread_rows(slot);
// write_all stores it back (rounded once).
template <class S>
float* update_all(int slot, typename S::T* p, int64_t n) {
  if constexpr (S::kFp32) {
    return p;
  } else {
    float* t = thread_rows(slot, static_cast<size_t>(n));
    widen_all<S>(t, p, n);
    return t;
  }
}
template <class S>
void write_all(typename S::T* p, const float* t, int64_t n) {
  if constexpr (!S::kFp32) narrow_all<S>(p, t, n);
}

template <class S>
struct Gemm;

template <>
struct Gemm<F32> {
  static void fwd_f32(float* out, const float* x, const float* w, const float* b, int64_t M, int64_t K, int64_t N,
                      bool acc) {
    matmul_forward(out, x, w, b, M, K, N, acc);
  }
  static void fwd(float* out, const float* x, const float* w, const float* b, int64_t M, int64_t K, int64_t N) {
    matmul_forward(out, x, w, b, M, K, N, false);
  }
  static void bwd_f32(float* dx, float* dw, float* db, const float* g, const float* x, const float* w, int64_t M,
                      int64_t K, int64_t N, bool acc) {
    matmul_backward(dx, dw, db, g, x, w, M, K, N, acc);
  }
  static void bwd(float* dx, float* dw, float* db, const float* g, const float* x, const float* w, int64_t M, int64_t K,
                  int64_t N) {
    matmul_backward(dx, dw, db, g, x, w, M, K, N, false);
  }
  // The logits of an lm-head tile, out[R, V] = x[R, C] @ w[V, C]^T: always one sgemm (matmul_forward
  // would take sgemv for a single row, which sums in another order).
  static void logits(float* out, const float* x, const float* w, int64_t R, int64_t C, int64_t V) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, R, V, C, 1.0f, x, C, w, C, 0.0f, out, V);
  }
};

template <>
struct Gemm<Bf16> {
  using T = uint16_t;
  static void fwd_f32(float* out, const T* x, const T* w, const float* b, int64_t M, int64_t K, int64_t N, bool acc) {
    matmul_forward_bf16(out, x, w, b, M, K, N, acc);
  }
  static void fwd(T* out, const T* x, const T* w, const float* b, int64_t M, int64_t K, int64_t N) {
    matmul_forward_bf16_out_bf16(out, x, w, b, M, K, N);
  }
  static void bwd_f32(float* dx, float* dw, float* db, const T* g, const T* x, const T* w, int64_t M, int64_t K,
                      int64_t N, bool acc) {
    matmul_backward_bf16(dx, dw, db, g, x, w, M, K, N, acc);
  }
  static void bwd(T* dx, float* dw, float* db, const T* g, const T* x, const T* w, int64_t M, int64_t K, int64_t N) {
    if (dx == nullptr)
      matmul_backward_bf16(nullptr, dw, db, g, x, w, M, K, N, false);
    else
      matmul_backward_bf16_dinp_bf16(dx, dw, db, g, x, w, M, K, N);
  }
  static void logits(float* out, const T* x, const T* w, int64_t R, int64_t C, int64_t V) {
    fwd_f32(out, x, w, nullptr, R, C, V, false);
  }
};

template <>
struct Gemm<Fp16> {
  using T = uint16_t;
  static void fwd_f32(float* out, const T* x, const T* w, const float* b, int64_t M, int64_t K, int64_t N, bool acc) {
    float* xf = thread_rows(0, static_cast<size_t>(M * K));
    float* wf = thread_rows(1, static_cast<size_t>(N * K));
    widen_all<Fp16>(xf, x, M * K);
    widen_all<Fp16>(wf, w, N * K);
    matmul_forward(out, xf, wf, b, M, K, N, acc);
  }
  static void fwd(T* out, const T* x, const T* w, const float* b, int64_t M, int64_t K, int64_t N) {
    float* of = thread_rows(2, static_cast<size_t>(M * N));
    fwd_f32(of, x, w, b, M, K, N, false);
    narrow_all<Fp16>(out, of, M * N);
  }
  static void bwd_f32(float* dx, float* dw, float* db, const T* g, const T* x, const T* w, int64_t M, int64_t K,
                      int64_t N, bool acc) {
    float* gf = thread_rows(0, static_cast<size_t>(M * N));
    float* xf = thread_rows(1, dw ? static_cast<size_t>(M * K) : 0);
    float* wf = thread_rows(2, dx ? static_cast<size_t>(N * K) : 0);
    widen_all<Fp16>(gf, g, M * N);
    if (dw) widen_all<Fp16>(xf, x, M * K);
    if (dx) widen_all<Fp16>(wf, w, N * K);
    matmul_backward(dx, dw, db, gf, xf, wf, M, K, N, acc);
  }
  static void bwd(T* dx, float* dw, float* db, const T* g, const T* x, const T* w, int64_t M, int64_t K, int64_t N) {
    float* dxf = dx ? thread_rows(3, static_cast<size_t>(M * K)) : nullptr;
    bwd_f32(dxf, dw, db, g, x, w, M, K, N, false);
    if (dx) narrow_all<Fp16>(dx, dxf, M * K);
  }
  static void logits(float* out, const T* x, const T* w, int64_t R, int64_t C, int64_t V) {
    fwd_f32(out, x, w, nullptr, R, C, V, false);
  }
};

}  // namespace lathe::cpu
