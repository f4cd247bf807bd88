// Fused lm head + softmax + cross-entropy on CUDA, chunked over rows, and the fp32 logits of
// evaluation / generation. Contract: kernels/cpu/ops.h (lm_head_loss); scratch layout and launch
// sizes: kernels/cuda/lm_head_loss_launch.h.
//
// Per call (x[N, C], w[V, C] in the table's dtype, targets[N] int32, losses[N] fp32, dw fp32):
//   0. targets checked on the device (first row with target >= V, atomicMin: a deterministic
//      answer); an out-of-range target throws before anything is written (as the CPU kernel).
// Per chunk of R rows:
//   1. logits[R, V] fp32 = x_chunk @ w^T                  (cuBLASLt, fp32 accumulation)
//   2. one block per row: max, sum of exp(logit - max) in double (fixed-order block reduction),
//      loss = max + log(sum) - logit[target]; backward: dlogit = exp(logit - max) * (grad_scale /
//      sum), minus grad_scale at the target; ignored rows (target < 0): loss 0, dlogits 0
//   3. dx_chunk[R, C] = dlogits @ w (overwrite), dw[V, C] += dlogits^T @ x_chunk
// Then one block sums losses[0, N) in double in a fixed order and the sum comes to the host.
// Each step is deterministic, so two calls give bit-identical losses, dx and dw.
//
// The GEMMs are cudak1's (matmul.cu, cuBLASLt, fp32 compute without TF32): gemm_nt_f32out for the
// fp32 logits of a chunk and matmul_backward for dx (= dlogits @ w) and dw (+= dlogits^T @ x, fp32).
// 16-bit tables round the dlogits to their dtype for the two backward GEMMs (as the CPU bf16 table).
// clang-format off
#include "kernels/cuda/device_util.cuh"  // first: it configures fmt for nvcc
// clang-format on
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "kernels/backend.h"  // VocabParallel
#include "kernels/cuda/lm_head_loss_launch.h"
#include "kernels/cuda/ops.h"

namespace lathe::cuda {
namespace {

using lm_head::kCheckThreads;
using lm_head::kReduceThreads;
using lm_head::kRowThreads;

// ---- kernels -------------------------------------------------------------------------------------
__global__ void check_targets_kernel(const int32_t* __restrict__ targets, int64_t N, int64_t V,
                                     unsigned long long* __restrict__ first_bad) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kCheckThreads + threadIdx.x;
  if (i < N && targets[i] >= V) atomicMin(first_bad, static_cast<unsigned long long>(i));
}

// Final-logit soft-capping (Gemma 2), in place on n fp32 logits: l <- cap * tanh(l / cap). The
// softmax kernels below then read capped logits and, with cap > 0, multiply each dlogit by the
// cap's derivative 1 - (l / cap)^2.
__global__ void softcap_kernel(float* __restrict__ logits, int64_t n, float cap) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kCheckThreads + threadIdx.x;
  if (i < n) logits[i] = cap * tanhf(logits[i] / cap);
}
__device__ __forceinline__ float cap_grad(float g, float capped, float cap) {
  if (cap <= 0.0f) return g;
  const float th = capped / cap;
  return g * (1.0f - th * th);
}

