// How the CPU op tables (kernels/cpu/tables.h) are assembled: each op's file holds one
// `template <class S>` per kernel, S a storage type of kernels/cpu/storage.h (F32, Bf16, Fp16),
// and fills that op's slots of a table with add_<op><S>. fp32 is one storage type like the others,
// so every dtype of an op runs the same loop, read in one place.
#pragma once
#include "kernels/backend.h"

namespace lathe::cpu {

struct F32;
struct Bf16;
struct Fp16;

template <class S>
void add_matmul(Ops& o);  // matmul.cpp: matmul_forward, matmul_backward, logits_forward
template <class S>
void add_embedding(Ops& o);  // embedding.cpp
template <class S>
void add_layernorm(Ops& o);  // layernorm.cpp
template <class S>
void add_rmsnorm(Ops& o);  // rmsnorm.cpp
template <class S>
void add_pointwise(Ops& o);  // pointwise.cpp: gelu, swiglu, residual, bias_add
template <class S>
void add_rope(Ops& o);  // rope.cpp
template <class S>
void add_attention(Ops& o);  // attention.cpp
template <class S>
void add_lm_head_loss(Ops& o);  // lm_head_loss.cpp (with the vocab-parallel twin)

// In an op's file: the add_<op> of every storage type.
#define LATHE_CPU_ADD_SLOTS(fn)    \
  template void fn<F32>(Ops & o);  \
  template void fn<Bf16>(Ops & o); \
  template void fn<Fp16>(Ops & o);

}  // namespace lathe::cpu
