#include "parallel/sharded_optimizer.h"

#include <algorithm>

#include "core/error.h"
#include "optim/chunks.h"
#include "optim/clip.h"
#include "parallel/grad_sync.h"

namespace lathe::parallel {

ShardedOptimizer::ShardedOptimizer(dist::Communicator& dp, const optim::OptimConfig& cfg, size_t num_params,
                                   std::vector<optim::ParamRange> ranges, int zero)
    : dp_(dp), zero_(zero), shards_(num_params, dp.size(), optim::kChunk) {
  LATHE_CHECK(zero >= 0 && zero <= 2, "parallel.zero must be 0, 1 or 2, got {}", zero);
  ranges_ = zero ? ranges_in_shard(ranges, state_begin(), state_end()) : std::move(ranges);
  opt_ = optim::make_optimizer(cfg, state_end() - state_begin());
  // LAMB's whole-tensor norms under ZeRO: every rank's chunk sums, in rank (= flat) order.
  if (zero)
    opt_->set_chunk_sums_gather([this](const std::vector<optim::ChunkSums>& mine) { return gather_data(mine); });
}

std::vector<optim::ChunkSums> all_gather_chunk_sums(dist::Communicator& c, const std::vector<optim::ChunkSums>& mine,
                                                    std::vector<int64_t>* counts_out) {
  const size_t n = static_cast<size_t>(c.size());
  std::vector<int64_t> counts(n);
  const int64_t count = static_cast<int64_t>(mine.size());
  c.all_gather(&count, counts.data(), std::vector<size_t>(n, 1), DType::I64);
  std::vector<size_t> bytes(n);
  size_t total = 0;
  for (size_t r = 0; r < n; ++r) total += static_cast<size_t>(counts[r]);
  for (size_t r = 0; r < n; ++r) bytes[r] = static_cast<size_t>(counts[r]) * sizeof(optim::ChunkSums);
  std::vector<optim::ChunkSums> all(total);
  c.all_gather(mine.data(), all.data(), bytes, DType::U8);
  if (counts_out) *counts_out = std::move(counts);
  return all;
}

std::vector<optim::ChunkSums> ShardedOptimizer::gather_data(const std::vector<optim::ChunkSums>& mine) {
  return zero_ ? all_gather_chunk_sums(dp_, mine) : mine;
}

void ShardedOptimizer::set_tensor_parallel(dist::Communicator& tp, std::vector<bool> sharded) {
  if (tp.size() == 1) return;
  opt_->set_chunk_sums_gather([this, &tp, sharded = std::move(sharded)](const std::vector<optim::ChunkSums>& mine) {
    std::vector<int64_t> counts;
    const std::vector<optim::ChunkSums> all = all_gather_chunk_sums(tp, gather_data(mine), &counts);
    std::vector<optim::ChunkSums> out;
    size_t i = 0;
    for (size_t r = 0; r < counts.size(); ++r)
      for (int64_t k = 0; k < counts[r]; ++k, ++i) {
        const int64_t id = all[i].tensor;
        LATHE_CHECK(id >= 0 && static_cast<size_t>(id) < sharded.size(),
                    "lamb under tensor parallelism: chunk of tensor {} outside the table of {} tensors", id,
                    sharded.size());
        if (r == 0 || sharded[static_cast<size_t>(id)]) out.push_back(all[i]);
      }
    return out;
  });
}

double ShardedOptimizer::grad_norm(const float* grads) {
  return zero_ ? sharded_grad_norm(dp_, grads, shards_) : optim::global_grad_norm(grads, shards_.total());
}

void ShardedOptimizer::step(float* params, const float* grads, double lr, int64_t step, float grad_scale) {
  const size_t b = state_begin();
  opt_->step(params + b, grads + b, ranges_, lr, step, grad_scale);
  if (zero_) gather_shards(dp_, params, shards_);
}

}  // namespace lathe::parallel