// One block per row r of the chunk: logits[r, :] (fp32) -> loss; backward: dlogits (type G) of the
// row, written to dl (which is `logits` itself for fp32: each element is read, then overwritten by
// the same thread).
template <typename G>
__global__ void __launch_bounds__(kRowThreads)
    softmax_xent_kernel(float* __restrict__ losses, float* logits, G* dl, const int32_t* __restrict__ targets,
                        int64_t V, float grad_scale, bool backward, float cap) {
  __shared__ float red_f[kRowThreads / 32];
  __shared__ double red_d[kRowThreads / 32];
  const int64_t r = blockIdx.x;
  float* s = logits + r * V;
  G* d = dl + r * V;
  const int32_t t = targets[r];
  if (t < 0) {  // ignored row (uniform across the block)
    if (threadIdx.x == 0) losses[r] = 0.0f;
    if (backward)
      for (int64_t j = threadIdx.x; j < V; j += kRowThreads) store_f(d + j, 0.0f);
    return;
  }
  const float target_logit = s[t];  // read before any thread overwrites the row
  float m = -INFINITY;
  for (int64_t j = threadIdx.x; j < V; j += kRowThreads) m = fmaxf(m, s[j]);
  m = block_max<kRowThreads>(m, red_f);
  double sum = 0.0;
  for (int64_t j = threadIdx.x; j < V; j += kRowThreads) sum += static_cast<double>(expf(s[j] - m));
  sum = block_sum<kRowThreads>(sum, red_d);
  if (threadIdx.x == 0)
    losses[r] = static_cast<float>(static_cast<double>(m) + log(sum) - static_cast<double>(target_logit));
  if (!backward) return;
  const float factor = static_cast<float>(static_cast<double>(grad_scale) / sum);
  for (int64_t j = threadIdx.x; j < V; j += kRowThreads) {
    float g = expf(s[j] - m) * factor;
    if (j == t) g -= grad_scale;
    store_f(d + j, cap_grad(g, s[j], cap));
  }
}

// ---- vocab-parallel rows (tensor parallelism: this rank's w holds vocabulary rows
// [vocab_begin, vocab_begin + V) of global_V), as kernels/cpu/lm_head_loss_vocab_parallel.cpp:
// per chunk, mx[R] = local row maxima (all-reduced: max), then sums[R] = sum exp(logit - mx) and
// tgt[R] = the target logit on the shard holding it, 0 elsewhere (all-reduced together: sum), then
// losses and dlogits from the whole row's statistics. red = [mx | sums | tgt], 3R doubles.
__global__ void __launch_bounds__(kRowThreads)
    vp_row_max_kernel(const float* __restrict__ logits, int64_t V, double* __restrict__ mx) {
  __shared__ float red_f[kRowThreads / 32];
  const float* s = logits + static_cast<int64_t>(blockIdx.x) * V;
  float m = -INFINITY;
  for (int64_t j = threadIdx.x; j < V; j += kRowThreads) m = fmaxf(m, s[j]);
  m = block_max<kRowThreads>(m, red_f);
  if (threadIdx.x == 0) mx[blockIdx.x] = static_cast<double>(m);
}

// The column of row r's target in this shard, or -1 (ignored row or another shard's column).
__device__ __forceinline__ int64_t local_target(int32_t t, int64_t vocab_begin, int64_t V) {
  const int64_t c = static_cast<int64_t>(t) - vocab_begin;
  return t >= 0 && c >= 0 && c < V ? c : -1;
}

__global__ void __launch_bounds__(kRowThreads)
    vp_row_sums_kernel(const float* __restrict__ logits, const int32_t* __restrict__ targets, int64_t V,
                       int64_t vocab_begin, int64_t R, double* __restrict__ red) {
  __shared__ double red_d[kRowThreads / 32];
  const int64_t r = blockIdx.x;
  const float* s = logits + r * V;
  const int32_t t = targets[r];
  const float m = static_cast<float>(red[r]);
  double sum = 0.0;
  if (t >= 0)
    for (int64_t j = threadIdx.x; j < V; j += kRowThreads) sum += static_cast<double>(expf(s[j] - m));
  sum = block_sum<kRowThreads>(sum, red_d);
  if (threadIdx.x == 0) {
    const int64_t c = local_target(t, vocab_begin, V);
    red[R + r] = sum;
    red[2 * R + r] = c >= 0 ? static_cast<double>(s[c]) : 0.0;
  }
}

