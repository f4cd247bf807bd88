// The distributed optimizer of a run (issue 24 item 2): one type for the host and the device. It
// owns what happens to the flat gradient buffer [P] after backward and the update of the flat
// parameter buffer [P], whatever the layout:
//
//   * gradient reduction over the data-parallel group, in buckets issued while the step's last
//     backward still runs (parallel::GradSync: ZeRO 0 all-reduce, ZeRO 1/2 reduce-scatter onto
//     this rank's FlatShards shard; ZeRO 2 hands host pages outside the shard back);
//   * the global gradient norm: the whole buffer, the shards' chunk sums under ZeRO, or, under
//     tensor/pipeline parallelism, the elements this rank counts summed over a norm group;
//   * the AdamW / LAMB update of this rank's part ([state_begin, state_end): its shard under ZeRO
//     1/2/3), then the shards all-gathered (ZeRO 1/2; ZeRO 3 gathers them block by block when the
//     next pass needs them: parallel/param_gather.h); LAMB's per-tensor norms gather chunk sums over the data
//     group (ZeRO) and the tensor group (split tensors).
//
// The kernels are the backend's step ops (kernels/step_ops.h: the CPU table is optim/'s own
// kernels, bit for bit), so one code path runs on the CPU and on a GPU. What differs by memory:
//   * host model: the reduction runs over the data group itself and the moments are the host
//     optimizer's buffers (local(): the checkpoint's view);
//   * device model (device: cuda): the buckets and the weight shards move over a DEVICE group of
//     the same ranks (NCCL, bootstrapped over the data group), whose buffers are backend memory; the
//     scalars (norm chunk sums, LAMB sums) stay on the host group. Before each bucket is issued the
//     compute stream is synchronised (the grads_ready hook fires when backward's kernels are issued,
//     not done). ZeRO 2 reduces as ZeRO 1 (device memory has no pages to hand back). The moments
//     live in backend memory; local()'s buffers stage them for checkpoints (download_state before
//     a save, upload_state after a load). NCCL sums in its own ring/tree order: a DP=N device run
//     equals the CPU run within float reassociation, and every rank receives the same bits.
//   * test hook `device_path_on_host` (FaultPlan::device_path_on_host): a host model through the
//     device wiring (backend-memory moments staged through local(), a second host group standing in
//     for NCCL, the stream synchronisation): bit-identical to the host path
//     (tests/train/test_device_dp_host.py, tests/parallel/test_dist_optimizer.cpp).
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dist/comm.h"
#include "kernels/backend.h"
#include "optim/optimizer.h"
#include "parallel/flat_shards.h"
#include "parallel/grad_sync.h"
#include "parallel/param_gather.h"

namespace lathe::parallel {

// The flat buffers the optimizer works on, in `backend` memory: params[P] and grads[P].
struct FlatState {
  const Backend* backend = nullptr;
  float* params = nullptr;
  float* grads = nullptr;
  size_t size = 0;  // P
};

struct DistOptimizerConfig {
  optim::OptimConfig optim;  // the recipe's optimizer section (name, betas, eps, weight decay, grad_clip)
  int zero = 0;              // parallel.zero
  // ZeRO 3, parallel.shard_group S (0: the whole data group): hybrid sharding, below.
  int shard_group = 0;
  size_t bucket_elems = 1;   // parallel.bucket_mb * 2^20 / 4
  // Device models: issue buckets from the grads_ready hook during backward (false: all after
  // backward; so under tensor parallelism, whose hooks' NCCL collectives on another communicator
  // must be ordered the same way on every rank).
  bool overlap = true;
  bool device_path_on_host = false;  // test hook (above)
};

class DistOptimizer {
 public:
  // Collective over `data` when the path is the device's and data has several ranks (the device
  // group is made then). Fresh (zero) moments; a resume fills local()'s buffers then upload_state().
  // ranges: the model's tensors (StepRange::tensor = index in its table).
  DistOptimizer(FlatState flat, dist::Communicator& data, const DistOptimizerConfig& cfg,
                std::vector<optim::ParamRange> ranges);
  ~DistOptimizer();
  DistOptimizer(const DistOptimizer&) = delete;  // the hooks and gathers hold `this`
  DistOptimizer& operator=(const DistOptimizer&) = delete;

