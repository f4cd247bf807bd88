// The optimizer step of a device-resident model (Model::on_device()): gradient norm, non-finite
// check, scaling and the AdamW / LAMB update run where the buffers are, through a small table per
// backend, so the trainer names no backend (it never calls lathe::cuda:: directly).
//
// DeviceOptimizer owns the moments in backend memory (allocated once) and stages them through the
// host optimizer's buffers for checkpoints: download_state() before a save, upload_state() after a
// load; checkpoints stay host fp32 (a GPU run resumes on the CPU and back).
// What the device path does not do yet (refused by check_device_layout): several processes (data,
// tensor or pipeline parallel over NCCL), ZeRO, LAMB under tensor parallelism.
#pragma once
#include <span>
#include <string>
#include <vector>

#include "config/recipe.h"
#include "kernels/backend.h"
#include "models/model.h"
#include "optim/optimizer.h"

namespace lathe {

// Training-step kernels of a backend over flat fp32 buffers in its memory (kernels/cuda/optimizer.h
// on CUDA: same formulas, same order and float scalars as optim/, a few ulp from FMA contraction).
struct StepKernels {
  const char* backend = "";
  void (*adamw_step)(float* params, const float* grads, float* m, float* v, std::span<const optim::ParamRange> ranges,
                     const optim::OptimConfig& cfg, double lr, int64_t step, float grad_scale) = nullptr;
  void (*lamb_step)(float* params, const float* grads, float* m, float* v, std::span<const optim::ParamRange> ranges,
                    const optim::OptimConfig& cfg, double lr, int64_t step, float grad_scale,
                    const optim::ChunkSumsGather& gather) = nullptr;
  double (*global_grad_norm)(const float* grads, size_t n) = nullptr;  // waits; the host gets the norm
  bool (*has_non_finite)(const float* x, size_t n) = nullptr;          // waits
  void (*scale_inplace)(float* x, size_t n, float s) = nullptr;        // stream-ordered
};

// The step kernels of `backend`: nullptr for host backends (the CPU path uses optim/ directly) and
// for the stand-in "cuda" backend of a build without CUDA.
const StepKernels* step_kernels(const Backend& backend);

// The layouts the device path runs: one process, no tensor/pipeline parallelism, ZeRO 0. Throws
// naming the recipe key and the fix otherwise (lathe check and train call it for device: cuda).
void check_device_layout(const Recipe& r, int world_size);

class DeviceOptimizer {
 public:
  // `host` is the trainer's optimizer: its state buffers are the staging copies of the moments.
  DeviceOptimizer(Model& model, const optim::OptimConfig& cfg, std::vector<optim::ParamRange> ranges,
                  optim::Optimizer& host);
  // The gradient norm (fp64 sums in fixed chunk order: the same chunks as optim::global_grad_norm).
  double grad_norm() const;
  // One update of the model's backend parameters; grad_scale as optim::Optimizer::step.
  void step(double lr, int64_t step, float grad_scale);
  // Moments backend -> host optimizer (before a checkpoint) and host -> backend (after a load).
  void download_state();
  void upload_state();

 private:
  Model& model_;
  optim::OptimConfig cfg_;
  std::vector<optim::ParamRange> ranges_;
  optim::Optimizer& host_;
  const StepKernels* k_;
  DeviceBuffer m_, v_;
};

}  // namespace lathe
