// The optimizer of a data-parallel group, over the flat parameter buffer [P]:
//   zero 0: every rank keeps full moments and applies the whole update (replicated);
//   zero 1, 2: rank r keeps moments only for its FlatShards shard, updates that part of the
//            parameters and the shards are all-gathered, so moment memory shrinks by the data
//            degree. Stage 2 differs from 1 in the gradient reduction (GradSync keeps only the
//            shard valid), not here.
// The gradient norm is summed in chunk order in every stage and the update is elementwise (LAMB's
// per-tensor norms gather every rank's chunk sums and add them in flat order), so the parameters
// after a step are bit-identical for zero 0, 1 and 2 (tests/parallel). Ranges need tensor ids
// (optim::ParamRange::tensor) for LAMB under ZeRO.
#pragma once
#include <memory>
#include <vector>

#include "dist/comm.h"
#include "optim/optimizer.h"
#include "parallel/flat_shards.h"

namespace lathe::parallel {

class ShardedOptimizer {
 public:
  // Fresh (zero) moments for [state_begin, state_end); a resume fills local()'s buffers from the
  // checkpoint's shards (train/checkpoint.h: load_checkpoint_moments).
  ShardedOptimizer(dist::Communicator& dp, const optim::OptimConfig& cfg, size_t num_params,
                   std::vector<optim::ParamRange> ranges, int zero);
  ShardedOptimizer(const ShardedOptimizer&) = delete;  // the LAMB norm gather holds `this`
  ShardedOptimizer& operator=(const ShardedOptimizer&) = delete;

  int zero() const { return zero_; }
  const FlatShards& shards() const { return shards_; }
  // [state_begin, state_end) of the flat buffer whose moments this rank holds.
  size_t state_begin() const { return zero_ ? shards_.begin(dp_.rank()) : 0; }
  size_t state_end() const { return zero_ ? shards_.end(dp_.rank()) : shards_.total(); }
  optim::Optimizer& local() { return *opt_; }
  // Tensor parallelism: LAMB's per-tensor norms of the tensors split over `tp` (sharded[id] for
  // tensor id ParamRange::tensor) add every tensor rank's chunk sums; the replicated ones take
  // tensor rank 0's (every rank holds the same values). The chunks of a shard are not the chunks
  // of the global tensor, so the trust ratios equal one process's up to summation order (not bit
  // for bit). AdamW ignores it. `tp` must outlive the optimizer.
  void set_tensor_parallel(dist::Communicator& tp, std::vector<bool> sharded);

  // L2 norm of the reduced gradients (GradSync::finish done): whole buffer for zero 0, shards
  // summed across ranks otherwise.
  double grad_norm(const float* grads);
  // One update; grad_scale is the clipping coefficient. Parameters are complete on every rank after.
  void step(float* params, const float* grads, double lr, int64_t step, float grad_scale);

 private:
  dist::Communicator& dp_;
  int zero_;
  FlatShards shards_;
  std::vector<optim::ParamRange> ranges_;  // this rank's ranges, relative to state_begin()
  std::unique_ptr<optim::Optimizer> opt_;
  // Every data rank's chunk sums in flat order (ZeRO), or this rank's.
  std::vector<optim::ChunkSums> gather_data(const std::vector<optim::ChunkSums>& mine);
};

// Collective over `c`: every rank's `mine` concatenated in rank order (ranks may hold different
// counts); counts_out receives each rank's count. LAMB's ChunkSumsGather under ZeRO (host memory).
std::vector<optim::ChunkSums> all_gather_chunk_sums(dist::Communicator& c, const std::vector<optim::ChunkSums>& mine,
                                                    std::vector<int64_t>* counts_out = nullptr);

}  // namespace lathe::parallel
