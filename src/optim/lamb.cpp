// LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning"), as NVIDIA apex FusedLAMB
// computes it, per parameter tensor: the optimizer owns the moments and the ZeRO chunk-sums
// gather; the update is the CPU step kernel (kernels/cpu/step.h states the formulas), the same
// function cpu_backend().step_ops() registers.
#include "kernels/cpu/step.h"
#include "optim/optimizer.h"

namespace lathe::optim {
namespace {

class Lamb final : public Optimizer {
 public:
  Lamb(const OptimConfig& cfg, size_t n) : cfg_(cfg), n_(n), m_(n), v_(n) {}

  void step(float* params, const float* grads, std::span<const ParamRange> ranges, double lr, int64_t step,
            float grad_scale) override {
    check_step_args("lamb", n_, ranges, step);
    cpu::lamb_step(params, grads, m_.data(), v_.data(), ranges, step_hyper(cfg_), lr, step, grad_scale, gather_);
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
