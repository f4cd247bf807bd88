// AdamW with exactly torch.optim.AdamW's (foreach=False) arithmetic, fp32 state:
//   p *= 1 - lr*wd                       (decoupled decay, ranges with decay=true only)
//   m  = beta1*m + (1-beta1)*g
//   v  = beta2*v + (1-beta2)*g*g
//   p -= lr/(1-beta1^t) * m / (sqrt(v)/sqrt(1-beta2^t) + eps)
// The scalar factors are computed in double and rounded to float once, as torch does with Python
// scalars applied to float tensors.
#include <cmath>

#include "optim/chunks.h"
#include "optim/optimizer.h"

namespace lathe::optim {
namespace {

class AdamW final : public Optimizer {
 public:
  AdamW(const OptimConfig& cfg, size_t n) : cfg_(cfg), n_(n), m_(n), v_(n) {}

  void step(float* params, const float* grads, std::span<const ParamRange> ranges, double lr, int64_t step,
            float grad_scale) override {
    check_step_args("adamw", n_, ranges, step);
    const double bc1 = 1.0 - std::pow(cfg_.beta1, static_cast<double>(step));
    const double bc2 = 1.0 - std::pow(cfg_.beta2, static_cast<double>(step));
    const float decay_mul = static_cast<float>(1.0 - lr * cfg_.weight_decay);
    const float b1 = static_cast<float>(cfg_.beta1), one_minus_b1 = static_cast<float>(1.0 - cfg_.beta1);
    const float b2 = static_cast<float>(cfg_.beta2), one_minus_b2 = static_cast<float>(1.0 - cfg_.beta2);
    const float neg_step_size = static_cast<float>(-(lr / bc1));
    const float bc2_sqrt = static_cast<float>(std::sqrt(bc2));
    const float eps = static_cast<float>(cfg_.eps);
    const std::vector<Chunk> chunks = make_chunks(ranges);
    float* m = m_.data();
    float* v = v_.data();
    const int64_t nchunks = static_cast<int64_t>(chunks.size());
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < nchunks; ++c) {
      const Chunk ch = chunks[static_cast<size_t>(c)];
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

  std::vector<std::pair<std::string, Buffer<float>*>> state_buffers() override {
    return {{"exp_avg", &m_}, {"exp_avg_sq", &v_}};
  }

 private:
  OptimConfig cfg_;
  size_t n_;
  Buffer<float> m_, v_;
};

}  // namespace

std::unique_ptr<Optimizer> make_adamw(const OptimConfig& cfg, size_t num_params) {
  return std::make_unique<AdamW>(cfg, num_params);
}

}  // namespace lathe::optim
