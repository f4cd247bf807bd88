#include "train/device_step.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>

#include "core/error.h"
#include "dist/nccl_comm.h"
#include "optim/clip.h"
#include "parallel/grad_sync.h"
#include "parallel/sharded_optimizer.h"
#include "train/device_tp.h"
#include "train/preflight.h"

namespace lathe {

void check_device_layout(const Recipe& r, int world_size) {
  if (r.device == "cpu") return;
  auto refuse = [&](const std::string& what, const std::string& why) {
    throw_error(
        "{}: device: {} does not run {} yet: {} (device: {} runs one process, or data and tensor "
        "parallelism over NCCL with any parallel.zero; use device: cpu for this layout)",
        r.source, r.device, what, why, r.device);
  };
  if (r.parallel.tensor > 1 && r.optimizer.name == "lamb")
    refuse(fmt::format("optimizer.name = lamb with parallel.tensor = {}", r.parallel.tensor),
           "LAMB's per-tensor norms under tensor parallelism are not gathered over the tensor group by the device "
           "optimizer (use adamw)");
  if (r.parallel.tensor > 1 && !r.training.eval_tasks.empty())
    refuse(fmt::format("training.eval_tasks with parallel.tensor = {}", r.parallel.tensor),
           "the device model's logits are not vocab parallel (remove training.eval_tasks, or score the model "
           "afterwards with lathe eval)");
  if (world_size > 1 && !dist::have_nccl())
    refuse(fmt::format("this job has {} processes (data or tensor parallelism)", world_size),
           "this lathe was built without NCCL (nccl.h and libnccl were not found when it was configured: install "
           "NCCL and rebuild with -DLATHE_CUDA=ON)");
}

DeviceOptimizer::DeviceOptimizer(Model& model, const optim::OptimConfig& cfg, std::vector<optim::ParamRange> ranges,
                                 optim::Optimizer& host, std::unique_ptr<DeviceDataParallel> dp)
    : model_(model),
      cfg_(cfg),
      host_(host),
      k_(model.backend().step_ops()),
      dp_(std::move(dp)),
      begin_(dp_ ? dp_->state_begin() : 0),
      end_(dp_ ? dp_->state_end() : model.num_params()) {
  LATHE_CHECK(k_, "device optimizer: the {} backend has no step ops in this build", model.backend().name());
  LATHE_CHECK(model.has_gradients(), "device optimizer: the model has no gradients");
  LATHE_CHECK(!dp_ || dp_->shards().total() == model.num_params(),
              "device optimizer: shards of {} elements for a model of {} parameters", dp_ ? dp_->shards().total() : 0,
              model.num_params());
  ranges_ =
      begin_ == 0 && end_ == model.num_params() ? std::move(ranges) : parallel::ranges_in_shard(ranges, begin_, end_);
  m_.resize(model.backend(), end_ - begin_, DType::F32);  // zeroed: fresh moments
  v_.resize(model.backend(), end_ - begin_, DType::F32);
}

DeviceOptimizer::~DeviceOptimizer() = default;

double DeviceOptimizer::reduce_grads() { return dp_ ? dp_->reduce_grads() : 0.0; }

void DeviceOptimizer::set_grad_norm_group(dist::Communicator& group, std::vector<std::pair<size_t, size_t>> owned) {
  norm_group_ = &group;
  norm_owned_ = std::move(owned);
}

double DeviceOptimizer::grad_norm() const {
  float* g = const_cast<Model&>(model_).backend_grad_data();
  if (norm_group_) {
    LATHE_CHECK(k_->grad_sq_chunk_sums, "device optimizer: the {} kernels have no chunk sums", k_->backend);
    return device_tensor_parallel_grad_norm(*norm_group_, g, norm_owned_, k_->grad_sq_chunk_sums);
  }
  if (dp_ && dp_->zero() > 0 && dp_->size() > 1) {
    LATHE_CHECK(k_->grad_sq_chunk_sums, "device optimizer: the {} kernels have no chunk sums", k_->backend);
    return parallel::sharded_grad_norm(dp_->host(), g, dp_->shards(), k_->grad_sq_chunk_sums);
  }
  return k_->global_grad_norm(g, model_.num_params());
}

void DeviceOptimizer::step(double lr, int64_t step, float grad_scale) {
  float* p = model_.backend_param_data();
  const float* g = model_.backend_grad_data();
  auto* m = static_cast<float*>(m_.data());
  auto* v = static_cast<float*>(v_.data());
  if (cfg_.name == "lamb")
    k_->lamb_step(p + begin_, g + begin_, m, v, ranges_, optim::step_hyper(cfg_), lr, step, grad_scale,
                  dp_ ? dp_->chunk_sums_gather() : optim::ChunkSumsGather{});
  else
    k_->adamw_step(p + begin_, g + begin_, m, v, ranges_, optim::step_hyper(cfg_), lr, step, grad_scale);
  if (dp_) dp_->gather_params(p);
}

void DeviceOptimizer::download_state() {
  const auto bufs = host_.state_buffers();
  LATHE_CHECK(bufs.size() == 2, "device optimizer: {} state buffers on the host, expected 2", bufs.size());
  DeviceBuffer* dev[2] = {&m_, &v_};  // exp_avg, exp_avg_sq: the host optimizer's order
  for (size_t i = 0; i < 2; ++i) {
    LATHE_CHECK(bufs[i].second->size() == end_ - begin_, "device optimizer: state '{}' has {} floats, not {}",
                bufs[i].first, bufs[i].second->size(), end_ - begin_);
    model_.backend().copy(bufs[i].second->data(), dev[i]->data(), dev[i]->bytes(), CopyKind::DeviceToHost);
  }
  model_.backend().synchronize();
}

void DeviceOptimizer::upload_state() {
  const auto bufs = host_.state_buffers();
  LATHE_CHECK(bufs.size() == 2, "device optimizer: {} state buffers on the host, expected 2", bufs.size());
  DeviceBuffer* dev[2] = {&m_, &v_};
  for (size_t i = 0; i < 2; ++i) {
    LATHE_CHECK(bufs[i].second->size() == end_ - begin_, "device optimizer: state '{}' has {} floats, not {}",
                bufs[i].first, bufs[i].second->size(), end_ - begin_);
    model_.backend().copy(dev[i]->data(), bufs[i].second->data(), dev[i]->bytes(), CopyKind::HostToDevice);
  }
  model_.backend().synchronize();
}

std::unique_ptr<DeviceOptimizer> make_device_optimizer(Model& model, const Recipe& r,
                                                       std::vector<optim::ParamRange> ranges,
                                                       parallel::ShardedOptimizer& opt, dist::Communicator& dp,
                                                       bool device_path_on_host) {
  const bool on_host =
      !model.on_device() && device_path_on_host && !(r.parallel.tensor > 1 && r.optimizer.name == "lamb");
  if (!model.on_device() && !on_host) return nullptr;
  const StepOps* k = model.backend().step_ops();  // on_host: the cpu backend's, optim/'s own kernels
  LATHE_CHECK(k && k->device_index, "{}: device: {}: the {} backend has no step ops in this build", r.source, r.device,
              model.backend().name());
  if (on_host && dp.rank() == 0)  // so that a test sees the hook took effect
    fmt::print(stderr,
               "LATHE_TEST_DEVICE_PATH_ON_HOST: the cpu model trains through the device path ({} ranks, ZeRO {})\n",
               dp.size(), opt.zero());
  std::unique_ptr<DeviceDataParallel> ddp;
  if (dp.size() > 1) {
    // Collective over dp: NCCL's unique id is broadcast over it, the GPUs checked distinct. The
    // host test path stands a second host group of the same ranks in for NCCL.
    auto group =
        on_host ? dp.split(0, dp.rank(), dp.name() + "-device") : dist::make_nccl_communicator(dp, k->device_index());
    const size_t bucket_elems = static_cast<size_t>(std::max(1.0, r.parallel.bucket_mb * (1 << 20) / 4));
    // Overlap with backward, except under tensor parallelism: its hooks' NCCL collectives (another
    // communicator) would then run while buckets are in flight, and NCCL requires the operations of
    // communicators sharing a GPU to be ordered the same way on every rank.
    const char* ov = std::getenv("LATHE_DEVICE_DP_OVERLAP");
    const bool overlap = !(ov && std::string(ov) == "0") && r.parallel.tensor == 1;
    ddp = std::make_unique<DeviceDataParallel>(dp, std::move(group), opt.shards(), opt.zero(), bucket_elems,
                                               model.backend(), model.backend_grad_data(), overlap);
  }
  return std::make_unique<DeviceOptimizer>(model, optimizer_config(r), std::move(ranges), opt.local(), std::move(ddp));
}

}  // namespace lathe
