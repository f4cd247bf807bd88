// DataLoader: windows against direct indexing of the token stream, the train/valid split,
// shuffling (reproducible, seed-dependent, a permutation per epoch), prefetching that changes
// nothing, and state()/restore() resuming identically.
#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <random>
#include <set>

#include "core/error.h"
#include "data/loader.h"

namespace fs = std::filesystem;
using lathe::DType;
using namespace lathe::data;

namespace {

struct TempDir {
  fs::path path;
  TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "lathe_loader_XXXXXX").string();
    path = ::mkdtemp(tmpl.data());
  }
  ~TempDir() { fs::remove_all(path); }
};

// Dataset of exactly ntokens tokens in short documents (lengths 1..6) so that most windows span
// boundaries. With `positional`, token = its global position (I32), which identifies a sample
// from its first input.
struct Fixture {
  TempDir tmp;
  std::vector<int32_t> stream;
  std::vector<int64_t> doc_starts;
  std::shared_ptr<const IndexedDataset> ds;
  Fixture(int64_t ntokens, bool positional, uint32_t seed = 1) {
    std::mt19937 g(seed);
    const std::string prefix = (tmp.path / "d").string();
    IndexedDatasetWriter w(prefix, positional ? DType::I32 : DType::U16);
    while (static_cast<int64_t>(stream.size()) < ntokens) {
      std::vector<int32_t> doc(std::min<int64_t>(1 + g() % 6, ntokens - static_cast<int64_t>(stream.size())));
      for (auto& t : doc) {
        t = positional ? static_cast<int32_t>(stream.size() + (&t - doc.data())) : static_cast<int32_t>(g() % 50000);
      }
      doc_starts.push_back(static_cast<int64_t>(stream.size()));
      stream.insert(stream.end(), doc.begin(), doc.end());
      w.add_document(doc);
    }
    w.finalize();
    ds = std::make_shared<IndexedDataset>(prefix);
  }
};

struct Batch {
  std::vector<int32_t> in, tgt;
  bool operator==(const Batch&) const = default;
};
std::vector<Batch> take(DataLoader& dl, int n) {
  std::vector<Batch> out;
  for (int i = 0; i < n; ++i) {
    Batch b{std::vector<int32_t>(dl.batch_size() * dl.seq_len()), std::vector<int32_t>(dl.batch_size() * dl.seq_len())};
    dl.next(b.in.data(), b.tgt.data());
    out.push_back(std::move(b));
  }
  return out;
}

}  // namespace

TEST(Loader, NumSamples) {
  EXPECT_EQ(num_samples(101, 10), 10);
  EXPECT_EQ(num_samples(100, 10), 9);  // sample 9 would need token 100
  EXPECT_EQ(num_samples(0, 10), 0);
}

TEST(Loader, WindowsMatchTokenStream) {
  Fixture f(1000, false);
  const int64_t S = 13, B = 4;
  const int64_t n = num_samples(f.ds->total_tokens(), S);
  DataLoader dl(f.ds, all_samples(n), B, S, 0, /*shuffle=*/false, 0);
  EXPECT_EQ(dl.batches_per_epoch(), n / B);
  int crossings = 0;
  auto batches = take(dl, static_cast<int>(dl.batches_per_epoch()));
  for (int64_t k = 0; k < dl.batches_per_epoch(); ++k)
    for (int64_t r = 0; r < B; ++r) {
      const int64_t s = k * B + r;  // unshuffled: samples in order
      for (int64_t t = 0; t < S; ++t) {
        ASSERT_EQ(batches[k].in[r * S + t], f.stream[s * S + t]) << "sample " << s << " t " << t;
        ASSERT_EQ(batches[k].tgt[r * S + t], f.stream[s * S + t + 1]) << "sample " << s << " t " << t;
      }
      for (int64_t d : f.doc_starts) crossings += (d > s * S && d <= s * S + S);
    }
  EXPECT_GT(crossings, 100);  // windows do span document boundaries
}

TEST(Loader, LastSampleUsesLastToken) {
  Fixture f(201, true);
  const int64_t S = 10;
  ASSERT_EQ(f.ds->total_tokens() % S, 1);
  const int64_t n = num_samples(f.ds->total_tokens(), S);
  DataLoader dl(f.ds, {n - 1}, 1, S, 0, false, 0);
  auto b = take(dl, 1);
  EXPECT_EQ(b[0].tgt.back(), f.ds->total_tokens() - 1);
  EXPECT_THROW(DataLoader(f.ds, {n}, 1, S, 0, false, 0), lathe::Error);
}

