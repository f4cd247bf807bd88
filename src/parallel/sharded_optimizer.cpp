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
  if (zero) {
    // LAMB's whole-tensor norms: every rank's chunk sums, in rank (= flat) order.
    opt_->set_chunk_sums_gather([this](const std::vector<optim::ChunkSums>& mine) {
      const size_t n = static_cast<size_t>(dp_.size());
      std::vector<int64_t> counts(n);
      const int64_t count = static_cast<int64_t>(mine.size());
      dp_.all_gather(&count, counts.data(), std::vector<size_t>(n, 1), DType::I64);
      std::vector<size_t> bytes(n);
      size_t total = 0;
      for (size_t r = 0; r < n; ++r) total += static_cast<size_t>(counts[r]);
      for (size_t r = 0; r < n; ++r) bytes[r] = static_cast<size_t>(counts[r]) * sizeof(optim::ChunkSums);
      std::vector<optim::ChunkSums> all(total);
      dp_.all_gather(mine.data(), all.data(), bytes, DType::U8);
      return all;
    });
  }
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
