// GEMMs of the CUDA tables on cuBLASLt (kernels/cuda/ops.h), PyTorch nn.Linear layout as
// kernels/cpu/matmul.cpp: out[M,N] = inp[M,K] @ weight[N,K]^T (+ bias[N]).
//
// Row-major X[R, S] is column-major X^T (S x R, leading dimension S), so in cuBLAS's column-major
// terms (m x n output, k inner):
//   forward   out^T [N x M]   = op_T(weight: K x N, ld K) . op_N(inp^T: K x M, ld K)
//   dinp      dinp^T [K x M]  = op_N(weight: K x N, ld K) . op_N(dout^T: N x M, ld N)
//   dweight   dW^T [K x N]   += op_N(inp^T: K x M, ld K)   . op_T(dout^T: N x M, ld N)   (fp32 D, beta 1)
// Compute type fp32 everywhere (CUBLAS_COMPUTE_32F: no TF32 for the fp32 table, so it stays the
// reference), alpha/beta fp32; "+=" is beta = 1 with C = D (the sum formed in fp32, rounded once).
// The bias is the BIAS epilogue (fp32 bias vector) when cuBLASLt offers it for the types, else a
// bias_add after the GEMM. dbias is a deterministic two-pass column sum (launch.h col_sum_plan).
// matmul_bias_gelu_forward: the GELU_AUX_BIAS epilogue (GELU_AUX without a bias) writes
// out = gelu(acc + bias) from the fp32 accumulator and the pre-activation acc + bias as aux (rounded
// to the table's dtype; backward's gelu_backward reads it), when cuBLASLt has an algorithm for the
// shape (aux leading dimension N divisible by 8, bias 16-byte aligned); else the GEMM and the GELU
// kernel apart. cuBLASLt's GELU is the tanh approximation, as lathe's (kernels/cpu/ops.h).
//
// Descriptors, layouts and the heuristic's algorithm are cached per (shape, types, transposes,
// epilogue, pointer alignments): the same call always runs the same algorithm, so results are
// bit-reproducible on one GPU, and the heuristic runs once per shape, not per step.
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <tuple>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace lathe::cuda {

namespace {

cudaDataType_t cuda_type(DType d) {
  switch (d) {
    case DType::F32:
      return CUDA_R_32F;
    case DType::BF16:
      return CUDA_R_16BF;
    case DType::F16:
      return CUDA_R_16F;
    default:
      fail("cuda matmul: no GEMM for element type " + std::string(dtype_name(d)));
  }
}

// Largest power of two (<= 256) dividing the address: cuBLASLt's heuristic assumes 256-byte
// alignment unless told otherwise, and operands at an offset (a chunk of rows) may have less.
uint32_t alignment(const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  uint32_t al = 256;
  while (al > 1 && (a % al) != 0) al >>= 1;
  return al;
}

struct GemmKey {
  bool ta, tb;
  int64_t m, n, k, lda, ldb, ldc;
  DType ab, cd;
  bool bias;
  uint32_t al_a, al_b, al_c, al_bias;
  bool gelu = false;    // GELU_AUX(_BIAS) epilogue: D = gelu(pre), aux = pre (matmul_bias_gelu_forward)
  uint32_t al_aux = 0;  // the aux pointer's alignment (the heuristic reads the pointer)
  auto tie() const {
    return std::tie(ta, tb, m, n, k, lda, ldb, ldc, ab, cd, bias, al_a, al_b, al_c, al_bias, gelu, al_aux);
  }
  bool operator<(const GemmKey& o) const { return tie() < o.tie(); }
};

struct GemmPlan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool fused_bias = false;  // false with a bias: bias_add after the GEMM
  bool fused_gelu = false;  // GELU_AUX(_BIAS) plan built (else the caller runs the unfused pair)
};

std::mutex g_mu;
std::map<GemmKey, GemmPlan>& plans() {
  static auto* m = new std::map<GemmKey, GemmPlan>;  // process lifetime (never destroyed)
  return *m;
}

std::string describe(const GemmKey& k) {
  auto n = [](int64_t v) { return std::to_string(v); };
  return "m=" + n(k.m) + " n=" + n(k.n) + " k=" + n(k.k) + " op(A)=" + (k.ta ? "T" : "N") +
         " op(B)=" + (k.tb ? "T" : "N") + " A/B " + std::string(dtype_name(k.ab)) + " C/D " +
         std::string(dtype_name(k.cd)) + (k.bias ? " bias" : "") + " (alignments " + n(k.al_a) + "/" + n(k.al_b) + "/" +
         n(k.al_c) + ")";
}

// Builds the plan; with fuse_bias or gelu_aux, returns false when no algorithm supports the
// epilogue (BIAS, GELU_AUX, GELU_AUX_BIAS). gelu_aux: `aux` is the pre-activation output's address.
bool build_plan(const GemmKey& k, bool fuse_bias, GemmPlan& p, bool gelu_aux = false, const void* aux = nullptr) {
  const cublasOperation_t ta = k.ta ? CUBLAS_OP_T : CUBLAS_OP_N, tb = k.tb ? CUBLAS_OP_T : CUBLAS_OP_N;
  LATHE_CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  LATHE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
  LATHE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
  if (fuse_bias || gelu_aux) {
    const cublasLtEpilogue_t epi = !gelu_aux   ? CUBLASLT_EPILOGUE_BIAS
                                   : fuse_bias ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS
                                               : CUBLASLT_EPILOGUE_GELU_AUX;
    LATHE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi)));
  }
  if (fuse_bias) {
    const cudaDataType_t bias_type = CUDA_R_32F;
    LATHE_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type, sizeof(bias_type)));
  }
  if (gelu_aux) {  // aux (the GELU input) laid out as D: same type (the default), same leading dimension
    const int64_t ld = k.ldc;
    LATHE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ld, sizeof(ld)));
    LATHE_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux, sizeof(aux)));
  }
  // Stored (pre-op) shapes: op(A) is m x k, op(B) is k x n, C/D m x n, all column-major.
  LATHE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.a, cuda_type(k.ab), k.ta ? k.k : k.m, k.ta ? k.m : k.k, k.lda));
  LATHE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.b, cuda_type(k.ab), k.tb ? k.n : k.k, k.tb ? k.k : k.n, k.ldb));
  LATHE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.c, cuda_type(k.cd), k.m, k.n, k.ldc));
  cublasLtMatmulPreference_t pref = nullptr;
  LATHE_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  const size_t ws = kCublasLtWorkspaceBytes;
  LATHE_CUBLAS_CHECK(
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
  const uint32_t al[4] = {k.al_a, k.al_b, k.al_c, k.al_c};
  const cublasLtMatmulPreferenceAttributes_t al_attr[4] = {
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
  for (int i = 0; i < 4; ++i)
    LATHE_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, al_attr[i], &al[i], sizeof(al[i])));
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t st =
      cublasLtMatmulAlgoGetHeuristic(cublaslt(), p.desc, p.a, p.b, p.c, p.c, pref, 1, &result, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  if (st != CUBLAS_STATUS_SUCCESS || found == 0) {
    cublasLtMatmulDescDestroy(p.desc);
    cublasLtMatrixLayoutDestroy(p.a);
    cublasLtMatrixLayoutDestroy(p.b);
    cublasLtMatrixLayoutDestroy(p.c);
    p = GemmPlan{};
    if (fuse_bias || gelu_aux) return false;
    if (st != CUBLAS_STATUS_SUCCESS) throw_cublas(st, "cublasLtMatmulAlgoGetHeuristic", __FILE__, __LINE__);
    fail("cuda matmul: cuBLASLt has no algorithm for " + describe(k));
  }
  p.algo = result.algo;
  p.fused_bias = fuse_bias;
  p.fused_gelu = gelu_aux;
  return true;
}

