// Kernels of the CPU bf16 and fp16 op tables (kernels/cpu/ops_half.cpp, attention.cpp) that other
// files define. Everything else of those tables lives in ops_half.cpp behind the tables
// themselves (kernels/cpu/tables.h); the contract is kernels/backend.h's Ops.
#pragma once
#include <cstddef>
#include <cstdint>

namespace lathe::cpu {

// Attention on 16-bit q|k|v and out: each head is widened into fp32 in the scratch, the fp32
// kernel's per-head code runs on it, results are rounded once. Scratch: attention_scratch_bytes_half.
// doc_start: as cpu::attention_forward (kernels/cpu/ops.h), nullptr for plain causal attention.
size_t attention_scratch_bytes_half(int64_t T, int64_t D);
void attention_forward_bf16(void* out, float* lse, const void* qkv, int64_t B, int64_t T, int64_t H, int64_t KVH,
                            int64_t D, void* scratch, const int32_t* doc_start);
void attention_backward_bf16(void* dqkv, const void* dout, const void* qkv, const void* out, const float* lse,
                             int64_t B, int64_t T, int64_t H, int64_t KVH, int64_t D, void* scratch,
                             const int32_t* doc_start);
void attention_forward_fp16(void* out, float* lse, const void* qkv, int64_t B, int64_t T, int64_t H, int64_t KVH,
                            int64_t D, void* scratch, const int32_t* doc_start);
void attention_backward_fp16(void* dqkv, const void* dout, const void* qkv, const void* out, const float* lse,
                             int64_t B, int64_t T, int64_t H, int64_t KVH, int64_t D, void* scratch,
                             const int32_t* doc_start);

}  // namespace lathe::cpu
