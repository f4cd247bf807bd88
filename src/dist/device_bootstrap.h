// How the ranks of a GPU job find their device and build device communicators (NCCL), in plain
// C++ so that it is tested over the thread communicator on machines without GPUs
// (tests/dist/test_device_bootstrap.cpp); src/dist/nccl_comm.cpp (CUDA builds) calls it.
//
//  * One GPU per rank: the launcher's local rank (ranks of this node, 0..local_size-1) picks the
//    device. Launchers say it in their environment (Open MPI, MPICH/Intel MPI, Slurm, torchrun);
//    without that the ranks compare host names over the host communicator.
//  * A device group is bootstrapped over a host group of the same ranks (MPI, or threads in
//    tests): its rank 0 creates the unique id (ncclGetUniqueId), broadcasts it, and every rank
//    initialises its member (ncclCommInitRank). A failure on rank 0 reaches every rank as an
//    error (the broadcast carries it), never as a hang.
//  * Groups split from a device group use the host group's split (same colors and keys, so the
//    same members in the same order) and bootstrap the new group over the host subgroup.
#pragma once
#include <cstddef>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dist/comm.h"

namespace lathe::dist {

struct LocalRank {
  int rank = 0;        // among the ranks of this node
  int size = 1;        // ranks on this node
  std::string source;  // where it came from: "OMPI_COMM_WORLD_LOCAL_RANK", "host names", ...
};

// The local rank a launcher put in the environment, first found of: Open MPI
// (OMPI_COMM_WORLD_LOCAL_RANK / _LOCAL_SIZE), MPICH / Intel MPI (MPI_LOCALRANKID / MPI_LOCALNRANKS),
// Slurm (SLURM_LOCALID / SLURM_NTASKS_PER_NODE, when the latter is a plain number), torchrun (LOCAL_RANK /
// LOCAL_WORLD_SIZE). nullopt when none is set. A malformed value (not an integer, rank outside
// [0, size)) is an error naming the variable and its value.
std::optional<LocalRank> local_rank_from_env(const std::function<const char*(const char*)>& getenv);

// Collective over `comm`: ranks reporting the same host name are one node; a rank's local rank is
// the number of lower ranks on its node.
LocalRank local_rank_from_hosts(Communicator& comm, const std::string& hostname);

// The launcher's local rank, else the host-name exchange over `comm` (collective then).
LocalRank local_rank(Communicator& comm);

// The device of this rank: local_rank when the node shows at least local_size devices; device 0
// when it shows exactly one (the launcher bound one GPU per rank: CUDA_VISIBLE_DEVICES; sharing is
// caught by check_distinct_devices). Otherwise an error naming the ranks, the devices and the fix
// (one rank per GPU: fewer ranks per node, or more visible GPUs).
int device_for_local_rank(const LocalRank& lr, int device_count);

// Collective over `comm`: every rank reports (host name, device UUID); two ranks on one device is
// an error naming both ranks, the host and the device (NCCL would refuse later with less to go on).
void check_distinct_devices(Communicator& comm, const std::string& hostname, const std::string& device_uuid);

// Collective over `host`: rank 0 fills `id_bytes` bytes with make_id (ncclGetUniqueId) and
// broadcasts them; then init(id, rank, size) runs on every rank (ncclCommInitRank). If make_id
// throws on rank 0, every rank throws "... rank 0 of group 'X' could not create the unique id: ...".
void bootstrap_group(Communicator& host, size_t id_bytes, const std::function<void(void* id)>& make_id,
                     const std::function<void(const void* id, int rank, int size)>& init);

// The strings of every rank, in rank order (collective over `comm`; each at most 4096 bytes).
std::vector<std::string> all_gather_strings(Communicator& comm, const std::string& mine);

// This process's host name (gethostname).
std::string host_name();

}  // namespace lathe::dist
