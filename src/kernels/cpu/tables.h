// The op tables of the CPU backend, one per compute dtype (listed by cpu_backend().op_tables()).
#pragma once
#include "kernels/backend.h"

namespace lathe::cpu {

// fp32: the reference implementation, the kernels of kernels/cpu/ops.h as they are.
const Ops& fp32_ops();
// bf16: 16-bit activations and GEMM weights, oneDNN bf16 GEMMs with fp32 accumulation, fp32 math
// in every other kernel (kernels/cpu/ops_half.cpp).
const Ops& bf16_ops();
// fp16: fp16 storage, fp32 compute, GEMMs on widened fp32 copies (a correctness path: this CPU
// generation has no fp16 GEMM instructions; see ops_half.cpp).
const Ops& fp16_ops();

}  // namespace lathe::cpu
