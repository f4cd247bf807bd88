// The op tables of the CPU backend, one per compute dtype (listed by cpu_backend().op_tables()).
#pragma once
#include "kernels/backend.h"

namespace lathe::cpu {

// fp32: the reference implementation, the kernels of kernels/cpu/ops.h as they are.
const Ops& fp32_ops();
// bf16: 16-bit activations and GEMM weights, oneDNN bf16 GEMMs with fp32 accumulation, fp32 math
// in every other kernel (kernels/cpu/tables.cpp).
const Ops& bf16_ops();
// fp16: fp16 storage, fp32 compute, GEMMs on widened fp32 copies (a correctness path: this CPU
// generation has no fp16 GEMM instructions; see gemm.h).
const Ops& fp16_ops();

// The matmul_bias_gelu_forward slot of the CPU tables: Table()'s own matmul_forward into pre, then
// its gelu_forward (the unfused pair, bit for bit).
template <const Ops& (*Table)()>
void matmul_bias_gelu_unfused(void* out, void* pre, const void* inp, const void* weight, const float* bias, int64_t M,
                              int64_t K, int64_t N) {
  const Ops& t = Table();
  t.matmul_forward(pre, inp, weight, bias, M, K, N, false);
  t.gelu_forward(out, pre, M * N);
}

}  // namespace lathe::cpu
