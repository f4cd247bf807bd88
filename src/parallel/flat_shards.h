// How a flat buffer of P elements (parameters, gradients, optimizer moments: one ParamTable
// layout) is divided among the ranks of a data-parallel group for ZeRO. Cuts fall on multiples of
// optim::kChunk, the unit in which gradient norms and optimizer reductions are summed, so a rank's
// shard holds whole chunks and the chunk partial sums it computes are exactly those a single
// process computes: sharded norms are bit-identical to unsharded ones (summed in chunk order).
// Like Megatron's distributed optimizer, cuts ignore tensor boundaries: a tensor may straddle two
// shards.
#pragma once
#include <cstddef>
#include <vector>

namespace lathe::parallel {

class FlatShards {
 public:
  // total elements split over `ranks` at multiples of `align` (the last shard takes the tail; a
  // shard may be empty when there are fewer aligned blocks than ranks).
  FlatShards(size_t total, int ranks, size_t align);
  FlatShards() = default;  // no ranks, no elements
  // Every `per` consecutive shards of `fine` merged into one (fine.ranks() / per shards).
  static FlatShards merged(const FlatShards& fine, int per);

  int ranks() const { return static_cast<int>(bounds_.size()) - 1; }
  size_t total() const { return bounds_.back(); }
  size_t begin(int r) const { return bounds_[static_cast<size_t>(r)]; }
  size_t end(int r) const { return bounds_[static_cast<size_t>(r) + 1]; }
  size_t size(int r) const { return end(r) - begin(r); }
  // Elements per rank (the counts of an all_gather of the shards).
  std::vector<size_t> sizes() const;
  // How many elements of [b, e) each rank's shard holds (the counts of a reduce_scatter of that
  // range); they sum to e - b.
  std::vector<size_t> overlap(size_t b, size_t e) const;

 private:
  std::vector<size_t> bounds_ = {0};  // ranks + 1 offsets, bounds_[0] = 0, bounds_[ranks] = total
};

}  // namespace lathe::parallel