template <typename G>
__global__ void __launch_bounds__(kRowThreads)
    vp_apply_kernel(float* __restrict__ losses, float* logits, G* dl, const int32_t* __restrict__ targets, int64_t V,
                    int64_t vocab_begin, int64_t R, const double* __restrict__ red, float grad_scale, bool backward,
                    float cap) {
  const int64_t r = blockIdx.x;
  float* s = logits + r * V;
  G* d = dl + r * V;
  const int32_t t = targets[r];
  if (t < 0) {
    if (threadIdx.x == 0) losses[r] = 0.0f;
    if (backward)
      for (int64_t j = threadIdx.x; j < V; j += kRowThreads) store_f(d + j, 0.0f);
    return;
  }
  const double mx = red[r], sum = red[R + r], tgt = red[2 * R + r];
  if (threadIdx.x == 0) losses[r] = static_cast<float>(mx + log(sum) - tgt);
  if (!backward) return;
  const float m = static_cast<float>(mx);
  const float factor = static_cast<float>(static_cast<double>(grad_scale) / sum);
  const int64_t c = local_target(t, vocab_begin, V);
  for (int64_t j = threadIdx.x; j < V; j += kRowThreads) {
    float g = expf(s[j] - m) * factor;
    if (j == c) g -= grad_scale;
    store_f(d + j, cap_grad(g, s[j], cap));
  }
}

// aux->total = sum of losses[0, N) in double: thread i adds rows i, i + 1024, ... in order, then a
// fixed-order block reduction.
__global__ void __launch_bounds__(kReduceThreads)
    sum_losses_kernel(const float* __restrict__ losses, int64_t N, double* __restrict__ total) {
  __shared__ double red[kReduceThreads / 32];
  double acc = 0.0;
  for (int64_t i = threadIdx.x; i < N; i += kReduceThreads) acc += static_cast<double>(losses[i]);
  acc = block_sum<kReduceThreads>(acc, red);
  if (threadIdx.x == 0) *total = acc;
}

// ---- host side -----------------------------------------------------------------------------------
struct Aux {
  unsigned long long first_bad;
  double total;
};

// This rank's share of a vocabulary split across the tensor-parallel group (kernels/backend.h's
// VocabParallel); nullptr: the whole vocabulary. all_reduce works in place on device doubles
// written by kernels on stream(): it must order its own work after them (NCCL on stream(), or a
// synchronisation) and finish before it returns or on stream().
struct VocabSplit {
  int64_t vocab_begin = 0, global_V = 0;
  void (*all_reduce)(void* ctx, double* buf, int64_t count, bool max) = nullptr;
  void* ctx = nullptr;
};

