#include "parallel/grad_sync.h"

#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>

#include "core/error.h"
#include "core/trace.h"
#include "optim/chunks.h"
#include "optim/clip.h"

namespace lathe::parallel {

GradSync::GradSync(dist::Communicator& dp, float* grads, const FlatShards& shards, int zero, size_t bucket_elems)
    : dp_(dp), grads_(grads), shards_(shards), zero_(zero) {
  LATHE_CHECK(zero >= 0 && zero <= 2, "parallel.zero must be 0, 1 or 2, got {}", zero);
  LATHE_CHECK(bucket_elems > 0, "GradSync: bucket of 0 elements");
  LATHE_CHECK(shards.ranks() == dp.size(), "GradSync: {} shards for a data-parallel group of {}", shards.ranks(),
              dp.size());
  const size_t P = shards.total();
  for (size_t e = P; e > 0;) {
    const size_t b = e > bucket_elems ? e - bucket_elems : 0;
    buckets_.push_back({b, e});
    e = b;
  }
  std::reverse(buckets_.begin(), buckets_.end());
}

GradSync::~GradSync() {
  for (auto& f : inflight_) try {
      if (f.work) f.work->wait();
    } catch (...) {  // the error was (or will be) reported by finish(); nothing to add while unwinding
    }
}

void GradSync::issue(Bucket& b) {
  b.issued = true;
  if (dp_.size() == 1) return;
  if (before_issue_) before_issue_();
  float* p = grads_ + b.begin;
  const size_t index = static_cast<size_t>(&b - buckets_.data());
  if (zero_ == 0) {
    inflight_.push_back({index, dp_.all_reduce_async(p, b.end - b.begin, DType::F32)});
  } else {
    // In place: this rank's part of the bucket receives the reduced values (comm.h allows recv to
    // overlap send: the data are exchanged before any output is written).
    const size_t mine = std::max(b.begin, std::min(b.end, shards_.begin(dp_.rank())));
    inflight_.push_back(
        {index, dp_.reduce_scatter_async(p, grads_ + mine, shards_.overlap(b.begin, b.end), DType::F32)});
  }
}

void GradSync::release_outside_shard(size_t b, size_t e) {
  const size_t sb = shards_.begin(dp_.rank()), se = shards_.end(dp_.rank());
  auto clear = [&](size_t lo, size_t hi) {  // [lo, hi) of the buffer becomes zeros
    if (lo >= hi) return;
    constexpr uintptr_t kPage = 4096;
    const uintptr_t a = reinterpret_cast<uintptr_t>(grads_ + lo), z = reinterpret_cast<uintptr_t>(grads_ + hi);
    const uintptr_t pa = (a + kPage - 1) & ~(kPage - 1), pz = z & ~(kPage - 1);
    if (pz > pa && ::madvise(reinterpret_cast<void*>(pa), pz - pa, MADV_DONTNEED) == 0) {
      std::memset(grads_ + lo, 0, pa - a);  // the partial pages at both ends (shared with neighbours)
      std::memset(reinterpret_cast<void*>(pz), 0, z - pz);
    } else {
      std::memset(grads_ + lo, 0, (hi - lo) * sizeof(float));
    }
  };
  clear(b, std::min(e, std::max(b, sb)));  // before the shard
  clear(std::max(b, std::min(e, se)), e);  // after it
}

void GradSync::reap(bool wait) {
  std::vector<InFlight> still;
  for (auto& f : inflight_) {
    if (!wait && !f.work->done()) {
      still.push_back(std::move(f));
      continue;
    }
    f.work->wait();  // done: rethrows its error, if any
    if (zero_ == 2) release_outside_shard(buckets_[f.bucket].begin, buckets_[f.bucket].end);
  }
  inflight_.swap(still);
}

void GradSync::zero_grads() {
  if (zero_ == 2 && dp_.size() > 1) {
    const size_t sb = shards_.begin(dp_.rank()), se = shards_.end(dp_.rank());
    std::memset(grads_ + sb, 0, (se - sb) * sizeof(float));
  } else {
    std::memset(grads_, 0, shards_.total() * sizeof(float));
  }
}

void GradSync::ready(size_t begin, size_t end) {
  LATHE_CHECK(begin <= end && end <= shards_.total(), "GradSync::ready: range [{}, {}) outside the buffer of {}", begin,
              end, shards_.total());
  if (begin == end) return;
  // A range reported twice would be counted twice and its bucket reduced before it is complete.
  auto next = reported_.lower_bound(begin);
  const bool overlaps_next = next != reported_.end() && next->first < end;
  const bool overlaps_prev = next != reported_.begin() && std::prev(next)->second > begin;
  LATHE_CHECK(!overlaps_next && !overlaps_prev, "GradSync::ready: [{}, {}) overlaps a range already reported this step",
              begin, end);
  reported_.emplace(begin, end);
  // Buckets are sorted; find the first that ends after begin.
  auto it =
      std::upper_bound(buckets_.begin(), buckets_.end(), begin, [](size_t v, const Bucket& b) { return v < b.end; });
  for (; it != buckets_.end() && it->begin < end; ++it) {
    it->ready += std::min(end, it->end) - std::max(begin, it->begin);
    if (it->ready == it->end - it->begin && !it->issued) issue(*it);
  }
  if (zero_ == 2) reap(false);  // release what has been reduced while backward goes on
}

double GradSync::finish() {
  for (auto& b : buckets_)
    if (!b.issued) issue(b);
  const auto t0 = std::chrono::steady_clock::now();
  {
    trace::Scope wait("wait for gradient reduction", trace::Cat::Comm);  // the exposed part
    reap(true);
  }
  for (auto& b : buckets_) b.ready = 0, b.issued = false;
  reported_.clear();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

double sharded_grad_norm(dist::Communicator& dp, const float* grads, const FlatShards& shards, ChunkSqSums chunk_sums) {
  const size_t k = optim::kChunk;
  std::vector<size_t> chunks(static_cast<size_t>(dp.size()));
  for (int r = 0; r < dp.size(); ++r) {
    LATHE_CHECK(shards.begin(r) % k == 0, "sharded_grad_norm: shard {} starts at {}, not a multiple of {}", r,
                shards.begin(r), k);
    chunks[static_cast<size_t>(r)] = (shards.size(r) + k - 1) / k;
  }
  size_t total = 0, before = 0;
  for (int r = 0; r < dp.size(); ++r) {
    if (r < dp.rank()) before += chunks[static_cast<size_t>(r)];
    total += chunks[static_cast<size_t>(r)];
  }
  std::vector<double> partial(total);
  const int me = dp.rank();
  chunk_sums(grads + shards.begin(me), shards.size(me), partial.data() + before);
  dp.all_gather(partial.data() + before, partial.data(), chunks, DType::F64);
  return optim::norm_from_chunk_sums(partial.data(), total);
}

std::vector<optim::ParamRange> ranges_in_shard(const std::vector<optim::ParamRange>& ranges, size_t b, size_t e) {
  std::vector<optim::ParamRange> out;
  for (const auto& r : ranges) {
    const size_t lo = std::max(b, r.offset), hi = std::min(e, r.offset + r.size);
    if (hi > lo) out.push_back({lo - b, hi - lo, r.decay, r.tensor});
  }
  return out;
}

}  // namespace lathe::parallel
