// Tensor parallelism (Megatron-LM's column/row splits) applied to a model from outside: each rank
// builds the family's model from a config with its share of the heads and of the MLP width
// (shard_config), so the model body runs unchanged on smaller GEMMs; the shard rules of
// the parameter table say which slice of each global tensor a rank holds; and the group's
// collectives, installed on the model's StepHooks::tp, are called as Megatron's paired mappings
// (models/tp_mappings.h): reduce_from_tensor_region ("g") sums the partial products of the
// row-parallel GEMMs in forward, copy_to_tensor_region ("f") the partial input gradients of the
// column-parallel GEMMs in backward (one all-reduce).
//
//   q|k|v, fc / gate|up   Column  rows split (per section: GPT-2's fused c_attn gives each rank its
//                                  heads of q, of k and of v), bias split the same way
//   o_proj, down/c_proj   Row     columns split; the bias is added once after the all-reduce
//   norms, row biases,    Replicated
//   wpe
//   wte, lm_head          Vocab   rows split: rank r holds vocab_shard(V, tp, r) (V/tp rows each when
//                                  tp divides V, else the first V % tp ranks one row more)
//
// Vocab parallel (Megatron's VocabParallelEmbedding and parallel cross-entropy; StepHooks::tp.vocab):
// the embedding looks up the rank's own tokens (zero rows for the others; wpe added by rank 0) and
// the partial outputs are all-reduced; the head computes local logits [rows, V/tp] per chunk, the
// row max all-reduced (max), the sum of exp and the target logit all-reduced (sum), so the whole
// logits never exist; its partial input gradient is all-reduced like a column-parallel GEMM's.
// Any V >= tp splits (Megatron's behaviour without padding the model): when tp does not divide V the
// shards are uneven (GPT-2's 50257 rows at tp=2: 25129 + 25128), never padded, so wte / lm_head and
// every checkpoint or HF tensor keep exactly V rows and no logit exists outside the vocabulary; the
// per-rank tables then differ in those two tensors only (gather_global and the logits' all-gather
// take per-rank counts). A V that tp divides splits exactly as before, so its results are unchanged.
//
// Replicated tensors see identical inputs and gradients on every rank (the residual stream is
// whole between the parallel regions), so they stay identical without any reduction.
//
// Sequence parallelism (`sequence`, Megatron's --sequence-parallel): between the parallel regions
// rank r holds only rows [r*N/tp, (r+1)*N/tp) of the [N = B*T, C] residual stream, with its norms
// and their statistics (activation memory of those buffers / tp). The all-reduce after a
// row-parallel GEMM becomes a reduce-scatter into the rank's rows (reduce_scatter_to_sequence_region),
// an all-gather of the norm output precedes each column-parallel GEMM (gather_from_sequence_region);
// in backward the duals (all-gather of the residual gradient before the row-parallel GEMMs'
// backward, reduce-scatter of the column-parallel input gradient). The embedding output enters the
// stream by each rank taking its rows (scatter_to_sequence_region; a split vocabulary's partial
// lookups are reduce-scattered); the final norm runs on the rows and is all-gathered before the lm
// head. Norm weights see only the rank's rows, so their
// gradients are summed over the group (reduce_sequence_norm_grads). Every value is the one of
// tensor parallelism without it, bit for bit: the reductions sum the same partials in the same
// rank order, and a shard model (TensorShard::parts) sums its norm-weight gradients in tp row chunks
// either way.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "config/model_config.h"
#include "dist/comm.h"
#include "models/model.h"
#include "models/param_table.h"

