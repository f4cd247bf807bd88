#pragma once
#include <omp.h>

#include <atomic>

namespace lathe {
inline int max_threads() { return omp_get_max_threads(); }

// Deterministic reductions (layernorm/rmsnorm parameter gradients, the lm head's dx) split their
// rows or tiles into reduction_parts() partial sums added in part order, and the threads share
// the parts: results depend on this number, never on how many threads run. Training fixes it at
// start (set_reduction_parts: the thread count then, or LATHE_REDUCTION_PARTS), so the thread
// count may change mid-run (core/blas_env.h, LoadFollower) without changing a bit, and two
// machines with different core counts give the same bits when they set the same number. 0 (the
// default) follows omp_get_max_threads(): one part per thread, for tools and kernel tests.
namespace detail {
inline std::atomic<int> reduction_parts{0};
}
inline int reduction_parts() {
  const int p = detail::reduction_parts.load(std::memory_order_relaxed);
  return p > 0 ? p : omp_get_max_threads();
}
inline void set_reduction_parts(int parts) { detail::reduction_parts.store(parts > 0 ? parts : 0); }
// Threads' own rows in a kernel's scratch: at least one per thread that may run, and at least one
// per reduction part (so a buffer sized by this fits either).
inline int scratch_slots() {
  const int p = reduction_parts(), t = omp_get_max_threads();
  return p > t ? p : t;
}
}  // namespace lathe
