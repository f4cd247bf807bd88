// The blend-plan cache (data/blend_cache.h) and the loader's blend mode (data/loader.h):
//   * built once, then reused bit-identically; equal to plan_blend (the oracle)
//   * a corrupt, truncated, foreign or out-of-range cache file is refused with the reason and
//     rebuilt, never used; plans of earlier inputs are removed when a new one is written
//   * the inputs hash changes with every input: a prefix rewritten (size or mtime), weight, epochs,
//     seq_len, seed, total
//   * open_blend names the entry of a missing prefix, a dtype mismatch, a dataset without a sample
//   * the loader hands out exactly the plan's samples (read directly as the oracle), the same for
//     one reader of the whole batch and for two data-parallel readers of half the rows each, and
//     continues identically after restore()
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <numeric>

#include "core/error.h"
#include "data/blend_cache.h"
#include "data/loader.h"
#include "io/fs.h"

namespace lathe::data {
namespace {

namespace fs = std::filesystem;

struct TempDir {
  fs::path p;
  TempDir() {
    char tmpl[] = "/tmp/lathe_blend_cache_XXXXXX";
    p = ::mkdtemp(tmpl);
  }
  ~TempDir() { fs::remove_all(p); }
  std::string operator/(const std::string& n) const { return (p / n).string(); }
};

// A dataset of `docs` documents whose token k of document d is (base + d * 7 + k) % 251: every
// sample window identifies where it came from.
void write_dataset(const std::string& prefix, int docs, int len, int base, DType dt = DType::U16) {
  IndexedDatasetWriter w(prefix, dt);
  for (int d = 0; d < docs; ++d) {
    std::vector<int32_t> t(static_cast<size_t>(len + d % 5));
    for (size_t k = 0; k < t.size(); ++k) t[k] = (base + d * 7 + static_cast<int>(k)) % 251;
    w.add_document(t);
  }
  w.finalize();
}

std::vector<BlendSource> synthetic() { return {{"web", 0.6, 700}, {"code", 0.3, 90}, {"books", 0.1, 13, 50.0}}; }

void expect_same(const BlendPlan& a, const BlendPlan& b) {
  EXPECT_EQ(a.dataset, b.dataset);
  EXPECT_EQ(a.sample, b.sample);
  EXPECT_EQ(a.taken, b.taken);
  EXPECT_EQ(a.epochs, b.epochs);
}

TEST(BlendCache, BuiltOnceThenReusedAndEqualToThePlan) {
  TempDir t;
  const auto s = synthetic();
  const BlendPlan oracle = plan_blend(s, 5000, 99);
  const std::string dir = t / "cache";
  CachedPlan a = cached_blend_plan(s, 64, 99, 5000, dir, true);
  EXPECT_EQ(a.status, "built");
  ASSERT_TRUE(fs::exists(a.path)) << a.path;
  EXPECT_EQ(fs::path(a.path).parent_path(), fs::path(dir));
  expect_same(*a.plan, oracle);
  CachedPlan b = cached_blend_plan(s, 64, 99, 5000, dir, true);
  EXPECT_EQ(b.status, "reused");
  EXPECT_EQ(b.path, a.path);
  expect_same(*b.plan, oracle);
  // write = false (another rank, `lathe check`): reads the cache, never writes one.
  const std::string other = t / "other";
  CachedPlan c = cached_blend_plan(s, 64, 99, 5000, other, false);
  EXPECT_EQ(c.status, "planned in memory");
  EXPECT_FALSE(fs::exists(other));
}

TEST(BlendCache, UnusableFilesAreRebuiltNeverUsed) {
  TempDir t;
  const auto s = synthetic();
  const std::string dir = t / "cache";
  const CachedPlan a = cached_blend_plan(s, 64, 5, 3000, dir, true);
  const std::string path = a.path;
  const std::string good = io::read_file(path);
  const uint64_t h = blend_inputs_hash(s, 64, 5, 3000);
  std::string why;
  ASSERT_NE(read_blend_cache(path, h, s, 3000, &why), nullptr) << why;

  auto rewrite = [&](const std::string& bytes) {
    std::ofstream(path, std::ios::binary | std::ios::trunc)
        .write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  };
  struct Case {
    const char* name;
    std::string bytes;
    const char* why;
  };
  std::string flipped = good;
  flipped[good.size() / 2] ^= 0x10;
  std::string magic = good;
  magic[0] = 'X';
  std::vector<Case> cases = {{"truncated", good.substr(0, good.size() - 9), "bytes, expected"},
                             {"empty", "", "bytes, expected"},
                             {"a flipped bit", flipped, "checksum mismatch"},
                             {"bad magic", magic, "bad magic"}};
  for (const auto& c : cases) {
    rewrite(c.bytes);
    EXPECT_EQ(read_blend_cache(path, h, s, 3000, &why), nullptr) << c.name;
    EXPECT_NE(why.find(c.why), std::string::npos) << c.name << ": " << why;
    const CachedPlan r = cached_blend_plan(s, 64, 5, 3000, dir, true);
    EXPECT_EQ(r.status.rfind("rebuilt (the cache was unusable: ", 0), 0u) << c.name << ": " << r.status;
    expect_same(*r.plan, *a.plan);
    EXPECT_EQ(io::read_file(path), good) << c.name << ": the rebuilt file is the original";
  }
  // A valid file of other inputs under this name (copied by hand) is refused by its recorded hash.
  EXPECT_EQ(read_blend_cache(path, h ^ 1, s, 3000, &why), nullptr);
  EXPECT_NE(why.find("other inputs"), std::string::npos) << why;
  // Entries beyond a dataset's samples (the datasets shrank, same hash forged): out of range.
  auto smaller = s;
  smaller[0].samples = 10;
  EXPECT_EQ(read_blend_cache(path, h, smaller, 3000, &why), nullptr);
  EXPECT_NE(why.find("out of range"), std::string::npos) << why;
}

TEST(BlendCache, EveryInputChangesTheHashAndStalePlansAreRemoved) {
  TempDir t;
  const std::string web = t / "web", code = t / "code";
  write_dataset(web, 40, 60, 0);
  write_dataset(code, 20, 60, 100);
  std::vector<BlendSource> s = {{web, 0.7, 50}, {code, 0.3, 25}};
  const uint64_t h0 = blend_inputs_hash(s, 32, 1, 1000);
  EXPECT_EQ(blend_inputs_hash(s, 32, 1, 1000), h0);
  auto changed = [&](auto edit) {
    auto c = s;
    int64_t T = 32, total = 1000;
    uint64_t seed = 1;
    edit(c, T, seed, total);
    return blend_inputs_hash(c, T, seed, total) != h0;
  };
  EXPECT_TRUE(changed([](auto& c, auto&, auto&, auto&) { c[0].weight = 0.70000001; }));
  EXPECT_TRUE(changed([](auto& c, auto&, auto&, auto&) { c[1].max_epochs = 3; }));
  EXPECT_TRUE(changed([](auto& c, auto&, auto&, auto&) { c[1].samples = 24; }));
  EXPECT_TRUE(changed([](auto&, auto& T, auto&, auto&) { T = 33; }));
  EXPECT_TRUE(changed([](auto&, auto&, auto& seed, auto&) { seed = 2; }));
  EXPECT_TRUE(changed([](auto&, auto&, auto&, auto& total) { total = 1001; }));
  EXPECT_TRUE(changed([](auto& c, auto&, auto&, auto&) { std::swap(c[0], c[1]); }));

  const std::string dir = t / "cache";
  const CachedPlan first = cached_blend_plan(s, 32, 1, 1000, dir, true);
  // The prefix rewritten with other documents of the same size: only its mtime moves.
  struct stat before {};
  ASSERT_EQ(::stat((web + ".bin").c_str(), &before), 0);
  write_dataset(web, 40, 60, 3);
  struct timespec times[2] = {before.st_atim, before.st_mtim};
  times[1].tv_sec += 1;  // a filesystem with coarse timestamps still sees the rewrite
  ASSERT_EQ(::utimensat(AT_FDCWD, (web + ".bin").c_str(), times, 0), 0);
  EXPECT_NE(blend_inputs_hash(s, 32, 1, 1000), h0);
  const CachedPlan second = cached_blend_plan(s, 32, 1, 1000, dir, true);
  EXPECT_EQ(second.status, "built");
  EXPECT_NE(second.path, first.path);
  EXPECT_FALSE(fs::exists(first.path)) << "the plan of the earlier inputs is removed";
  EXPECT_TRUE(fs::exists(second.path));
  // A prefix that grows (more documents) changes the hash through its sizes.
  const uint64_t h1 = blend_inputs_hash(s, 32, 1, 1000);
  write_dataset(code, 30, 60, 100);
  EXPECT_NE(blend_inputs_hash(s, 32, 1, 1000), h1);
  EXPECT_NE(cached_blend_plan(s, 32, 1, 1000, dir, true).path, second.path);
}

TEST(BlendCache, OpenBlendNamesTheEntry) {
  TempDir t;
  write_dataset(t / "a", 10, 50, 0);
  write_dataset(t / "b32", 10, 50, 0, DType::I32);
  write_dataset(t / "tiny", 1, 3, 0);
  auto err = [&](std::vector<BlendEntryInput> in) {
    try {
      open_blend(in, 16);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  std::string e = err({{t / "a", 1, 0}, {t / "missing", 1, 0}});
  EXPECT_NE(e.find("data.blend[1].prefix " + (t / "missing")), std::string::npos) << e;
  e = err({{t / "a", 1, 0}, {t / "b32", 1, 0}});
  EXPECT_NE(e.find("data.blend[1].prefix"), std::string::npos) << e;
  EXPECT_NE(e.find("token dtype"), std::string::npos) << e;
  e = err({{t / "tiny", 1, 0}});
  EXPECT_NE(e.find("data.blend[0].prefix"), std::string::npos) << e;
  EXPECT_NE(e.find("no sample"), std::string::npos) << e;
  const OpenedBlend ob = open_blend({{t / "a", 2, 0}}, 16);
  EXPECT_EQ(ob.sources[0].samples, num_samples(ob.datasets[0]->total_tokens(), 16));
}

TEST(BlendCache, SequencesEndingWithCountsTheLastToken) {
  TempDir t;
  IndexedDatasetWriter w(t / "eod", DType::U16);
  for (int d = 0; d < 100; ++d) {  // documents 0, 3, 6, ... end with the EOD id 250
    std::vector<int32_t> doc = {1, 2, 3, d % 3 == 0 ? 250 : 4};
    w.add_document(doc);
  }
  w.finalize();
  IndexedDataset ds(t / "eod");
  EXPECT_EQ(sequences_ending_with(ds, 250, 1000), std::make_pair(int64_t{34}, int64_t{100}));
  EXPECT_EQ(sequences_ending_with(ds, 4, 1000), std::make_pair(int64_t{66}, int64_t{100}));
  EXPECT_EQ(sequences_ending_with(ds, 7, 1000).first, 0);
  const auto some = sequences_ending_with(ds, 250, 10);  // evenly spaced: 0, 11, 22, ..., 99
  EXPECT_EQ(some.second, 10);
  EXPECT_EQ(some.first, 4);  // 0, 33, 66, 99
}

TEST(BlendLoader, HandsOutThePlanTheSameForAnyRowSplitAndAfterRestore) {
  TempDir t;
  write_dataset(t / "web", 30, 70, 0);
  write_dataset(t / "code", 12, 40, 100);
  write_dataset(t / "books", 4, 30, 200);
  const OpenedBlend ob = open_blend({{t / "web", 0.5, 0}, {t / "code", 0.3, 0}, {t / "books", 0.2, 0}}, 16);
  const int64_t G = 6, T = 16, steps = 40;
  auto plan = std::make_shared<const BlendPlan>(plan_blend(ob.sources, steps * G, 3));
  ASSERT_GT(plan->epochs[2], 1.0) << "books repeats: the test covers a second epoch";
  DataLoader whole(ob.datasets, plan, G, T, 2);
  DataLoader r0(ob.datasets, plan, G, T, 0, 0, G / 2), r1(ob.datasets, plan, G, T, 3, G / 2, G / 2);
  std::vector<int32_t> in(G * T), tg(G * T), a(G * T / 2), b(G * T / 2), ta(G * T / 2), tb(G * T / 2);
  std::vector<int32_t> window(T + 1);
  for (int64_t k = 0; k < steps; ++k) {
    whole.next(in.data(), tg.data());
    r0.next(a.data(), ta.data());
    r1.next(b.data(), tb.data());
    for (int64_t r = 0; r < G; ++r) {  // oracle: the plan's sample read directly
      const size_t g = static_cast<size_t>(k * G + r);
      ob.datasets[plan->dataset[g]]->read_global(plan->sample[g] * T, T + 1, window.data());
      ASSERT_TRUE(std::equal(window.begin(), window.begin() + T, in.begin() + r * T)) << "batch " << k << " row " << r;
      ASSERT_TRUE(std::equal(window.begin() + 1, window.end(), tg.begin() + r * T)) << "batch " << k << " row " << r;
    }
    ASSERT_TRUE(std::equal(a.begin(), a.end(), in.begin())) << "rank 0 rows, batch " << k;
    ASSERT_TRUE(std::equal(b.begin(), b.end(), in.begin() + G * T / 2)) << "rank 1 rows, batch " << k;
    EXPECT_EQ(whole.state().epoch, 0);
    EXPECT_EQ(whole.state().position, (k + 1) * G);
    EXPECT_EQ(r1.state().position, (k + 1) * G) << "the state counts whole batches, whatever the rows";
  }
  // Past the plan: an error naming the plan's size, not a wrap-around.
  try {
    whole.next(in.data(), tg.data());
    ADD_FAILURE() << "no error past the end of the plan";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("the blend plan holds 240 samples"), std::string::npos) << e.what();
  }
  // Restore mid-run continues exactly.
  DataLoader again(ob.datasets, plan, G, T, 2);
  again.restore({0, 17 * G});
  again.next(in.data(), tg.data());
  for (int64_t r = 0; r < G; ++r) {
    const size_t g = static_cast<size_t>(17 * G + r);
    ob.datasets[plan->dataset[g]]->read_global(plan->sample[g] * T, T + 1, window.data());
    ASSERT_TRUE(std::equal(window.begin(), window.begin() + T, in.begin() + r * T)) << "row " << r;
  }
  EXPECT_THROW(again.restore({1, 0}), Error);
  EXPECT_THROW(again.restore({0, steps * G + 1}), Error);
  // The data position a checkpoint records.
  const auto taken = blend_taken_before(*plan, 60);
  EXPECT_EQ(std::accumulate(taken.begin(), taken.end(), int64_t{0}), 60);
  EXPECT_EQ(blend_taken_before(*plan, steps * G), plan->taken);
  EXPECT_EQ(blend_prefix_hash(*plan, 60), blend_prefix_hash(*plan, 60));
  EXPECT_NE(blend_prefix_hash(*plan, 60), blend_prefix_hash(*plan, 66));
  auto other = std::make_shared<const BlendPlan>(plan_blend(ob.sources, steps * G, 4));
  EXPECT_NE(blend_prefix_hash(*plan, 60), blend_prefix_hash(*other, 60)) << "another seed, another sequence";
}

}  // namespace
}  // namespace lathe::data
