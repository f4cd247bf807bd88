#include "data/blend.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <functional>

#include "core/error.h"
#include "core/stop.h"

namespace lathe::data {

namespace {
uint64_t splitmix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
}  // namespace

FeistelPermutation::FeistelPermutation(int64_t n, uint64_t key) : n_(n) {
  LATHE_CHECK(n >= 1, "FeistelPermutation of {} elements", n);
  int bits = 2;
  while ((int64_t{1} << bits) < n) ++bits;
  if (bits % 2) ++bits;  // two equal halves
  half_bits_ = bits / 2;
  mask_ = (uint64_t{1} << half_bits_) - 1;
  for (int r = 0; r < 4; ++r) keys_[r] = splitmix(key * 4 + static_cast<uint64_t>(r) + 1);
}

uint64_t FeistelPermutation::round(uint64_t x, int r) const { return splitmix(x ^ keys_[r]) & mask_; }

int64_t FeistelPermutation::operator()(int64_t i) const {
  // A bijection on [0, 4^half_bits) applied until the value falls inside [0, n): cycle walking
  // keeps it a bijection on [0, n) (the domain is < 4n, so < 4 steps on average).
  uint64_t x = static_cast<uint64_t>(i);
  do {
    uint64_t l = x >> half_bits_, r = x & mask_;
    for (int k = 0; k < 4; ++k) {
      const uint64_t t = l ^ round(r, k);
      l = r;
      r = t;
    }
    x = (l << half_bits_) | r;
  } while (x >= static_cast<uint64_t>(n_));
  return static_cast<int64_t>(x);
}

std::vector<double> blend_shares(const std::vector<BlendSource>& sources) {
  double wmax = 0;
  for (const auto& s : sources) wmax = std::max(wmax, s.weight);
  std::vector<double> share(sources.size(), 0.0);
  if (!(wmax > 0) || !std::isfinite(wmax)) return share;
  double sum = 0;  // of weights <= 1: at most the number of sources
  for (const auto& s : sources) sum += s.weight / wmax;
  for (size_t i = 0; i < sources.size(); ++i) share[i] = sources[i].weight / wmax / sum;
  return share;
}

BlendPlan plan_blend(const std::vector<BlendSource>& sources, int64_t total, uint64_t seed, const StopFn& stop) {
  LATHE_CHECK(!sources.empty(), "data.blend: no datasets");
  LATHE_CHECK(sources.size() < (uint64_t{1} << 32), "data.blend: {} datasets", sources.size());
  LATHE_CHECK(total >= 0, "data.blend: {} samples", total);
  for (const auto& s : sources) {
    LATHE_CHECK(std::isfinite(s.weight) && s.weight > 0, "data.blend: {}: weight {} must be a positive number", s.name,
                s.weight);
    LATHE_CHECK(s.samples >= 1, "data.blend: {}: no sample of seq_len tokens (the dataset is too small)", s.name);
    LATHE_CHECK(std::isfinite(s.max_epochs) && s.max_epochs >= 0, "data.blend: {}: epochs {} must be >= 0", s.name,
                s.max_epochs);
  }
  constexpr int64_t kChunk = int64_t{1} << 20;  // samples between two polls of `stop`
  auto poll = [&](int64_t done, const char* pass) {
    if (stop && stop())
      throw Interrupted(fmt::format("data.blend: planning stopped by a signal at sample {} of {} ({}); nothing was "
                                    "written (the blend-plan cache included)",
                                    done, total, pass),
                        kExitStopped);
  };
  const size_t D = sources.size();
  BlendPlan p;
  p.dataset.resize(static_cast<size_t>(total));
  p.sample.resize(static_cast<size_t>(total));
  p.taken.assign(D, 0);
  // Due-time steps 1 / share. A sum of weights that overflows (1e308 + 1e308) takes the shares of
  // the weights divided by the largest; a finite one keeps wsum / weight, bit for bit, so plans
  // and checkpoints of earlier runs stay valid.
  double wsum = 0;
  for (const auto& s : sources) wsum += s.weight;
  const std::vector<double> share = blend_shares(sources);
  std::vector<double> inv(D);
  for (size_t i = 0; i < D; ++i) inv[i] = std::isfinite(wsum) ? wsum / sources[i].weight : 1.0 / share[i];
  // (due time, source): smallest first, ties to the lower source index. Keys are distinct (the
  // index breaks ties), so the order of the samples is fixed by the keys, whatever the heap does.
  // A hand-written binary min-heap whose top is replaced in place and sifted down: one pass over
  // log2(D) levels per sample instead of std::priority_queue's pop + push (2x faster at D = 1000).
  using Entry = std::pair<double, uint32_t>;
  std::vector<Entry> heap;
  heap.reserve(D);
  for (size_t i = 0; i < D; ++i) heap.push_back({0.5 * inv[i], static_cast<uint32_t>(i)});
  std::make_heap(heap.begin(), heap.end(), std::greater<Entry>());
  auto sift_down = [&heap, D]() {
    size_t j = 0;
    const Entry x = heap[0];
    for (;;) {
      size_t c = 2 * j + 1;
      if (c >= D) break;
      if (c + 1 < D && heap[c + 1] < heap[c]) ++c;
      if (!(heap[c] < x)) break;
      heap[j] = heap[c];
      j = c;
    }
    heap[j] = x;
  };
  // Pass 1 (sequential: each choice depends on the previous ones): the dataset of every sample, and
  // its index t within that dataset's stream (kept in p.sample until pass 2).
  for (int64_t k = 0; k < total; ++k) {
    if (k % kChunk == 0) poll(k, "choosing datasets");
    const uint32_t i = heap[0].second;
    const int64_t t = p.taken[i]++;
    heap[0].first = (static_cast<double>(t + 1) + 0.5) * inv[i];
    sift_down();
    p.dataset[static_cast<size_t>(k)] = i;
    p.sample[static_cast<size_t>(k)] = t;
  }
  // Pass 2 (independent per sample, so in parallel; the same values as a sequential loop): stream
  // index t of dataset i is sample perm_e(t mod n) of epoch e = t / n. Each thread keeps one
  // permutation per dataset, rebuilt when that dataset's epoch changes.
  // In blocks of 16 chunks, `stop` polled between them.
  for (int64_t k0 = 0; k0 < total; k0 += 16 * kChunk) {
    poll(k0, "permuting samples");
    const int64_t k1 = std::min(total, k0 + 16 * kChunk);
#pragma omp parallel
    {
      std::vector<FeistelPermutation> perm;
      std::vector<int64_t> perm_epoch(D, -1);
      perm.reserve(D);
      for (size_t i = 0; i < D; ++i) perm.emplace_back(sources[i].samples, 0);
#pragma omp for schedule(static)
      for (int64_t k = k0; k < k1; ++k) {
        const uint32_t i = p.dataset[static_cast<size_t>(k)];
        const int64_t t = p.sample[static_cast<size_t>(k)], n = sources[i].samples, epoch = t / n;
        if (epoch != perm_epoch[i]) {
          perm[i] = FeistelPermutation(
              n, splitmix(seed ^ splitmix((static_cast<uint64_t>(i) << 32) ^ static_cast<uint64_t>(epoch))));
          perm_epoch[i] = epoch;
        }
        p.sample[static_cast<size_t>(k)] = perm[i](t % n);
      }
    }
  }
  p.epochs.resize(D);
  for (size_t i = 0; i < D; ++i) {
    p.epochs[i] = static_cast<double>(p.taken[i]) / static_cast<double>(sources[i].samples);
    LATHE_CHECK(sources[i].max_epochs == 0 || p.epochs[i] <= sources[i].max_epochs + 1e-12,
                "data.blend: {}: the run needs {} samples from it = {:.2f} epochs of its {} samples, beyond its cap "
                "epochs: {} (raise the cap, lower its weight, or shorten the run)",
                sources[i].name, p.taken[i], p.epochs[i], sources[i].samples, sources[i].max_epochs);
  }
  return p;
}

}  // namespace lathe::data
