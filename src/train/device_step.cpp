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

#ifdef LATHE_HAVE_CUDA
#include "kernels/cuda/optimizer.h"
#include "kernels/cuda/runtime.h"
#endif

namespace lathe {

namespace {

// host_step_kernels(): optim/'s optimizers over caller-held moments (a fresh optimizer per call,
// its state loaded from and stored back to m and v: tests only, so the copies do not matter).
size_t ranges_end(std::span<const optim::ParamRange> ranges) {
  size_t n = 0;
  for (const auto& r : ranges) n = std::max(n, r.offset + r.size);
  return n;
}

void host_update(std::unique_ptr<optim::Optimizer> opt, float* params, const float* grads, float* m, float* v,
                 std::span<const optim::ParamRange> ranges, double lr, int64_t step, float grad_scale, size_t n) {
  auto st = opt->state_buffers();
  std::copy(m, m + n, st[0].second->data());
  std::copy(v, v + n, st[1].second->data());
  opt->step(params, grads, ranges, lr, step, grad_scale);
  std::copy(st[0].second->data(), st[0].second->data() + n, m);
  std::copy(st[1].second->data(), st[1].second->data() + n, v);
}

void host_adamw(float* params, const float* grads, float* m, float* v, std::span<const optim::ParamRange> ranges,
                const optim::OptimConfig& cfg, double lr, int64_t step, float grad_scale) {
  const size_t n = ranges_end(ranges);
  host_update(optim::make_adamw(cfg, n), params, grads, m, v, ranges, lr, step, grad_scale, n);
}

void host_lamb(float* params, const float* grads, float* m, float* v, std::span<const optim::ParamRange> ranges,
               const optim::OptimConfig& cfg, double lr, int64_t step, float grad_scale,
               const optim::ChunkSumsGather& gather) {
  const size_t n = ranges_end(ranges);
  auto opt = optim::make_lamb(cfg, n);
  if (gather) opt->set_chunk_sums_gather(gather);
  host_update(std::move(opt), params, grads, m, v, ranges, lr, step, grad_scale, n);
}

bool host_non_finite(const float* x, size_t n) {
  for (size_t i = 0; i < n; ++i)
    if (!std::isfinite(x[i])) return true;
  return false;
}

void host_scale(float* x, size_t n, float s) {
  for (size_t i = 0; i < n; ++i) x[i] *= s;
}

}  // namespace

const StepKernels* host_step_kernels() {
  static const StepKernels k = [] {
    StepKernels t;
    t.backend = "cpu";
    t.adamw_step = &host_adamw;
    t.lamb_step = &host_lamb;
    t.global_grad_norm = &optim::global_grad_norm;
    t.has_non_finite = &host_non_finite;
    t.scale_inplace = &host_scale;
    t.grad_sq_chunk_sums = &optim::grad_sq_chunk_sums;
    t.device_index = [] { return -1; };
    return t;
  }();
  return &k;
}

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
      t.grad_sq_chunk_sums = &cuda::grad_sq_chunk_sums;
      t.device_index = [] { return cuda::device(); };
      return t;
    }();
    return &k;
  }
#endif
  return nullptr;
}

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
                                 optim::Optimizer& host, std::unique_ptr<DeviceDataParallel> dp,
                                 const StepKernels* kernels)
    : model_(model),
      cfg_(cfg),
      host_(host),
      k_(kernels ? kernels : step_kernels(model.backend())),
      dp_(std::move(dp)),
      begin_(dp_ ? dp_->state_begin() : 0),
      end_(dp_ ? dp_->state_end() : model.num_params()) {
  LATHE_CHECK(k_, "device optimizer: the {} backend has no optimizer kernels in this build", model.backend().name());
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
    k_->lamb_step(p + begin_, g + begin_, m, v, ranges_, cfg_, lr, step, grad_scale,
                  dp_ ? dp_->chunk_sums_gather() : optim::ChunkSumsGather{});
  else
    k_->adamw_step(p + begin_, g + begin_, m, v, ranges_, cfg_, lr, step, grad_scale);
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

bool device_path_on_host() {
  static const bool on = [] {
    const char* e = std::getenv("LATHE_TEST_DEVICE_PATH_ON_HOST");
    return e != nullptr && std::string(e) == "1";
  }();
  return on;
}

std::unique_ptr<DeviceOptimizer> make_device_optimizer(Model& model, const Recipe& r,
                                                       std::vector<optim::ParamRange> ranges,
                                                       parallel::ShardedOptimizer& opt, dist::Communicator& dp) {
  const bool on_host =
      !model.on_device() && device_path_on_host() && !(r.parallel.tensor > 1 && r.optimizer.name == "lamb");
  if (!model.on_device() && !on_host) return nullptr;
  const StepKernels* k = on_host ? host_step_kernels() : step_kernels(model.backend());
  LATHE_CHECK(k && k->device_index, "{}: device: {}: the {} backend has no step kernels in this build", r.source,
              r.device, model.backend().name());
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
  return std::make_unique<DeviceOptimizer>(model, optimizer_config(r), std::move(ranges), opt.local(), std::move(ddp),
                                           k);
}

}  // namespace lathe
