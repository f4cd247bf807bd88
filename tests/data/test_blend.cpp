// Blend planning (data/blend.h): shares follow the weights at every prefix of the plan (within 2
// samples per dataset: the bound data/blend.h states for Sainte-Lague order), datasets interleave, each dataset's samples
// are a permutation per epoch, the plan is deterministic for a seed and changes with it, caps and
// bad weights are errors naming the dataset; 1,000 datasets plan fast.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <set>

#include <fmt/format.h>

#include "core/error.h"
#include "core/stop.h"
#include "data/blend.h"

namespace lathe::data {
namespace {

TEST(Feistel, IsAPermutationForOddSizes) {
  for (int64_t n : {1, 2, 3, 7, 31, 64, 1000, 4097}) {
    FeistelPermutation p(n, 42);
    std::vector<char> seen(static_cast<size_t>(n), 0);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t v = p(i);
      ASSERT_TRUE(v >= 0 && v < n) << n;
      ASSERT_FALSE(seen[static_cast<size_t>(v)]) << "n " << n << " value " << v << " twice";
      seen[static_cast<size_t>(v)] = 1;
    }
    if (n >= 31) {  // not the identity
      int fixed = 0;
      for (int64_t i = 0; i < n; ++i) fixed += p(i) == i;
      EXPECT_LT(fixed, n / 4) << n;
    }
  }
}

TEST(Blend, SharesFollowTheWeightsAtEveryPrefix) {
  std::vector<BlendSource> s = {{"web", 0.7, 5000}, {"code", 0.2, 300}, {"books", 0.1, 100}};
  const int64_t N = 20000;
  const BlendPlan p = plan_blend(s, N, 1234);
  std::vector<int64_t> count(3, 0);
  for (int64_t k = 0; k < N; ++k) {
    ++count[p.dataset[static_cast<size_t>(k)]];
    for (size_t i = 0; i < 3; ++i)  // exact share of the first k+1 samples, within 2 samples
      ASSERT_LE(std::fabs(static_cast<double>(count[i]) - s[i].weight * static_cast<double>(k + 1)), 2.0)
          << "dataset " << i << " after " << k + 1 << " samples";
  }
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_NEAR(static_cast<double>(count[i]) / N, s[i].weight, 0.01);
    EXPECT_EQ(p.taken[i], count[i]);
  }
  // Interleaved: the first 10 samples already hold every dataset.
  std::set<uint32_t> first(p.dataset.begin(), p.dataset.begin() + 10);
  EXPECT_EQ(first.size(), 3u);
  // Each epoch of a dataset is a permutation of its samples ("books": 2000 samples = 20 epochs).
  std::vector<int64_t> books;
  for (int64_t k = 0; k < N; ++k)
    if (p.dataset[static_cast<size_t>(k)] == 2) books.push_back(p.sample[static_cast<size_t>(k)]);
  for (size_t e = 0; e + 100 <= books.size(); e += 100) {
    std::set<int64_t> epoch(books.begin() + static_cast<std::ptrdiff_t>(e),
                            books.begin() + static_cast<std::ptrdiff_t>(e + 100));
    EXPECT_EQ(epoch.size(), 100u) << "epoch " << e / 100;
  }
  EXPECT_NE(std::vector<int64_t>(books.begin(), books.begin() + 100),
            std::vector<int64_t>(books.begin() + 100, books.begin() + 200));  // reshuffled per epoch
}

TEST(Blend, RandomBlendsStayWithinTwoSamplesOfTheirShare) {
  uint64_t x = 12345;
  auto rnd = [&] {  // xorshift, uniform in [0, 1)
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    return static_cast<double>(x >> 11) / 9007199254740992.0;
  };
  double worst = 0;
  for (int trial = 0; trial < 20; ++trial) {
    const int D = 2 + static_cast<int>(rnd() * 49);
    std::vector<BlendSource> s;
    double wsum = 0;
    for (int i = 0; i < D; ++i) {
      s.push_back({fmt::format("d{}", i), std::pow(rnd(), 3) + 1e-3, 1000});
      wsum += s.back().weight;
    }
    const BlendPlan p = plan_blend(s, 3000, 1);
    std::vector<int64_t> count(static_cast<size_t>(D), 0);
    for (size_t k = 0; k < 3000; ++k) {
      ++count[p.dataset[k]];
      for (int i = 0; i < D; ++i)
        worst = std::max(worst, std::fabs(static_cast<double>(count[static_cast<size_t>(i)]) -
                                          s[static_cast<size_t>(i)].weight / wsum * static_cast<double>(k + 1)));
    }
  }
  std::printf("worst deviation from the exact share at any prefix: %.3f samples\n", worst);
  EXPECT_LE(worst, 2.0);
}