  int zero() const { return zero_; }
  const FlatShards& shards() const { return shards_; }
  // [state_begin, state_end): the part of the flat buffer whose moments this rank holds and updates.
  size_t state_begin() const { return zero_ ? shards_.begin(data_.rank()) : 0; }
  size_t state_end() const { return zero_ ? shards_.end(data_.rank()) : shards_.total(); }
  double grad_clip() const { return cfg_.optim.grad_clip; }
  size_t bucket_elems() const { return cfg_.bucket_elems; }
  bool device_path() const { return staged_; }
  // The host moments (sized state_end - state_begin): the checkpoint's view of the optimizer.
  optim::Optimizer& local() { return *host_; }

  // Tensor parallelism: LAMB's per-tensor norms add every tensor rank's chunk sums of the split
  // tensors (split[id] for tensor id) and take tensor rank 0's of the replicated ones. The trust
  // ratios then equal one process's up to summation order. `tp` must outlive the optimizer.
  void set_tensor_parallel(dist::Communicator& tp, std::vector<bool> split);
  // Tensor/pipeline parallelism: the norm counts the elements `owned` of this rank's buffer (clipped
  // to the shard under ZeRO) and sums their squares over `group` (the replica, or the world with
  // ZeRO). `group` must outlive the optimizer.
  void set_grad_norm_group(dist::Communicator& group, std::vector<std::pair<size_t, size_t>> owned);

  // ZeRO 3 with several data ranks (host models): the weights outside this rank's shard are
  // gathered per block (parallel/param_gather.h) from the model's before_block hook, which should
  // feed before_block(). blocks: Model::param_ranges_by_block(). Nothing otherwise.
  // Hybrid sharding (shard_group S < N data ranks, R = N / S): gradients and moments stay sharded
  // over all N ranks (every reduction in data-rank order: bit-identical to ZeRO 0), the weights
  // over S: rank r holds the weight shard of the R consecutive ranks r - r % R ... (the merge of
  // their gradient shards), assembled after each update by an all-gather among those R ranks
  // (replicas), and gathers blocks from the S ranks r % R, r % R + R, ... (its shard group: the
  // ranks of one node when the job is launched with mpirun --map-by node).
  // bf16/fp16 compute: `copy` is the model's compute-dtype copy (ParamGather::ComputeCopy), converted
  // per gathered block and released with the weights; the caller keeps weight_shard()'s copy current
  // (Model::keep_compute_weights).
  void set_param_blocks(std::vector<ParamGather::Ranges> blocks, int prefetch, ParamGather::ComputeCopy copy = {});
  // ZeRO 3 with gathers: the flat range of the weights this rank keeps resident (its merged shard
  // under hybrid sharding); [0, P) otherwise.
  std::pair<size_t, size_t> weight_shard() const;
  // The same range before the optimizer exists (a flat buffer of `total` elements, data rank
  // `rank` of `ranks`, parallel.shard_group; ZeRO 3 with ranks > 1): what the rank initialises or
  // reads at startup (train/session.cpp).
  static std::pair<size_t, size_t> weight_shard_of(size_t total, int rank, int ranks, int shard_group);
  bool gathers() const { return gather_ != nullptr; }
  ParamGather* param_gather() { return gather_.get(); }  // tests
  void before_block(int64_t block, bool backward);
  // ZeRO 3: every weight complete on this rank (before a checkpoint, an evaluation or an export;
  // collective over the data group). A pass outside a training micro-batch while they are not is an
  // error. Nothing otherwise.
  void gather_whole();

