#include "train/device_step.h"

#include <fmt/format.h>

#include "core/error.h"

#ifdef LATHE_HAVE_CUDA
#include "kernels/cuda/optimizer.h"
#endif

namespace lathe {

const StepKernels* step_kernels(const Backend& backend) {
  if (backend.device() == DeviceKind::Host) return nullptr;
#ifdef LATHE_HAVE_CUDA
  if (&backend == &cuda_backend()) {  // the real one, not the no-CUDA stand-in of the same name
    static const StepKernels k = [] {
      StepKernels t;
      t.backend = "cuda";
      t.adamw_step = &cuda::adamw_step;
      t.lamb_step = &cuda::lamb_step;
      t.global_grad_norm = &cuda::global_grad_norm;
      t.has_non_finite = &cuda::has_non_finite;
      t.scale_inplace = &cuda::scale_inplace;
      return t;
    }();
    return &k;
  }
#endif
  return nullptr;
}

void check_device_layout(const Recipe& r, int world_size) {
  if (r.device == "cpu") return;
  auto refuse = [&](const std::string& what) {
    throw_error(
        "{}: device: {} runs one process without tensor or pipeline parallelism so far, but {} (NCCL data "
        "parallelism is built, dist/nccl_comm.h, but not yet wired into the trainer; use device: cpu for this "
        "layout)",
        r.source, r.device, what);
  };
  if (world_size > 1) refuse(fmt::format("this job has {} processes", world_size));
  if (r.parallel.tensor > 1) refuse(fmt::format("parallel.tensor = {}", r.parallel.tensor));
  if (r.parallel.pipeline > 1) refuse(fmt::format("parallel.pipeline = {}", r.parallel.pipeline));
}

DeviceOptimizer::DeviceOptimizer(Model& model, const optim::OptimConfig& cfg, std::vector<optim::ParamRange> ranges,
                                 optim::Optimizer& host)
    : model_(model), cfg_(cfg), ranges_(std::move(ranges)), host_(host), k_(step_kernels(model.backend())) {
  LATHE_CHECK(k_, "device optimizer: the {} backend has no optimizer kernels in this build", model.backend().name());
  LATHE_CHECK(model.has_gradients(), "device optimizer: the model has no gradients");
  m_.resize(model.backend(), model.num_params(), DType::F32);  // zeroed: fresh moments
  v_.resize(model.backend(), model.num_params(), DType::F32);
}

double DeviceOptimizer::grad_norm() const {
  return k_->global_grad_norm(const_cast<Model&>(model_).backend_grad_data(), model_.num_params());
}

void DeviceOptimizer::step(double lr, int64_t step, float grad_scale) {
  float* p = model_.backend_param_data();
  const float* g = model_.backend_grad_data();
  auto* m = static_cast<float*>(m_.data());
  auto* v = static_cast<float*>(v_.data());
  if (cfg_.name == "lamb")
    k_->lamb_step(p, g, m, v, ranges_, cfg_, lr, step, grad_scale, optim::ChunkSumsGather{});
  else
    k_->adamw_step(p, g, m, v, ranges_, cfg_, lr, step, grad_scale);
}

void DeviceOptimizer::download_state() {
  const auto bufs = host_.state_buffers();
  LATHE_CHECK(bufs.size() == 2, "device optimizer: {} state buffers on the host, expected 2", bufs.size());
  DeviceBuffer* dev[2] = {&m_, &v_};  // exp_avg, exp_avg_sq: the host optimizer's order
  for (size_t i = 0; i < 2; ++i) {
    LATHE_CHECK(bufs[i].second->size() == model_.num_params(), "device optimizer: state '{}' has {} floats, not {}",
                bufs[i].first, bufs[i].second->size(), model_.num_params());
    model_.backend().copy(bufs[i].second->data(), dev[i]->data(), dev[i]->bytes(), CopyKind::DeviceToHost);
  }
  model_.backend().synchronize();
}

void DeviceOptimizer::upload_state() {
  const auto bufs = host_.state_buffers();
  LATHE_CHECK(bufs.size() == 2, "device optimizer: {} state buffers on the host, expected 2", bufs.size());
  DeviceBuffer* dev[2] = {&m_, &v_};
  for (size_t i = 0; i < 2; ++i)
    model_.backend().copy(dev[i]->data(), bufs[i].second->data(), dev[i]->bytes(), CopyKind::HostToDevice);
  model_.backend().synchronize();
}

}  // namespace lathe
