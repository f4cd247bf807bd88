// Token + learned position embedding (kernels/cuda/ops.h), mirroring kernels/cpu/embedding.cpp;
// wte holds vocabulary rows [vocab_begin, vocab_begin + vocab_rows) (vocab-parallel shards; the
// whole table: 0, V): other tokens give a zero row (+ wpe) in forward and no gradient in backward.
//   forward:  out[B,T,C] = wte[tokens[b,t]] (+ wpe[pos(b,t)]), one thread per element (the sum in
//             fp32, rounded once; without wpe a copy).
//   backward: dwte[V,C] += scatter of dout rows by token, WITHOUT atomics: the (token, row) pairs
//             are stably radix-sorted by token (CUB: deterministic), then one block per run of equal
//             tokens adds the run's dout rows in row order onto the dwte row: the same additions in
//             the same order as the CPU fp32 kernel ((dwte + g_first) + g_next ...).
//             dwpe[T,C] += sum over b of dout[b,t] (one thread per (t, c), b in order); with
//             positions, a sorted scatter as dwte's.
// Workspace: runtime.h slot kSlotEmbedding (CUB's temp storage, sorted keys, row indices).
#include <cub/device/device_radix_sort.cuh>
#include <string>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace lathe::cuda {

namespace {

template <class T>
__global__ void embedding_forward_kernel(T* __restrict__ out, const int32_t* __restrict__ tokens,
                                         const T* __restrict__ wte, const T* __restrict__ wpe, int64_t T_, int64_t C,
                                         int64_t n, const int32_t* __restrict__ positions, int64_t vocab_begin,
                                         int64_t vocab_rows) {
  LATHE_GRID_LOOP(i, n) {
    const int64_t r = i / C, c = i - r * C;
    const int64_t v = static_cast<int64_t>(tokens[r]) - vocab_begin;
    const bool mine = v >= 0 && v < vocab_rows;  // else another shard's token: a zero row (+ wpe)
    if (wpe == nullptr) {
      out[i] = mine ? wte[v * C + c] : from_f<T>(0.0f);
    } else {
      const int64_t p = positions ? positions[r] : r % T_;
      out[i] = mine ? from_f<T>(to_f(wte[v * C + c]) + to_f(wpe[p * C + c])) : wpe[p * C + c];
    }
  }
}

__global__ void iota_kernel(int32_t* v, int64_t n) { LATHE_GRID_LOOP(i, n) v[i] = static_cast<int32_t>(i); }

// Sort keys: the destination row of each source row (key - begin), or -1 (sorted first, skipped)
// outside [0, rows).
__global__ void local_keys_kernel(int32_t* keys, const int32_t* in, int64_t n, int64_t begin, int64_t rows) {
  LATHE_GRID_LOOP(i, n) {
    const int64_t v = static_cast<int64_t>(in[i]) - begin;
    keys[i] = (v >= 0 && v < rows) ? static_cast<int32_t>(v) : -1;
  }
}

// Block per sorted position i that starts a run of equal keys: its threads own columns and add
// the run's dout rows (in row order, the stable sort's) onto the destination row, starting from
// its old value: the additions of the CPU fp32 kernel in its order.
template <class T>
__global__ void sorted_scatter_kernel(float* __restrict__ dst, const int32_t* __restrict__ keys,
                                      const int32_t* __restrict__ rows, const T* __restrict__ dout, int64_t n,
                                      int64_t C) {
  for (int64_t i = blockIdx.x; i < n; i += gridDim.x) {
    const int32_t key = keys[i];
    if (key < 0 || (i > 0 && keys[i - 1] == key)) continue;  // skipped, or not the first of its run
    int64_t end = i + 1;
    while (end < n && keys[end] == key) ++end;
    float* d = dst + static_cast<int64_t>(key) * C;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
      float acc = d[c];
      for (int64_t j = i; j < end; ++j) acc += to_f(dout[static_cast<int64_t>(rows[j]) * C + c]);
      d[c] = acc;
    }
  }
}

// dwpe[t, c] += dout[0, t, c] + dout[1, t, c] + ... (b in order).
template <class T>
__global__ void dwpe_kernel(float* __restrict__ dwpe, const T* __restrict__ dout, int64_t B, int64_t T_, int64_t C) {
  LATHE_GRID_LOOP(i, T_ * C) {
    float acc = dwpe[i];
    for (int64_t b = 0; b < B; ++b) acc += to_f(dout[b * T_ * C + i]);
    dwpe[i] = acc;
  }
}