  // The step's events, in order.
  // Zeroes the gradients before the first micro-batch (ZeRO 2/3 on the host: only the shard).
  void zero_grads();
  // Around each micro-batch's forward_backward (ZeRO 3; nothing otherwise): the weights are
  // gathered per block in between; after it the gathers are released and, unless it was the last
  // micro-batch, its gradients reduce-scattered at once and added to the shard's sum (so no rank
  // holds a whole gradient buffer across micro-batches). Returns the seconds spent waiting.
  void begin_micro_batch();
  double end_micro_batch(bool last);
  // True when the data group has several ranks: the model's grads_ready hook should feed
  // grads_ready() (StepHooks::grads_ready).
  bool reduces() const { return sync_ != nullptr; }
  // The gradients of the micro-batch now in backward are the step's final ones (the last one).
  void set_last_backward(bool last) { last_backward_ = last; }
  // From the model's grads_ready hook (or a pipeline after its schedule): [begin, end) is final.
  // Only during the last backward (ZeRO 3: every backward); a bucket whose elements are all final
  // is issued at once.
  void grads_ready(size_t begin, size_t end);
  // After the step's backward: the buckets not yet issued are, and all are waited for. Returns the
  // seconds spent waiting (the communication backward did not hide); 0 in one process.
  double reduce_grads();
  // The global L2 norm of the reduced gradients (NaN/Inf if any is), the same on every rank.
  double grad_norm();
  // One update (lr already scheduled; `step` counts applied updates from 1; grad_scale multiplies
  // every gradient as read: clipping coefficient x loss-scale reciprocal). Parameters complete on
  // every rank after.
  void step(double lr, int64_t step, float grad_scale);

  // Device path: moments backend -> local() (before a checkpoint) and local() -> backend (after a
  // load). Nothing on the host path (local()'s buffers are the moments).
  void download_state();
  void upload_state();

 private:
  std::pair<float*, float*> moments();
  optim::ChunkSumsGather chunk_sums_gather();

  FlatState flat_;
  dist::Communicator& data_;
  DistOptimizerConfig cfg_;
  const StepOps* k_;
  int zero_;
  bool staged_;  // the device path: moments in backend memory, the reduction over device_group_
  FlatShards shards_;
  std::vector<optim::ParamRange> ranges_;  // this rank's, relative to state_begin()
  std::unique_ptr<optim::Optimizer> host_;
  DeviceBuffer m_, v_;                                // device path: the moments
  std::unique_ptr<dist::Communicator> device_group_;  // device path with several data ranks
  dist::Communicator* move_ = nullptr;                // where buckets and weight shards travel
  std::unique_ptr<GradSync> sync_;                    // several data ranks
  std::unique_ptr<ParamGather> gather_;               // ZeRO 3 with several data ranks
  FlatShards weight_shards_;                          // ZeRO 3: the weights' (merged under hybrid sharding)
  std::unique_ptr<dist::Communicator> shard_group_, replicas_;  // hybrid sharding
  bool stale_ = false;    // ZeRO 3: the weights outside the shard are not this step's
  bool in_pass_ = false;  // ZeRO 3: between begin_micro_batch and end_micro_batch
  std::vector<float> acc_;  // ZeRO 3 with accumulation: the shard's sum of the reduced micro-batches
  bool acc_live_ = false;
  bool last_backward_ = false;
  dist::Communicator* tp_ = nullptr;  // LAMB under tensor parallelism
  std::vector<bool> tp_split_;
  dist::Communicator* norm_group_ = nullptr;
  std::vector<std::pair<size_t, size_t>> norm_owned_;
};

// Collective over `c`: every rank's `mine` concatenated in rank order (ranks may hold different
// counts); counts_out receives each rank's count. LAMB's chunk-sum gathers (host memory).
std::vector<optim::ChunkSums> all_gather_chunk_sums(dist::Communicator& c, const std::vector<optim::ChunkSums>& mine,
                                                    std::vector<int64_t>* counts_out = nullptr);

}  // namespace lathe::parallel
