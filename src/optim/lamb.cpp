// LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning"), as NVIDIA apex FusedLAMB
// computes it (adam_w_mode, grad_averaging, no global grad-norm pre-scaling), per parameter tensor
// (one ParamRange):
//   m = beta1*m + (1-beta1)*g;  v = beta2*v + (1-beta2)*g*g
//   u = (m/(1-beta1^t)) / (sqrt(v/(1-beta2^t)) + eps) + wd*p        (wd only if decay)
//   trust = ||p|| / ||u||   (1 if either norm is 0)
//   p -= lr * trust * u
// Unlike apex (which uses trust = 1 for tensors without weight decay unless use_nvlamb), the trust
// ratio applies to every tensor. Norms are accumulated in double per fixed chunk and summed in
// chunk order, so results do not depend on the thread count.
#include <cmath>
#include <tuple>
#include <unordered_map>

#include "core/error.h"

#include "optim/chunks.h"
#include "optim/optimizer.h"

namespace lathe::optim {
namespace {

class Lamb final : public Optimizer {
 public:
  Lamb(const OptimConfig& cfg, size_t n) : cfg_(cfg), n_(n), m_(n), v_(n) {}

  void step(float* params, const float* grads, std::span<const ParamRange> ranges, double lr, int64_t step,
            float grad_scale) override {
    check_step_args("lamb", n_, ranges, step);
    const float inv_bc1 = static_cast<float>(1.0 / (1.0 - std::pow(cfg_.beta1, static_cast<double>(step))));
    const float inv_bc2 = static_cast<float>(1.0 / (1.0 - std::pow(cfg_.beta2, static_cast<double>(step))));
    const float b1 = static_cast<float>(cfg_.beta1), one_minus_b1 = static_cast<float>(1.0 - cfg_.beta1);
    const float b2 = static_cast<float>(cfg_.beta2), one_minus_b2 = static_cast<float>(1.0 - cfg_.beta2);
    const float eps = static_cast<float>(cfg_.eps);
    const float wd = static_cast<float>(cfg_.weight_decay);
    const std::vector<Chunk> chunks = make_chunks(ranges);
    const int64_t nchunks = static_cast<int64_t>(chunks.size());
    std::vector<double> psq(chunks.size()), usq(chunks.size());
    float* m = m_.data();
    float* v = v_.data();
    // u from the (already updated) moments and the old parameters; used by both passes, so
    // the update applies exactly the u whose norm was measured.
    auto update = [&](size_t i, float w) {
      return (m[i] * inv_bc1) / (std::sqrt(v[i] * inv_bc2) + eps) + w * params[i];
    };

    // Pass 1: moments, and ||p||^2, ||u||^2 per chunk.
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < nchunks; ++c) {
      const Chunk ch = chunks[static_cast<size_t>(c)];
      const float w = ranges[ch.range].decay ? wd : 0.0f;
      double ps = 0.0, us = 0.0;
#pragma omp simd reduction(+ : ps, us)
      for (size_t i = ch.begin; i < ch.end; ++i) {
        const float g = grads[i] * grad_scale;  // x * 1.0f == x exactly
        m[i] = m[i] * b1 + g * one_minus_b1;
        v[i] = v[i] * b2 + g * g * one_minus_b2;
        const float u = update(i, w);
        ps += static_cast<double>(params[i]) * params[i];
        us += static_cast<double>(u) * u;
      }
      psq[static_cast<size_t>(c)] = ps;
      usq[static_cast<size_t>(c)] = us;
    }

    // Per-range norms: the range's chunks summed in flat order. Under ZeRO the chunks of every rank
    // (gather_) are summed per tensor in the same order, then looked up by tensor id.
    std::vector<double> pn(ranges.size(), 0.0), un(ranges.size(), 0.0);
    if (gather_) {
      std::vector<ChunkSums> local(chunks.size());
      for (size_t c = 0; c < chunks.size(); ++c) {
        LATHE_CHECK(ranges[chunks[c].range].tensor >= 0, "lamb: range {} has no tensor id (needed under ZeRO)",
                    chunks[c].range);
        local[c] = {ranges[chunks[c].range].tensor, psq[c], usq[c]};
      }
      std::unordered_map<int64_t, std::pair<double, double>> total;
      for (const ChunkSums& cs : gather_(local)) {
        auto& t = total[cs.tensor];
        t.first += cs.p;
        t.second += cs.u;
      }
      for (size_t r = 0; r < ranges.size(); ++r) std::tie(pn[r], un[r]) = total.at(ranges[r].tensor);
    } else {
      for (size_t c = 0; c < chunks.size(); ++c) {
        pn[chunks[c].range] += psq[c];
        un[chunks[c].range] += usq[c];
      }
    }
    std::vector<float> scale(ranges.size());
    for (size_t r = 0; r < ranges.size(); ++r) {
      const double p = std::sqrt(pn[r]), u = std::sqrt(un[r]);
      const double trust = (p > 0.0 && u > 0.0) ? p / u : 1.0;
      scale[r] = static_cast<float>(-lr * trust);
    }

    // Pass 2: apply.
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < nchunks; ++c) {
      const Chunk ch = chunks[static_cast<size_t>(c)];
      const float w = ranges[ch.range].decay ? wd : 0.0f;
      const float s = scale[ch.range];
#pragma omp simd
      for (size_t i = ch.begin; i < ch.end; ++i) params[i] += s * update(i, w);
    }
  }

  std::vector<std::pair<std::string, Buffer<float>*>> state_buffers() override {
    return {{"exp_avg", &m_}, {"exp_avg_sq", &v_}};
  }
  void set_chunk_sums_gather(ChunkSumsGather g) override { gather_ = std::move(g); }

 private:
  ChunkSumsGather gather_;
  OptimConfig cfg_;
  size_t n_;
  Buffer<float> m_, v_;
};

}  // namespace

std::unique_ptr<Optimizer> make_lamb(const OptimConfig& cfg, size_t num_params) {
  return std::make_unique<Lamb>(cfg, num_params);
}

}  // namespace lathe::optim