// dst[idx[r] - begin] += dout[r] for the rows r < n with idx[r] - begin in [0, rows), deterministic
// (stable radix sort of the destination rows, then runs).
template <class T>
void scatter_rows(float* dst, const int32_t* idx, const T* dout, int64_t n, int64_t C, int64_t begin, int64_t rows) {
  LATHE_CUDA_REQUIRE(n <= INT32_MAX,
                     "cuda embedding backward: " + std::to_string(n) + " rows exceed the int32 row index");
  const int num = static_cast<int>(n);
  size_t temp_bytes = 0;
  LATHE_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, static_cast<const int32_t*>(nullptr),
                                                   static_cast<int32_t*>(nullptr), static_cast<const int32_t*>(nullptr),
                                                   static_cast<int32_t*>(nullptr), num, 0, 32, stream()));
  const size_t arr = (static_cast<size_t>(n) * sizeof(int32_t) + 255) / 256 * 256;
  char* ws = static_cast<char*>(workspace(kSlotEmbedding, temp_bytes + 4 * arr));
  int32_t* keys = reinterpret_cast<int32_t*>(ws);
  int32_t* keys_sorted = reinterpret_cast<int32_t*>(ws + arr);
  int32_t* rows_in = reinterpret_cast<int32_t*>(ws + 2 * arr);
  int32_t* rows_sorted = reinterpret_cast<int32_t*>(ws + 3 * arr);
  void* temp = ws + 4 * arr;
  local_keys_kernel<<<blocks(n), kThreads, 0, stream()>>>(keys, idx, n, begin, rows);
  LATHE_CUDA_LAUNCHED(local_keys_kernel);
  iota_kernel<<<blocks(n), kThreads, 0, stream()>>>(rows_in, n);
  LATHE_CUDA_LAUNCHED(iota_kernel);
  LATHE_CUDA_CHECK(
      cub::DeviceRadixSort::SortPairs(temp, temp_bytes, keys, keys_sorted, rows_in, rows_sorted, num, 0, 32, stream()));
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(n, kMaxBlocks));
  sorted_scatter_kernel<<<grid, kThreads, 0, stream()>>>(dst, keys_sorted, rows_sorted, dout, n, C);
  LATHE_CUDA_LAUNCHED(sorted_scatter_kernel);
}

}  // namespace

template <DType D>
void embedding_forward(void* out, const int32_t* tokens, const void* wte, const void* wpe, int64_t B, int64_t T,
                       int64_t C, const int32_t* positions, int64_t vocab_begin, int64_t vocab_rows) {
  const int64_t n = B * T * C;
  if (n <= 0) return;
  using E = typename Elem<D>::T;
  embedding_forward_kernel<<<blocks(n), kThreads, 0, stream()>>>(static_cast<E*>(out), tokens,
                                                                 static_cast<const E*>(wte), static_cast<const E*>(wpe),
                                                                 T, C, n, positions, vocab_begin, vocab_rows);
  LATHE_CUDA_LAUNCHED(embedding_forward_kernel);
}

template <DType D>
void embedding_backward(float* dwte, float* dwpe, const void* dout, const int32_t* tokens, int64_t B, int64_t T,
                        int64_t C, const int32_t* positions, int64_t vocab_begin, int64_t vocab_rows) {
  if (B * T <= 0 || C <= 0) return;
  using E = typename Elem<D>::T;
  const E* g = static_cast<const E*>(dout);
  scatter_rows(dwte, tokens, g, B * T, C, vocab_begin, vocab_rows);
  if (dwpe == nullptr) return;
  if (positions != nullptr) {
    scatter_rows(dwpe, positions, g, B * T, C, 0, INT32_MAX);
  } else {
    dwpe_kernel<<<blocks(T * C), kThreads, 0, stream()>>>(dwpe, g, B, T, C);
    LATHE_CUDA_LAUNCHED(dwpe_kernel);
  }
}

LATHE_CUDA_INSTANTIATE(embedding_forward, (void*, const int32_t*, const void*, const void*, int64_t, int64_t, int64_t,
                                           const int32_t*, int64_t, int64_t))
LATHE_CUDA_INSTANTIATE(embedding_backward, (float*, float*, const void*, const int32_t*, int64_t, int64_t, int64_t,
                                            const int32_t*, int64_t, int64_t))

}  // namespace lathe::cuda
