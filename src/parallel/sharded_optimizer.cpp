#include "parallel/sharded_optimizer.h"

#include "core/error.h"
#include "optim/chunks.h"
#include "optim/clip.h"
#include "parallel/grad_sync.h"

namespace lathe::parallel {

ShardedOptimizer::ShardedOptimizer(dist::Communicator& dp, const optim::OptimConfig& cfg, size_t num_params,
                                   std::vector<optim::ParamRange> ranges, int zero)
    : dp_(dp), zero_(zero), shards_(num_params, dp.size(), optim::kChunk) {
  LATHE_CHECK(zero >= 0 && zero <= 2, "parallel.zero must be 0, 1 or 2, got {}", zero);
  // LAMB's trust ratio needs each tensor's whole-tensor norms; with tensors cut across shards that
  // needs a cross-rank reduction inside the optimizer step, which is not implemented yet.
  LATHE_CHECK(zero == 0 || cfg.name != "lamb",
              "optimizer.name lamb with parallel.zero {} is not supported yet: LAMB's per-tensor trust ratios are not "
              "reduced across ZeRO shards; use parallel.zero 0 with LAMB, or adamw",
              zero);
  ranges_ = zero ? ranges_in_shard(ranges, state_begin(), state_end()) : std::move(ranges);
  opt_ = optim::make_optimizer(cfg, state_end() - state_begin());
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
