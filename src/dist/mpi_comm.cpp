// Open MPI behind the Communicator interface. MPI moves bytes only (allgatherv, alltoallv, bcast,
// send/recv, barrier, comm_split); reductions are lathe's own, in rank order (comm.h), so results
// do not depend on the algorithm MPI picks. Every communicator calls MPI from its own progress
// thread, so MPI is initialised with MPI_THREAD_MULTIPLE. Errors return (MPI_ERRORS_RETURN) and
// become lathe::Error naming the operation and the group.
#include <fmt/format.h>

#include <climits>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "core/error.h"
#include "dist/comm.h"

#ifdef LATHE_HAVE_MPI
#include <mpi.h>
#endif

namespace lathe::dist {

bool launched_by_mpi() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_SIZE", "PMI_RANK"})
    if (std::getenv(v)) return true;
  return false;
}

#ifdef LATHE_HAVE_MPI

namespace {

void check_mpi(int rc, const char* op, const std::string& where) {
  if (rc == MPI_SUCCESS) return;
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, msg, &len);
  throw_error("{}: MPI {} failed: {}", where, op, std::string(msg, static_cast<size_t>(len)));
}

int as_count(size_t bytes, const std::string& where) {
  // MPI counts are int: larger messages would need derived datatypes (not needed by any caller yet).
  LATHE_CHECK(bytes <= static_cast<size_t>(INT_MAX),
              "{}: a message of {} bytes exceeds MPI's 2 GiB count limit; use smaller buckets (parallel.bucket_mb)",
              where, bytes);
  return static_cast<int>(bytes);
}

// MPI_Init_thread once per process; MPI_Finalize at exit.
struct MpiRuntime {
  MpiRuntime() {
    int provided = 0;
    int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
    if (rc != MPI_SUCCESS) throw_error("MPI_Init_thread failed (code {})", rc);
    if (provided < MPI_THREAD_MULTIPLE)
      throw_error(
          "this MPI library gives thread level {} but lathe needs MPI_THREAD_MULTIPLE (communication runs on its "
          "own threads); use Open MPI built with thread support (Debian's openmpi-bin is)",
          provided);
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  }
  ~MpiRuntime() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Finalize();
  }
};