TEST(Blend, DeterministicForASeedAndDifferentForAnother) {
  std::vector<BlendSource> s = {{"a", 1, 777}, {"b", 3, 1000}};
  const BlendPlan p1 = plan_blend(s, 5000, 7), p2 = plan_blend(s, 5000, 7), p3 = plan_blend(s, 5000, 8);
  EXPECT_EQ(p1.dataset, p2.dataset);
  EXPECT_EQ(p1.sample, p2.sample);
  EXPECT_EQ(p1.dataset, p3.dataset);  // the interleaving depends on the weights only
  EXPECT_NE(p1.sample, p3.sample);    // the order within each dataset on the seed
  // A longer run extends the plan: its first 5000 samples are the same.
  const BlendPlan longer = plan_blend(s, 9000, 7);
  EXPECT_TRUE(std::equal(p1.sample.begin(), p1.sample.end(), longer.sample.begin()));
}

TEST(Blend, ErrorsNameTheDataset) {
  auto err = [](std::vector<BlendSource> s, int64_t n) {
    try {
      plan_blend(s, n, 1);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(err({{"data/web", 0.0, 10}}, 5).find("data/web: weight 0"), std::string::npos);
  EXPECT_NE(err({{"data/web", -1, 10}}, 5).find("data/web"), std::string::npos);
  EXPECT_NE(err({{"data/tiny", 1, 0}}, 5).find("data/tiny: no sample"), std::string::npos);
  const std::string cap = err({{"data/web", 1, 1000}, {"data/books", 1, 10, 2.0}}, 100);
  EXPECT_NE(cap.find("data/books"), std::string::npos) << cap;
  EXPECT_NE(cap.find("5.00 epochs"), std::string::npos) << cap;
  EXPECT_EQ(err({{"data/web", 1, 1000}, {"data/books", 1, 10, 5.0}}, 100), "");  // exactly at the cap
}

TEST(Blend, HugeWeightsDoNotOverflowTheirSum) {
  // Issue 23 S5: 1e308 + 1e308 = inf made every due time inf: one dataset took every sample.
  std::vector<BlendSource> s = {{"a", 1e308, 100}, {"b", 1e308, 100}, {"c", 0.5e308, 100}};
  const BlendPlan p = plan_blend(s, 1000, 3);
  EXPECT_EQ(p.taken, (std::vector<int64_t>{400, 400, 200}));
  const std::vector<double> share = blend_shares(s);
  EXPECT_DOUBLE_EQ(share[0], 0.4);
  EXPECT_DOUBLE_EQ(share[2], 0.2);
  // Finite sums keep the plan of earlier versions exactly: the same as weights 2, 2, 1.
  std::vector<BlendSource> small = {{"a", 2, 100}, {"b", 2, 100}, {"c", 1, 100}};
  EXPECT_EQ(plan_blend(small, 1000, 3).dataset, p.dataset);
}

TEST(Blend, StopRequestInterruptsPlanning) {
  // Issue 23 H3: a SIGINT during planning (the stop function) ends it with lathe::Interrupted.
  std::vector<BlendSource> s = {{"a", 1, 100}, {"b", 1, 100}};
  int polls = 0;
  try {
    plan_blend(s, int64_t{1} << 22, 1, [&] { return ++polls >= 2; });
    ADD_FAILURE() << "planning ignored the stop request";
  } catch (const Interrupted& e) {
    EXPECT_EQ(e.exit_code(), 75);
    EXPECT_NE(std::string(e.what()).find("planning stopped by a signal"), std::string::npos) << e.what();
  }
  EXPECT_EQ(polls, 2);
}

TEST(Blend, AThousandDatasetsPlanFast) {
  std::vector<BlendSource> s;
  for (int i = 0; i < 1000; ++i) s.push_back({fmt::format("d{}", i), 1.0 + i % 7, 100000 + i});
  const auto t0 = std::chrono::steady_clock::now();
  const BlendPlan p = plan_blend(s, 2'000'000, 3);
  const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("1,000 datasets, 2M samples planned in %.2f s\n", sec);
  EXPECT_LT(sec, 20.0);  // ~0.3 s measured; generous for sanitizer and loaded machines
  EXPECT_EQ(p.dataset.size(), 2'000'000u);
}

}  // namespace
}  // namespace lathe::data
