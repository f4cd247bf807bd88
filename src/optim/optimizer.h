// Optimizers over the flat fp32 parameter buffer. A model's parameters, gradients and optimizer
// moments each live in one flat buffer of P floats; ParamRange says where each parameter tensor
// sits and whether it gets weight decay (typically: matrices yes, norms/biases no).
// Elements not covered by any range are left untouched.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "core/buffer.h"
#include "kernels/step_ops.h"

namespace lathe::optim {

// A parameter tensor's place in the flat buffers (kernels/step_ops.h's StepRange: offset, size,
// decay, and its tensor id, -1: this range alone; a tensor cut by a ZeRO shard boundary appears as
// one range on each rank holding part of it, with one id).
using ParamRange = StepRange;

// LAMB's per-tensor norms come from partial sums per chunk (optim/chunks.h). Under ZeRO a tensor's
// chunks sit on several ranks: the optimizer hands its chunk sums (flat order) to a ChunkSumsGather,
// which returns the chunk sums of every rank in flat order (rank order), so that each rank adds a
// tensor's chunks in the same order a single process does: bit-identical trust ratios.
using ChunkSums = StepChunkSums;  // tensor id; sums of p^2 and of u^2 over the chunk
using ChunkSumsGather = StepChunkSumsGather;

// The recipe's `optimizer` section (config/recipe.h) as it is: these are its defaults.
// lr is the peak rate the schedule starts from (ScheduleConfig::lr; step() takes the scheduled
// rate) and grad_clip the global norm the trainer clips to (0 = no clipping); the optimizers
// themselves read name, betas, eps and weight_decay.
struct OptimConfig {
  std::string name = "adamw";  // "adamw" | "lamb"
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0.1;
  double lr = 3e-4;
  double grad_clip = 1.0;
};
// The hyper-parameters the step kernels read (kernels/step_ops.h).
inline StepHyper step_hyper(const OptimConfig& cfg) { return {cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay}; }

class Optimizer {
 public:
  virtual ~Optimizer() = default;
  // One update of params[P] with grads[P]. `step` counts from 1 (bias correction); `lr` is the
  // already-scheduled learning rate. grad_scale multiplies every gradient as it is read (the
  // clipping coefficient), which saves a separate read-modify-write pass over the gradients;
  // the result is bit-identical to scaling the gradients first.
  virtual void step(float* params, const float* grads, std::span<const ParamRange> ranges, double lr, int64_t step,
                    float grad_scale = 1.0f) = 0;
  // State for checkpoints: name -> flat buffer of P floats ("exp_avg", "exp_avg_sq").
  virtual std::vector<std::pair<std::string, Buffer<float>*>> state_buffers() = 0;
  // For optimizers that need whole-tensor norms (LAMB); others ignore it. Every range then needs a
  // tensor id (ParamRange::tensor >= 0).
  virtual void set_chunk_sums_gather(ChunkSumsGather) {}
};

// Checks the config (betas in [0,1), eps > 0, weight_decay >= 0); errors name the field.
void validate(const OptimConfig& cfg);
// "adamw" | "lamb"; an unknown name is an error listing the valid ones.
std::unique_ptr<Optimizer> make_optimizer(const OptimConfig& cfg, size_t num_params);

// Shared helpers (optimizer.cpp).
// Throws unless every range lies inside [0, num_params) and step >= 1.
void check_step_args(const char* who, size_t num_params, std::span<const ParamRange> ranges, int64_t step);
std::unique_ptr<Optimizer> make_adamw(const OptimConfig& cfg, size_t num_params);
std::unique_ptr<Optimizer> make_lamb(const OptimConfig& cfg, size_t num_params);

}  // namespace lathe::optim
