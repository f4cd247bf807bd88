// Communicators: the one interface through which ranks exchange data (Open MPI between processes,
// threads in one process for tests, a single rank without any launcher; NCCL later).
//
// Design rules (issue 8; shared/reference/distributed.md):
//  * A Communicator is a process group. Groups are made with split() and passed explicitly to the
//    code that needs them; nothing keeps a communicator in a global.
//  * Every floating-point reduction is computed by lathe itself in a fixed order: the data are
//    exchanged with an all-to-all, then rank j sums the n contributions to its segment as
//    ((c_0 + c_1) + c_2) + ..., in rank order, and the segments are all-gathered. The result is
//    bit-identical on every rank, for every implementation (MPI, threads) and whatever algorithm
//    the MPI library would have picked, so training results depend only on the layout.
//  * Every operation of a communicator runs on that communicator's own progress thread, in the
//    order it was issued (Open MPI makes no progress by itself): the *_async calls return at once
//    with a handle, the blocking calls are "issue, then wait". Collectives must be issued in the
//    same order on every rank of the group, as with MPI.
//  * A watchdog (Watchdog, shared by a communicator and the groups split from it) aborts the job
//    when an operation does not finish within its timeout, after printing the rank, the
//    operation, its sequence number, the group and the training step: no silent hang.
#pragma once
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/dtype.h"

namespace lathe::dist {

enum class ReduceOp { Sum, Max, Min };

// Handle of an operation issued with *_async. wait() returns when the operation is complete
// (its output buffers may then be read, its input buffers reused) and rethrows its error.
class Work {
 public:
  virtual ~Work() = default;
  virtual void wait() = 0;
  virtual bool done() const = 0;
};
using WorkPtr = std::shared_ptr<Work>;

// Aborts a stuck job. One per process (made by the launcher-facing code and handed to the world
// communicator); communicators register the operation they are running.
class Watchdog {
 public:
  // timeout_s <= 0 disables it. on_timeout prints nothing itself; it must end the whole job
  // (MPI_Abort for MPI; the default calls std::_Exit(134)).
  explicit Watchdog(double timeout_s, std::function<void(const std::string&)> on_timeout = {});
  ~Watchdog();
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  double timeout_s() const { return timeout_s_; }
  // Training step shown in the timeout message (set by the trainer at each step).
  void set_step(int64_t step) { step_.store(step); }
  int64_t step() const { return step_.load(); }

  // Called by communicators around each operation; slot identifies the progress thread.
  int register_slot(std::string description);  // "rank 1 group 'dp' (2 ranks)"
  void begin(int slot, const char* op, uint64_t seq);
  void end(int slot);

  // Run on the watchdog's thread when an operation times out, after the message is printed and
  // before on_timeout: device communicators abort their stuck work there (ncclCommAbort; NCCL
  // kernels would otherwise keep the GPU spinning). A hook must not block. Returns an id for
  // remove_abort_hook (a communicator removes its hook before it is destroyed).
  int add_abort_hook(std::function<void()> hook);
  void remove_abort_hook(int id);

 private:
  void run();
  struct Slot;
  double timeout_s_;
  std::function<void(const std::string&)> on_timeout_;
  std::atomic<int64_t> step_{-1};
  struct State;
  std::unique_ptr<State> state_;
};

class Communicator {
 public:
  virtual ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  const std::string& name() const { return name_; }  // "world", "dp", ...
  std::string describe() const;                      // "group 'dp' (rank 1 of 2)"

  // Ranks that pass the same color form a new group, ordered by (key, rank in this group).
  // Collective over this group. color < 0: this rank joins no group (returns nullptr).
  std::unique_ptr<Communicator> split(int color, int key, const std::string& name);