namespace lathe::parallel {

// The vocabulary rows [begin, begin + rows) that tensor-parallel rank `rank` of `tp` holds of a
// vocabulary of V rows: V = q*tp + e, ranks below e hold q + 1 rows, the others q (contiguous, in rank
// order). Never empty for V >= tp; rank 0 always holds the most (ceil(V/tp)).
struct VocabShard {
  int64_t begin = 0, rows = 0;
};
VocabShard vocab_shard(int64_t V, int tp, int rank);

// The config of rank `rank`'s model: attention heads, KV heads and the MLP width divided by tp,
// the whole model's head_dim (explicit_head_dim), vocabulary rows vocab_shard(V, tp, rank).rows
// (vocab_size). Ranks differ only in vocab_size, and only when tp does not divide V; the default rank
// 0 holds the largest shard (the per-rank figure of memory estimates). Errors name the value that tp
// does not divide (heads, KV heads, MLP width) or a vocabulary smaller than tp. tp == 1: `global`.
ModelConfig shard_config(const ModelConfig& global, int tp, int rank = 0);
// What a shard model is beyond its config (models/tensor_shard.h): the whole vocabulary V, parts = tp
// and `sequence`: sequence parallelism (tp > 1 only, else an error naming parallel.sequence).
// tp == 1: a whole model's (default) TensorShard.
TensorShard tensor_shard(const ModelConfig& global, int tp, bool sequence = false);
// Rank `rank`'s shard model of `global`: build_model(shard_config) with set_tensor_shard(tensor_shard).
std::unique_ptr<Model> build_shard_model(const ModelConfig& global, int tp, bool sequence, int rank,
                                         const ComputeSpec& compute = {});

// One contiguous run of a rank's shard: `count` floats at `global` in the global tensor and at
// `local` in the rank's tensor (offsets within the tensors).
struct SliceRun {
  int64_t global = 0, local = 0, count = 0;
};
// The runs that make up rank `rank`'s tensor `local` out of the global tensor `global` (same name),
// following global.shard and global.sections; error when the local shape is not the shard's.
std::vector<SliceRun> shard_runs(const ParamSpec& global, const ParamSpec& local, int rank, int tp);

// Copies rank's shard of every tensor from the global flat buffer `g` (laid out by `global`) into
// the local flat buffer `l` (laid out by `local`). Every local tensor must exist in `global`.
void scatter_shard(const ParamTable& global, const float* g, const ParamTable& local, float* l, int rank, int tp);
// The inverse for one rank: writes its shard of every tensor into `g` (replicated tensors whole).
void place_shard(const ParamTable& global, float* g, const ParamTable& local, const float* l, int rank, int tp);
// Assembles the global flat buffer on every rank of `tp_group` from each rank's local buffer
// (all-gather). `local` is this rank's table; the other ranks' are the same but for their
// vocabulary rows (vocab_shard), so the all-gather takes each rank's own count.
void gather_global(dist::Communicator& tp_group, const ParamTable& global, const ParamTable& local, const float* l,
                   float* g);

// Writes into `local` exactly the values Model::init_weights(seed) gives the global model, sliced
// to this rank (each tensor's global values are drawn from its own stream and then sliced), and
// refreshes the compute-dtype copies.
void init_shard(Model& local, const ParamTable& global, int rank, int tp, uint64_t seed);

// Installs the collectives of StepHooks::tp on `m` (models/tp_mappings.h, whose pairs the model
// calls): all_reduce over `tp_group` (deterministic, in rank order, src/dist/comm.h; bf16/fp16
// activations are summed in fp32 and rounded once); the vocab-parallel shard (StepHooks::tp.vocab:
// this rank's vocabulary rows, the loss statistics' all-reduce) and gather_vocab for logits. With a
// sequence-parallel shard (TensorShard) also the row collectives (all_gather_rows;
// reduce_scatter_rows, 16-bit summed in fp32 as above; split_rows: this rank's rows;
// all_reduce_f32: the norm gradients). `m` must be a shard model of tp_group.size() parts
// (build_shard_model), else an error.
// tp_group must outlive the model's passes and have m.tensor_shard().parts ranks.
void attach_tensor_parallel(Model& m, dist::Communicator& tp_group);

// Which elements of the local flat buffer count towards global sums (gradient norm, parameter
// counts): every element of a sharded tensor, and a replicated tensor only on rank 0 of the group.
// Returns [begin, end) ranges in floats, merged where adjacent.
std::vector<std::pair<size_t, size_t>> owned_ranges(const ParamTable& local, int rank);

// attach_tensor_parallel for the trainer, whatever the memory (tensor_parallel_device.cpp): on a
// host model exactly that (returns null); on a device model (or, with device_path_on_host, the host
// test path of parallel/dist_optimizer.h that runs a CPU model through the device wiring over a
// second host group) it builds the device group over `tp_host` (NCCL; collective) and installs the
// collectives over it, each after a synchronisation of the backend's stream. The returned group must
// outlive the model's passes.
std::unique_ptr<dist::Communicator> attach_tensor_parallel_on_device(Model& model, dist::Communicator& tp_host,
                                                                     bool device_path_on_host = false);

}  // namespace lathe::parallel