const GemmPlan& plan_for(const GemmKey& k) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = plans().find(k);
  if (it != plans().end()) return it->second;
  GemmPlan p;
  // The epilogue reads the bias vector with 16-byte loads: an unaligned bias is added separately.
  if (!(k.bias && k.al_bias >= 16 && build_plan(k, true, p))) build_plan(k, false, p);
  return plans().emplace(k, p).first->second;
}

// The GELU_AUX(_BIAS) plan of k (k.gelu), or one with fused_gelu = false when cuBLASLt has none for
// these shapes, types and alignments (the caller then runs the GEMM and the GELU kernel apart).
const GemmPlan& gelu_plan_for(const GemmKey& k, const void* aux) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = plans().find(k);
  if (it != plans().end()) return it->second;
  GemmPlan p;
  // cuBLASLt: the aux leading dimension divisible by 8; the bias read with 16-byte loads.
  if (k.ldc % 8 == 0 && (!k.bias || k.al_bias >= 16)) build_plan(k, k.bias, p, true, aux);
  return plans().emplace(k, p).first->second;
}

template <class T>
__global__ void bias_add_rows_kernel(T* out, const float* bias, int64_t rows, int64_t cols) {
  LATHE_GRID_LOOP(i, rows * cols) out[i] = from_f<T>(to_f(out[i]) + bias[i % cols]);
}

