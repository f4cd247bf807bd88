// Linear layer forward/backward (PyTorch nn.Linear layout: weight[N, K]): the fp32 GEMMs on OpenBLAS
// sgemm, and the table slots of every storage type on them or on the 16-bit GEMMs (gemm.h), where
// "+=" into a 16-bit output adds in fp32 and rounds the sum once.
//
// OpenBLAS is the OpenMP build, so its GEMMs run on the same OpenMP workers as the rest of the
// kernels (and run single-threaded when called from inside a parallel region). OpenBLAS splits
// the output (M, N) among threads, never K, so its results are deterministic for a fixed thread
// count. The bias reduction here is split over columns, each column summed in row order, which
// makes it independent of the thread count.
#include <cblas.h>

#include <climits>
#include <cstring>

#include "core/error.h"
#include "kernels/cpu/col_sums.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/op_slots.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/storage.h"

namespace lathe::cpu {

namespace {

// Below this many floats an OpenMP fork costs more than the loop itself.
constexpr int64_t kParallelMin = 1 << 14;

inline int as_blas_int(int64_t v, const char* what) {
  LATHE_CHECK(v >= 0 && v <= INT_MAX, "matmul: dimension {}={} does not fit OpenBLAS's 32-bit int; split the GEMM",
              what, v);
  return static_cast<int>(v);
}

}  // namespace

void matmul_forward(float* out, const float* inp, const float* weight, const float* bias, int64_t M, int64_t K,
                    int64_t N, bool accumulate) {
  const int m = as_blas_int(M, "M"), k = as_blas_int(K, "K"), n = as_blas_int(N, "N");
  if (M == 0 || N == 0) return;
  float beta = accumulate ? 1.0f : 0.0f;
  if (bias != nullptr && !accumulate) {
    // Same as torch.addmm: out starts as the broadcast bias and the GEMM adds into it (beta = 1).
#pragma omp parallel for schedule(static) if (M * N >= kParallelMin)
    for (int64_t i = 0; i < M; ++i) std::memcpy(out + i * N, bias, sizeof(float) * N);
    beta = 1.0f;
  }
  if (K == 0) {
    if (beta == 0.0f) std::memset(out, 0, sizeof(float) * M * N);
  } else if (M == 1) {
    // One row (token-by-token generation): sgemv streams the weight once, where OpenBLAS 0.3.21's
    // sgemm would first pack it (~2x slower at the lm head). out[N] = weight[N,K] @ inp[K].
    // beta = 0 is spelled as zero-fill + beta = 1 so that stale NaNs in out never survive,
    // whatever the OpenBLAS version does for ?scal by zero.
    if (beta == 0.0f) std::memset(out, 0, sizeof(float) * N);
    cblas_sgemv(CblasRowMajor, CblasNoTrans, n, k, 1.0f, weight, k, inp, 1, 1.0f, out, 1);
  } else {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, k, 1.0f, inp, k, weight, k, beta, out, n);
  }
  if (bias != nullptr && accumulate) {
#pragma omp parallel for schedule(static) if (M * N >= kParallelMin)
    for (int64_t i = 0; i < M; ++i) {
      float* __restrict o = out + i * N;
      for (int64_t j = 0; j < N; ++j) o[j] += bias[j];
    }
  }
}

void matmul_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                     const float* weight, int64_t M, int64_t K, int64_t N, bool accumulate_dinp) {
  const int m = as_blas_int(M, "M"), k = as_blas_int(K, "K"), n = as_blas_int(N, "N");
  if (dinp != nullptr && M > 0 && K > 0) {
    // dinp[M,K] = dout[M,N] @ weight[N,K]
    if (N == 0) {
      if (!accumulate_dinp) std::memset(dinp, 0, sizeof(float) * M * K);
    } else {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, k, n, 1.0f, dout, n, weight, k,
                  accumulate_dinp ? 1.0f : 0.0f, dinp, k);
    }
  }
  if (dweight != nullptr && M > 0 && N > 0 && K > 0) {
    // dweight[N,K] += dout[M,N]^T @ inp[M,K]
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, n, k, m, 1.0f, dout, n, inp, k, 1.0f, dweight, k);
  }
  if (dbias != nullptr && M > 0 && N > 0) add_column_sums(dbias, dout, M, N, [](float x) { return x; });
}

namespace {

template <class S>
void forward_t(void* out_v, const void* inp, const void* weight, const float* bias, int64_t M, int64_t K, int64_t N,
               bool accumulate) {
  auto* out = as<S>(out_v);
  if (!accumulate) return Gemm<S>::fwd(out, as<S>(inp), as<S>(weight), bias, M, K, N);
  float* t = update_all<S>(3, out, M * N);  // out += ...: the sum in fp32, rounded once
  Gemm<S>::fwd_f32(t, as<S>(inp), as<S>(weight), bias, M, K, N, true);
  write_all<S>(out, t, M * N);
}

template <class S>
void backward_t(void* dinp_v, float* dweight, float* dbias, const void* dout, const void* inp, const void* weight,
                int64_t M, int64_t K, int64_t N, bool accumulate_dinp) {
  auto* dinp = as<S>(dinp_v);
  if (dinp == nullptr || !accumulate_dinp)
    return Gemm<S>::bwd(dinp, dweight, dbias, as<S>(dout), as<S>(inp), as<S>(weight), M, K, N);
  float* t = update_all<S>(3, dinp, M * K);
  Gemm<S>::bwd_f32(t, dweight, dbias, as<S>(dout), as<S>(inp), as<S>(weight), M, K, N, true);
  write_all<S>(dinp, t, M * K);
}

template <class S>
void logits_t(float* logits, const void* x, const void* w, int64_t M, int64_t C, int64_t V) {
  Gemm<S>::fwd_f32(logits, as<S>(x), as<S>(w), nullptr, M, C, V, false);
}

}  // namespace

template <class S>
void add_matmul(Ops& o) {
  o.matmul_forward = forward_t<S>;
  o.matmul_backward = backward_t<S>;
  o.logits_forward = logits_t<S>;
}
LATHE_CPU_ADD_SLOTS(add_matmul)

}  // namespace lathe::cpu
