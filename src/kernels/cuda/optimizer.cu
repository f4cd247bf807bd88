// Optimizer, gradient-norm, non-finite and scale kernels on CUDA over the flat fp32 buffers
// (declarations and contracts: kernels/cuda/optimizer.h; work split: kernels/cuda/optimizer_launch.h).
//
// AdamW and LAMB use the formulas of kernels/cpu/step.cpp (optim/'s) in the same order with the
// same float scalars (computed on the host in double and rounded once, as the CPU code does), one
// block per chunk of kernels/step_ops.h. Differences to the CPU are at the ulp level: nvcc and GCC
// contract different a*b+c into FMAs (both compile with contraction on), and IEEE sqrt / division
// are exact in both (no fast math here).
//
// Reductions (LAMB's per-chunk ||p||^2 and ||u||^2, the gradient's per-chunk sum of squares) are
// double, one block per chunk in a fixed order (block_sum), and the chunk sums are added on the
// host in chunk order: deterministic, and the same partition as the CPU (so ZeRO's chunk-sum
// exchange and norm_from_step_chunk_sums apply unchanged).
// clang-format off
#include "kernels/cuda/device_util.cuh"  // first: it configures fmt for nvcc
// clang-format on
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <mutex>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "kernels/cuda/optimizer.h"
#include "kernels/cuda/optimizer_launch.h"

namespace lathe::cuda {
namespace {

using optim_launch::DeviceChunk;
constexpr int kOptThreads = optim_launch::kThreads;

// ---- device memory kept between calls (grow only; guarded by one mutex) ----------------------
// The chunk table of the last ranges seen (the trainer passes the same ranges every step, so the
// table is uploaded once), and small buffers for chunk sums, LAMB's scales and the non-finite flag.
struct State {
  std::mutex mu;
  std::vector<StepRange> ranges;    // the ranges the device table was built from
  std::vector<DeviceChunk> chunks;  // host copy (kept alive while the copy is in flight)
  DeviceChunk* dev_chunks = nullptr;
  size_t chunk_cap = 0;
  double* sums = nullptr;  // per-chunk sums
  size_t sums_cap = 0;
  float* scales = nullptr;  // LAMB: per-range -lr * trust
  size_t scales_cap = 0;
  int* flag = nullptr;
};
State& state() {
  static State* s = new State;  // never destroyed: device memory outlives static destructors' context
  return *s;
}

template <typename T>
T* grow(T* p, size_t& cap, size_t n) {
  if (n <= cap && p != nullptr) return p;
  if (p) {
    LATHE_CUDA_CHECK(cudaStreamSynchronize(stream()));  // kernels may still read the old buffer
    LATHE_CUDA_CHECK(cudaFree(p));
  }
  const size_t c = n == 0 ? 1 : n;
  void* q = nullptr;
  LATHE_CUDA_CHECK(cudaMalloc(&q, c * sizeof(T)));
  cap = c;
  return static_cast<T*>(q);
}

bool same_ranges(std::span<const StepRange> a, const std::vector<StepRange>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i].offset != b[i].offset || a[i].size != b[i].size || a[i].decay != b[i].decay || a[i].tensor != b[i].tensor)
      return false;
  return true;
}

// The device chunk table of `ranges` (caller holds st.mu).
const DeviceChunk* chunk_table(State& st, std::span<const StepRange> ranges) {
  if (!same_ranges(ranges, st.ranges) || st.dev_chunks == nullptr) {
    st.ranges.assign(ranges.begin(), ranges.end());
    st.chunks = optim_launch::device_chunks(ranges);
    st.dev_chunks = grow(st.dev_chunks, st.chunk_cap, st.chunks.size());
    if (!st.chunks.empty())
      LATHE_CUDA_CHECK(cudaMemcpyAsync(st.dev_chunks, st.chunks.data(), st.chunks.size() * sizeof(DeviceChunk),
                                       cudaMemcpyHostToDevice, stream()));
  }
  return st.dev_chunks;
}

void check_ranges(const char* who, std::span<const StepRange> ranges, int64_t step) {
  LATHE_CU_CHECK(step >= 1, "{}: step must be >= 1, got {}", who, step);
  for (size_t r = 0; r < ranges.size(); ++r)
    LATHE_CU_CHECK(ranges[r].offset + ranges[r].size >= ranges[r].offset,
                   "{}: parameter range {} (offset {}, size {}) overflows", who, r, ranges[r].offset, ranges[r].size);
}

