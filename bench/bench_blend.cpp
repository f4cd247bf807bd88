// Blend planning time (issue 11): 1,000 synthetic prefixes of 10^5 documents each (10^8 documents in
// total). Planning reads only each prefix's number of samples (its tokens / seq_len, from the .idx
// sizes), so the prefixes are synthesized as sample counts: 10^5 documents of a mean 700 tokens at
// seq_len 2048 give ~34,000 samples per prefix (varied +-50%), weights drawn from a skewed
// distribution. For each run length (samples = steps x global batch) it prints the planning time,
// the plan cache's write and verified read (data/blend_cache.h), and the worst share error.
//
//   build/bench/bench_blend [--prefixes 1000] [--samples 1000000,10000000] [--seed 1]
#include <fmt/format.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <string>
#include <vector>

#include "core/timer.h"
#include "data/blend.h"
#include "data/blend_cache.h"
#include "io/xxh64.h"

using namespace lathe;

namespace {
// CPU time of the process (all threads): steadier than wall time on a shared machine.
double cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}
}  // namespace

int main(int argc, char** argv) {
  int64_t D = 1000;
  std::vector<int64_t> totals = {1'000'000, 10'000'000};
  uint64_t seed = 1;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    if (k == "--prefixes") D = std::atoll(argv[i + 1]);
    if (k == "--seed") seed = std::strtoull(argv[i + 1], nullptr, 10);
    if (k == "--samples") {
      totals.clear();
      for (const char* c = argv[i + 1]; *c;) {
        char* end = nullptr;
        totals.push_back(std::strtoll(c, &end, 10));
        c = *end == ',' ? end + 1 : end;
      }
    }
  }
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  auto rnd = [&] {  // xorshift, uniform in [0, 1)
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    return static_cast<double>(x >> 11) / 9007199254740992.0;
  };
  const int64_t docs_per_prefix = 100'000, mean_doc_tokens = 700, seq_len = 2048;
  std::vector<data::BlendSource> s;
  int64_t all_samples = 0;
  for (int64_t i = 0; i < D; ++i) {
    const double tokens = static_cast<double>(docs_per_prefix * mean_doc_tokens) * (0.5 + rnd());
    const int64_t samples = static_cast<int64_t>(tokens / seq_len);
    s.push_back({fmt::format("synthetic/prefix_{:04d}", i), std::pow(rnd(), 3) + 1e-3, samples, 0});
    all_samples += samples;
  }
  double wsum = 0;
  for (const auto& e : s) wsum += e.weight;
  fmt::print("{} prefixes x {} documents ({} documents), {} samples of seq_len {} available\n", D, docs_per_prefix,
             D * docs_per_prefix, all_samples, seq_len);
  const std::string dir = (std::filesystem::temp_directory_path() / "lathe_bench_blend").string();
  std::filesystem::remove_all(dir);
  for (const int64_t total : totals) {
    double t0 = now_seconds();
    const double c0 = cpu_seconds();
    const data::BlendPlan p = data::plan_blend(s, total, seed);
    const double plan_s = now_seconds() - t0, plan_cpu = cpu_seconds() - c0;
    double worst = 0;  // largest |taken - share x total| in samples
    for (size_t i = 0; i < s.size(); ++i)
      worst =
          std::max(worst, std::fabs(static_cast<double>(p.taken[i]) - s[i].weight / wsum * static_cast<double>(total)));
    const uint64_t h = data::blend_inputs_hash(s, seq_len, seed, total);
    const std::string path = data::blend_cache_path(dir, h);
    std::filesystem::create_directories(dir);
    t0 = now_seconds();
    data::write_blend_cache(path, h, p);
    const double write_s = now_seconds() - t0;
    t0 = now_seconds();
    std::string why;
    const auto back = data::read_blend_cache(path, h, s, total, &why);
    const double read_s = now_seconds() - t0;
    if (!back || back->sample != p.sample) {
      fmt::print("error: the cache did not read back: {}\n", why);
      return 1;
    }
    fmt::print(
        "samples {:>11}: plan {:.3f} s ({:.0f} ns/sample; process CPU {:.3f} s) | cache {:.0f} MB written (fsync) "
        "{:.3f} s, read + "
        "verified {:.3f} s | worst share error {:.2f} samples | plan xxh64 {}\n",
        total, plan_s, plan_s / static_cast<double>(total) * 1e9, plan_cpu,
        static_cast<double>(std::filesystem::file_size(path)) / 1e6, write_s, read_s, worst,
        io::hex64(data::blend_prefix_hash(p, total)));
    std::filesystem::remove(path);
  }
  std::filesystem::remove_all(dir);
  return 0;
}
