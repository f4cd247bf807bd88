#include "parallel/dist_optimizer.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "core/trace.h"
#include "dist/nccl_comm.h"
#include "optim/chunks.h"

namespace lathe::parallel {

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

DistOptimizer::DistOptimizer(FlatState flat, dist::Communicator& data, const DistOptimizerConfig& cfg,
                             std::vector<optim::ParamRange> ranges)
    : flat_(flat),
      data_(data),
      cfg_(cfg),
      k_(flat.backend ? flat.backend->step_ops() : nullptr),
      zero_(cfg.zero),
      staged_(flat.backend && (flat.backend->device() != DeviceKind::Host || cfg.device_path_on_host)),
      shards_(flat.size, data.size(), optim::kChunk) {
  LATHE_CHECK(flat.backend && flat.params && flat.grads, "distributed optimizer: no parameter or gradient buffer");
  LATHE_CHECK(k_, "distributed optimizer: the {} backend has no step ops in this build", flat.backend->name());
  LATHE_CHECK(zero_ >= 0 && zero_ <= 3, "parallel.zero must be 0, 1, 2 or 3, got {}", zero_);
  LATHE_CHECK(zero_ < 3 || !staged_ || data.size() == 1,
              "parallel.zero = 3 runs on host models only so far (device: cpu); use parallel.zero <= 2 on a device");
  LATHE_CHECK(cfg.bucket_elems > 0, "distributed optimizer: buckets of 0 elements");
  const size_t b = state_begin(), e = state_end();
  ranges_ = zero_ ? ranges_in_shard(ranges, b, e) : std::move(ranges);
  host_ = optim::make_optimizer(cfg.optim, e - b);
  if (staged_) {
    LATHE_CHECK(k_->device_index, "distributed optimizer: the {} backend has no device index", k_->backend);
    m_.resize(*flat.backend, e - b, DType::F32);  // zeroed: fresh moments
    v_.resize(*flat.backend, e - b, DType::F32);
  }
  if (data.size() == 1) return;
  move_ = &data_;
  int sync_zero = std::min(zero_, 2);  // ZeRO 3 reduces the gradients as 2 (per micro-batch)
  if (staged_) {
    // Collective over data: NCCL's unique id is broadcast over it and the GPUs checked distinct. The
    // host test path stands a second host group of the same ranks in for NCCL. The device group's
    // rank r reduces onto shard r, which data's rank r updates: same ranks, same order.
    device_group_ = flat.backend->device() == DeviceKind::Host ? data.split(0, data.rank(), data.name() + "-device")
                                                               : dist::make_nccl_communicator(data, k_->device_index());
    LATHE_CHECK(device_group_->size() == data.size() && device_group_->rank() == data.rank(),
                "distributed optimizer: the device group {} is not the data group {} (same ranks, same order)",
                device_group_->describe(), data.describe());
    move_ = device_group_.get();
    sync_zero = std::min(zero_, 1);  // ZeRO 2 reduces as 1: backend memory has no host pages to hand back
  }
  sync_ = std::make_unique<GradSync>(*move_, flat.grads, shards_, sync_zero, cfg.bucket_elems);
  if (staged_)
    sync_->set_before_issue([be = flat.backend] {
      trace::Scope span("compute stream sync for a gradient bucket", trace::Cat::Comm);
      be->synchronize();
    });
}

DistOptimizer::~DistOptimizer() = default;

void DistOptimizer::set_tensor_parallel(dist::Communicator& tp, std::vector<bool> split) {
  if (tp.size() == 1) return;
  tp_ = &tp;
  tp_split_ = std::move(split);
}

void DistOptimizer::set_grad_norm_group(dist::Communicator& group, std::vector<std::pair<size_t, size_t>> owned) {
  norm_group_ = &group;
  norm_owned_.clear();
  const size_t sb = state_begin(), se = state_end();
  for (auto [b, e] : owned) {  // under ZeRO only the shard of the gradient is reduced: count that
    if (zero_ == 0) {
      norm_owned_.push_back({b, e});
    } else if (std::max(b, sb) < std::min(e, se)) {
      norm_owned_.push_back({std::max(b, sb), std::min(e, se)});
    }
  }
}

std::pair<size_t, size_t> DistOptimizer::weight_shard_of(size_t total, int rank, int ranks, int shard_group) {
  const int s = shard_group == 0 ? ranks : shard_group;
  LATHE_CHECK(ranks >= 1 && s >= 1 && ranks % s == 0 && rank >= 0 && rank < ranks,
              "parallel.shard_group = {} does not divide parallel.data = {}: choose a divisor of the data degree (0 = "
              "all {} data ranks)",
              shard_group, ranks, ranks);
  const int R = ranks / s;  // as set_param_blocks: merged shards of R consecutive ranks, gathered over rank / R
  const FlatShards w = FlatShards::merged(FlatShards(total, ranks, optim::kChunk), R);
  const int g = R > 1 ? rank / R : rank;
  return {w.begin(g), w.end(g)};
}

std::pair<size_t, size_t> DistOptimizer::weight_shard() const {
  if (!gather_) return {0, shards_.total()};
  const int g = shard_group_ ? shard_group_->rank() : data_.rank();  // the gathers' group
  return {weight_shards_.begin(g), weight_shards_.end(g)};
}

void DistOptimizer::set_param_blocks(std::vector<ParamGather::Ranges> blocks, int prefetch,
                                     ParamGather::ComputeCopy copy) {
  if (zero_ != 3 || data_.size() == 1) return;
  const int n = data_.size(), s = cfg_.shard_group == 0 ? n : cfg_.shard_group;
  LATHE_CHECK(s >= 1 && n % s == 0,
              "parallel.shard_group = {} does not divide parallel.data = {}: choose a divisor of the data degree (0 = "
              "all {} data ranks)",
              cfg_.shard_group, n, n);
  weight_shards_ = FlatShards::merged(shards_, n / s);
  dist::Communicator* group = &data_;
  if (s < n) {  // collective over data: every rank splits both groups, in this order
    const int R = n / s, r = data_.rank();
    shard_group_ = data_.split(r % R, r / R, data_.name() + "-shard");
    replicas_ = data_.split(r / R, r % R, data_.name() + "-replica");
    group = shard_group_.get();
  }
  gather_ = std::make_unique<ParamGather>(*group, flat_.params, weight_shards_, std::move(blocks), prefetch);
  gather_->set_compute_copy(std::move(copy));
  // From here only the shards are resident: the weights (loaded whole) and the gradients outside them.
  gather_->release_whole();
  stale_ = true;
  sync_->release_outside_shard();
}

void DistOptimizer::before_block(int64_t block, bool backward) {
  if (!gather_) return;
  if (in_pass_) {
    gather_->before_block(block, backward);
    return;
  }
  LATHE_CHECK(!stale_,
              "ZeRO 3: a pass outside a training micro-batch (block {}) on sharded weights; internal: "
              "DistOptimizer::gather_whole() must come first",
              block);
}

void DistOptimizer::gather_whole() {
  if (!gather_ || !stale_) return;
  trace::Scope span("gather the whole model (ZeRO 3)", trace::Cat::Comm);
  gather_->gather_whole();
  stale_ = false;
}

void DistOptimizer::begin_micro_batch() {
  if (gather_) in_pass_ = true;
}

double DistOptimizer::end_micro_batch(bool last) {
  double waited = 0;  // the weight gathers' waits, then the gradients'
  if (gather_) {
    waited = gather_->end_pass();
    in_pass_ = false;
    stale_ = true;  // the released pages read as zeros until gathered again
  }
  if (zero_ != 3 || !sync_ || last) return waited;
  waited += sync_->finish();
  const size_t b = state_begin(), n = state_end() - b;
  float* g = flat_.grads + b;
  if (!acc_live_) {
    acc_.assign(g, g + n);
    acc_live_ = true;
  } else {
    for (size_t i = 0; i < n; ++i) acc_[i] += g[i];
  }
  std::fill(g, g + n, 0.0f);  // the next micro-batch accumulates from zero (the rest was released)
  return waited;
}

void DistOptimizer::zero_grads() {
  if (sync_ && !staged_)
    sync_->zero_grads();  // ZeRO 2: only the shard (the rest was released as zeros)
  else
    flat_.backend->memset(flat_.grads, 0, flat_.size * sizeof(float));
}

void DistOptimizer::grads_ready(size_t begin, size_t end) {
  if ((!last_backward_ && zero_ != 3) || !sync_) return;
  if (staged_ && !cfg_.overlap) return;  // all of them in reduce_grads
  sync_->ready(begin, end);
}

double DistOptimizer::reduce_grads() {
  const double waited = sync_ ? sync_->finish() : 0.0;
  if (acc_live_) {  // ZeRO 3: the earlier micro-batches' reduced sum, in micro-batch order
    float* g = flat_.grads + state_begin();
    for (size_t i = 0; i < acc_.size(); ++i) g[i] = acc_[i] + g[i];
    acc_live_ = false;
  }
  return waited;
}

double DistOptimizer::grad_norm() {
  const float* g = flat_.grads;
  if (norm_group_) {  // chunk sums of each counted range added in order, then the group's sum
    double sum = 0;
    std::vector<double> chunks;
    for (const auto& [b, e] : norm_owned_) {
      chunks.assign((e - b + optim::kChunk - 1) / optim::kChunk, 0.0);
      k_->grad_sq_chunk_sums(g + b, e - b, chunks.data());
      for (double c : chunks) sum += c;
    }
    norm_group_->all_reduce(&sum, 1, DType::F64);
    return std::sqrt(sum);
  }
  if (zero_) return sharded_grad_norm(data_, g, shards_, k_->grad_sq_chunk_sums);
  return k_->global_grad_norm(g, flat_.size);
}

std::pair<float*, float*> DistOptimizer::moments() {
  if (staged_) return {static_cast<float*>(m_.data()), static_cast<float*>(v_.data())};
  const auto bufs = host_->state_buffers();  // exp_avg, exp_avg_sq
  return {bufs[0].second->data(), bufs[1].second->data()};
}

// LAMB's whole-tensor norms: under ZeRO every data rank's chunk sums in rank (= flat) order; under
// tensor parallelism every tensor rank's of the split tensors, tensor rank 0's of the others. Empty:
// this rank's sums are the whole model's.
optim::ChunkSumsGather DistOptimizer::chunk_sums_gather() {
  if (!zero_ && !tp_) return {};
  return [this](const std::vector<optim::ChunkSums>& mine) {
    std::vector<optim::ChunkSums> data_sums = zero_ ? all_gather_chunk_sums(data_, mine) : mine;
    if (!tp_) return data_sums;
    std::vector<int64_t> counts;
    const std::vector<optim::ChunkSums> all = all_gather_chunk_sums(*tp_, data_sums, &counts);
    std::vector<optim::ChunkSums> out;
    size_t i = 0;
    for (size_t r = 0; r < counts.size(); ++r)
      for (int64_t k = 0; k < counts[r]; ++k, ++i) {
        const int64_t id = all[i].tensor;
        LATHE_CHECK(id >= 0 && static_cast<size_t>(id) < tp_split_.size(),
                    "lamb under tensor parallelism: chunk of tensor {} outside the table of {} tensors", id,
                    tp_split_.size());
        if (r == 0 || tp_split_[static_cast<size_t>(id)]) out.push_back(all[i]);
      }
    return out;
  };
}

void DistOptimizer::step(double lr, int64_t step, float grad_scale) {
  LATHE_CHECK(step >= 1, "distributed optimizer: step {} (steps count from 1)", step);
  const size_t b = state_begin();
  auto [m, v] = moments();
  float* p = flat_.params + b;
  const float* g = flat_.grads + b;
  if (cfg_.optim.name == "lamb")
    k_->lamb_step(p, g, m, v, ranges_, optim::step_hyper(cfg_.optim), lr, step, grad_scale, chunk_sums_gather());
  else
    k_->adamw_step(p, g, m, v, ranges_, optim::step_hyper(cfg_.optim), lr, step, grad_scale);
  if (zero_ == 0 || data_.size() == 1) return;  // each rank applied the whole update
  if (gather_) {  // ZeRO 3: the other shards are gathered block by block when the next pass needs them
    stale_ = true;
    if (replicas_) {  // hybrid: this rank's weight shard from the updates of its replicas' gradient shards
      const int R = replicas_->size(), first = data_.rank() - data_.rank() % R;
      std::vector<size_t> counts(static_cast<size_t>(R));
      for (int j = 0; j < R; ++j) counts[static_cast<size_t>(j)] = shards_.size(first + j);
      replicas_->all_gather(flat_.params + b, flat_.params + shards_.begin(first), counts, DType::F32);
    }
    return;
  }
  if (staged_) flat_.backend->synchronize();    // the shard's update is complete
  move_->all_gather(flat_.params + b, flat_.params, shards_.sizes(), DType::F32);
}

void DistOptimizer::download_state() {
  if (!staged_) return;
  const auto bufs = host_->state_buffers();
  DeviceBuffer* dev[2] = {&m_, &v_};  // exp_avg, exp_avg_sq: the host optimizer's order
  for (size_t i = 0; i < 2; ++i) {
    LATHE_CHECK(bufs[i].second->size() * sizeof(float) == dev[i]->bytes(),
                "distributed optimizer: state '{}' has {} floats on the host", bufs[i].first, bufs[i].second->size());
    flat_.backend->copy(bufs[i].second->data(), dev[i]->data(), dev[i]->bytes(), CopyKind::DeviceToHost);
  }
  flat_.backend->synchronize();
}

void DistOptimizer::upload_state() {
  if (!staged_) return;
  const auto bufs = host_->state_buffers();
  DeviceBuffer* dev[2] = {&m_, &v_};
  for (size_t i = 0; i < 2; ++i) {
    LATHE_CHECK(bufs[i].second->size() * sizeof(float) == dev[i]->bytes(),
                "distributed optimizer: state '{}' has {} floats on the host", bufs[i].first, bufs[i].second->size());
    flat_.backend->copy(dev[i]->data(), bufs[i].second->data(), dev[i]->bytes(), CopyKind::HostToDevice);
  }
  flat_.backend->synchronize();
}

}  // namespace lathe::parallel