// ---- kernels -------------------------------------------------------------------------------------
struct AdamWScalars {
  float decay_mul, b1, one_minus_b1, b2, one_minus_b2, neg_step_size, bc2_sqrt, eps, grad_scale;
};

__global__ void __launch_bounds__(kOptThreads)
    adamw_kernel(float* __restrict__ params, const float* __restrict__ grads, float* __restrict__ m,
                 float* __restrict__ v, const DeviceChunk* __restrict__ chunks, AdamWScalars k) {
  const DeviceChunk ch = chunks[blockIdx.x];
  const float dm = ch.decay ? k.decay_mul : 1.0f;
  for (int64_t i = ch.begin + threadIdx.x; i < ch.end; i += kOptThreads) {
    const float g = grads[i] * k.grad_scale;
    const float p = params[i] * dm;
    const float mi = m[i] * k.b1 + g * k.one_minus_b1;
    const float vi = v[i] * k.b2 + g * g * k.one_minus_b2;
    m[i] = mi;
    v[i] = vi;
    const float denom = sqrtf(vi) / k.bc2_sqrt + k.eps;
    params[i] = p + k.neg_step_size * (mi / denom);
  }
}

struct LambScalars {
  float inv_bc1, inv_bc2, b1, one_minus_b1, b2, one_minus_b2, eps, wd, grad_scale;
};

// LAMB's update direction from the updated moments and the old parameter (kernels/cpu/step.cpp `update`).
__device__ __forceinline__ float lamb_u(float mi, float vi, float p, float w, const LambScalars& k) {
  return (mi * k.inv_bc1) / (sqrtf(vi * k.inv_bc2) + k.eps) + w * p;
}

// Pass 1: moments; sums[2c] = sum p^2, sums[2c + 1] = sum u^2 over chunk c (double).
__global__ void __launch_bounds__(kOptThreads)
    lamb_moments_kernel(const float* __restrict__ params, const float* __restrict__ grads, float* __restrict__ m,
                        float* __restrict__ v, const DeviceChunk* __restrict__ chunks, LambScalars k,
                        double* __restrict__ sums) {
  __shared__ double red[kOptThreads / 32];
  const DeviceChunk ch = chunks[blockIdx.x];
  const float w = ch.decay ? k.wd : 0.0f;
  double ps = 0.0, us = 0.0;
  for (int64_t i = ch.begin + threadIdx.x; i < ch.end; i += kOptThreads) {
    const float g = grads[i] * k.grad_scale;
    const float mi = m[i] * k.b1 + g * k.one_minus_b1;
    const float vi = v[i] * k.b2 + g * g * k.one_minus_b2;
    m[i] = mi;
    v[i] = vi;
    const float p = params[i];
    const float u = lamb_u(mi, vi, p, w, k);
    ps += static_cast<double>(p) * p;
    us += static_cast<double>(u) * u;
  }
  ps = block_sum<kOptThreads>(ps, red);
  us = block_sum<kOptThreads>(us, red);
  if (threadIdx.x == 0) {
    sums[2 * blockIdx.x] = ps;
    sums[2 * blockIdx.x + 1] = us;
  }
}

// Pass 2: p += scale[range] * u.
__global__ void __launch_bounds__(kOptThreads)
    lamb_apply_kernel(float* __restrict__ params, const float* __restrict__ m, const float* __restrict__ v,
                      const DeviceChunk* __restrict__ chunks, LambScalars k, const float* __restrict__ scales) {
  const DeviceChunk ch = chunks[blockIdx.x];
  const float w = ch.decay ? k.wd : 0.0f;
  const float s = scales[ch.range];
  for (int64_t i = ch.begin + threadIdx.x; i < ch.end; i += kOptThreads)
    params[i] += s * lamb_u(m[i], v[i], params[i], w, k);
}

// sums[c] = sum of squares (double) of x[c * kChunk, min((c + 1) * kChunk, n)).
__global__ void __launch_bounds__(kOptThreads)
    sq_chunk_kernel(const float* __restrict__ x, int64_t n, double* __restrict__ sums) {
  __shared__ double red[kOptThreads / 32];
  const int64_t b = static_cast<int64_t>(blockIdx.x) * static_cast<int64_t>(kStepChunk);
  const int64_t e = min(b + static_cast<int64_t>(kStepChunk), n);
  double s = 0.0;
  for (int64_t i = b + threadIdx.x; i < e; i += kOptThreads) s += static_cast<double>(x[i]) * x[i];
  s = block_sum<kOptThreads>(s, red);
  if (threadIdx.x == 0) sums[blockIdx.x] = s;
}

