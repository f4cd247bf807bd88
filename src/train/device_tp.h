// Tensor parallelism (parallel/tensor_parallel.h) of a device-resident model (device: cuda): the
// collectives of the model's StepHooks::tp (models/tp_mappings.h) run over an NCCL group of the
// tensor-parallel ranks, so the partial sums of the row-parallel GEMMs, the vocab-parallel loss
// statistics and (sequence parallelism) the row gathers and reduce-scatters move device buffers
// over NCCL, never through host copies.
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
//  * What stays refused on the device (check_device_layout): LAMB (its per-tensor norms under
//    tensor parallelism gather chunk sums over the tensor group: not wired for the device
//    optimizer), training.eval_tasks (the device forward_logits is never vocab parallel:
//    models/transformer.cpp).
#pragma once
#include <memory>
#include <utility>
#include <vector>

#include "dist/comm.h"
#include "models/model.h"

namespace lathe {

// Replaces parallel::attach_tensor_parallel for the trainer: on a host model (the CPU path) it is
// exactly that and returns null; on a device model (or the host test path of train/device_step.h:
// LATHE_TEST_DEVICE_PATH_ON_HOST, which runs the CPU model through here with a second host group)
// it builds the device group over `tp_host` (NCCL; collective) and installs the collectives over it.
// The returned group must outlive the model's passes.
// device_path_on_host: FaultPlan::device_path_on_host (a host model through the device wiring).
std::unique_ptr<dist::Communicator> attach_tensor_parallel_on_device(Model& model, dist::Communicator& tp_host,
                                                                     bool device_path_on_host = false);

// The gradient norm of tensor parallelism (parallel::tensor_parallel_grad_norm) with the chunk sums
// of backend memory: each owned range's chunk sums by `chunk_sums` (host results), added in order,
// then summed over `group` (host memory, MPI).
using DeviceChunkSqSums = void (*)(const float* grads, size_t n, double* out_host);
double device_tensor_parallel_grad_norm(dist::Communicator& group, const float* grads,
                                        const std::vector<std::pair<size_t, size_t>>& owned,
                                        DeviceChunkSqSums chunk_sums);

}  // namespace lathe