// D[m x n] = alpha op(A) op(B) + beta C (+ bias[m] broadcast over columns), column-major, C = D.
// Row-major callers pass their output's row length as m (the bias runs along it).
void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const void* A, int64_t lda, const void* B, int64_t ldb,
          void* Cd, int64_t ldc, DType ab, DType cd, float beta, const float* bias) {
  if (m <= 0 || n <= 0) return;
  LATHE_CUDA_REQUIRE(k >= 1, "cuda matmul: inner dimension " + std::to_string(k) + " (must be >= 1)");
  const GemmKey key{ta,
                    tb,
                    m,
                    n,
                    k,
                    lda,
                    ldb,
                    ldc,
                    ab,
                    cd,
                    bias != nullptr,
                    alignment(A),
                    alignment(B),
                    alignment(Cd),
                    alignment(bias)};
  const GemmPlan& p = plan_for(key);
  if (p.fused_bias) {
    LATHE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
  }
  const float alpha = 1.0f;
  LATHE_CUBLAS_CHECK(cublasLtMatmul(cublaslt(), p.desc, &alpha, A, p.a, B, p.b, &beta, Cd, p.c, Cd, p.c, &p.algo,
                                    cublaslt_workspace(), kCublasLtWorkspaceBytes, stream()));
  if (bias && !p.fused_bias) {
    LATHE_CUDA_REQUIRE(ldc == m, "cuda matmul: an unfused bias needs a packed output");
    switch (cd) {
      case DType::F32:
        bias_add_rows_kernel<<<blocks(m * n), kThreads, 0, stream()>>>(static_cast<float*>(Cd), bias, n, m);
        break;
      case DType::BF16:
        bias_add_rows_kernel<<<blocks(m * n), kThreads, 0, stream()>>>(static_cast<__nv_bfloat16*>(Cd), bias, n, m);
        break;
      default:
        bias_add_rows_kernel<<<blocks(m * n), kThreads, 0, stream()>>>(static_cast<__half*>(Cd), bias, n, m);
    }
    LATHE_CUDA_LAUNCHED(bias_add_rows_kernel);
  }
}

// Pass 1 of the column sums: block (32 columns) x (8 row lanes) per (column tile, row chunk); the 8
// lanes' sums are combined in lane order; one partial row per chunk.
template <class T>
__global__ void col_sums_partial_kernel(float* __restrict__ partial, const T* __restrict__ x, int64_t M, int64_t N,
                                        int64_t rows_per_partial) {
  __shared__ float s[8][33];
  const int64_t c = static_cast<int64_t>(blockIdx.x) * 32 + threadIdx.x;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * rows_per_partial;
  const int64_t r1 = min(r0 + rows_per_partial, M);
  float acc = 0.0f;
  if (c < N)
    for (int64_t r = r0 + threadIdx.y; r < r1; r += 8) acc += to_f(x[r * N + c]);
  s[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && c < N) {
    float t = 0.0f;
    for (int j = 0; j < 8; ++j) t += s[j][threadIdx.x];
    partial[static_cast<int64_t>(blockIdx.y) * N + c] = t;
  }
}

__global__ void col_sums_final_kernel(float* __restrict__ out, const float* __restrict__ partial, int64_t N,
                                      int64_t P) {
  LATHE_GRID_LOOP(c, N) {
    float t = 0.0f;
    for (int64_t p = 0; p < P; ++p) t += partial[p * N + c];
    out[c] += t;
  }
}

}  // namespace

