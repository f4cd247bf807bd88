// How much memory a model needs, computed from its config before anything is allocated, and the
// refusal when that exceeds the machine. A config.json or recipe with n_layer 2^31 or a vocabulary
// of 2^40 must be answered with the number and the fields, not by an allocation that swaps the
// machine to death or aborts. Every product is overflow-checked (core/checked.h).
//
// build_model() checks parameters + gradients, Model::allocate(B, T, moments) adds activations and
// optimizer moments, so every command path is covered; `lathe check` / `lathe train` call
// estimate_memory + check_memory_fits with the recipe's B, T and optimizer to print and enforce the
// whole figure before the first step.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>

#include "config/model_config.h"
#include "core/dtype.h"
#include "models/recompute.h"
#include "models/tensor_shard.h"

namespace lathe {

struct MemoryEstimate {
  int64_t num_params = 0;  // floats of the parameter table (tied lm_head counted once)
  int64_t param_bytes = 0, grad_bytes = 0, optimizer_bytes = 0, activation_bytes = 0;
  // bf16/fp16 compute: the compute-dtype copy of the weights the GEMMs read (0 for fp32).
  int64_t compute_weight_bytes = 0;
  DType compute_dtype = DType::F32;
  Recompute recompute = Recompute::None;  // the activation plan's recompute mode
  int64_t batch = 0, seq_len = 0;         // the (B, T) the activations are sized for; 0 = none
  int optimizer_moments = 0;
  int64_t moment_shards = 1;  // ZeRO: each rank holds 1/moment_shards of the moments
  // ZeRO 3 (shard_parameters): each rank holds 1/param_shards of the weights and gradients, plus
  // gather_bytes of gathered blocks (included in param_bytes) and the gradients of the blocks in
  // backward (included in grad_bytes).
  int64_t param_shards = 1, gather_bytes = 0;
  int prefetch = 0;
  // Sequence parallelism (a tensor-parallel shard with sequence_parallel): the stream is
  // sharded over sequence_parts ranks, and the arena is sequence_saving_bytes smaller than the same
  // shard's without it (the norms' and residuals' rows / tp, less one gathered [N, C] buffer).
  int64_t sequence_parts = 1, sequence_saving_bytes = 0;
  int64_t total_bytes() const {
    return param_bytes + grad_bytes + optimizer_bytes + activation_bytes + compute_weight_bytes;
  }
  // "params 0.5 MB + grads 0.5 MB + optimizer moments (2) 1.0 MB + activations (B=8, T=128) 3.2 MB = 5.2 MB"
  std::string breakdown() const;
};

// fp32 parameters + gradients + `optimizer_moments` fp32 copies (AdamW and LAMB keep 2) + the
// activation arena Model::allocate(B, T) reserves computing in `compute_dtype` on the CPU backend
// (exactly: the same layout walk, Model::plan_activations) + for bf16/fp16 the compute-dtype copy
// of the weights. B = T = 0: no activations. moment_shards > 1: per rank of a ZeRO group of that
// size (moments divided). `recompute`: the plan of Model::allocate(B, T, moments, recompute).
// A tensor-parallel shard's config and `shard` (parallel/tensor_parallel.h) give one rank's figure;
// with sequence parallelism the breakdown also says what it saves.
// Validates `cfg` first; throws lathe::Error when a size does not fit 64 bits.
MemoryEstimate estimate_memory(const ModelConfig& cfg, int64_t B, int64_t T, int optimizer_moments,
                               int64_t moment_shards = 1, DType compute_dtype = DType::F32,
                               Recompute recompute = Recompute::None, const TensorShard& shard = {});

// ZeRO 3 (parallel/param_gather.h) over `shards` data ranks with `prefetch` blocks gathered ahead:
// params = the 1/shards shard + (1 + prefetch) x the largest block (embedding, a decoder layer, the
// head) gathered; grads = the shard + the largest block's gradients awaiting their reduction (+ a
// tied embedding's, written from the head's backward until the embedding's). Address space stays
// the whole model's (the flat buffers are reserved whole; only their resident pages shrink).
// Hybrid sharding: the weights over weight_shards ranks (parallel.shard_group; 0 = shards).
// bf16/fp16 (e.compute_dtype): the compute copy likewise, the weight shard's plus the gathered blocks'.
// Gradients: a reduction bucket of `bucket_elems` fills over several blocks before it is reduced
// and its pages outside the shard released (parallel/grad_sync.h), so one bucket is resident on top
// of the block being written.
void shard_parameters(MemoryEstimate& e, const ModelConfig& cfg, int64_t shards, int prefetch,
                      int64_t weight_shards = 0, int64_t bucket_elems = 0);

// Memory this process can use: the smallest of physical RAM (MemTotal in /proc/meminfo), the
// cgroup limit (memory.max) and RLIMIT_AS. `source` says which one bounds it.
struct MachineMemory {
  int64_t bytes = 0;  // 0 = unknown (then nothing is refused)
  std::string source;
};
MachineMemory machine_memory();

// Throws lathe::Error "WHAT: <model fields> needs X (breakdown) but <source> is Y; reduce ..." when
// est.total_bytes() exceeds machine_memory(). `what` names the file / recipe the config came from.
void check_memory_fits(const MemoryEstimate& est, const ModelConfig& cfg, std::string_view what);

// "1.5 GB" / "340.0 MB" / "12.0 KB" (decimal units, as the trainer's log).
std::string format_bytes(int64_t bytes);

}  // namespace lathe
