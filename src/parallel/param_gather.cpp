#include "parallel/param_gather.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>

#include "core/error.h"
#include "core/trace.h"

namespace lathe::parallel {

namespace {

// Sorted, adjacent runs merged.
ParamGather::Ranges normalised(ParamGather::Ranges r) {
  std::sort(r.begin(), r.end());
  ParamGather::Ranges out;
  for (const auto& [b, e] : r) {
    if (b >= e) continue;
    if (!out.empty() && out.back().second >= b)
      out.back().second = std::max(out.back().second, e);
    else
      out.push_back({b, e});
  }
  return out;
}

// `from` without the elements of [b, e).
ParamGather::Ranges minus(const ParamGather::Ranges& from, size_t b, size_t e) {
  ParamGather::Ranges out;
  for (const auto& [lo, hi] : from) {
    if (hi <= b || lo >= e) {
      out.push_back({lo, hi});
      continue;
    }
    if (lo < b) out.push_back({lo, b});
    if (hi > e) out.push_back({e, hi});
  }
  return out;
}

}  // namespace

ParamGather::ParamGather(dist::Communicator& group, float* params, const FlatShards& shards, std::vector<Ranges> blocks,
                         int prefetch)
    : group_(group), params_(params), shards_(shards), prefetch_(prefetch) {
  LATHE_CHECK(params != nullptr, "ZeRO 3: no parameter buffer to gather into");
  LATHE_CHECK(prefetch >= 0 && prefetch <= 2, "parallel.prefetch must be 0, 1 or 2, got {}", prefetch);
  LATHE_CHECK(shards.ranks() == group.size(), "ZeRO 3: {} shards for a data-parallel group of {}", shards.ranks(),
              group.size());
  LATHE_CHECK(blocks.size() >= 2, "ZeRO 3: {} blocks (a model has an embedding and a head at least)", blocks.size());
  for (auto& b : blocks) {
    b = normalised(std::move(b));
    LATHE_CHECK(b.empty() || b.back().second <= shards.total(),
                "ZeRO 3: a block's range ends at {}, past the buffer of {} elements", b.back().second, shards.total());
    blocks_.push_back(std::move(b));
  }
  slots_.resize(static_cast<size_t>(positions()));
  f32_ = blocks_;
  low_.assign(blocks_.size(), {});
}

ParamGather::~ParamGather() {
  for (auto& s : slots_)
    for (auto& w : s.works) try {
        if (w) w->wait();
      } catch (...) {  // reported by whoever waited first; nothing to add while unwinding
      }
}

std::pair<int64_t, bool> ParamGather::at(int64_t pos) const {
  const int64_t n = static_cast<int64_t>(blocks_.size());
  return pos < n ? std::pair{pos, false} : std::pair{2 * (n - 1) - pos, true};
}

void ParamGather::note(Op op, int64_t pos) {
  if (!record_events) return;
  const auto [block, backward] = at(pos);
  events_.push_back({op, block, backward});
}

void ParamGather::issue(int64_t pos) {
  Slot& s = slots_[static_cast<size_t>(pos)];
  s.issued = true;
  note(Op::Issue, pos);
  const int me = group_.rank();
  const size_t block = static_cast<size_t>(at(pos).first);
  // This rank's part of [b, e) is already in place (send aliases its own segment of recv).
  auto gather = [&](std::byte* base, size_t elem, DType dt, size_t b, size_t e) {
    const size_t mine = std::max(b, std::min(e, shards_.begin(me)));
    const std::vector<size_t> counts = shards_.overlap(b, e);
    gathered_bytes_ += (e - b - counts[static_cast<size_t>(me)]) * elem;
    s.works.push_back(group_.all_gather_async(base + mine * elem, base + b * elem, counts, dt));
  };
  if (low_[block].empty() || f32_[block].size() <= 1) {
    for (const auto& [b, e] : f32_[block])
      gather(reinterpret_cast<std::byte*>(params_), sizeof(float), DType::F32, b, e);
  } else {  // many small fp32 tensors: packed into one collective, unpacked in wait()
    s.counts.assign(static_cast<size_t>(group_.size()), 0);
    for (const auto& [b, e] : f32_[block]) {
      const std::vector<size_t> c = shards_.overlap(b, e);
      for (size_t r = 0; r < c.size(); ++r) s.counts[r] += c[r];
      const size_t lo = std::max(b, shards_.begin(me)), hi = std::min(e, shards_.end(me));
      if (lo < hi) s.send.insert(s.send.end(), params_ + lo, params_ + hi);
      gathered_bytes_ += (e - b - c[static_cast<size_t>(me)]) * sizeof(float);
    }
    size_t total = 0;
    for (size_t c : s.counts) total += c;
    s.recv.resize(total);
    s.works.push_back(group_.all_gather_async(s.send.data(), s.recv.data(), s.counts, DType::F32));
  }
  for (const auto& [b, e] : low_[block])
    gather(static_cast<std::byte*>(copy_.data), copy_.elem_bytes, copy_.dtype, b, e);
}

void ParamGather::wait(int64_t pos) {
  Slot& s = slots_[static_cast<size_t>(pos)];
  if (s.ready) return;
  const auto t0 = std::chrono::steady_clock::now();
  {
    trace::Scope span("wait for weight gather", trace::Cat::Comm);
    for (auto& w : s.works) w->wait();
  }
  waited_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  s.works.clear();
  s.ready = true;
  note(Op::Wait, pos);
  if (!s.counts.empty()) unpack(s, static_cast<size_t>(at(pos).first));
  if (copy_.data)  // bf16/fp16: the compute copy of the fp32 weights just gathered
    for (const auto& [b, e] : f32_[static_cast<size_t>(at(pos).first)]) copy_.convert(b, e);
}

void ParamGather::unpack(Slot& s, size_t block) {
  const int me = group_.rank();
  size_t at = 0;  // rank r's pieces follow ranks 0..r-1's in recv, in the order of f32_[block]
  for (int r = 0; r < group_.size(); ++r) {
    for (const auto& [b, e] : f32_[block]) {
      const size_t lo = std::max(b, shards_.begin(r)), hi = std::min(e, shards_.end(r));
      if (lo >= hi) continue;
      if (r != me)
        std::copy(s.recv.begin() + static_cast<ptrdiff_t>(at), s.recv.begin() + static_cast<ptrdiff_t>(at + hi - lo),
                  params_ + lo);
      at += hi - lo;
    }
  }
  LATHE_CHECK(at == s.recv.size(), "internal: ZeRO 3 unpacked {} of {} gathered elements", at, s.recv.size());
  s.send = {};
  s.recv = {};
  s.counts.clear();
}

void ParamGather::release(int64_t pos, int64_t keep_lo, int64_t keep_hi) {
  const int me = group_.rank();
  Ranges r = minus(blocks_[static_cast<size_t>(at(pos).first)], shards_.begin(me), shards_.end(me));
  for (int64_t q = std::max<int64_t>(keep_lo, 0); q < std::min(keep_hi, positions()); ++q)
    for (const auto& [b, e] : blocks_[static_cast<size_t>(at(q).first)]) r = minus(r, b, e);
  note(Op::Release, pos);
  release_ranges(r);
}

void ParamGather::release_ranges(const Ranges& r) {
  static const uintptr_t kPage = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  auto give_back = [&](const std::byte* base, size_t elem, size_t lo, size_t hi) {
    const uintptr_t a = reinterpret_cast<uintptr_t>(base + lo * elem),
                    z = reinterpret_cast<uintptr_t>(base + hi * elem);
    const uintptr_t pa = (a + kPage - 1) & ~(kPage - 1), pz = z & ~(kPage - 1);
    if (pz > pa && ::madvise(reinterpret_cast<void*>(pa), pz - pa, MADV_DONTNEED) == 0) released_bytes_ += pz - pa;
  };
  for (const auto& [lo, hi] : r) {  // whole pages only: the edges may hold a neighbour's weights
    give_back(reinterpret_cast<const std::byte*>(params_), sizeof(float), lo, hi);
    if (copy_.data) give_back(static_cast<const std::byte*>(copy_.data), copy_.elem_bytes, lo, hi);
  }
}

void ParamGather::set_compute_copy(ComputeCopy copy) {
  LATHE_CHECK(cur_ < 0, "ZeRO 3: the compute copy set in the middle of a pass (position {})", cur_);
  LATHE_CHECK(!copy.data || (copy.elem_bytes > 0 && copy.convert),
              "ZeRO 3: a compute copy of {}-byte elements without a conversion", copy.elem_bytes);
  LATHE_CHECK(copy.compute_only.empty() || (copy.data && copy.compute_only.size() == blocks_.size() &&
                                            dtype_size(copy.dtype) == copy.elem_bytes),
              "ZeRO 3: compute-dtype gathers of {} blocks ({}-byte elements, dtype of {} bytes) for a model of {} "
              "blocks",
              copy.compute_only.size(), copy.elem_bytes, dtype_size(copy.dtype), blocks_.size());
  f32_ = blocks_;
  low_.assign(blocks_.size(), {});
  for (size_t k = 0; k < copy.compute_only.size(); ++k) {
    // f32 = the block's ranges outside compute_only; low = the whole block when it has any inside.
    Ranges rest = blocks_[k];
    for (const auto& [b, e] : normalised(copy.compute_only[k])) rest = minus(rest, b, e);
    const bool any_low = rest != blocks_[k];
    f32_[k] = std::move(rest);
    if (any_low) low_[k] = blocks_[k];
  }
  copy_ = std::move(copy);
}

void ParamGather::before_block(int64_t block, bool backward) {
  const int64_t n = static_cast<int64_t>(blocks_.size());
  LATHE_CHECK(block >= 0 && block < n && !(backward && block == n - 1),
              "ZeRO 3: before_block({}, {}) outside the model's blocks 0..{}", block, backward, n - 1);
  const int64_t p = backward ? 2 * (n - 1) - block : block;
  LATHE_CHECK(p > cur_, "ZeRO 3: block {} ({}) requested after position {} of the pass: blocks out of order", block,
              backward ? "backward" : "forward", cur_);
  const int64_t hi = span_hi_ < 0 ? positions() : span_hi_;
  LATHE_CHECK(p >= span_lo_ && p < hi, "ZeRO 3: block {} ({}) outside this pass's span of positions [{}, {})", block,
              backward ? "backward" : "forward", span_lo_, hi);
  const int64_t keep_hi = std::min(p + prefetch_ + 1, hi);
  for (int64_t q = std::max<int64_t>(cur_, 0); q < p; ++q) {  // the previous block (and any skipped)
    Slot& s = slots_[static_cast<size_t>(q)];
    if (!s.issued) continue;
    wait(q);
    release(q, p, keep_hi);
  }
  if (!slots_[static_cast<size_t>(p)].issued) issue(p);
  wait(p);
  for (int64_t q = p + 1; q < keep_hi; ++q)
    if (!slots_[static_cast<size_t>(q)].issued) issue(q);
  cur_ = p;
}

void ParamGather::begin_span(int64_t first, int64_t last, bool backward) {
  const int64_t n = static_cast<int64_t>(blocks_.size());
  LATHE_CHECK(cur_ < 0, "ZeRO 3: a span begun in the middle of a pass (position {})", cur_);
  LATHE_CHECK(0 <= first && first <= last && last < n && !(backward && last == n - 1),
              "ZeRO 3: span of blocks {}..{} ({}) outside the model's blocks 0..{}", first, last,
              backward ? "backward" : "forward", n - 1);
  span_lo_ = backward ? 2 * (n - 1) - last : first;
  span_hi_ = (backward ? 2 * (n - 1) - first : last) + 1;
}

double ParamGather::end_pass() {
  for (int64_t q = std::max<int64_t>(cur_, 0); q < positions(); ++q) {
    Slot& s = slots_[static_cast<size_t>(q)];
    if (!s.issued) continue;
    wait(q);
    release(q, 0, 0);
  }
  for (auto& s : slots_) s = Slot{};
  cur_ = -1;
  span_lo_ = 0;
  span_hi_ = -1;
  const double waited = waited_s_;
  waited_s_ = 0;
  return waited;
}

void ParamGather::release_whole() {
  LATHE_CHECK(cur_ < 0, "ZeRO 3: the whole model released in the middle of a pass (position {})", cur_);
  const int me = group_.rank();
  release_ranges(minus({{0, shards_.total()}}, shards_.begin(me), shards_.end(me)));
}

void ParamGather::gather_whole() {
  LATHE_CHECK(cur_ < 0, "ZeRO 3: the whole model gathered in the middle of a pass (position {})", cur_);
  const int me = group_.rank();
  group_.all_gather(params_ + shards_.begin(me), params_, shards_.sizes(), DType::F32);
  if (copy_.data) copy_.convert(0, shards_.total());
}

}  // namespace lathe::parallel
