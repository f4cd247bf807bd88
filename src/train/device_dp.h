// Data parallelism (ZeRO 0, 1, 2) of a device-resident model (device: cuda, one GPU per rank,
// `mpirun -np N lathe train recipe.yaml --set device=cuda`).
//
// Two communicators of the same ranks (the trainer's data-parallel group):
//  * the DEVICE group (NCCL, dist/nccl_comm.h) moves backend buffers and nothing else: the gradient buckets (ZeRO 0:
//    all_reduce; ZeRO 1/2: reduce_scatter onto this rank's FlatShards shard, in place: parallel::GradSync over the
//    device group) and, after a ZeRO 1/2 update, the all-gather of the weights' shards;
//  * the HOST group (MPI, the trainer's `dpc`) carries the step's scalars: the loss sum and the token count
//    (train/train_step.cpp), the gradient norm's chunk sums under ZeRO (a few doubles per rank), LAMB's per-chunk sums, stop
//    flags. Their sums are lathe's rank-order host sums (dist/comm.h).
//
// When the gradients are reduced: bucketed during the last micro-batch's backward, from the model's grads_ready hook,
// through parallel::GradSync (the CPU path's bucketing, buckets cut from the end of the buffer backwards) on the device
// group. The hook fires when a block's backward kernels have been *issued*, not when they are done, so before each
// bucket's reduction is issued the compute stream is synchronised (GradSync::set_before_issue); the NCCL kernels then
// run on their own stream while the rest of backward runs on the compute stream. The price: one stream synchronisation
// per bucket (the host stops queueing kernels ahead until the stream drains; parallel.bucket_mb sets how many).
// LATHE_DEVICE_DP_OVERLAP=0 reduces every bucket after backward instead (one synchronisation, nothing overlapped), and
// so does tensor parallelism (its hooks' NCCL collectives on another communicator would otherwise run while buckets are
// in flight, in an order that may differ between ranks: NCCL's rule for several communicators on one GPU). A finer
// scheme would record an event at the hook and make the NCCL stream wait on it (no host synchronisation): the Backend
// interface has no events yet.
//
// ZeRO 2 on the device reduces exactly as ZeRO 1 does: the device gradient buffer is allocated whole once
// (models/model.h) and backward writes it in full, so there is nothing to hand back (the CPU path releases host pages
// outside the shard; a device path would need a shard-sized gradient buffer and per-bucket reduce-scatter during
// backward). Moments are shard-sized for ZeRO 1 and 2 (train/device_step.h: DeviceOptimizer).
//
// Numerics: NCCL's own ring/tree sums, not lathe's rank-order sum, so a DP=N device run equals the DP=N CPU run within
// float reassociation (a few ulp per step), not bit for bit; every rank of the device group receives the same bits, so
// replicas stay identical. Over the thread communicator (tests, a host "device") the results are bit-identical to
// GradSync + ShardedOptimizer (tests/train/test_device_dp.cpp).
#pragma once
#include <cstddef>
#include <memory>
#include <utility>
#include <vector>

#include "dist/comm.h"
#include "kernels/backend.h"
#include "optim/optimizer.h"
#include "parallel/flat_shards.h"
#include "parallel/grad_sync.h"

namespace lathe {

class DeviceDataParallel {
 public:
  // host: the trainer's data-parallel group (host buffers). device: a communicator of the same
  // ranks in the same order whose operations take `backend` memory (NCCL; any communicator over
  // host memory in tests). shards: the ShardedOptimizer's cut (FlatShards at optim::kChunk).
  // bucket_elems: parallel.bucket_mb * 2^20 / 4.
  // grads: the model's gradient buffer (backend memory, shards.total() floats). overlap: issue
  // buckets from grads_ready() during backward (else all of them in reduce_grads()).
  DeviceDataParallel(dist::Communicator& host, std::unique_ptr<dist::Communicator> device,
                     const parallel::FlatShards& shards, int zero, size_t bucket_elems, const Backend& backend,
                     float* grads, bool overlap = true);
  ~DeviceDataParallel();

  int zero() const { return zero_; }
  int size() const { return host_.size(); }
  dist::Communicator& host() { return host_; }
  dist::Communicator& device() { return *device_; }
  const parallel::FlatShards& shards() const { return shards_; }
  // [state_begin, state_end): the part of the flat buffer whose moments this rank holds (its shard
  // under ZeRO 1/2, everything under ZeRO 0).
  size_t state_begin() const { return zero_ ? shards_.begin(host_.rank()) : 0; }
  size_t state_end() const { return zero_ ? shards_.end(host_.rank()) : shards_.total(); }
  size_t num_buckets() const;
  bool overlap() const { return overlap_; }

  // From the model's grads_ready hook during the step's last backward: [begin, end) is final; a
  // bucket whose elements are all final is reduced at once (overlap), else nothing happens here.
  void grads_ready(size_t begin, size_t end);
  // After the step's last backward: the buckets not yet issued are (the backend's stream
  // synchronised first), then all are waited for. ZeRO 0: every element holds the sum over ranks;
  // ZeRO 1/2: the elements of this rank's shard do (the rest is stale). Returns the seconds spent
  // here (the communication backward did not hide).
  double reduce_grads();
  // ZeRO 1/2, after this rank updated params[state_begin, state_end) (backend memory): every rank
  // receives every shard, in place, over the device group (the backend's stream is synchronised
  // first). ZeRO 0: nothing (each rank applied the whole update).
  void gather_params(float* params);
  // LAMB's whole-tensor norms under ZeRO: every rank's chunk sums in rank (= flat) order, over the
  // host group. An empty function under ZeRO 0 (the local sums are the whole model's).
  optim::ChunkSumsGather chunk_sums_gather();

 private:
  dist::Communicator& host_;
  std::unique_ptr<dist::Communicator> device_;
  const parallel::FlatShards& shards_;
  int zero_;
  const Backend& backend_;
  bool overlap_;
  std::unique_ptr<parallel::GradSync> sync_;  // over *device_, ZeRO 2 as 1 (the buffer is device memory)
};

}  // namespace lathe
