// Data-parallel gradient reduction, in buckets issued while backward is still running.
//
// Every rank holds the full flat gradient buffer [P] (its own micro-batches' sum). Backward
// reports ranges whose gradients are final for the step (GradSync::ready, e.g. from a "layer l
// gradients ready" hook); as soon as every element of a bucket has been reported, the bucket is
// reduced on the data-parallel communicator's progress thread while backward continues:
//   zero 0:      all_reduce of the bucket (every rank ends with the sum of all ranks)
//   zero 1, 2:   reduce_scatter of the bucket over the ZeRO shards (FlatShards): each rank ends
//                with the sum only in the part of the bucket that its shard covers.
// Every element is summed over ranks in rank order (dist/comm.h) whatever the bucket size or
// stage, so ZeRO 0/1/2 give bit-identical reduced gradients. Buckets are cut from the end of the
// buffer backwards (the head's and last layers' gradients are ready first).
//
// zero 2 keeps only the gradient shard after reduction: once a bucket's reduce-scatter has
// completed, the part of it outside this rank's shard is zeroed by handing its whole pages back to
// the OS (madvise MADV_DONTNEED: they read as zeros when next touched) and memset at the page
// edges. Between the reduction and the next backward a rank's resident gradients are its shard,
// and zero_grads() then only has to clear the shard. What it does not save: the buffer is still
// written in full during backward (gradients accumulate over micro-batches before the reduction,
// which keeps ZeRO 0/1/2 bit-identical), so with grad_accum_steps > 1 the whole buffer is
// resident at the peak; with one micro-batch, buckets are released as their reductions finish.
#pragma once
#include <cstddef>
#include <functional>
#include <map>
#include <vector>

#include "dist/comm.h"
#include "optim/optimizer.h"
#include "parallel/flat_shards.h"

namespace lathe::parallel {

class GradSync {
 public:
  // bucket_elems: elements per bucket (parallel.bucket_mb * 2^20 / 4 for fp32); the bucket at
  // offset 0 takes the remainder.
  GradSync(dist::Communicator& dp, float* grads, const FlatShards& shards, int zero, size_t bucket_elems);
  ~GradSync();  // waits for buckets still in flight (their buffers must outlive them)

  // [begin, end) is final for this step. Ranges reported within one step must not overlap.
  void ready(size_t begin, size_t end);
  // Reduces every bucket not yet issued, waits for all, resets for the next step. Returns the
  // seconds spent waiting here: communication that backward did not hide.
  double finish();

  size_t num_buckets() const { return buckets_.size(); }
  // Called right before each bucket's reduction is issued. A device-resident model's gradients
  // are written by kernels still queued when backward reports them: parallel/dist_optimizer.h synchronises
  // the compute stream here (grads then points to device memory, zero must not be 2 and
  // zero_grads is not used: both touch the buffer from the host).
  void set_before_issue(std::function<void()> f) { before_issue_ = std::move(f); }
  // Zeroes the gradients before a step's first micro-batch: the whole buffer, or for zero 2 only
  // the shard (the rest was zeroed when it was released).
  void zero_grads();
  // zero 2: the whole buffer outside this rank's shard becomes zeros, its pages handed back.
  void release_outside_shard() { release_outside_shard(0, shards_.total()); }

 private:
  struct Bucket {
    size_t begin, end, ready = 0;
    bool issued = false;
  };
  void issue(Bucket& b);
  // zero 2: the parts of [b, e) outside this rank's shard become zeros (pages released).
  void release_outside_shard(size_t b, size_t e);
  void reap(bool wait);  // completed (or, with wait, all) buckets: their works dropped, zero 2 releases

  dist::Communicator& dp_;
  float* grads_;
  const FlatShards& shards_;
  int zero_;
  std::vector<Bucket> buckets_;  // ascending offsets
  struct InFlight {
    size_t bucket;
    dist::WorkPtr work;
  };
  std::vector<InFlight> inflight_;
  std::map<size_t, size_t> reported_;  // begin -> end of the ranges reported this step
  std::function<void()> before_issue_;
};

// Global L2 norm of the reduced gradients when each rank holds only its shard (zero >= 1): this
// rank's chunk sums of squares by `chunk_sums(shard, n, out_host)` (the backend's step op: grads may
// be backend memory), all-gathered over `dp` (only the doubles travel) and summed in chunk order.
// Bit-identical to the global norm of the whole reduced buffer (the shards hold whole chunks).
using ChunkSqSums = void (*)(const float* grads, size_t n, double* out_host);
double sharded_grad_norm(dist::Communicator& dp, const float* grads, const FlatShards& shards, ChunkSqSums chunk_sums);

// The parameter ranges clipped to the shard [b, e) and rebased to b: what a ZeRO rank passes to
// Optimizer::step together with params + b, grads + b and moments sized e - b.
std::vector<optim::ParamRange> ranges_in_shard(const std::vector<optim::ParamRange>& ranges, size_t b, size_t e);

}  // namespace lathe::parallel
