// Data-parallel gradient reduction and ZeRO on the in-process thread communicator, against the
// single-process computation (the oracle): every rank's gradients are known functions of (rank,
// element); the reference sums them in rank order (as a single process accumulating the ranks'
// micro-batches one after another does) and takes optim::global_grad_norm over the whole buffer.
// Required: bit-identical reduced gradients and norm (the shards' chunk sums under ZeRO) for every
// data degree 1..4, every ZeRO stage and bucket size, with ranges reported in backward order.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <tuple>

#include "dist/comm.h"
#include "optim/chunks.h"
#include "optim/clip.h"
#include "optim/optimizer.h"
#include "parallel/flat_shards.h"
#include "parallel/grad_sync.h"

using namespace lathe;
using namespace lathe::parallel;

namespace {

constexpr size_t kP = 3 * optim::kChunk + 4321;  // not a multiple of the chunk

float grad_of(int rank, size_t i) {
  return static_cast<float>(std::sin(0.001 * static_cast<double>(i) * (rank + 1)) *
                            std::pow(10.0, static_cast<int>((i * 7 + static_cast<size_t>(rank)) % 5) - 2));
}

// Tensor ranges of a pretend model: "layers" of uneven sizes, some without weight decay.
std::vector<optim::ParamRange> model_ranges() {
  std::vector<optim::ParamRange> r;
  size_t off = 0, k = 0;
  while (off < kP) {
    const size_t n = std::min(kP - off, size_t{1000} + (k * 2711) % 9000);
    r.push_back({off, n, k % 3 != 0, static_cast<int64_t>(k)});
    off += n, ++k;
  }
  return r;
}

struct Reference {
  std::vector<float> grads;
  double norm;
};

Reference reference(int dp) {
  Reference ref;
  ref.grads.assign(kP, 0.0f);
  for (int r = 0; r < dp; ++r)
    for (size_t i = 0; i < kP; ++i) ref.grads[i] += grad_of(r, i);
  ref.norm = optim::global_grad_norm(ref.grads.data(), kP);
  return ref;
}

}  // namespace

class GradSyncLayouts : public ::testing::TestWithParam<std::tuple<int, int, size_t>> {};

// The update on top of the reduction (AdamW, LAMB's whole-tensor norms over shards) is
// tests/parallel/test_dist_optimizer.cpp's.
TEST_P(GradSyncLayouts, BitIdenticalToSingleProcess) {
  const auto [dp, zero, bucket] = GetParam();
  const Reference ref = reference(dp);
  const auto ranges = model_ranges();
  dist::run_threads(dp, [&](dist::Communicator& comm) {
    const int me = comm.rank();
    std::vector<float> grads(kP);
    for (size_t i = 0; i < kP; ++i) grads[i] = grad_of(me, i);
    FlatShards shards(kP, dp, optim::kChunk);
    GradSync sync(comm, grads.data(), shards, zero, bucket);
    // Backward order: the last tensors' gradients are final first.
    for (size_t k = ranges.size(); k-- > 0;) sync.ready(ranges[k].offset, ranges[k].offset + ranges[k].size);
    const double waited = sync.finish();
    EXPECT_GE(waited, 0.0);
    const size_t b = zero == 0 ? 0 : shards.begin(me), e = zero == 0 ? kP : shards.end(me);
    EXPECT_EQ(0, std::memcmp(grads.data() + b, ref.grads.data() + b, (e - b) * sizeof(float)))
        << "reduced gradients differ, rank " << me;

    // The norm over the shards' chunk sums (ZeRO) equals the whole buffer's.
    const double norm = zero ? sharded_grad_norm(comm, grads.data(), shards, &optim::grad_sq_chunk_sums)
                             : optim::global_grad_norm(grads.data(), kP);
    EXPECT_EQ(norm, ref.norm);
  });
}

INSTANTIATE_TEST_SUITE_P(DpZeroBucket, GradSyncLayouts,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4), ::testing::Values(0, 1, 2),
                                            ::testing::Values(size_t{5000}, size_t{1} << 20)));

TEST(FlatShards, CutsAtChunkMultiplesAndCoverTheBuffer) {
  FlatShards s(kP, 3, optim::kChunk);  // 4 chunks over 3 ranks: 2, 1, 1
  EXPECT_EQ(s.begin(0), 0u);
  EXPECT_EQ(s.end(0), 2 * optim::kChunk);
  EXPECT_EQ(s.end(1), 3 * optim::kChunk);
  EXPECT_EQ(s.end(2), kP);
  FlatShards tiny(10, 4, optim::kChunk);  // one chunk, four ranks: three empty shards
  EXPECT_EQ(tiny.size(0), 10u);
  EXPECT_EQ(tiny.size(3), 0u);
  auto o = s.overlap(optim::kChunk + 5, 3 * optim::kChunk + 7);
  EXPECT_EQ(o, (std::vector<size_t>{optim::kChunk - 5, optim::kChunk, 7}));
}

// ZeRO 2 keeps only the shard after the reduction: everything outside it reads as zero (pages
// released, edges cleared), zero_grads() clears the shard, and a second step that accumulates (+=)
// into the buffer reduces exactly as a fresh buffer would (no stale values sent to other ranks).
TEST(GradSync, ZeroTwoKeepsOnlyTheShardAndTheNextStepStartsFromZeros) {
  for (int dp : {2, 3}) {
    dist::run_threads(dp, [&](dist::Communicator& comm) {
      const int me = comm.rank();
      // Page-aligned like the model's gradient buffer, sized so that many whole pages are released.
      std::vector<float> grads(kP + 5000);
      float* g = grads.data() + 3;  // an unaligned start: edges must be cleared by memset
      FlatShards shards(kP, dp, optim::kChunk);
      GradSync sync(comm, g, shards, 2, 5000);
      const auto ranges = model_ranges();
      for (int round = 0; round < 2; ++round) {
        sync.zero_grads();
        for (size_t i = 0; i < kP; ++i) g[i] += grad_of(me + round, i);
        for (size_t k = ranges.size(); k-- > 0;) sync.ready(ranges[k].offset, ranges[k].offset + ranges[k].size);
        sync.finish();
        const size_t sb = shards.begin(me), se = shards.end(me);
        size_t nonzero_outside = 0, wrong_inside = 0;
        for (size_t i = 0; i < kP; ++i) {
          if (i < sb || i >= se) {
            nonzero_outside += g[i] != 0.0f;
          } else {
            float want = 0.0f;
            for (int r = 0; r < dp; ++r) want += grad_of(r + round, i);
            wrong_inside += std::memcmp(&want, &g[i], 4) != 0;
          }
        }
        EXPECT_EQ(nonzero_outside, 0u) << "dp " << dp << " rank " << me << " round " << round;
        EXPECT_EQ(wrong_inside, 0u) << "dp " << dp << " rank " << me << " round " << round;
      }
      EXPECT_EQ(grads[0] + grads[1] + grads[2], 0.0f);  // outside the buffer: untouched
    });
  }
}

TEST(GradSync, RangeReportedTwiceIsAnError) {
  dist::run_threads(1, [](dist::Communicator& comm) {
    std::vector<float> g(100);
    FlatShards shards(100, 1, optim::kChunk);
    GradSync sync(comm, g.data(), shards, 0, 64);
    sync.ready(0, 50);
    EXPECT_THROW(sync.ready(40, 60), Error);
  });
}
