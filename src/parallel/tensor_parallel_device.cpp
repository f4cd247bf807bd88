// Tensor parallelism of a device-resident model (device: cuda): the collectives of the model's
// StepHooks::tp (models/tp_mappings.h) run over an NCCL group of the tensor-parallel ranks, so the
// partial sums of the row-parallel GEMMs, the vocab-parallel loss statistics and (sequence
// parallelism) the row gathers and reduce-scatters move device buffers over NCCL, never through
// host copies.
//
//  * Every collective first synchronises the backend's stream: the model calls it when the kernels
//    that write its buffer have been *issued*; NCCL runs on its own stream (dist/nccl_comm.h) and
//    its blocking calls return with the result complete, so the next kernels see it.
//  * fp32: the same collectives as the CPU (all_reduce / reduce_scatter / all_gather of the group);
//    bf16/fp16: NCCL reduces in the 16-bit type itself (a sum rounded at each of NCCL's steps:
//    one rounding at tp = 2, as the CPU's widen-sum-round; more for larger tp) where the CPU path
//    widens to fp32 and sums in rank order. split_rows is a device-to-device copy.
//  * The vocab-parallel statistics are fp64 device buffers (kernels/cuda/lm_head_loss.cu), reduced
//    with NCCL's max / sum.
//  * What stays refused on the device (parallel/parallelize.h: check_device_layout): LAMB (its
//    per-tensor norms under tensor parallelism are not gathered for the device moments) and
//    training.eval_tasks (the device forward_logits is never vocab parallel).
#include <cmath>
#include <memory>

#include "core/error.h"
#include "dist/nccl_comm.h"
#include "parallel/tensor_parallel.h"

namespace lathe::parallel {

namespace {

// StepHooks::tp.vocab's reduction over the device group: fp64 device buffers (the per-row max, then
// the sums of the vocab-parallel loss).
struct VocabCtx {
  dist::Communicator* group;
  const Backend* backend;
};

void device_vocab_all_reduce(void* ctx, double* buf, int64_t count, bool max) {
  auto* c = static_cast<VocabCtx*>(ctx);
  c->backend->synchronize();
  c->group->all_reduce(buf, static_cast<size_t>(count), DType::F64, max ? dist::ReduceOp::Max : dist::ReduceOp::Sum);
}

// The CPU collectives (parallel::attach_tensor_parallel over `g`; models/tp_mappings.h) made
// device-safe: the backend's stream synchronised before each collective, 16-bit reductions in NCCL's
// own type, split_rows a device copy. Only those the CPU installed are replaced.
void install_device_collectives(Model& m, dist::Communicator* g) {
  const Backend* be = &m.backend();
  const DType dt = m.compute_dtype();
  const size_t es = dtype_size(dt);
  const int tp = g->size(), rank = g->rank();
  auto counts = [tp](int64_t n) { return std::vector<size_t>(static_cast<size_t>(tp), static_cast<size_t>(n)); };
  TpMappings& tpm = m.hooks().tp;
  TpCollectives& h = tpm.comm;
  auto ctx = std::make_shared<VocabCtx>(VocabCtx{g, be});
  // ctx lives as long as this collective (the model's): the vocab reduction is a plain pointer + context.
  h.all_reduce = [g, be, dt, ctx](void* buf, int64_t n) {
    be->synchronize();
    g->all_reduce(buf, static_cast<size_t>(n), dt);
  };
  if (tpm.vocab.all_reduce) {
    tpm.vocab.all_reduce = device_vocab_all_reduce;
    tpm.vocab.ctx = ctx.get();
  }
  if (h.all_gather_rows)
    h.all_gather_rows = [g, be, dt, counts](const void* shard, void* full, int64_t n) {
      be->synchronize();
      g->all_gather(shard, full, counts(n), dt);
    };
  if (h.split_rows)
    h.split_rows = [be, rank, es](const void* full, void* shard, int64_t n) {
      const auto* src = static_cast<const std::byte*>(full) + static_cast<size_t>(rank) * static_cast<size_t>(n) * es;
      // rank > 0: [rank*n, (rank+1)*n) and [0, n) do not overlap (stream-ordered copy, no wait).
      if (src != shard) be->copy(shard, src, static_cast<size_t>(n) * es, CopyKind::DeviceToDevice);
    };
  if (h.all_reduce_f32)
    h.all_reduce_f32 = [g, be](float* grads, int64_t n) {
      be->synchronize();
      g->all_reduce(grads, static_cast<size_t>(n), DType::F32);
    };
  if (h.reduce_scatter_rows)
    h.reduce_scatter_rows = [g, be, dt, counts](void* full, void* shard, int64_t n) {
      be->synchronize();
      g->reduce_scatter(full, shard, counts(n), dt);
    };
}

}  // namespace

std::unique_ptr<dist::Communicator> attach_tensor_parallel_on_device(Model& model, dist::Communicator& tp_host,
                                                                     bool device_path_on_host) {
  const bool on_host = !model.on_device() && device_path_on_host;
  if (tp_host.size() == 1 || (!model.on_device() && !on_host)) {
    attach_tensor_parallel(model, tp_host);
    return nullptr;
  }
  std::unique_ptr<dist::Communicator> group;
  if (on_host) {
    group = tp_host.split(0, tp_host.rank(), tp_host.name() + "-device");
  } else {
    const StepOps* k = model.backend().step_ops();
    LATHE_CHECK(k && k->device_index, "tensor parallel: the {} backend has no step ops in this build",
                model.backend().name());
    group = dist::make_nccl_communicator(tp_host, k->device_index());  // collective over tp_host
  }
  attach_tensor_parallel(model, *group);
  // The host test path takes the device collectives too where they run on host memory (fp32: the 16-bit
  // ones reduce in NCCL's 16-bit types, which the host communicators do not have).
  if (!on_host || model.compute_dtype() == DType::F32) install_device_collectives(model, group.get());
  return group;
}

}  // namespace lathe::parallel
