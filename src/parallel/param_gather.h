// ZeRO 3 (parallel.zero: 3): the fp32 weights sharded over the data-parallel group like the
// moments and the gradients (FlatShards: rank r owns [begin(r), end(r)) of the flat buffer), and
// gathered block by block around the model's passes (StepHooks::before_block).
//
// The model keeps its flat parameter buffer [P] as address space: the pages of this rank's shard
// stay resident (the fp32 master the optimizer updates), the others are filled by an all-gather of
// a block's ranges right before the block runs (forward, and again before its backward), and handed
// back to the OS (madvise MADV_DONTNEED, as ZeRO 2 does with gradient pages) once the pass has moved
// on. Only whole pages inside a block's ranges and outside the shard are released; the pages at the
// edges stay resident (a few KiB per tensor run). So between the blocks the resident weights are
// the shard plus the blocks gathered: the one computing and up to `prefetch` ahead, whose
// all-gathers run on the communicator's progress thread while the current block computes
// (forward: block l+1, l+2 during l; backward: l-1, l-2).
//
// A training pass visits the positions
//     (0,f) (1,f) ... (L,f) (L+1,f) (L,b) ... (1,b) (0,b)
// (block 0 = embedding, 1..L = decoder layers, L+1 = head, whose forward and backward are one call);
// before_block must be called in that order (a pass may stop early: end_pass()). Every gather is
// an exact copy of the owners' values, so the model computes with the same bits as at ZeRO 0.
//
// Pipeline parallelism (pipeline_executor.h) gathers per use: each Forward or Backward action of
// the schedule (one micro-batch through one chunk of the stage's layers) is a pass of its own over
// a span of positions (begin_span), and releases its blocks at its end. With 1F1B several
// micro-batches are in flight, so a chunk's weights are gathered once per action (2 x micro-batches
// per step, as without a pipeline) rather than kept for the step: the weights resident stay the shard
// plus 1 + prefetch blocks, whatever the schedule holds in flight.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

#include "core/dtype.h"
#include "dist/comm.h"
#include "parallel/flat_shards.h"

namespace lathe::parallel {

class ParamGather {
 public:
  using Ranges = std::vector<std::pair<size_t, size_t>>;
  // blocks[b]: the flat ranges block b reads (Model::param_ranges_by_block). `params` [shards.total()]
  // must be page-backed memory this object may madvise. prefetch: 0..2 blocks gathered ahead.
  ParamGather(dist::Communicator& group, float* params, const FlatShards& shards, std::vector<Ranges> blocks,
              int prefetch);
  ~ParamGather();  // waits for gathers still in flight

  // bf16/fp16 compute (Model::keep_compute_weights): the model's compute-dtype copy of the flat
  // buffer (`data`, `elem_bytes` per element, the same offsets), page-backed like `params`, its
  // pages released with the fp32 ones: the copy resident is the shard's plus the gathered blocks'.
  // Gathers in the compute dtype (FSDP2's mixed precision): the ranges of `compute_only[block]`,
  // which the kernels read only through the copy (GEMM weights, embeddings), move as `dtype` (half
  // the bytes of fp32) from the owners' copies, which the owners keep current (the rounding of
  // their fp32 shard after each update: Model::keep_compute_weights), so the bits equal rounding
  // after an fp32 gather. The rest (norm weights, biases: read in fp32) moves as fp32 and its copy
  // is converted (`convert(begin, end)` per range) when the gather is waited for. compute_only
  // empty: every range moves as fp32 and is converted.
  struct ComputeCopy {
    void* data = nullptr;
    size_t elem_bytes = 0;
    std::function<void(size_t, size_t)> convert;
    DType dtype = DType::F32;
    std::vector<Ranges> compute_only;  // by block; empty or one list per block
  };
  void set_compute_copy(ComputeCopy copy);
  ParamGather(const ParamGather&) = delete;
  ParamGather& operator=(const ParamGather&) = delete;

  // The hook: block's weights are complete when it returns; the previous block's are released and
  // the next `prefetch` blocks' gathers issued.
  void before_block(int64_t block, bool backward);
  // The next pass covers only blocks first..last in one direction (forward: first, ..., last;
  // backward: last, ..., first), and prefetch stays inside it. Pipeline actions; end_pass() ends it.
  void begin_span(int64_t first, int64_t last, bool backward);
  // After a pass: gathers in flight waited for, every gathered block released. Returns the seconds
  // the pass spent waiting for gathers (the communication compute did not hide).
  double end_pass();
  // Every weight complete on this rank (checkpoints, evaluation, export): one all-gather of the shards.
  void gather_whole();
  // Every page outside this rank's shard handed back (after the weights were loaded whole).
  void release_whole();

  // What happened, in order (tests): a gather issued, waited for, or a block's pages released.
  enum class Op { Issue, Wait, Release };
  struct Event {
    Op op;
    int64_t block;
    bool backward;
    bool operator==(const Event&) const = default;
  };
  const std::vector<Event>& events() const { return events_; }
  void clear_events() { events_.clear(); }
  bool record_events = false;
  // Bytes handed back to the OS so far (whole pages; tests).
  size_t released_bytes() const { return released_bytes_; }
  // Bytes this rank received from the other ranks' shards by gathers so far (fp32 and compute dtype).
  size_t gathered_bytes() const { return gathered_bytes_; }
  int prefetch() const { return prefetch_; }
  int64_t blocks() const { return static_cast<int64_t>(blocks_.size()); }

 private:
  int64_t positions() const { return 2 * static_cast<int64_t>(blocks_.size()) - 1; }
  std::pair<int64_t, bool> at(int64_t pos) const;  // (block, backward) of a position
  void issue(int64_t pos);
  void wait(int64_t pos);
  // pos's block's pages outside the shard and outside the blocks of positions [keep_lo, keep_hi).
  void release(int64_t pos, int64_t keep_lo, int64_t keep_hi);
  void note(Op op, int64_t pos);
  void release_ranges(const Ranges& r);  // whole pages of r (and of the compute copy's r)

  dist::Communicator& group_;
  float* params_;
  const FlatShards& shards_;
  std::vector<Ranges> blocks_;  // sorted, merged
  // Per block: the ranges gathered as fp32 (then converted) and those gathered in the compute dtype
  // (compute-dtype mode: the whole block, norms included, whose copies convert then overwrites with
  // the same values, so that a block is one collective plus one packed fp32 one).
  std::vector<Ranges> f32_, low_;
  int prefetch_;
  ComputeCopy copy_;
  struct Slot {
    bool issued = false, ready = false;
    std::vector<dist::WorkPtr> works;
    // Packed fp32 ranges (compute-dtype mode: a block's norms and biases, many small tensors, in
    // one collective): this rank's pieces in order, and every rank's ([counts[r]] each, rank order).
    std::vector<float> send, recv;
    std::vector<size_t> counts;
  };
  void unpack(Slot& s, size_t block);
  std::vector<Slot> slots_;             // by position, this pass
  int64_t cur_ = -1;                    // the position computing
  int64_t span_lo_ = 0, span_hi_ = -1;  // this pass's positions [lo, hi); hi < 0: to the end
  std::vector<Event> events_;
  size_t released_bytes_ = 0;
  size_t gathered_bytes_ = 0;
  double waited_s_ = 0;  // this pass
};

}  // namespace lathe::parallel
