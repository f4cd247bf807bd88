// The tensor- and sequence-parallel communication of a model pass, as named forward/backward pairs
// (Megatron-Core's megatron/core/tensor_parallel/mappings.py): each region the model enters or leaves
// is one pair, so the backward of every forward collective is declared next to it.
//
//   pair                               forward            backward              where (transformer.cpp)
//   copy_to_tensor_region              identity           all-reduce            input of the column-parallel GEMMs
//                                                                               (q|k|v, fc / gate|up) and of the
//                                                                               vocab-parallel head
//   reduce_from_tensor_region          all-reduce         identity              output of the row-parallel GEMMs
//                                                                               (o_proj, c_proj / down) and of the
//                                                                               vocab-parallel embedding
//   gather_from_sequence_region        all-gather         reduce-scatter        norm outputs into the column-
//                                                         (split: whole vocab)  parallel GEMMs and the lm head
//   reduce_scatter_to_sequence_region  reduce-scatter     all-gather            output of the row-parallel GEMMs
//                                                                               and of the vocab-parallel embedding
//   scatter_to_sequence_region         split              all-gather            whole-vocabulary embedding output
//   gather_from_tensor_region          all-gather cols    (no backward)         vocab-parallel logits (evaluation)
//
// plus two reductions that are not a region's: the sequence-parallel norm weights' gradients
// (Megatron's _allreduce_layernorm_grads: this rank's rows only, summed over the group) and the
// vocab-parallel loss statistics (VocabParallel, called inside the lm_head_loss kernel).
// Without sequence parallelism the first two pairs run; with it the three sequence pairs take their
// place (a column-parallel GEMM's input is gathered rather than copied, a row-parallel output is
// reduce-scattered rather than all-reduced). Identity halves are not calls.
//
// The model knows no communicator: the group's collectives (TpCollectives) are installed from
// outside by parallel::attach_tensor_parallel (host communicators) and, for device-resident models,
// attach_tensor_parallel_on_device (parallel/tensor_parallel.h); the model calls only the pairs' halves.
#pragma once
#include <cstdint>
#include <functional>

#include "kernels/backend.h"  // VocabParallel

namespace lathe {

// The collectives of the tensor-parallel group on the model's buffers. Counts are elements of the
// compute dtype unless stated; "rows" are [S, C] shards of the residual stream, S*C = shard_count,
// and a full buffer is [tp*S, C] in rank order. Unset: the layers are whole (no tensor parallelism).
struct TpCollectives {
  // In place: `buf` holds this rank's partial sum and becomes the group's sum (16-bit: widened,
  // summed in fp32 in rank order and rounded once on the host communicators).
  std::function<void(void* buf, int64_t count)> all_reduce;
  // Sequence parallelism (TensorShard::sequence_parallel): every rank's `shard` into `full`.
  std::function<void(const void* shard, void* full, int64_t shard_count)> all_gather_rows;
  // `full` holds this rank's partial sums; `shard` receives the group's sum of this rank's rows
  // (`shard` may be `full`'s start; 16-bit summed in fp32 as all_reduce).
  std::function<void(void* full, void* shard, int64_t shard_count)> reduce_scatter_rows;
  // `full` is the same on every rank; `shard` receives this rank's rows (no communication; `shard`
  // may be `full`'s start).
  std::function<void(const void* full, void* shard, int64_t shard_count)> split_rows;
  // In place over `count` fp32 values (norm weight gradients), summed in rank order.
  std::function<void(float* grads, int64_t count)> all_reduce_f32;
  // Vocab parallel: `local` [M, V_local] fp32 logits of this rank -> `whole` [M, global V] (every
  // rank's columns at its vocabulary rows; an all-gather).
  std::function<void(const float* local, float* whole, int64_t M, int64_t v_local)> gather_vocab;
};

struct TpMappings {
  TpCollectives comm;
  // Vocab-parallel embedding and head: this rank's wte / lm_head hold rows
  // [vocab.vocab_begin, + config().vocab_size) of Model::global_vocab(). all_reduce unset: the
  // whole vocabulary. When set, the embedding's partial outputs (the shard holding row 0 adds wpe)
  // leave through reduce_from_tensor_region (or reduce_scatter_to_sequence_region) and the head's
  // input enters through copy_to_tensor_region; gather_from_tensor_region serves forward_logits.
  VocabParallel vocab;

  // The layers are split over a group (the pairs of tensor parallelism are installed).
  bool tensor_parallel() const { return comm.all_reduce != nullptr; }
  // The collectives of the sequence pairs are installed.
  bool sequence_parallel() const {
    return comm.all_gather_rows && comm.reduce_scatter_rows && comm.split_rows && comm.all_reduce_f32;
  }

