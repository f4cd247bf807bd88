#include "train/device_dp.h"

#include <algorithm>
#include <chrono>

#include "core/error.h"
#include "core/trace.h"
#include "parallel/sharded_optimizer.h"

namespace lathe {

DeviceDataParallel::DeviceDataParallel(dist::Communicator& host, std::unique_ptr<dist::Communicator> device,
                                       const parallel::FlatShards& shards, int zero, size_t bucket_elems,
                                       const Backend& backend)
    : host_(host), device_(std::move(device)), shards_(shards), zero_(zero), backend_(backend) {
  LATHE_CHECK(device_ != nullptr, "device data parallel: no device communicator");
  LATHE_CHECK(zero >= 0 && zero <= 2, "parallel.zero must be 0, 1 or 2, got {}", zero);
  LATHE_CHECK(bucket_elems > 0, "device data parallel: bucket of 0 elements");
  // The two groups must be the same ranks in the same order: the device group's rank r reduces
  // onto shard r, which the host group's rank r updates.
  LATHE_CHECK(device_->size() == host.size() && device_->rank() == host.rank(),
              "device data parallel: the device group {} is not the host group {} (same ranks, same order)",
              device_->describe(), host.describe());
  LATHE_CHECK(shards.ranks() == host.size(), "device data parallel: {} shards for a data-parallel group of {}",
              shards.ranks(), host.size());
  for (size_t e = shards.total(); e > 0;) {  // as GradSync: the bucket at offset 0 takes the remainder
    const size_t b = e > bucket_elems ? e - bucket_elems : 0;
    buckets_.push_back({b, e});
    e = b;
  }
  std::reverse(buckets_.begin(), buckets_.end());
}

DeviceDataParallel::~DeviceDataParallel() = default;

double DeviceDataParallel::reduce_grads(float* grads) {
  const auto t0 = std::chrono::steady_clock::now();
  trace::Scope span("wait for gradient reduction", trace::Cat::Comm);
  // The NCCL communicator runs on its own stream and thread: backward's gradients must be complete.
  backend_.synchronize();
  if (host_.size() > 1) {
    std::vector<dist::WorkPtr> works;
    works.reserve(buckets_.size());
    for (auto it = buckets_.rbegin(); it != buckets_.rend(); ++it) {  // the head's gradients first, as GradSync
      const auto [b, e] = *it;
      if (zero_ == 0) {
        works.push_back(device_->all_reduce_async(grads + b, e - b, DType::F32));
      } else {
        // In place: this rank's part of the bucket receives the reduced values.
        const size_t mine = std::max(b, std::min(e, shards_.begin(host_.rank())));
        works.push_back(device_->reduce_scatter_async(grads + b, grads + mine, shards_.overlap(b, e), DType::F32));
      }
    }
    for (auto& w : works) w->wait();
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void DeviceDataParallel::gather_params(float* params) {
  if (zero_ == 0 || host_.size() == 1) return;
  backend_.synchronize();  // the shard's update is complete
  device_->all_gather(params + shards_.begin(host_.rank()), params, shards_.sizes(), DType::F32);
}

optim::ChunkSumsGather DeviceDataParallel::chunk_sums_gather() {
  if (zero_ == 0) return {};
  return [this](const std::vector<optim::ChunkSums>& mine) { return parallel::all_gather_chunk_sums(host_, mine); };
}

}  // namespace lathe
