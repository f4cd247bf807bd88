// Rotary position embedding (kernels/cuda/ops.h), mirroring kernels/cpu/rope.cpp: HF rotate_half
// convention over the first rot dims of each head, tables fp32 [T, rot/2] from a host inv_freq with
// the CPU kernel's (= torch's) fp32 roundings of the angle,
// in-place rotation of `n_heads` heads of each row of x viewed as [B*T, row_stride].
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace lathe::cuda {

namespace {

// One thread per (t, i): one fp32 product t * inv_freq[i] (inv_freq from config/rope_scaling.cpp,
// the CPU kernel's input too); cos/sin of that float in double, rounded once, times the attention
// factor in fp32.
__global__ void rope_tables_kernel(float* cos_table, float* sin_table, int64_t T, int64_t half, const float* inv_freq,
                                   float attention_factor) {
  LATHE_GRID_LOOP(k, T * half) {
    const int64_t t = k / half, i = k - t * half;
    const float angle = static_cast<float>(t) * inv_freq[i];
    float c = static_cast<float>(cos(static_cast<double>(angle)));
    float s = static_cast<float>(sin(static_cast<double>(angle)));
    if (attention_factor != 1.0f) {
      c *= attention_factor;
      s *= attention_factor;
    }
    cos_table[k] = c;
    sin_table[k] = s;
  }
}

// One thread per (row, head, i < rot/2): rotates the pair (i, i + rot/2) of a head of D dims (the
// dims from rot on pass through). sign = -1: the transpose.
template <class T>
__global__ void rope_kernel(T* x, const float* cos_table, const float* sin_table, int64_t rows, int64_t T_,
                            int64_t n_heads, int64_t D, int64_t half, int64_t row_stride, float sign,
                            const int32_t* positions) {
  LATHE_GRID_LOOP(k, rows * n_heads * half) {
    const int64_t i = k % half, rh = k / half, h = rh % n_heads, r = rh / n_heads;
    const int64_t t = positions ? positions[r] : r % T_;
    const float c = cos_table[t * half + i], s = sign * sin_table[t * half + i];
    T* p = x + r * row_stride + h * D;
    const float a = to_f(p[i]), b = to_f(p[half + i]);
    p[i] = from_f<T>(a * c - b * s);
    p[half + i] = from_f<T>(b * c + a * s);
  }
}

template <DType D>
void rope(void* x, const float* cs, const float* sn, int64_t B, int64_t T, int64_t H, int64_t Dh, int64_t rot,
          int64_t stride, float sign, const int32_t* positions) {
  const int64_t half = rot / 2, n = B * T * H * half;
  if (n <= 0) return;
  rope_kernel<<<blocks(n), kThreads, 0, stream()>>>(static_cast<typename Elem<D>::T*>(x), cs, sn, B * T, T, H, Dh,
                                                    half, stride, sign, positions);
  LATHE_CUDA_LAUNCHED(rope_kernel);
}

}  // namespace

void rope_tables(float* cos_table, float* sin_table, int64_t T, int64_t half, const float* inv_freq,
                 float attention_factor) {
  if (T * half <= 0) return;
  // inv_freq is host memory: copied into a stream-ordered workspace (pageable source: the copy has
  // read it when cudaMemcpyAsync returns).
  auto* dinv = static_cast<float*>(workspace(kSlotRope, static_cast<size_t>(half) * sizeof(float)));
  LATHE_CUDA_CHECK(cudaMemcpyAsync(dinv, inv_freq, static_cast<size_t>(half) * sizeof(float), cudaMemcpyHostToDevice,
                                   stream()));
  rope_tables_kernel<<<blocks(T * half), kThreads, 0, stream()>>>(cos_table, sin_table, T, half, dinv,
                                                                  attention_factor);
  LATHE_CUDA_LAUNCHED(rope_tables_kernel);
}

template <DType D>
void rope_forward(void* x, const float* cos_table, const float* sin_table, int64_t B, int64_t T, int64_t n_heads,
                  int64_t Dh, int64_t rot, int64_t row_stride, const int32_t* positions) {
  rope<D>(x, cos_table, sin_table, B, T, n_heads, Dh, rot, row_stride, 1.0f, positions);
}
template <DType D>
void rope_backward(void* dx, const float* cos_table, const float* sin_table, int64_t B, int64_t T, int64_t n_heads,
                   int64_t Dh, int64_t rot, int64_t row_stride, const int32_t* positions) {
  rope<D>(dx, cos_table, sin_table, B, T, n_heads, Dh, rot, row_stride, -1.0f, positions);
}

LATHE_CUDA_INSTANTIATE(rope_forward, (void*, const float*, const float*, int64_t, int64_t, int64_t, int64_t, int64_t,
                                      int64_t, const int32_t*))
LATHE_CUDA_INSTANTIATE(rope_backward, (void*, const float*, const float*, int64_t, int64_t, int64_t, int64_t, int64_t,
                                       int64_t, const int32_t*))

}  // namespace lathe::cuda