template <DType D>
double lm_head_loss_impl(float* losses, void* dx_v, float* dw, const void* x_v, const void* w_v, const int32_t* targets,
                         int64_t N, int64_t C, int64_t V, float grad_scale, bool backward, void* scratch,
                         int64_t chunk_rows, const VocabSplit* vs, float cap) {
  LATHE_CU_CHECK(N >= 0 && C >= 1 && V >= 1, "lm_head_loss: invalid shape N={} C={} V={}", N, C, V);
  LATHE_CU_CHECK(std::isfinite(cap) && cap >= 0.0f,
                 "lm_head_loss: softcap = {} must be finite and >= 0 (0 = no final logit soft-capping)", cap);
  LATHE_CU_CHECK(chunk_rows >= 1, "lm_head_loss: chunk_rows must be >= 1, got {}", chunk_rows);
  LATHE_CU_CHECK(!backward || (dx_v != nullptr && dw != nullptr), "lm_head_loss: backward needs dx and dw buffers");
  if (vs)
    LATHE_CU_CHECK(vs->vocab_begin >= 0 && vs->vocab_begin + V <= vs->global_V,
                   "lm_head_loss: vocab shard [{}, {}) is not inside the vocabulary of {} rows", vs->vocab_begin,
                   vs->vocab_begin + V, vs->global_V);
  const int64_t vocab = vs ? vs->global_V : V;  // targets are global ids
  if (N == 0) return 0.0;
  const int64_t R = std::min(chunk_rows, N);
  LATHE_CU_CHECK(lm_head::gemm_dims_fit(R, C, V) && N < (int64_t{1} << 31),
                 "lm_head_loss: N={} C={} V={} chunk_rows={} exceed cuBLAS's int dimensions; lower "
                 "training.micro_batch_size or the chunk size",
                 N, C, V, chunk_rows);
  using St = typename Elem<D>::T;
  const lm_head::ScratchLayout lay = lm_head::scratch_layout(chunk_rows, V, sizeof(St));
  LATHE_CU_CHECK(lay.bytes != 0, "lm_head_loss: scratch for chunk_rows={} V={} overflows", chunk_rows, V);
  auto* base = static_cast<char*>(scratch);
  float* logits = reinterpret_cast<float*>(base + lay.logits);
  using G = St;  // dlogits element type: 16-bit dlogits feed the 16-bit GEMMs, fp32 ones stay in place
  G* dl = reinterpret_cast<G*>(base + lay.dlogits);
  auto* aux = reinterpret_cast<Aux*>(base + lay.aux);
  auto* red = reinterpret_cast<double*>(base + lay.stats);  // [3R]: vocab-parallel row statistics
  const cudaStream_t st = stream();

  // 0. targets
  LATHE_CUDA_CHECK(cudaMemsetAsync(&aux->first_bad, 0xff, sizeof(aux->first_bad), st));
  check_targets_kernel<<<static_cast<unsigned>(lm_head::check_blocks(N)), kCheckThreads, 0, st>>>(targets, N, vocab,
                                                                                                  &aux->first_bad);
  check_launch("lm_head_loss (target check)");
  unsigned long long bad = 0;
  LATHE_CUDA_CHECK(cudaMemcpyAsync(&bad, &aux->first_bad, sizeof(bad), cudaMemcpyDeviceToHost, st));
  LATHE_CUDA_CHECK(cudaStreamSynchronize(st));
  if (bad != ~0ull) {
    int32_t t = 0;
    LATHE_CUDA_CHECK(cudaMemcpy(&t, targets + bad, sizeof(t), cudaMemcpyDeviceToHost));
    fail(
        "lm_head_loss: target {} at row {} is out of range for vocab size {}; check that the tokenizer's "
        "vocabulary matches model.vocab_size",
        t, bad, vocab);
  }

  const auto* x = static_cast<const St*>(x_v);
  const auto* w = static_cast<const St*>(w_v);
  auto* dx = static_cast<St*>(dx_v);
  for (int64_t c = 0; c < lm_head::num_chunks(N, chunk_rows); ++c) {
    const lm_head::ChunkRows rows = lm_head::chunk_rows_of(c, N, chunk_rows);
    const St* xc = x + rows.first * C;
    gemm_nt_f32out<D>(logits, xc, w, rows.count, C, V, false);
    if (cap > 0.0f) {
      const int64_t n = rows.count * V;
      softcap_kernel<<<static_cast<unsigned>((n + kCheckThreads - 1) / kCheckThreads), kCheckThreads, 0, st>>>(logits,
                                                                                                               n, cap);
      check_launch("lm_head_loss (final logit soft-capping)");
    }
    const unsigned nrows = static_cast<unsigned>(rows.count);
    const int32_t* tc = targets + rows.first;
    if (vs == nullptr) {
      softmax_xent_kernel<G>
          <<<nrows, kRowThreads, 0, st>>>(losses + rows.first, logits, dl, tc, V, grad_scale, backward, cap);
      check_launch("lm_head_loss (softmax / cross-entropy)");
    } else {
      vp_row_max_kernel<<<nrows, kRowThreads, 0, st>>>(logits, V, red);
      check_launch("lm_head_loss (vocab-parallel row max)");
      if (vs->all_reduce) vs->all_reduce(vs->ctx, red, rows.count, true);
      vp_row_sums_kernel<<<nrows, kRowThreads, 0, st>>>(logits, tc, V, vs->vocab_begin, rows.count, red);
      check_launch("lm_head_loss (vocab-parallel row sums)");
      if (vs->all_reduce) vs->all_reduce(vs->ctx, red + rows.count, 2 * rows.count, false);
      vp_apply_kernel<G><<<nrows, kRowThreads, 0, st>>>(losses + rows.first, logits, dl, tc, V, vs->vocab_begin,
                                                        rows.count, red, grad_scale, backward, cap);
      check_launch("lm_head_loss (vocab-parallel softmax / cross-entropy)");
    }
    if (backward) {
      // dx_chunk[R, C] = dlogits[R, V] @ w[V, C];  dw[V, C] += dlogits^T @ x_chunk[R, C]
      matmul_backward<D>(dx + rows.first * C, dw, nullptr, dl, xc, w, rows.count, C, V, false);
    }
  }
  sum_losses_kernel<<<1, kReduceThreads, 0, st>>>(losses, N, &aux->total);
  check_launch("lm_head_loss (loss sum)");
  double total = 0.0;
  LATHE_CUDA_CHECK(cudaMemcpyAsync(&total, &aux->total, sizeof(total), cudaMemcpyDeviceToHost, st));
  LATHE_CUDA_CHECK(cudaStreamSynchronize(st));
  return total;
}

