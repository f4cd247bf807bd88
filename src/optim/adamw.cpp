// AdamW with exactly torch.optim.AdamW's (foreach=False) arithmetic, fp32 state: the optimizer
// owns the moments; the update is the CPU step kernel (kernels/cpu/step.h states the formulas),
// the same function cpu_backend().step_ops() registers.
#include "kernels/cpu/step.h"
#include "optim/optimizer.h"

namespace lathe::optim {
namespace {

class AdamW final : public Optimizer {
 public:
  AdamW(const OptimConfig& cfg, size_t n) : cfg_(cfg), n_(n), m_(n), v_(n) {}

  void step(float* params, const float* grads, std::span<const ParamRange> ranges, double lr, int64_t step,
            float grad_scale) override {
    check_step_args("adamw", n_, ranges, step);
    cpu::adamw_step(params, grads, m_.data(), v_.data(), ranges, step_hyper(cfg_), lr, step, grad_scale);
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
