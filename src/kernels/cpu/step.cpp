// The CPU training-step ops (declarations and formulas: kernels/cpu/step.h).
#include "kernels/cpu/step.h"

#include <cmath>
#include <tuple>
#include <unordered_map>

#include "core/error.h"

namespace lathe::cpu {

void adamw_step(float* params, const float* grads, float* m, float* v, std::span<const StepRange> ranges,
                const StepHyper& hyper, double lr, int64_t step, float grad_scale) {
  const double bc1 = 1.0 - std::pow(hyper.beta1, static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(hyper.beta2, static_cast<double>(step));
  const float decay_mul = static_cast<float>(1.0 - lr * hyper.weight_decay);
  const float b1 = static_cast<float>(hyper.beta1), one_minus_b1 = static_cast<float>(1.0 - hyper.beta1);
  const float b2 = static_cast<float>(hyper.beta2), one_minus_b2 = static_cast<float>(1.0 - hyper.beta2);
  const float neg_step_size = static_cast<float>(-(lr / bc1));
  const float bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  const float eps = static_cast<float>(hyper.eps);
  const std::vector<StepChunk> chunks = make_step_chunks(ranges);
  const int64_t nchunks = static_cast<int64_t>(chunks.size());
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < nchunks; ++c) {
    const StepChunk ch = chunks[static_cast<size_t>(c)];
    const float dm = ranges[ch.range].decay ? decay_mul : 1.0f;
#pragma omp simd
    for (size_t i = ch.begin; i < ch.end; ++i) {
      const float g = grads[i] * grad_scale;  // x * 1.0f == x exactly
      const float p = params[i] * dm;
      const float mi = m[i] * b1 + g * one_minus_b1;
      const float vi = v[i] * b2 + g * g * one_minus_b2;
      m[i] = mi;
      v[i] = vi;
      const float denom = std::sqrt(vi) / bc2_sqrt + eps;
      params[i] = p + neg_step_size * (mi / denom);
    }
  }
}

void lamb_step(float* params, const float* grads, float* m, float* v, std::span<const StepRange> ranges,
               const StepHyper& hyper, double lr, int64_t step, float grad_scale, const StepChunkSumsGather& gather) {
  const float inv_bc1 = static_cast<float>(1.0 / (1.0 - std::pow(hyper.beta1, static_cast<double>(step))));
  const float inv_bc2 = static_cast<float>(1.0 / (1.0 - std::pow(hyper.beta2, static_cast<double>(step))));
  const float b1 = static_cast<float>(hyper.beta1), one_minus_b1 = static_cast<float>(1.0 - hyper.beta1);
  const float b2 = static_cast<float>(hyper.beta2), one_minus_b2 = static_cast<float>(1.0 - hyper.beta2);
  const float eps = static_cast<float>(hyper.eps);
  const float wd = static_cast<float>(hyper.weight_decay);
  const std::vector<StepChunk> chunks = make_step_chunks(ranges);
  const int64_t nchunks = static_cast<int64_t>(chunks.size());
  std::vector<double> psq(chunks.size()), usq(chunks.size());
  // u from the (already updated) moments and the old parameters; used by both passes, so
  // the update applies exactly the u whose norm was measured.
  auto update = [&](size_t i, float w) { return (m[i] * inv_bc1) / (std::sqrt(v[i] * inv_bc2) + eps) + w * params[i]; };

  // Pass 1: moments, and ||p||^2, ||u||^2 per chunk.
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < nchunks; ++c) {
    const StepChunk ch = chunks[static_cast<size_t>(c)];
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
  // (gather) are summed per tensor in the same order, then looked up by tensor id.
  std::vector<double> pn(ranges.size(), 0.0), un(ranges.size(), 0.0);
  if (gather) {
    std::vector<StepChunkSums> local(chunks.size());
    for (size_t c = 0; c < chunks.size(); ++c) {
      LATHE_CHECK(ranges[chunks[c].range].tensor >= 0, "lamb: range {} has no tensor id (needed under ZeRO)",
                  chunks[c].range);
      local[c] = {ranges[chunks[c].range].tensor, psq[c], usq[c]};
    }
    std::unordered_map<int64_t, std::pair<double, double>> total;
    for (const StepChunkSums& cs : gather(local)) {
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
    const StepChunk ch = chunks[static_cast<size_t>(c)];
    const float w = ranges[ch.range].decay ? wd : 0.0f;
    const float s = scale[ch.range];
#pragma omp simd
    for (size_t i = ch.begin; i < ch.end; ++i) params[i] += s * update(i, w);
  }
}

void grad_sq_chunk_sums(const float* grads, size_t n, double* out) {
  const int64_t nchunks = static_cast<int64_t>((n + kStepChunk - 1) / kStepChunk);
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < nchunks; ++c) {
    const size_t b = static_cast<size_t>(c) * kStepChunk, e = std::min(b + kStepChunk, n);
    double s = 0.0;
#pragma omp simd reduction(+ : s)
    for (size_t i = b; i < e; ++i) s += static_cast<double>(grads[i]) * grads[i];
    out[static_cast<size_t>(c)] = s;
  }
}

double global_grad_norm(const float* grads, size_t n) {
  std::vector<double> partial((n + kStepChunk - 1) / kStepChunk);
  grad_sq_chunk_sums(grads, n, partial.data());
  return norm_from_step_chunk_sums(partial.data(), partial.size());
}

bool has_non_finite(const float* x, size_t n) {
  for (size_t i = 0; i < n; ++i)
    if (!std::isfinite(x[i])) return true;
  return false;
}

void scale_inplace(float* x, size_t n, float s) {
  const int64_t nn = static_cast<int64_t>(n);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < nn; ++i) x[i] *= s;
}

const StepOps& step_ops() {
  static const StepOps t = [] {
    StepOps o;
    o.backend = "cpu";
    o.adamw_step = &adamw_step;
    o.lamb_step = &lamb_step;
    o.grad_sq_chunk_sums = &grad_sq_chunk_sums;
    o.global_grad_norm = &global_grad_norm;
    o.has_non_finite = &has_non_finite;
    o.scale_inplace = &scale_inplace;
    o.device_index = [] { return -1; };
    return o;
  }();
  return t;
}

}  // namespace lathe::cpu
