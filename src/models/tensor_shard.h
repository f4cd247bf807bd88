// What a tensor-parallel shard's model is beyond its config: the whole vocabulary it is a part of,
// the tensor-parallel degree and sequence parallelism. ModelConfig describes config.json only (a
// shard's config has heads / tp, KV heads / tp, the MLP width / tp, its vocabulary rows and the
// whole model's head_dim); this is set by the tensor-parallel code (parallel/tensor_parallel.h:
// tensor_shard) on the shard model (Model::set_tensor_shard) and passed to the memory estimate and
// the activation plan. Default: a whole model.
#pragma once
#include <cstdint>

#include "config/model_config.h"

namespace lathe {

struct TensorShard {
  // > 0: the whole vocabulary of a vocab-parallel shard, whose config's vocab_size counts only
  // this rank's rows of wte / lm_head. 0: the config's vocab_size is the whole vocabulary.
  int64_t global_vocab = 0;
  // The tensor-parallel degree the model is a shard of (> 1: the norm-weight gradients of a pass
  // are summed over that many equal row chunks, the order in which sequence parallelism sums them
  // over ranks, so TP and TP+SP give the same bits); with `sequence_parallel` the residual stream,
  // the norms and their statistics hold rows [r*N/tp, (r+1)*N/tp) of a pass's N = B*T rows
  // (Megatron's sequence parallelism; the StepHooks gather_rows / reduce_scatter_rows / take_rows
  // / reduce_norm_grads move the rows).
  int64_t parts = 1;
  bool sequence_parallel = false;
  // > 0: context parallelism (parallel/context_parallel.h): this model's passes hold some rows of
  // sequences of context_T tokens, at their global positions (set_documents positions < context_T;
  // the RoPE tables cover context_T positions), and attention runs through StepHooks::cp.
  int64_t context_T = 0;

  // The vocabulary token ids and targets range over.
  int64_t vocab(const ModelConfig& cfg) const { return global_vocab > 0 ? global_vocab : cfg.vocab_size; }
  // Sequence parallelism is on (sequence_parallel with parts > 1).
  bool seq_parallel() const { return sequence_parallel && parts > 1; }
  // Rows of the residual stream a pass over n = B*T rows holds: ceil(n / parts) with sequence
  // parallelism (a forward-only pass of n not divisible is padded), else n.
  int64_t rows_held(int64_t n) const { return seq_parallel() ? (n + parts - 1) / parts : n; }
  bool whole() const { return global_vocab == 0 && parts == 1 && !sequence_parallel; }
};

inline bool operator==(const TensorShard& a, const TensorShard& b) {
  return a.global_vocab == b.global_vocab && a.parts == b.parts && a.sequence_parallel == b.sequence_parallel &&
         a.context_T == b.context_T;
}

}  // namespace lathe