TEST(Loader, Split) {
  auto s = split_samples(10, 0.2);
  EXPECT_EQ(s.train, (std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6, 7}));
  EXPECT_EQ(s.valid, (std::vector<int64_t>{8, 9}));
  s = split_samples(1000, 0.0);
  EXPECT_EQ(s.train, all_samples(1000));
  EXPECT_TRUE(s.valid.empty());
  s = split_samples(7, 0.5);  // round(3.5) = 4
  EXPECT_EQ(s.valid.size(), 4u);
  EXPECT_EQ(s.train.size(), 3u);
  EXPECT_THROW(split_samples(10, 0.01), lathe::Error);  // valid would be empty
  EXPECT_THROW(split_samples(10, 1.0), lathe::Error);
  EXPECT_THROW(split_samples(10, -0.1), lathe::Error);
  EXPECT_THROW(split_samples(2, 0.9), lathe::Error);  // train would be empty
  EXPECT_THROW(split_samples(0, 0.1), lathe::Error);
}

TEST(Loader, ShuffleIsPermutationPerEpochAndReproducible) {
  Fixture f(3000, true);
  const int64_t S = 8, B = 5;
  const int64_t n = num_samples(f.ds->total_tokens(), S);
  auto ids = split_samples(n, 0.1).train;
  DataLoader a(f.ds, ids, B, S, 1234, true, 0), b(f.ds, ids, B, S, 1234, true, 0), c(f.ds, ids, B, S, 99, true, 0);
  const int64_t bpe = a.batches_per_epoch();
  EXPECT_EQ(bpe, static_cast<int64_t>(ids.size()) / B);
  auto ba = take(a, static_cast<int>(2 * bpe)), bb = take(b, static_cast<int>(2 * bpe)),
       bc = take(c, static_cast<int>(2 * bpe));
  EXPECT_EQ(ba, bb);
  EXPECT_NE(ba, bc);
  const auto valid = split_samples(n, 0.1).valid;
  const std::set<int64_t> valid_set(valid.begin(), valid.end());
  std::vector<int64_t> epoch_samples[2];
  for (int64_t k = 0; k < 2 * bpe; ++k)
    for (int64_t r = 0; r < B; ++r) {
      const int32_t first = ba[k].in[r * S];
      ASSERT_EQ(first % S, 0);
      const int64_t s = first / S;
      for (int64_t t = 0; t < S; ++t) {  // the whole window is that sample's
        ASSERT_EQ(ba[k].in[r * S + t], s * S + t);
        ASSERT_EQ(ba[k].tgt[r * S + t], s * S + t + 1);
      }
      EXPECT_EQ(valid_set.count(s), 0u) << "validation sample " << s << " in training batch";
      epoch_samples[k / bpe].push_back(s);
    }
  for (auto& e : epoch_samples) {
    std::set<int64_t> uniq(e.begin(), e.end());
    EXPECT_EQ(uniq.size(), e.size());  // each sample at most once per epoch
    EXPECT_EQ(uniq.size(), static_cast<size_t>(bpe * B));
  }
  EXPECT_NE(epoch_samples[0], epoch_samples[1]);  // reshuffled each epoch
  // Not in order (a shuffle of ~300 samples that leaves them sorted is practically impossible).
  EXPECT_FALSE(std::is_sorted(epoch_samples[0].begin(), epoch_samples[0].end()));
  // epoch_order is a permutation of the ids.
  auto o = a.epoch_order(3);
  std::sort(o.begin(), o.end());
  EXPECT_EQ(o, ids);
}

TEST(Loader, FullEpochCoversEverySample) {
  Fixture f(241, true);
  const int64_t S = 4, B = 6;  // 60 samples = 10 batches exactly
  const int64_t n = num_samples(f.ds->total_tokens(), S);
  ASSERT_EQ(n, 60);
  DataLoader dl(f.ds, all_samples(n), B, S, 5, true, 2);
  std::map<int64_t, int> count;
  for (auto& b : take(dl, 10))
    for (int64_t r = 0; r < B; ++r) count[b.in[r * S] / S]++;
  EXPECT_EQ(count.size(), 60u);
  for (auto [s, c] : count) EXPECT_EQ(c, 1) << "sample " << s;
  EXPECT_EQ(dl.state().epoch, 1);
  EXPECT_EQ(dl.state().position, 0);
}