  // ---- copy_to_tensor_region (Megatron's _CopyToModelParallelRegion, "f") --------------------------
  // Entering a column-parallel region whose input is whole on every rank.
  //   forward:  identity
  //   backward: `grad` [N, C] holds this rank's partial input gradient -> the group's sum
  void copy_to_tensor_region_backward(void* grad, int64_t count) const { comm.all_reduce(grad, count); }

  // ---- reduce_from_tensor_region (Megatron's _ReduceFromModelParallelRegion, "g") ------------------
  // Leaving a row-parallel region: each rank holds a partial sum of the whole output.
  //   forward:  `out` [N, C] partial -> the group's sum
  //   backward: identity (the output gradient is whole on every rank)
  void reduce_from_tensor_region_forward(void* out, int64_t count) const { comm.all_reduce(out, count); }

  // ---- gather_from_sequence_region (Megatron's _GatherFromSequenceParallelRegion) ------------------
  // Leaving the sequence-parallel stream for a region that reads all N rows.
  //   forward:  every rank's [S, C] `shard` -> `full` [tp*S, C]; returns `full`. The column-parallel
  //             GEMMs' backward gathers their input again for the weight gradients (as Megatron's).
  const void* gather_from_sequence_region_forward(const void* shard, void* full, int64_t shard_count) const {
    comm.all_gather_rows(shard, full, shard_count);
    return full;
  }
  //   backward: the region's output gradient was tensor-parallel (partial per rank: the column-
  //             parallel GEMMs' input gradient, a vocab-parallel head's) -> reduce-scatter into the
  //             rank's rows (Megatron's tensor_parallel_output_grad = True) ...
  void gather_from_sequence_region_backward(void* full, void* shard, int64_t shard_count) const {
    comm.reduce_scatter_rows(full, shard, shard_count);
  }
  //   ... or whole on every rank (a whole-vocabulary head's) -> the rank's rows (= False: a split).
  void gather_from_sequence_region_backward_whole(const void* full, void* shard, int64_t shard_count) const {
    comm.split_rows(full, shard, shard_count);
  }

  // ---- reduce_scatter_to_sequence_region (Megatron's _ReduceScatterToSequenceParallelRegion) -------
  // Leaving a row-parallel region for the sequence-parallel stream.
  //   forward:  `full` [tp*S, C] partial sums -> the group's sum of this rank's rows into `shard`
  void reduce_scatter_to_sequence_region_forward(void* full, void* shard, int64_t shard_count) const {
    comm.reduce_scatter_rows(full, shard, shard_count);
  }
  //   backward: the rank's [S, C] output gradient -> every rank's into `full`; returns `full`
  const void* reduce_scatter_to_sequence_region_backward(const void* shard, void* full, int64_t shard_count) const {
    comm.all_gather_rows(shard, full, shard_count);
    return full;
  }

  // ---- scatter_to_sequence_region (Megatron's _ScatterToSequenceParallelRegion) --------------------
  // Entering the sequence-parallel stream from a value that is whole on every rank.
  //   forward:  `full` [tp*S, C] -> this rank's rows into `shard` (no communication)
  void scatter_to_sequence_region_forward(const void* full, void* shard, int64_t shard_count) const {
    comm.split_rows(full, shard, shard_count);
  }
  //   backward: the rank's [S, C] gradient -> every rank's into `full`; returns `full`
  const void* scatter_to_sequence_region_backward(const void* shard, void* full, int64_t shard_count) const {
    comm.all_gather_rows(shard, full, shard_count);
    return full;
  }

  // ---- gather_from_tensor_region (Megatron's _GatherFromModelParallelRegion, last dimension) -------
  // The vocab-parallel head's logits for evaluation and generation.
  //   forward:  `local` [M, V_local] fp32 -> `whole` [M, global V]
  //   backward: none (logits are never differentiated; training takes the loss kernel's path)
  void gather_from_tensor_region_forward(const float* local, float* whole, int64_t M, int64_t v_local) const {
    comm.gather_vocab(local, whole, M, v_local);
  }

  // ---- the sequence-parallel norm weights (Megatron's _allreduce_layernorm_grads) ------------------
  // Backward only: `count` fp32 weight (and bias) gradients of this rank's rows -> the group's sum in
  // rank order (the model then adds them to its gradients).
  void reduce_sequence_norm_grads(float* grads, int64_t count) const { comm.all_reduce_f32(grads, count); }
};

}  // namespace lathe
