// Launch configuration of the CUDA attention, fused lm-head loss and optimizer kernels (plain C++
// headers, no GPU needed): head-dim buckets and shared memory, block orders covering every tile
// exactly once, the tiles the kernels visit covering every (query, key) pair the mask allows (with
// documents), the loss scratch layout, and the optimizer chunks equal to optim/chunks.h's.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <set>
#include <utility>
#include <vector>

#include "kernels/cuda/attention_launch.h"
#include "kernels/cuda/lm_head_loss_launch.h"
#include "kernels/cuda/optimizer_launch.h"
#include "optim/chunks.h"

using namespace lathe;
using namespace lathe::cuda;

namespace {

// ---- attention ---------------------------------------------------------------------------------
TEST(CudaAttentionLaunch, HeadDimBuckets) {
  EXPECT_EQ(attn::head_dim_bucket(1), 16);
  EXPECT_EQ(attn::head_dim_bucket(16), 16);
  EXPECT_EQ(attn::head_dim_bucket(17), 32);
  EXPECT_EQ(attn::head_dim_bucket(33), 64);
  EXPECT_EQ(attn::head_dim_bucket(64), 64);
  EXPECT_EQ(attn::head_dim_bucket(65), 128);
  EXPECT_EQ(attn::head_dim_bucket(128), 128);
  EXPECT_EQ(attn::head_dim_bucket(129), 0);  // refused by the host code
  EXPECT_EQ(attn::head_dim_bucket(0), 0);
  EXPECT_EQ(attn::head_dim_bucket(-3), 0);
}

TEST(CudaAttentionLaunch, SharedMemoryPerHeadDim) {
  // Q, K, V tiles of 64 x (DP + 1) floats and one 64 x 80 score tile.
  EXPECT_EQ(attn::forward_smem_bytes(64), 4u * (3 * 64 * 65 + 64 * 80));
  EXPECT_EQ(attn::dkdv_smem_bytes(64), 4u * (4 * 64 * 65 + 2 * 64 * 80 + 3 * 64));
  EXPECT_EQ(attn::dq_smem_bytes(128), 4u * (4 * 64 * 129 + 64 * 80 + 3 * 64));
  for (int dp : {16, 32, 64, 128}) {
    EXPECT_LE(attn::forward_smem_bytes(dp), attn::kMaxSmemSm90) << dp;
    EXPECT_LE(attn::dkdv_smem_bytes(dp), attn::kMaxSmemSm90) << dp;
    EXPECT_LE(attn::dq_smem_bytes(dp), attn::kMaxSmemSm90) << dp;
    EXPECT_LT(attn::dq_smem_bytes(dp), attn::dkdv_smem_bytes(dp));
  }
  // 256 threads = 16 x 16, each owning 4 x 4 entries of a 64 x 64 score tile.
  EXPECT_EQ(attn::kThreads, 256);
  EXPECT_EQ(attn::kTile, 4 * 16);
}

TEST(CudaAttentionLaunch, GridCoversEveryTileOnceHeaviestFirst) {
  for (int64_t T : {1, 63, 64, 65, 129, 1000}) {
    const int64_t B = 3, H = 4, KVH = 2, nt = attn::num_tiles(T);
    EXPECT_EQ(nt, (T + 63) / 64);
    const int64_t fb = attn::forward_blocks(B, T, H);
    EXPECT_EQ(fb, nt * B * H);
    EXPECT_EQ(attn::dq_blocks(B, T, H), fb);
    EXPECT_EQ(attn::dkdv_blocks(B, T, KVH), nt * B * KVH);
    std::set<std::pair<int64_t, int64_t>> seen;
    int64_t prev_tile = nt;
    for (int64_t blk = 0; blk < fb; ++blk) {
      const attn::BlockWork w = attn::query_block(blk, nt, B * H);
      ASSERT_GE(w.tile, 0);
      ASSERT_LT(w.tile, nt);
      ASSERT_LT(w.slot, B * H);
      EXPECT_LE(w.tile, prev_tile) << "query tiles go from the last (heaviest) to the first";
      prev_tile = w.tile;
      EXPECT_TRUE(seen.insert({w.tile, w.slot}).second) << "block " << blk << " repeats a tile";
    }
    EXPECT_EQ(static_cast<int64_t>(seen.size()), fb);
    seen.clear();
    prev_tile = -1;
    for (int64_t blk = 0; blk < attn::dkdv_blocks(B, T, KVH); ++blk) {
      const attn::BlockWork w = attn::key_block(blk, B * KVH);
      ASSERT_LT(w.tile, nt);
      ASSERT_LT(w.slot, B * KVH);
      EXPECT_GE(w.tile, prev_tile) << "key tiles go from the first (heaviest) to the last";
      prev_tile = w.tile;
      EXPECT_TRUE(seen.insert({w.tile, w.slot}).second);
    }
    EXPECT_EQ(static_cast<int64_t>(seen.size()), nt * B * KVH);
  }
  EXPECT_EQ(attn::causal_score_tiles(1024), 16 * 17 / 2);
}

// Random document segmentations of a sample: ds[0] = 0, each start equals the previous or t.
std::vector<int32_t> random_docs(int64_t T, std::mt19937& rng, double p_new) {
  std::vector<int32_t> ds(static_cast<size_t>(T));
  std::bernoulli_distribution fresh(p_new);
  for (int64_t t = 0; t < T; ++t) ds[t] = (t == 0 || fresh(rng)) ? static_cast<int32_t>(t) : ds[t - 1];
  return ds;
}

// The (query, key) pairs the kernels' loops visit, as the kernels bound them (attention.cu):
// forward and dQ: per query tile, key tiles from first_key(ds[i0], i0) to the tile's last query;
// dK/dV: per key tile, query tiles from the key tile on while query_tile_sees_keys. Every pair the
// mask allows (lo_i <= j <= i) must be visited by all three, or a probability / gradient is lost.
TEST(CudaAttentionLaunch, VisitedTilesCoverTheDocumentMask) {
  std::mt19937 rng(7);
  for (int64_t T : {1, 5, 64, 65, 200, 333}) {
    for (double p_new : {0.0, 0.01, 0.05, 0.3, 1.0}) {
      const std::vector<int32_t> ds = random_docs(T, rng, p_new);
      const int64_t nt = attn::num_tiles(T);
      std::vector<char> fwd(static_cast<size_t>(T * T), 0), kv(static_cast<size_t>(T * T), 0);
      int64_t fwd_tiles = 0, kv_tiles = 0;
      for (int64_t qt = 0; qt < nt; ++qt) {
        const int64_t i0 = qt * attn::kTile, nr = std::min<int64_t>(attn::kTile, T - i0);
        for (int64_t j0 = attn::first_key(ds[i0], i0); j0 < i0 + nr; j0 += attn::kTile) {
          ASSERT_EQ(j0 % attn::kTile, 0);
          ++fwd_tiles;
          for (int64_t i = i0; i < i0 + nr; ++i)
            for (int64_t j = j0; j < std::min(j0 + attn::kTile, i0 + nr); ++j) fwd[i * T + j] = 1;
        }
      }
      for (int64_t kt = 0; kt < nt; ++kt) {
        const int64_t j0 = kt * attn::kTile, nk = std::min<int64_t>(attn::kTile, T - j0);
        for (int64_t qt = kt; qt < nt; ++qt) {
          const int64_t i0 = qt * attn::kTile, nr = std::min<int64_t>(attn::kTile, T - i0);
          if (!attn::query_tile_sees_keys(ds[i0], i0, j0, nk)) break;
          ++kv_tiles;
          for (int64_t i = i0; i < i0 + nr; ++i)
            for (int64_t j = j0; j < j0 + nk; ++j) kv[i * T + j] = 1;
        }
      }
      for (int64_t i = 0; i < T; ++i)
        for (int64_t j = ds[i]; j <= i; ++j) {
          ASSERT_TRUE(fwd[i * T + j]) << "T=" << T << " p=" << p_new << ": forward/dQ skip query " << i << " key " << j;
          ASSERT_TRUE(kv[i * T + j]) << "T=" << T << " p=" << p_new << ": dK/dV skip query " << i << " key " << j;
        }
      // Both loops visit the same tiles (the forward's set, seen from the key side).
      EXPECT_EQ(fwd_tiles, kv_tiles) << "T=" << T << " p=" << p_new;
      if (p_new == 0.0) {
        EXPECT_EQ(fwd_tiles, attn::causal_score_tiles(T));
      }
      if (p_new == 1.0) {  // a document starting at every token: only the diagonal tiles remain
        EXPECT_EQ(fwd_tiles, nt);
      }
    }
  }
}

// The same coverage under a sliding window (issue 25): lo_i = window_lo(ds[i], window, i) = the
// later of the document start and i - window + 1. Every visible pair is visited, the loops agree,
// no visited tile lies wholly left of its rows' windows, and a short window visits far fewer tiles.
TEST(CudaAttentionLaunch, VisitedTilesCoverTheWindowMask) {
  std::mt19937 rng(9);
  for (int64_t T : {1, 65, 200, 333, 1000})
    for (double p_new : {0.0, 0.02})
      for (int64_t window : {1, 63, 64, 65, 130}) {
        const std::vector<int32_t> ds = random_docs(T, rng, p_new);
        std::vector<int64_t> lo(static_cast<size_t>(T));
        for (int64_t i = 0; i < T; ++i) lo[i] = attn::window_lo(ds[i], window, i);
        const int64_t nt = attn::num_tiles(T);
        std::vector<char> fwd(static_cast<size_t>(T * T), 0), kv(static_cast<size_t>(T * T), 0);
        int64_t fwd_tiles = 0, kv_tiles = 0;
        for (int64_t qt = 0; qt < nt; ++qt) {
          const int64_t i0 = qt * attn::kTile, nr = std::min<int64_t>(attn::kTile, T - i0);
          for (int64_t j0 = attn::first_key(lo[i0], i0); j0 < i0 + nr; j0 += attn::kTile) {
            ++fwd_tiles;
            // No visited tile lies wholly left of its first row's window (nor so of later rows').
            EXPECT_GE(j0 + attn::kTile - 1, lo[i0]) << "T=" << T << " window=" << window;
            for (int64_t i = i0; i < i0 + nr; ++i)
              for (int64_t j = j0; j < std::min(j0 + attn::kTile, i0 + nr); ++j) fwd[i * T + j] = 1;
          }
        }
        for (int64_t kt = 0; kt < nt; ++kt) {
          const int64_t j0 = kt * attn::kTile, nk = std::min<int64_t>(attn::kTile, T - j0);
          for (int64_t qt = kt; qt < nt; ++qt) {
            const int64_t i0 = qt * attn::kTile, nr = std::min<int64_t>(attn::kTile, T - i0);
            if (!attn::query_tile_sees_keys(lo[i0], i0, j0, nk)) break;
            ++kv_tiles;
            for (int64_t i = i0; i < i0 + nr; ++i)
              for (int64_t j = j0; j < j0 + nk; ++j) kv[i * T + j] = 1;
          }
        }
        for (int64_t i = 0; i < T; ++i)
          for (int64_t j = lo[i]; j <= i; ++j) {
            ASSERT_TRUE(fwd[i * T + j]) << "T=" << T << " window=" << window << ": forward/dQ skip " << i << "," << j;
            ASSERT_TRUE(kv[i * T + j]) << "T=" << T << " window=" << window << ": dK/dV skip " << i << "," << j;
          }
        EXPECT_EQ(fwd_tiles, kv_tiles) << "T=" << T << " window=" << window;
        // At most the diagonal tile and the (window + 63) / 64 + 1 tiles before it per query tile.
        EXPECT_LE(fwd_tiles, nt * ((window + attn::kTile - 1) / attn::kTile + 1)) << "T=" << T << " window=" << window;
      }
  EXPECT_EQ(attn::window_lo(0, 0, 500), 0);      // no window
  EXPECT_EQ(attn::window_lo(0, 100, 500), 401);  // keys j > 500 - 100
  EXPECT_EQ(attn::window_lo(450, 100, 500), 450);
  EXPECT_EQ(attn::window_lo(0, 100, 50), 0);
}

TEST(CudaAttentionLaunch, FirstKeyClampsMalformedStarts) {
  EXPECT_EQ(attn::first_key(0, 100), 0);
  EXPECT_EQ(attn::first_key(70, 100), 64);
  EXPECT_EQ(attn::first_key(-5, 100), 0);     // clamped to 0
  EXPECT_EQ(attn::first_key(900, 130), 128);  // clamped to i0
  EXPECT_TRUE(attn::query_tile_sees_keys(63, 64, 0, 64));
  EXPECT_FALSE(attn::query_tile_sees_keys(64, 64, 0, 64));
  EXPECT_TRUE(attn::query_tile_sees_keys(-1, 64, 0, 64));
}

// ---- lm head loss ------------------------------------------------------------------------------
TEST(CudaLmHeadLaunch, ScratchLayout) {
  const lm_head::ScratchLayout f = lm_head::scratch_layout(4, 10, 4);
  EXPECT_EQ(f.logits, 0u);
  EXPECT_EQ(f.dlogits, 0u);  // fp32: dlogits in place
  EXPECT_EQ(f.aux, 256u);    // 160 bytes rounded up to 256
  EXPECT_EQ(f.stats, 256u + lm_head::kAuxBytes);
  EXPECT_EQ(f.bytes, f.stats + 256u);  // 3 x 4 doubles rounded up
  const lm_head::ScratchLayout h = lm_head::scratch_layout(4, 10, 2);
  EXPECT_EQ(h.dlogits, 256u);
  EXPECT_EQ(h.aux, 512u);
  EXPECT_EQ(h.bytes, 512u + lm_head::kAuxBytes + 256u);
  // GPT-2 vocabulary, 1024-row chunks: the logits chunk dominates; bf16 adds its dlogits copy.
  const lm_head::ScratchLayout g = lm_head::scratch_layout(1024, 50257, 2);
  EXPECT_EQ(g.dlogits, lm_head::align_up(size_t{1024} * 50257 * 4));
  EXPECT_GE(g.bytes, size_t{1024} * 50257 * 6);
  EXPECT_EQ(g.dlogits % lm_head::kAlign, 0u);
  EXPECT_EQ(g.aux % lm_head::kAlign, 0u);
  EXPECT_EQ(g.stats % lm_head::kAlign, 0u);
  EXPECT_EQ(g.bytes - g.stats, lm_head::align_up(3 * 1024 * 8));
  EXPECT_EQ(lm_head::scratch_layout(0, 10, 4).bytes, 0u);
  EXPECT_EQ(lm_head::scratch_layout(int64_t{1} << 40, int64_t{1} << 30, 4).bytes, 0u) << "overflow is refused";
}

TEST(CudaLmHeadLaunch, ChunksCoverRowsOnce) {
  for (int64_t N : {1, 7, 64, 65, 1000})
    for (int64_t R : {1, 3, 64, 5000}) {
      int64_t next = 0;
      for (int64_t c = 0; c < lm_head::num_chunks(N, R); ++c) {
        const lm_head::ChunkRows rows = lm_head::chunk_rows_of(c, N, R);
        EXPECT_EQ(rows.first, next);
        EXPECT_GE(rows.count, 1);
        EXPECT_LE(rows.count, R);
        next += rows.count;
      }
      EXPECT_EQ(next, N) << "N=" << N << " R=" << R;
    }
  EXPECT_EQ(lm_head::check_blocks(1), 1);
  EXPECT_EQ(lm_head::check_blocks(257), 2);
  EXPECT_TRUE(lm_head::gemm_dims_fit(1024, 768, 50257));
  EXPECT_FALSE(lm_head::gemm_dims_fit(int64_t{1} << 31, 768, 50257));
}

// ---- optimizer -----------------------------------------------------------------------------------
TEST(CudaOptimizerLaunch, ChunksAreOptimsChunks) {
  const size_t K = optim::kChunk;
  // Ranges with gaps, a range crossing several chunk boundaries, a tiny one and an empty one.
  const std::vector<optim::ParamRange> ranges = {{0, 10, true, 0},
                                                 {100, 3 * K + 5, false, 1},
                                                 {4 * K, 1, true, 2},
                                                 {4 * K + 7, 0, true, 3},
                                                 {5 * K - 3, 10, false, 4}};
  const std::vector<optim::Chunk> cpu = optim::make_chunks(ranges);
  const std::vector<optim_launch::DeviceChunk> dev = optim_launch::device_chunks(ranges);
  ASSERT_EQ(dev.size(), cpu.size());
  for (size_t c = 0; c < cpu.size(); ++c) {
    EXPECT_EQ(dev[c].begin, static_cast<int64_t>(cpu[c].begin));
    EXPECT_EQ(dev[c].end, static_cast<int64_t>(cpu[c].end));
    EXPECT_EQ(dev[c].range, static_cast<int32_t>(cpu[c].range));
    EXPECT_EQ(dev[c].decay, ranges[cpu[c].range].decay ? 1 : 0);
    EXPECT_LE(dev[c].end - dev[c].begin, static_cast<int64_t>(K));
    EXPECT_GT(dev[c].end, dev[c].begin);
  }
  // The crossing range is cut at multiples of kChunk of the flat buffer.
  EXPECT_EQ(dev[1].begin, 100);
  EXPECT_EQ(dev[1].end, static_cast<int64_t>(K));
  EXPECT_EQ(optim_launch::flat_chunks(0), 0u);
  EXPECT_EQ(optim_launch::flat_chunks(1), 1u);
  EXPECT_EQ(optim_launch::flat_chunks(K), 1u);
  EXPECT_EQ(optim_launch::flat_chunks(K + 1), 2u);
  EXPECT_EQ(optim_launch::elementwise_blocks(1), 1u);
  EXPECT_EQ(optim_launch::elementwise_blocks(1024), 1u);
  EXPECT_EQ(optim_launch::elementwise_blocks(1025), 2u);
}

}  // namespace
