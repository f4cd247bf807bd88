// The CPU op tables, one per storage type (kernels/cpu/storage.h): each op's file fills its slots
// from its one template per kernel (op_slots.h), so fp32, bf16 and fp16 run the same loops:
//  * GEMMs (gemm.h): fp32 on OpenBLAS, bf16 on oneDNN, fp16 on widened fp32 copies (a correctness
//    path: this CPU generation has no fp16 GEMM instructions).
//  * Norms, attention, softmax/cross-entropy: statistics, running max/sum and the loss in fp32 on
//    rows widened from 16 bits (norm statistics, lse and losses are fp32 outputs in every table).
//  * Pointwise (GELU, SwiGLU, residual, RoPE, embedding): the fp32 formula (pointwise_math.h) on
//    widened blocks, rounded once.
//  * Parameter gradients are fp32 and accumulate (+=) into the fp32 gradient buffer in every op.
//  * "+=" into a 16-bit input gradient (norm backwards, the accumulate flags of the matmuls) adds
//    in fp32 and rounds the sum once.
// Scratch: the *_scratch_bytes of the 16-bit tables include the fp32 rows the kernels widen into;
// ops whose signature has no scratch use per-thread rows grown once (storage.h, thread_rows), so a
// training step allocates nothing after the first.
#include "kernels/cpu/tables.h"

#include "kernels/cpu/op_slots.h"
#include "kernels/cpu/storage.h"

namespace lathe::cpu {
namespace {

template <class S>
Ops make_ops() {
  Ops o;
  o.backend = "cpu";
  o.dtype = S::kDtype;
  add_matmul<S>(o);
  if constexpr (S::kDtype == DType::F32)
    o.matmul_bias_gelu_forward = matmul_bias_gelu_unfused<fp32_ops>;
  else if constexpr (S::kDtype == DType::BF16)
    o.matmul_bias_gelu_forward = matmul_bias_gelu_unfused<bf16_ops>;
  else
    o.matmul_bias_gelu_forward = matmul_bias_gelu_unfused<fp16_ops>;
  add_embedding<S>(o);
  add_layernorm<S>(o);
  add_rmsnorm<S>(o);
  add_pointwise<S>(o);
  add_rope<S>(o);
  add_attention<S>(o);
  add_lm_head_loss<S>(o);
  return o;
}

}  // namespace

const Ops& fp32_ops() {
  static const Ops table = make_ops<F32>();
  return table;
}

const Ops& bf16_ops() {
  static const Ops table = make_ops<Bf16>();
  return table;
}

const Ops& fp16_ops() {
  static const Ops table = make_ops<Fp16>();
  return table;
}

}  // namespace lathe::cpu
