#include "train/device_dp.h"

#include <algorithm>

#include "core/error.h"
#include "core/trace.h"
#include "parallel/sharded_optimizer.h"

namespace lathe {

DeviceDataParallel::DeviceDataParallel(dist::Communicator& host, std::unique_ptr<dist::Communicator> device,
                                       const parallel::FlatShards& shards, int zero, size_t bucket_elems,
                                       const Backend& backend, float* grads, bool overlap)
    : host_(host), device_(std::move(device)), shards_(shards), zero_(zero), backend_(backend), overlap_(overlap) {
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
  // ZeRO 2 reduces as ZeRO 1: GradSync's stage 2 hands host pages back (device memory has none).
  sync_ = std::make_unique<parallel::GradSync>(*device_, grads, shards, std::min(zero, 1), bucket_elems);
  // The NCCL communicator runs on its own stream and thread: a bucket's gradients must be complete
  // (their backward kernels done) before its reduction is issued.
  sync_->set_before_issue([this] {
    trace::Scope span("compute stream sync for a gradient bucket", trace::Cat::Comm);
    backend_.synchronize();
  });
}

DeviceDataParallel::~DeviceDataParallel() = default;

size_t DeviceDataParallel::num_buckets() const { return sync_->num_buckets(); }

void DeviceDataParallel::grads_ready(size_t begin, size_t end) {
  if (overlap_) sync_->ready(begin, end);
}

double DeviceDataParallel::reduce_grads() { return sync_->finish(); }

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