template <DType D>
void logits_impl(float* logits, const void* x, const void* w, int64_t M, int64_t C, int64_t V) {
  LATHE_CU_CHECK(M >= 0 && C >= 1 && V >= 1, "logits_forward: invalid shape M={} C={} V={}", M, C, V);
  if (M == 0) return;
  LATHE_CU_CHECK(lm_head::gemm_dims_fit(M, C, V), "logits_forward: M={} C={} V={} exceed cuBLAS's int dimensions", M, C,
                 V);
  gemm_nt_f32out<D>(logits, x, w, M, C, V, false);
}

}  // namespace

template <DType D>
double lm_head_loss(float* losses, void* dx, float* dw, const void* x, const void* w, const int32_t* targets, int64_t N,
                    int64_t C, int64_t V, float grad_scale, bool backward, void* scratch, int64_t chunk_rows,
                    const VocabParallel* vp, float softcap) {
  if (vp == nullptr)
    return lm_head_loss_impl<D>(losses, dx, dw, x, w, targets, N, C, V, grad_scale, backward, scratch, chunk_rows,
                                nullptr, softcap);
  VocabSplit vs;
  vs.vocab_begin = vp->vocab_begin;
  vs.global_V = vp->global_V;
  vs.all_reduce = vp->all_reduce;
  vs.ctx = vp->ctx;
  return lm_head_loss_impl<D>(losses, dx, dw, x, w, targets, N, C, V, grad_scale, backward, scratch, chunk_rows, &vs,
                              softcap);
}
template <DType D>
size_t lm_head_loss_scratch_bytes(int64_t chunk_rows, int64_t V) {
  return lm_head::scratch_layout(chunk_rows, V, static_cast<int>(sizeof(typename Elem<D>::T))).bytes;
}
template <DType D>
void logits_forward(float* logits, const void* x, const void* w, int64_t M, int64_t C, int64_t V) {
  logits_impl<D>(logits, x, w, M, C, V);
}

template double lm_head_loss<DType::F32>(float*, void*, float*, const void*, const void*, const int32_t*, int64_t,
                                         int64_t, int64_t, float, bool, void*, int64_t, const VocabParallel*, float);
template double lm_head_loss<DType::BF16>(float*, void*, float*, const void*, const void*, const int32_t*, int64_t,
                                          int64_t, int64_t, float, bool, void*, int64_t, const VocabParallel*, float);
template double lm_head_loss<DType::F16>(float*, void*, float*, const void*, const void*, const int32_t*, int64_t,
                                         int64_t, int64_t, float, bool, void*, int64_t, const VocabParallel*, float);
template size_t lm_head_loss_scratch_bytes<DType::F32>(int64_t, int64_t);
template size_t lm_head_loss_scratch_bytes<DType::BF16>(int64_t, int64_t);
template size_t lm_head_loss_scratch_bytes<DType::F16>(int64_t, int64_t);
LATHE_CUDA_INSTANTIATE(logits_forward, (float*, const void*, const void*, int64_t, int64_t, int64_t))

}  // namespace lathe::cuda
