#include "parallel/sharded_optimizer.h"

#include <algorithm>

#include "core/error.h"
#include "optim/chunks.h"
#include "optim/clip.h"
#include "parallel/grad_sync.h"

namespace lathe::parallel {

ShardedOptimizer::ShardedOptimizer(dist::Communicator& dp, const optim::OptimConfig& cfg, size_t num_params,
                                   std::vector<optim::ParamRange> ranges, int zero,
                                   std::unique_ptr<optim::Optimizer> loaded)
    : dp_(dp), zero_(zero), shards_(num_params, dp.size(), optim::kChunk) {
  LATHE_CHECK(zero >= 0 && zero <= 2, "parallel.zero must be 0, 1 or 2, got {}", zero);
  ranges_ = zero ? ranges_in_shard(ranges, state_begin(), state_end()) : std::move(ranges);
  if (loaded && zero == 0) {
    opt_ = std::move(loaded);
    return;
  }
  opt_ = optim::make_optimizer(cfg, state_end() - state_begin());
  if (loaded) adopt_state(*loaded);
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

void ShardedOptimizer::adopt_state(optim::Optimizer& full) {
  auto mine = opt_->state_buffers(), theirs = full.state_buffers();
  LATHE_CHECK(mine.size() == theirs.size(), "ShardedOptimizer::adopt_state: {} state buffers, got {}", mine.size(),
              theirs.size());
  for (size_t i = 0; i < mine.size(); ++i) {
    LATHE_CHECK(theirs[i].second->size() == shards_.total(),
                "ShardedOptimizer::adopt_state: '{}' holds {} values, not {}", theirs[i].first,
                theirs[i].second->size(), shards_.total());
    std::copy(theirs[i].second->data() + state_begin(), theirs[i].second->data() + state_end(), mine[i].second->data());
  }
}

void ShardedOptimizer::gather_state(optim::Optimizer* full) {
  auto mine = opt_->state_buffers();
  if (zero_ == 0) {  // every rank holds everything: rank 0 copies its own
    if (full) {
      auto theirs = full->state_buffers();
      for (size_t i = 0; i < mine.size(); ++i)
        std::copy(mine[i].second->data(), mine[i].second->data() + shards_.total(), theirs[i].second->data());
    }
    return;
  }
  const int me = dp_.rank();
  LATHE_CHECK((me == 0) == (full != nullptr), "ShardedOptimizer::gather_state: rank {} {} a full optimizer", me,
              full ? "got" : "lacks");
  constexpr int kTag = 7301;
  for (size_t i = 0; i < mine.size(); ++i) {
    if (me == 0) {
      float* dst = full->state_buffers()[i].second->data();
      std::copy(mine[i].second->data(), mine[i].second->data() + shards_.size(0), dst);
      for (int r = 1; r < dp_.size(); ++r)
        if (shards_.size(r)) dp_.recv(dst + shards_.begin(r), shards_.size(r) * sizeof(float), r, kTag);
    } else if (shards_.size(me)) {
      dp_.send(mine[i].second->data(), shards_.size(me) * sizeof(float), 0, kTag);
    }
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