TEST(Loader, PrefetchDoesNotChangeBatches) {
  Fixture f(2000, false);
  const int64_t S = 16, B = 3;
  auto ids = all_samples(num_samples(f.ds->total_tokens(), S));
  for (bool shuffle : {false, true}) {
    DataLoader sync(f.ds, ids, B, S, 7, shuffle, 0), pre(f.ds, ids, B, S, 7, shuffle, 3);
    const int n = static_cast<int>(sync.batches_per_epoch() * 3 + 2);  // across epoch boundaries
    EXPECT_EQ(take(sync, n), take(pre, n)) << "shuffle " << shuffle;
    EXPECT_EQ(sync.state().epoch, pre.state().epoch);
    EXPECT_EQ(sync.state().position, pre.state().position);
  }
}

TEST(Loader, StateAndRestore) {
  Fixture f(2000, false);
  const int64_t S = 16, B = 3;
  auto ids = all_samples(num_samples(f.ds->total_tokens(), S));
  for (int prefetch : {0, 3}) {
    DataLoader a(f.ds, ids, B, S, 42, true, prefetch);
    const int64_t bpe = a.batches_per_epoch();
    EXPECT_EQ(a.state().epoch, 0);
    EXPECT_EQ(a.state().position, 0);
    take(a, 5);
    LoaderState st = a.state();  // consumer view, even though the prefetcher ran ahead
    EXPECT_EQ(st.epoch, 0);
    EXPECT_EQ(st.position, 5 * B);
    auto cont = take(a, static_cast<int>(bpe + 4));
    // A fresh loader (as after loading a checkpoint), with the other prefetch setting.
    DataLoader b(f.ds, ids, B, S, 42, true, 3 - prefetch);
    b.restore(st);
    EXPECT_EQ(take(b, static_cast<int>(bpe + 4)), cont);
    // Restoring the same loader rewinds it.
    a.restore(st);
    EXPECT_EQ(a.state().position, st.position);
    EXPECT_EQ(take(a, static_cast<int>(bpe + 4)), cont);
    // Into a later epoch.
    a.restore({2, 2 * B});
    DataLoader c(f.ds, ids, B, S, 42, true, prefetch);
    take(c, static_cast<int>(2 * bpe + 2));
    EXPECT_EQ(c.state().epoch, 2);
    EXPECT_EQ(take(a, 3), take(c, 3));
  }
}

TEST(Loader, Errors) {
  Fixture f(100, false);
  auto ids = all_samples(num_samples(f.ds->total_tokens(), 10));
  EXPECT_THROW(DataLoader(f.ds, ids, 100, 10, 0, false, 0), lathe::Error);  // not one batch
  EXPECT_THROW(DataLoader(f.ds, ids, 0, 10, 0, false, 0), lathe::Error);
  EXPECT_THROW(DataLoader(f.ds, {-1}, 1, 10, 0, false, 0), lathe::Error);
  DataLoader dl(f.ds, ids, 2, 10, 0, false, 1);
  EXPECT_THROW(dl.restore({0, 1000}), lathe::Error);
}

// A resume that changes training.seq_len: the same epoch, as many tokens into it, whole batches,
// never beyond the epoch's samples.
TEST(Loader, RemapSeqLen) {
  auto eq = [](LoaderState a, LoaderState b) { return a.epoch == b.epoch && a.position == b.position; };
  EXPECT_TRUE(eq(remap_seq_len({2, 80}, 64, 256, 2, 41), {2, 20}));  // 5120 tokens either way
  EXPECT_TRUE(eq(remap_seq_len({0, 12}, 64, 256, 2, 41), {0, 2}));   // 768 tokens -> 3 samples -> 1 batch
  EXPECT_TRUE(eq(remap_seq_len({0, 10}, 256, 64, 4, 1000), {0, 40}));  // shorter samples: 4x the count
  EXPECT_TRUE(eq(remap_seq_len({1, 40}, 64, 64, 8, 100), {1, 40}));    // unchanged length
  EXPECT_TRUE(eq(remap_seq_len({0, 400}, 64, 256, 2, 41), {0, 41}));   // clamped: the epoch is over
  EXPECT_THROW(remap_seq_len({0, 1}, 0, 64, 2, 10), lathe::Error);
}
