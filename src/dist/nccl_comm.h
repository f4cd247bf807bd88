// NCCL behind the Communicator interface (dist/comm.h), for device-resident training: every buffer
// passed to its operations is a device pointer on the communicator's GPU.
//
//  * Bootstrap over a host communicator of the same ranks (MPI world or a group of it): rank 0
//    calls ncclGetUniqueId, the host communicator broadcasts it, every rank calls ncclCommInitRank
//    (dist/device_bootstrap.h, tested over threads). split() splits the host communicator with the
//    same colors and keys and bootstraps the subgroup the same way.
//  * One GPU per rank: `device` is the backend's GPU of this process (kernels/cuda/runtime.h
//    picks it from the launcher's local rank); creation checks over the host communicator that no
//    two ranks of a node share a GPU and names them when they do.
//  * Reductions are NCCL's own (ring / tree kernels), not lathe's rank-order host sum: for a fixed
//    number of ranks, topology, NCCL version and algorithm/protocol choice NCCL's results are
//    bit-reproducible run to run (pin NCCL_ALGO=Ring NCCL_PROTO=Simple to keep the choice fixed
//    across message sizes and machines), but they are not bit-equal to the CPU communicators' sums.
//    Uneven reduce_scatter / all_gather counts become grouped ncclReduce / ncclBroadcast calls.
//  * Every operation runs on the communicator's progress thread on its own CUDA stream and is
//    complete (stream synchronised) when its Work finishes. The caller makes its input ready
//    first: the device training path synchronises the backend's stream before issuing.
//  * send/recv: NCCL matches messages per peer in issue order; tags are not matched (issue them
//    in the same order on both sides, as the pipeline schedules do). A send completes when the
//    peer receives it (NCCL has no buffered sends).
//  * Errors name the NCCL call, ncclGetErrorString and ncclGetLastError. While waiting, a pending
//    asynchronous NCCL error (a peer died: ncclRemoteError) aborts the communicator and throws;
//    a watchdog timeout aborts it (ncclCommAbort, Watchdog::add_abort_hook) before ending the job.
#pragma once
#include <memory>

#include "dist/comm.h"

namespace lathe::dist {

// True when this build has NCCL (a CUDA build with nccl.h and libnccl found).
bool have_nccl();

// Collective over `host`: an NCCL communicator of host's ranks on GPU `device`. `host` must outlive
// the result (the trainer's world communicator does); groups split from the result own their host
// subgroups. Throws on a build without NCCL, naming how to get one.
std::unique_ptr<Communicator> make_nccl_communicator(Communicator& host, int device);

}  // namespace lathe::dist
