// Data parallelism (ZeRO 0, 1, 2) of a device-resident model (device: cuda, one GPU per rank,
// `mpirun -np N lathe train recipe.yaml --set device=cuda`).
//
// Two communicators of the same ranks (the trainer's data-parallel group):
//  * the DEVICE group (NCCL, dist/nccl_comm.h) moves backend buffers and nothing else: the
//    gradient buckets (ZeRO 0: all_reduce; ZeRO 1/2: reduce_scatter onto this rank's FlatShards
//    shard, in place) and, after a ZeRO 1/2 update, the all-gather of the weights' shards;
//  * the HOST group (MPI, the trainer's `dpc`) carries the step's scalars: the loss sum and the
//    token count (trainer.cpp), the gradient norm's chunk sums under ZeRO (a few doubles per rank),
//    LAMB's per-chunk sums, stop flags. Their sums are lathe's rank-order host sums (dist/comm.h).
//
// When the gradients are reduced: AFTER backward, not from the model's grads_ready hook. The
// device kernels of backward are queued on the backend's stream ahead of the host, so the hook
// fires when a block's kernels are issued, not when their gradients exist; the NCCL stream would
// have to wait on an event recorded on the compute stream at the hook (cudaEventRecord +
// cudaStreamWaitEvent), which the Backend interface does not offer yet. So reduce_grads()
// synchronises the backend's stream, then issues every bucket (cut from the end of the buffer
// backwards, as parallel/grad_sync.h) on the device group and waits for all: the communication is
// exposed (the step log's "comm exposed").
//
// ZeRO 2 on the device reduces exactly as ZeRO 1 does: the device gradient buffer is allocated
// whole once (models/model.h) and backward writes it in full, so there is nothing to hand back
// (the CPU path releases host pages outside the shard; a device path would need a shard-sized
// gradient buffer and per-bucket reduce-scatter during backward). Moments are shard-sized for
// ZeRO 1 and 2 (train/device_step.h: DeviceOptimizer).
//
// Numerics: NCCL's own ring/tree sums, not lathe's rank-order sum, so a DP=N device run equals
// the DP=N CPU run within float reassociation (a few ulp per step), not bit for bit; every rank
// of the device group receives the same bits, so replicas stay identical. Over the thread
// communicator (tests, a host "device") the results are bit-identical to GradSync +
// ShardedOptimizer (tests/train/test_device_dp.cpp).
#pragma once
#include <cstddef>
#include <memory>
#include <utility>
#include <vector>

#include "dist/comm.h"
#include "kernels/backend.h"
#include "optim/optimizer.h"
#include "parallel/flat_shards.h"

namespace lathe {

class DeviceDataParallel {
 public:
  // host: the trainer's data-parallel group (host buffers). device: a communicator of the same
  // ranks in the same order whose operations take `backend` memory (NCCL; any communicator over
  // host memory in tests). shards: the ShardedOptimizer's cut (FlatShards at optim::kChunk).
  // bucket_elems: parallel.bucket_mb * 2^20 / 4.
  DeviceDataParallel(dist::Communicator& host, std::unique_ptr<dist::Communicator> device,
                     const parallel::FlatShards& shards, int zero, size_t bucket_elems, const Backend& backend);
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
  // The buckets [begin, end), ascending (the order they are issued in is descending).
  const std::vector<std::pair<size_t, size_t>>& buckets() const { return buckets_; }

  // After the step's last backward: the backend's stream is synchronised, then every bucket of
  // grads[P] (backend memory) is reduced over the device group. ZeRO 0: every element holds the
  // sum over ranks; ZeRO 1/2: the elements of this rank's shard do (the rest is stale). Returns
  // the seconds spent here (all of it exposed communication).
  double reduce_grads(float* grads);
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
  std::vector<std::pair<size_t, size_t>> buckets_;
};

}  // namespace lathe