  // ---- collectives (blocking; each has an _async twin) ----
  // In place over `count` elements of `dtype` (F32, F64, I32, I64), reduced in rank order.
  void all_reduce(void* buf, size_t count, DType dtype, ReduceOp op = ReduceOp::Sum);
  // Host reductions (all_reduce, reduce_scatter without an implementation's own): the largest
  // temporary buffers one call holds, the pieces sent plus those received (`lathe plan` counts it).
  static constexpr size_t kReduceStagingBytes = size_t{16} << 20;
  WorkPtr all_reduce_async(void* buf, size_t count, DType dtype, ReduceOp op = ReduceOp::Sum);
  // send holds sum(counts) elements; rank r receives the reduction of segment r (counts[r]
  // elements, segments back to back in rank order) into recv. Uneven counts allowed. recv may
  // overlap send (the data are exchanged before any output is written). The host path stages at
  // most kReduceStagingBytes at a time (pieces of every segment exchanged in rounds) when recv is
  // disjoint from send or is exactly this rank's segment of it (the in-place use of all_reduce and
  // the ZeRO gradient buckets); other overlaps stage the whole exchange at once.
  void reduce_scatter(const void* send, void* recv, const std::vector<size_t>& counts, DType dtype,
                      ReduceOp op = ReduceOp::Sum);
  WorkPtr reduce_scatter_async(const void* send, void* recv, const std::vector<size_t>& counts, DType dtype,
                               ReduceOp op = ReduceOp::Sum);
  // Rank r contributes counts[r] elements (send); recv receives every contribution back to back
  // in rank order (sum(counts) elements). Uneven counts allowed; send may alias its own segment
  // of recv.
  void all_gather(const void* send, void* recv, const std::vector<size_t>& counts, DType dtype);
  WorkPtr all_gather_async(const void* send, void* recv, const std::vector<size_t>& counts, DType dtype);
  // All-to-all with per-peer counts (MPI_Alltoallv): send holds send_counts[j] elements for rank j,
  // blocks back to back in rank order; recv receives recv_counts[i] elements from rank i, back to
  // back in rank order (sum(recv_counts) elements). recv_counts[i] must equal what rank i sends
  // here: learn it first with exchange_counts. Zero counts are allowed in either direction. send and
  // recv must not overlap. Pure data movement: no arithmetic, so the result is exact on every
  // implementation. NCCL: device buffers, one grouped send/recv launch.
  void all_to_all(const void* send, const std::vector<size_t>& send_counts, void* recv,
                  const std::vector<size_t>& recv_counts, DType dtype);
  WorkPtr all_to_all_async(const void* send, const std::vector<size_t>& send_counts, void* recv,
                           const std::vector<size_t>& recv_counts, DType dtype);
  // The counts step of an all_to_allv: rank j learns send_counts[j] of every rank. Returns recv_counts
  // (element i: what rank i will send to this rank). Host values on every implementation (NCCL
  // exchanges them over its host communicator). Collective.
  std::vector<size_t> exchange_counts(const std::vector<size_t>& send_counts);
  void broadcast(void* buf, size_t bytes, int root);
  WorkPtr broadcast_async(void* buf, size_t bytes, int root);
  // Point to point: a message is matched by (peer, tag); messages between a pair with the same
  // tag arrive in order. send does not wait for the matching recv to start.
  void send(const void* buf, size_t bytes, int dst, int tag);
  WorkPtr send_async(const void* buf, size_t bytes, int dst, int tag);
  void recv(void* buf, size_t bytes, int src, int tag);
  WorkPtr recv_async(void* buf, size_t bytes, int src, int tag);
  // Exchange as one operation: send_bytes of `send` go to dst while recv_bytes from src arrive in
  // `recv` (MPI_Sendrecv; NCCL: a grouped send + recv), so a ring where every rank sends to its
  // next and receives from its previous cannot deadlock whatever the message size (MPI_Send of a
  // large message may wait for its receiver). dst and src may be equal; neither may be this rank.
  // send and recv must not overlap. Matched by tag as send / recv.
  void sendrecv(const void* send, size_t send_bytes, int dst, void* recv, size_t recv_bytes, int src, int tag);
  WorkPtr sendrecv_async(const void* send, size_t send_bytes, int dst, void* recv, size_t recv_bytes, int src,
                         int tag);
  void barrier();

  // Training step shown by the watchdog when an operation of this group times out.
  void set_step(int64_t step) { watchdog_->set_step(step); }
  // The watchdog of this group (shared with the groups split from it and with device
  // communicators built over it: dist/nccl_comm.h).
  const std::shared_ptr<Watchdog>& shared_watchdog() const { return watchdog_; }

  // Waits for every operation issued so far.
  void synchronize();
  // Operations issued so far (the sequence number the watchdog reports).
  uint64_t issued() const { return seq_; }

 protected:
  Communicator(int rank, int size, std::string name, std::shared_ptr<Watchdog> watchdog);