MpiRuntime& mpi_runtime() {
  static MpiRuntime rt;
  return rt;
}

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator(MPI_Comm comm, int rank, int size, std::string name, std::shared_ptr<Watchdog> wd, bool owned)
      : Communicator(rank, size, std::move(name), std::move(wd)), comm_(comm), owned_(owned) {}
  ~MpiCommunicator() override {
    stop_progress();
    if (owned_) MPI_Comm_free(&comm_);
  }

 protected:
  void do_all_gather(const void* send, void* recv, const std::vector<size_t>& bytes) override {
    std::vector<int> counts(bytes.size()), displs(bytes.size());
    size_t off = 0;
    for (size_t i = 0; i < bytes.size(); ++i) {
      counts[i] = as_count(bytes[i], describe());
      displs[i] = as_count(off, describe());
      off += bytes[i];
    }
    const void* src = send;
    if (send == static_cast<char*>(recv) + displs[static_cast<size_t>(rank())]) src = MPI_IN_PLACE;
    check_mpi(MPI_Allgatherv(src, counts[static_cast<size_t>(rank())], MPI_BYTE, recv, counts.data(), displs.data(),
                             MPI_BYTE, comm_),
              "Allgatherv", describe());
  }

  void do_all_to_all(const void* send, const std::vector<size_t>& send_bytes, void* recv,
                     const std::vector<size_t>& recv_bytes) override {
    const size_t n = send_bytes.size();
    std::vector<int> sc(n), sd(n), rc(n), rd(n);
    size_t so = 0, ro = 0;
    for (size_t i = 0; i < n; ++i) {
      sc[i] = as_count(send_bytes[i], describe());
      sd[i] = as_count(so, describe());
      rc[i] = as_count(recv_bytes[i], describe());
      rd[i] = as_count(ro, describe());
      so += send_bytes[i];
      ro += recv_bytes[i];
    }
    check_mpi(MPI_Alltoallv(send, sc.data(), sd.data(), MPI_BYTE, recv, rc.data(), rd.data(), MPI_BYTE, comm_),
              "Alltoallv", describe());
  }

  void do_broadcast(void* buf, size_t bytes, int root) override {
    check_mpi(MPI_Bcast(buf, as_count(bytes, describe()), MPI_BYTE, root, comm_), "Bcast", describe());
  }

  void do_send(const void* buf, size_t bytes, int dst, int tag) override {
    check_mpi(MPI_Send(buf, as_count(bytes, describe()), MPI_BYTE, dst, tag, comm_), "Send", describe());
  }

  void do_sendrecv(const void* send, size_t send_bytes, int dst, void* recv, size_t recv_bytes, int src,
                   int tag) override {
    MPI_Status st;
    check_mpi(MPI_Sendrecv(send, as_count(send_bytes, describe()), MPI_BYTE, dst, tag, recv,
                           as_count(recv_bytes, describe()), MPI_BYTE, src, tag, comm_, &st),
              "Sendrecv", describe());
    int got = 0;
    MPI_Get_count(&st, MPI_BYTE, &got);
    LATHE_CHECK(static_cast<size_t>(got) == recv_bytes,
                "{}: sendrecv expected {} bytes from rank {} tag {}, but {} bytes arrived", describe(), recv_bytes, src,
                tag, got);
  }

  void do_recv(void* buf, size_t bytes, int src, int tag) override {
    MPI_Status st;
    check_mpi(MPI_Recv(buf, as_count(bytes, describe()), MPI_BYTE, src, tag, comm_, &st), "Recv", describe());
    int got = 0;
    MPI_Get_count(&st, MPI_BYTE, &got);
    LATHE_CHECK(static_cast<size_t>(got) == bytes, "{}: recv of {} bytes from rank {} tag {}, but {} bytes arrived",
                describe(), bytes, src, tag, got);
  }

  void do_barrier() override { check_mpi(MPI_Barrier(comm_), "Barrier", describe()); }

  std::unique_ptr<Communicator> do_split(int color, const std::vector<int>& members, const std::string& name) override {
    int key = 0;
    if (color >= 0) key = static_cast<int>(std::find(members.begin(), members.end(), rank()) - members.begin());
    MPI_Comm out = MPI_COMM_NULL;
    check_mpi(MPI_Comm_split(comm_, color < 0 ? MPI_UNDEFINED : color, key, &out), "Comm_split", describe());
    if (out == MPI_COMM_NULL) return nullptr;
    MPI_Comm_set_errhandler(out, MPI_ERRORS_RETURN);
    int r = 0, s = 0;
    MPI_Comm_rank(out, &r);
    MPI_Comm_size(out, &s);
    return std::make_unique<MpiCommunicator>(out, r, s, name, watchdog(), true);
  }

 private:
  MPI_Comm comm_;
  bool owned_;
};

}  // namespace

std::unique_ptr<Communicator> make_world_communicator(double timeout_s) {
  if (!launched_by_mpi()) return make_local_communicator(std::make_shared<Watchdog>(timeout_s));
  mpi_runtime();
  auto wd = std::make_shared<Watchdog>(timeout_s, [](const std::string&) { MPI_Abort(MPI_COMM_WORLD, 134); });
  int r = 0, s = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  MPI_Comm_size(MPI_COMM_WORLD, &s);
  return std::make_unique<MpiCommunicator>(MPI_COMM_WORLD, r, s, "world", wd, false);
}

void abort_job(int exit_code) {
  std::fflush(stdout);
  std::fflush(stderr);
  int init = 0, fin = 0, size = 1;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  if (init && !fin) {
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    if (size > 1) MPI_Abort(MPI_COMM_WORLD, exit_code);
  }
  std::_Exit(exit_code);
}

namespace {
int running_world_size(int* rank) {
  int init = 0, fin = 0, size = 1;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  if (!init || fin) return 1;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  MPI_Comm_rank(MPI_COMM_WORLD, rank);
  return size;
}
}  // namespace

std::string job_rank_prefix() {
  int rank = 0;
  const int size = running_world_size(&rank);
  return size > 1 ? fmt::format("rank {} of {}: ", rank, size) : std::string();
}

void end_job_after_error(int exit_code) {
  int rank = 0;
  if (running_world_size(&rank) > 1) abort_job(exit_code);
}

#else  // built without MPI

std::string job_rank_prefix() { return {}; }
void end_job_after_error(int) {}

std::unique_ptr<Communicator> make_world_communicator(double timeout_s) {
  if (launched_by_mpi())
    throw_error(
        "started by an MPI launcher, but this lathe was built without MPI: install libopenmpi-dev and rebuild "
        "(scripts/build.sh)");
  return make_local_communicator(std::make_shared<Watchdog>(timeout_s));
}

void abort_job(int exit_code) {
  std::fflush(stdout);
  std::fflush(stderr);
  std::_Exit(exit_code);
}

#endif

}  // namespace lathe::dist