template <DType D>
void col_sums_add(float* out, const void* x, int64_t M, int64_t N) {
  if (M <= 0 || N <= 0) return;
  const ColSumPlan plan = col_sum_plan(M, N);
  float* partial = static_cast<float*>(workspace(kSlotColSum, plan.scratch_bytes));
  const dim3 grid(static_cast<unsigned>(ceil_div(N, 32)), static_cast<unsigned>(plan.partials));
  col_sums_partial_kernel<<<grid, dim3(32, 8), 0, stream()>>>(partial, static_cast<const typename Elem<D>::T*>(x), M, N,
                                                              plan.rows_per_partial);
  LATHE_CUDA_LAUNCHED(col_sums_partial_kernel);
  col_sums_final_kernel<<<blocks(N), kThreads, 0, stream()>>>(out, partial, N, plan.partials);
  LATHE_CUDA_LAUNCHED(col_sums_final_kernel);
}

template <DType D>
void matmul_forward(void* out, const void* inp, const void* weight, const float* bias, int64_t M, int64_t K, int64_t N,
                    bool accumulate) {
  gemm(true, false, N, M, K, weight, K, inp, K, out, N, D, D, accumulate ? 1.0f : 0.0f, bias);
}

template <DType D>
void matmul_bias_gelu_forward(void* out, void* pre, const void* inp, const void* weight, const float* bias, int64_t M,
                              int64_t K, int64_t N) {
  if (M <= 0 || N <= 0) return;
  LATHE_CUDA_REQUIRE(K >= 1, "cuda matmul: inner dimension " + std::to_string(K) + " (must be >= 1)");
  // As matmul_forward: out^T [N x M] = op_T(weight) . op_N(inp^T), with D = out and aux = pre.
  GemmKey key{
      true,           false,          N, M, K, K, K, N, D, D, bias != nullptr, alignment(weight), alignment(inp),
      alignment(out), alignment(bias)};
  key.gelu = true;
  key.al_aux = alignment(pre);
  const GemmPlan& p = gelu_plan_for(key, pre);
  if (!p.fused_gelu) {  // the unfused pair: the same contract, the GELU read from the rounded pre
    matmul_forward<D>(pre, inp, weight, bias, M, K, N, false);
    gelu_forward<D>(out, pre, M * N);
    return;
  }
  if (p.fused_bias)
    LATHE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
  LATHE_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &pre, sizeof(pre)));
  const float alpha = 1.0f, beta = 0.0f;
  LATHE_CUBLAS_CHECK(cublasLtMatmul(cublaslt(), p.desc, &alpha, weight, p.a, inp, p.b, &beta, out, p.c, out, p.c,
                                    &p.algo, cublaslt_workspace(), kCublasLtWorkspaceBytes, stream()));
}

template <DType D>
void matmul_backward(void* dinp, float* dweight, float* dbias, const void* dout, const void* inp, const void* weight,
                     int64_t M, int64_t K, int64_t N, bool accumulate_dinp) {
  if (dinp) gemm(false, false, K, M, N, weight, K, dout, N, dinp, K, D, D, accumulate_dinp ? 1.0f : 0.0f, nullptr);
  if (dweight) gemm(false, true, K, N, M, inp, K, dout, N, dweight, K, D, DType::F32, 1.0f, nullptr);
  if (dbias) col_sums_add<D>(dbias, dout, M, N);
}

template <DType D>
void gemm_nt_f32out(float* out, const void* a, const void* b, int64_t M, int64_t K, int64_t N, bool accumulate) {
  gemm(true, false, N, M, K, b, K, a, K, out, N, D, DType::F32, accumulate ? 1.0f : 0.0f, nullptr);
}

LATHE_CUDA_INSTANTIATE(matmul_forward, (void*, const void*, const void*, const float*, int64_t, int64_t, int64_t, bool))
LATHE_CUDA_INSTANTIATE(matmul_bias_gelu_forward,
                       (void*, void*, const void*, const void*, const float*, int64_t, int64_t, int64_t))
LATHE_CUDA_INSTANTIATE(matmul_backward,
                       (void*, float*, float*, const void*, const void*, const void*, int64_t, int64_t, int64_t, bool))
LATHE_CUDA_INSTANTIATE(col_sums_add, (float*, const void*, int64_t, int64_t))
LATHE_CUDA_INSTANTIATE(gemm_nt_f32out, (float*, const void*, const void*, int64_t, int64_t, int64_t, bool))

}  // namespace lathe::cuda