  // ---- what an implementation provides (run on the progress thread, blocking) ----
  // recv gets sum(bytes) bytes: rank r's `bytes[r]` bytes in rank order (send is bytes[rank()]).
  virtual void do_all_gather(const void* send, void* recv, const std::vector<size_t>& bytes) = 0;
  // send_bytes[j] bytes go to rank j (blocks back to back in send), recv_bytes[i] bytes arrive
  // from rank i (back to back in recv).
  virtual void do_all_to_all(const void* send, const std::vector<size_t>& send_bytes, void* recv,
                             const std::vector<size_t>& recv_bytes) = 0;
  virtual void do_broadcast(void* buf, size_t bytes, int root) = 0;
  virtual void do_send(const void* buf, size_t bytes, int dst, int tag) = 0;
  virtual void do_recv(void* buf, size_t bytes, int src, int tag) = 0;
  // Default: do_send then do_recv (right where a send never waits for its receiver: threads).
  virtual void do_sendrecv(const void* send, size_t send_bytes, int dst, void* recv, size_t recv_bytes, int src,
                           int tag) {
    do_send(send, send_bytes, dst, tag);
    do_recv(recv, recv_bytes, src, tag);
  }
  virtual void do_barrier() = 0;
  // Collective over this whole group. members: the ranks of this group that share this rank's
  // color, in new-rank order (empty when color < 0: then return nullptr).
  virtual std::unique_ptr<Communicator> do_split(int color, const std::vector<int>& members,
                                                 const std::string& name) = 0;
  // Reductions an implementation runs itself (NCCL on device buffers: its own kernels, not lathe's
  // rank-order host sum). Return false to take the portable path (all-to-all, then the rank-order
  // sum on the host), as MPI, threads and the local communicator do. Same contracts as the public
  // all_reduce / reduce_scatter; run on the progress thread.
  virtual bool do_all_reduce(void* /*buf*/, size_t /*count*/, DType /*dtype*/, ReduceOp /*op*/) { return false; }
  virtual bool do_reduce_scatter(const void* /*send*/, void* /*recv*/, const std::vector<size_t>& /*counts*/,
                                 DType /*dtype*/, ReduceOp /*op*/) {
    return false;
  }
  // All-gather of small HOST buffers (split's color/key exchange). Implementations whose
  // do_all_gather takes device buffers (NCCL) route this over their host communicator.
  virtual void do_host_all_gather(const void* send, void* recv, const std::vector<size_t>& bytes) {
    do_all_gather(send, recv, bytes);
  }
  // All-to-all of small HOST buffers (exchange_counts), routed as do_host_all_gather.
  virtual void do_host_all_to_all(const void* send, const std::vector<size_t>& send_bytes, void* recv,
                                  const std::vector<size_t>& recv_bytes) {
    do_all_to_all(send, send_bytes, recv, recv_bytes);
  }

  const std::shared_ptr<Watchdog>& watchdog() const { return watchdog_; }
  // Finishes the queued operations and stops the progress thread; every implementation calls it
  // first thing in its destructor (the thread runs the implementation's do_* methods).
  void stop_progress();

 private:
  // bytes: what the operation moves (profiler spans; -1 when not meaningful).
  WorkPtr issue(const char* op, std::function<void()> fn, int64_t bytes = -1);
  void reduce_scatter_now(const void* send, void* recv, const std::vector<size_t>& counts, DType dtype, ReduceOp op);
  struct Progress;
  int rank_, size_;
  std::string name_;
  std::shared_ptr<Watchdog> watchdog_;
  uint64_t seq_ = 0;
  int watchdog_slot_ = -1;              // used by the progress thread only
  std::unique_ptr<Progress> progress_;  // last member: its thread stops before the rest is destroyed
};

// One rank, no launcher: every collective is a copy (or nothing).
std::unique_ptr<Communicator> make_local_communicator(std::shared_ptr<Watchdog> watchdog = {});

// Runs fn(comm) on `n` threads, each holding rank i of an n-rank in-process group (tests and
// single-machine experiments). Rethrows the first exception any rank threw, after all finished.
// `watchdog` (optional) is shared by all ranks, as one process's would be.
void run_threads(int n, const std::function<void(Communicator&)>& fn, std::shared_ptr<Watchdog> watchdog = {});

// The process's world: an MPI communicator when this process was started by mpirun / srun
// (Open MPI or PMIx environment variables), otherwise a one-rank communicator (no MPI init).
// The watchdog's timeout ends the whole MPI job (MPI_Abort).
std::unique_ptr<Communicator> make_world_communicator(double timeout_s);
// True when started by an MPI launcher.
bool launched_by_mpi();
// Ends the whole job: MPI_Abort when MPI is running with more than one rank (so the other ranks do
// not wait forever for this one), else _Exit. Print the error before calling it.
[[noreturn]] void abort_job(int exit_code);
// "rank R of N: " while an MPI job of several ranks is running, else "" (for error lines).
std::string job_rank_prefix();
// After an error was printed: in an MPI job of several ranks, ends every rank (abort_job) so that
// none waits forever in a collective for this one; otherwise returns and the caller exits normally.
void end_job_after_error(int exit_code);

// Segment sizes for splitting `total` elements over n ranks: the first total % n get one more.
std::vector<size_t> even_counts(size_t total, int n);

}  // namespace lathe::dist