__global__ void non_finite_kernel(const float* __restrict__ x, int64_t n, int* __restrict__ flag) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kOptThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kOptThreads + threadIdx.x; i < n; i += stride)
    if (!isfinite(x[i])) *flag = 1;  // every writer writes 1: the result does not depend on the order
}

__global__ void scale_kernel(float* __restrict__ x, int64_t n, float s) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kOptThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kOptThreads + threadIdx.x; i < n; i += stride) x[i] *= s;
}

unsigned grid_of(size_t blocks) {
  LATHE_CU_CHECK(blocks <= optim_launch::kMaxBlocks, "optimizer kernels: {} blocks exceed the grid limit", blocks);
  return static_cast<unsigned>(blocks);
}

// Elementwise grids: at most 64K blocks, threads stride over the rest.
unsigned elementwise_grid(size_t n) {
  const size_t b = optim_launch::elementwise_blocks(n);
  return static_cast<unsigned>(b < 65536 ? (b == 0 ? 1 : b) : 65536);
}

}  // namespace

void adamw_step(float* params, const float* grads, float* m, float* v, std::span<const StepRange> ranges,
                const StepHyper& cfg, double lr, int64_t step, float grad_scale) {
  check_ranges("adamw", ranges, step);
  const double bc1 = 1.0 - std::pow(cfg.beta1, static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(cfg.beta2, static_cast<double>(step));
  AdamWScalars k;
  k.decay_mul = static_cast<float>(1.0 - lr * cfg.weight_decay);
  k.b1 = static_cast<float>(cfg.beta1);
  k.one_minus_b1 = static_cast<float>(1.0 - cfg.beta1);
  k.b2 = static_cast<float>(cfg.beta2);
  k.one_minus_b2 = static_cast<float>(1.0 - cfg.beta2);
  k.neg_step_size = static_cast<float>(-(lr / bc1));
  k.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  k.eps = static_cast<float>(cfg.eps);
  k.grad_scale = grad_scale;
  const cudaStream_t s = stream();  // first: selects the process's GPU before any allocation
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  const DeviceChunk* chunks = chunk_table(st, ranges);
  if (st.chunks.empty()) return;
  adamw_kernel<<<grid_of(st.chunks.size()), kOptThreads, 0, s>>>(params, grads, m, v, chunks, k);
  check_launch("adamw_step");
}

void lamb_step(float* params, const float* grads, float* m, float* v, std::span<const StepRange> ranges,
               const StepHyper& cfg, double lr, int64_t step, float grad_scale, const StepChunkSumsGather& gather) {
  check_ranges("lamb", ranges, step);
  LambScalars k;
  k.inv_bc1 = static_cast<float>(1.0 / (1.0 - std::pow(cfg.beta1, static_cast<double>(step))));
  k.inv_bc2 = static_cast<float>(1.0 / (1.0 - std::pow(cfg.beta2, static_cast<double>(step))));
  k.b1 = static_cast<float>(cfg.beta1);
  k.one_minus_b1 = static_cast<float>(1.0 - cfg.beta1);
  k.b2 = static_cast<float>(cfg.beta2);
  k.one_minus_b2 = static_cast<float>(1.0 - cfg.beta2);
  k.eps = static_cast<float>(cfg.eps);
  k.wd = static_cast<float>(cfg.weight_decay);
  k.grad_scale = grad_scale;
  const cudaStream_t s = stream();  // first: selects the process's GPU before any allocation
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  const DeviceChunk* chunks = chunk_table(st, ranges);
  const size_t nchunks = st.chunks.size();

  // Pass 1 and the chunk sums to the host.
  std::vector<double> sums(2 * nchunks);
  if (nchunks > 0) {
    st.sums = grow(st.sums, st.sums_cap, 2 * nchunks);
    lamb_moments_kernel<<<grid_of(nchunks), kOptThreads, 0, s>>>(params, grads, m, v, chunks, k, st.sums);
    check_launch("lamb_step (moments)");
    LATHE_CUDA_CHECK(cudaMemcpyAsync(sums.data(), st.sums, sums.size() * sizeof(double), cudaMemcpyDeviceToHost, s));
    LATHE_CUDA_CHECK(cudaStreamSynchronize(s));
  }

  // Per-range norms and trust ratios, as kernels/cpu/step.cpp (under ZeRO every rank's chunks, in flat
  // order, through `gather`; a rank may hold no chunk and still take part in the exchange).
  std::vector<double> pn(ranges.size(), 0.0), un(ranges.size(), 0.0);
  if (gather) {
    std::vector<StepChunkSums> local(nchunks);
    for (size_t c = 0; c < nchunks; ++c) {
      const size_t r = static_cast<size_t>(st.chunks[c].range);
      LATHE_CU_CHECK(ranges[r].tensor >= 0, "lamb: range {} has no tensor id (needed under ZeRO)", r);
      local[c] = {ranges[r].tensor, sums[2 * c], sums[2 * c + 1]};
    }
    std::unordered_map<int64_t, std::pair<double, double>> total;
    for (const StepChunkSums& cs : gather(local)) {
      auto& t = total[cs.tensor];
      t.first += cs.p;
      t.second += cs.u;
    }
    for (size_t r = 0; r < ranges.size(); ++r) {
      const auto it = total.find(ranges[r].tensor);
      LATHE_CU_CHECK(it != total.end(), "lamb: no chunk sums gathered for tensor {} (range {})", ranges[r].tensor, r);
      std::tie(pn[r], un[r]) = it->second;
    }
  } else {
    for (size_t c = 0; c < nchunks; ++c) {
      pn[static_cast<size_t>(st.chunks[c].range)] += sums[2 * c];
      un[static_cast<size_t>(st.chunks[c].range)] += sums[2 * c + 1];
    }
  }
  if (nchunks == 0) return;
  std::vector<float> scale(ranges.size());
  for (size_t r = 0; r < ranges.size(); ++r) {
    const double p = std::sqrt(pn[r]), u = std::sqrt(un[r]);
    const double trust = (p > 0.0 && u > 0.0) ? p / u : 1.0;
    scale[r] = static_cast<float>(-lr * trust);
  }
  st.scales = grow(st.scales, st.scales_cap, scale.size());
  LATHE_CUDA_CHECK(cudaMemcpyAsync(st.scales, scale.data(), scale.size() * sizeof(float), cudaMemcpyHostToDevice, s));
  lamb_apply_kernel<<<grid_of(nchunks), kOptThreads, 0, s>>>(params, m, v, chunks, k, st.scales);
  check_launch("lamb_step (apply)");
  // `scale` is pageable host memory: wait until the copy has read it before it goes away.
  LATHE_CUDA_CHECK(cudaStreamSynchronize(s));
}

void grad_sq_chunk_sums(const float* grads, size_t n, double* out_host) {
  const size_t nchunks = optim_launch::flat_chunks(n);
  if (nchunks == 0) return;
  const cudaStream_t s = stream();
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  st.sums = grow(st.sums, st.sums_cap, nchunks);
  sq_chunk_kernel<<<grid_of(nchunks), kOptThreads, 0, s>>>(grads, static_cast<int64_t>(n), st.sums);
  check_launch("grad_sq_chunk_sums");
  LATHE_CUDA_CHECK(cudaMemcpyAsync(out_host, st.sums, nchunks * sizeof(double), cudaMemcpyDeviceToHost, s));
  LATHE_CUDA_CHECK(cudaStreamSynchronize(s));
}

double global_grad_norm(const float* grads, size_t n) {
  std::vector<double> sums(optim_launch::flat_chunks(n));
  grad_sq_chunk_sums(grads, n, sums.data());
  return norm_from_step_chunk_sums(sums.data(), sums.size());  // chunk order, as on the CPU
}

bool has_non_finite(const float* x, size_t n) {
  if (n == 0) return false;
  const cudaStream_t s = stream();
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  if (st.flag == nullptr) {
    void* q = nullptr;
    LATHE_CUDA_CHECK(cudaMalloc(&q, sizeof(int)));
    st.flag = static_cast<int*>(q);
  }
  LATHE_CUDA_CHECK(cudaMemsetAsync(st.flag, 0, sizeof(int), s));
  non_finite_kernel<<<elementwise_grid(n), kOptThreads, 0, s>>>(x, static_cast<int64_t>(n), st.flag);
  check_launch("has_non_finite");
  int flag = 0;
  LATHE_CUDA_CHECK(cudaMemcpyAsync(&flag, st.flag, sizeof(int), cudaMemcpyDeviceToHost, s));
  LATHE_CUDA_CHECK(cudaStreamSynchronize(s));
  return flag != 0;
}

void scale_inplace(float* x, size_t n, float s) {
  if (n == 0) return;
  scale_kernel<<<elementwise_grid(n), kOptThreads, 0, stream()>>>(x, static_cast<int64_t>(n), s);
  check_launch("scale_inplace");
}

}  // namespace lathe::cuda
