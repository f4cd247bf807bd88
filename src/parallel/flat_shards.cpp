#include "parallel/flat_shards.h"

#include <algorithm>

#include "core/error.h"

namespace lathe::parallel {

FlatShards::FlatShards(size_t total, int ranks, size_t align) {
  LATHE_CHECK(ranks >= 1 && align >= 1, "FlatShards: {} ranks, alignment {}", ranks, align);
  const size_t blocks = (total + align - 1) / align, n = static_cast<size_t>(ranks);
  bounds_.resize(n + 1);
  size_t b = 0;
  for (size_t r = 0; r < n; ++r) {
    bounds_[r] = std::min(b * align, total);
    b += blocks / n + (r < blocks % n ? 1 : 0);  // the first blocks % n ranks take one block more
  }
  bounds_[n] = total;
}

FlatShards FlatShards::merged(const FlatShards& fine, int per) {
  LATHE_CHECK(per >= 1 && fine.ranks() % per == 0, "FlatShards: {} shards cannot be merged {} at a time", fine.ranks(),
              per);
  FlatShards c;
  c.bounds_.clear();
  for (int r = 0; r <= fine.ranks(); r += per) c.bounds_.push_back(fine.bounds_[static_cast<size_t>(r)]);
  return c;
}

std::vector<size_t> FlatShards::sizes() const {
  std::vector<size_t> s(static_cast<size_t>(ranks()));
  for (int r = 0; r < ranks(); ++r) s[static_cast<size_t>(r)] = size(r);
  return s;
}

std::vector<size_t> FlatShards::overlap(size_t b, size_t e) const {
  std::vector<size_t> c(static_cast<size_t>(ranks()), 0);
  for (int r = 0; r < ranks(); ++r) {
    const size_t lo = std::max(b, begin(r)), hi = std::min(e, end(r));
    if (hi > lo) c[static_cast<size_t>(r)] = hi - lo;
  }
  return c;
}

}  // namespace lathe::parallel
