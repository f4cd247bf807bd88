// NCCL communicator (dist/nccl_comm.h). Compiled with LATHE_HAVE_NCCL on CUDA builds (CMakeLists.txt
// gives this one file the CUDA and NCCL include directories); elsewhere only the refusal below.
#include "dist/nccl_comm.h"

#include <fmt/format.h>

#include "core/error.h"

#ifdef LATHE_HAVE_NCCL
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>

#include "dist/device_bootstrap.h"
#endif

namespace lathe::dist {

#ifndef LATHE_HAVE_NCCL

bool have_nccl() { return false; }

std::unique_ptr<Communicator> make_nccl_communicator(Communicator& host, int) {
  throw_error(
      "{}: NCCL is not available: this lathe was built without CUDA/NCCL (rebuild with cmake -DLATHE_CUDA=ON on a "
      "machine with the CUDA toolkit and NCCL, or set device: cpu)",
      host.describe());
}

#else

bool have_nccl() { return true; }

namespace {

const char* nccl_hint(ncclResult_t r) {
  switch (r) {
    case ncclRemoteError:
      return " (another rank failed or its connection dropped; its own error says why)";
    case ncclSystemError:
      return " (a system call or the network failed; NCCL_DEBUG=WARN prints which)";
    case ncclInvalidUsage:
      return " (ranks issued different operations, counts or roots: collectives must match on every rank)";
    case ncclUnhandledCudaError:
      return " (a CUDA call inside NCCL failed: the GPU may be in an error state)";
    default:
      return "";
  }
}

void check_nccl(ncclResult_t r, const char* call, const std::string& where, ncclComm_t comm = nullptr) {
  if (r == ncclSuccess) return;
  const char* last = ncclGetLastError(comm);
  throw_error("{}: NCCL {} failed: {}{}{}", where, call, ncclGetErrorString(r),
              last && *last ? fmt::format(" ({})", last) : std::string(), nccl_hint(r));
}

void check_cuda(cudaError_t e, const char* call, const std::string& where) {
  if (e == cudaSuccess) return;
  throw_error("{}: {} failed: {} ({})", where, call, cudaGetErrorString(e), cudaGetErrorName(e));
}

ncclDataType_t nccl_type(DType t, const std::string& where) {
  switch (t) {
    case DType::F32:
      return ncclFloat32;
    case DType::F64:
      return ncclFloat64;
    case DType::BF16:
      return ncclBfloat16;
    case DType::F16:
      return ncclFloat16;
    case DType::I32:
      return ncclInt32;
    case DType::I64:
      return ncclInt64;
    case DType::U8:
      return ncclUint8;
    default:
      throw_error("{}: NCCL has no element type for {}", where, dtype_name(t));
  }
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::Max:
      return ncclMax;
    case ReduceOp::Min:
      return ncclMin;
    default:
      return ncclSum;
  }
}

std::string uuid_hex(const cudaUUID_t& u) {
  std::string s = "GPU-";
  for (int i = 0; i < 16; ++i) s += fmt::format("{:02x}", static_cast<unsigned char>(u.bytes[i]));
  return s;
}

class NcclCommunicator final : public Communicator {
 public:
  // `owned` (a split's host subgroup) or `borrowed` (the world) is the host communicator.
  NcclCommunicator(std::unique_ptr<Communicator> owned, Communicator* borrowed, int device, const std::string& name,
                   std::shared_ptr<Watchdog> wd)
      : Communicator((owned ? *owned : *borrowed).rank(), (owned ? *owned : *borrowed).size(), name, std::move(wd)),
        owned_host_(std::move(owned)),
        host_(owned_host_ ? owned_host_.get() : borrowed),
        device_(device) {
    const std::string where = describe();
    check_cuda(cudaSetDevice(device_), "cudaSetDevice", where);
    check_cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags", where);
    check_cuda(cudaMalloc(&scratch_, 64), "cudaMalloc (barrier scratch)", where);
    bootstrap_group(
        *host_, sizeof(ncclUniqueId),
        [&](void* id) { check_nccl(ncclGetUniqueId(static_cast<ncclUniqueId*>(id)), "ncclGetUniqueId", where); },
        [&](const void* id, int rank, int size) {
          ncclUniqueId uid;
          std::memcpy(&uid, id, sizeof(uid));
          check_nccl(ncclCommInitRank(&comm_, size, uid, rank), "ncclCommInitRank", where);
        });
    // The watchdog's timeout aborts this communicator's stuck kernels before the job ends.
    hook_ = watchdog()->add_abort_hook([this] { abort_from_watchdog(); });
  }

  ~NcclCommunicator() override {
    stop_progress();
    watchdog()->remove_abort_hook(hook_);
    cudaSetDevice(device_);
    if (comm_ && !aborted_.load()) ncclCommDestroy(comm_);  // an abort already freed it
    if (scratch_) cudaFree(scratch_);
    if (stream_) cudaStreamDestroy(stream_);
  }

 protected:
  void do_all_gather(const void* send, void* recv, const std::vector<size_t>& bytes) override {
    const bool even = std::all_of(bytes.begin(), bytes.end(), [&](size_t b) { return b == bytes[0]; });
    run("all_gather", [&] {
      if (even) {
        check(ncclAllGather(send, recv, bytes[0], ncclUint8, comm_, stream_), "ncclAllGather");
        return;
      }
      // Uneven segments: rank j broadcasts its segment into place (one group, one launch).
      check(ncclGroupStart(), "ncclGroupStart");
      size_t off = 0;
      for (int j = 0; j < size(); ++j) {
        const size_t b = bytes[static_cast<size_t>(j)];
        char* dst = static_cast<char*>(recv) + off;
        if (b) check(ncclBroadcast(j == rank() ? send : dst, dst, b, ncclUint8, j, comm_, stream_), "ncclBroadcast");
        off += b;
      }
      check(ncclGroupEnd(), "ncclGroupEnd");
    });
  }

  void do_all_to_all(const void* send, const std::vector<size_t>& send_bytes, void* recv,
                     const std::vector<size_t>& recv_bytes) override {
    run("all_to_all", [&] {
      check(ncclGroupStart(), "ncclGroupStart");
      size_t so = 0, ro = 0;
      for (int j = 0; j < size(); ++j) {
        const size_t sb = send_bytes[static_cast<size_t>(j)], rb = recv_bytes[static_cast<size_t>(j)];
        if (sb) check(ncclSend(static_cast<const char*>(send) + so, sb, ncclUint8, j, comm_, stream_), "ncclSend");
        if (rb) check(ncclRecv(static_cast<char*>(recv) + ro, rb, ncclUint8, j, comm_, stream_), "ncclRecv");
        so += sb;
        ro += rb;
      }
      check(ncclGroupEnd(), "ncclGroupEnd");
    });
  }

  void do_broadcast(void* buf, size_t bytes, int root) override {
    run("broadcast", [&] { check(ncclBroadcast(buf, buf, bytes, ncclUint8, root, comm_, stream_), "ncclBroadcast"); });
  }

  void do_send(const void* buf, size_t bytes, int dst, int) override {
    run("send", [&] { check(ncclSend(buf, bytes, ncclUint8, dst, comm_, stream_), "ncclSend"); });
  }

  void do_recv(void* buf, size_t bytes, int src, int) override {
    run("recv", [&] { check(ncclRecv(buf, bytes, ncclUint8, src, comm_, stream_), "ncclRecv"); });
  }

  // One group: the send and the receive progress together (a ring cannot deadlock).
  void do_sendrecv(const void* send, size_t send_bytes, int dst, void* recv, size_t recv_bytes, int src,
                   int) override {
    run("sendrecv", [&] {
      check(ncclGroupStart(), "ncclGroupStart");
      if (send_bytes) check(ncclSend(send, send_bytes, ncclUint8, dst, comm_, stream_), "ncclSend");
      if (recv_bytes) check(ncclRecv(recv, recv_bytes, ncclUint8, src, comm_, stream_), "ncclRecv");
      check(ncclGroupEnd(), "ncclGroupEnd");
    });
  }

  void do_barrier() override {
    run("barrier",
        [&] { check(ncclAllReduce(scratch_, scratch_, 1, ncclInt32, ncclSum, comm_, stream_), "ncclAllReduce"); });
  }

  std::unique_ptr<Communicator> do_split(int color, const std::vector<int>& members, const std::string& name) override {
    const int key =
        color < 0 ? 0 : static_cast<int>(std::find(members.begin(), members.end(), rank()) - members.begin());
    auto sub = host_->split(color, key, name);  // same colors and keys: the same members in the same order
    if (!sub) return nullptr;
    bind();
    return std::make_unique<NcclCommunicator>(std::move(sub), nullptr, device_, name, watchdog());
  }

  bool do_all_reduce(void* buf, size_t count, DType dtype, ReduceOp op) override {
    const ncclDataType_t t = nccl_type(dtype, describe());
    run("all_reduce", [&] { check(ncclAllReduce(buf, buf, count, t, nccl_op(op), comm_, stream_), "ncclAllReduce"); });
    return true;
  }

  bool do_reduce_scatter(const void* send, void* recv, const std::vector<size_t>& counts, DType dtype,
                         ReduceOp op) override {
    const ncclDataType_t t = nccl_type(dtype, describe());
    const size_t es = dtype_size(dtype);
    size_t total = 0, mine_off = 0;
    for (int j = 0; j < size(); ++j) {
      if (j == rank()) mine_off = total;
      total += counts[static_cast<size_t>(j)];
    }
    const size_t mine = counts[static_cast<size_t>(rank())];
    const bool even = std::all_of(counts.begin(), counts.end(), [&](size_t c) { return c == counts[0]; });
    run("reduce_scatter", [&] {
      // recv may overlap send (comm.h). NCCL's in place is recv == send + own segment; any other
      // overlap reads from a private copy of send.
      const char* src = static_cast<const char*>(send);
      char* out = static_cast<char*>(recv);
      void* staged = nullptr;
      const bool in_place = out == src + mine_off * es;
      if (!in_place && out < src + total * es && src < out + mine * es) {
        check_cuda(cudaMallocAsync(&staged, total * es, stream_), "cudaMallocAsync (reduce_scatter staging)",
                   describe());
        check_cuda(cudaMemcpyAsync(staged, src, total * es, cudaMemcpyDeviceToDevice, stream_), "cudaMemcpyAsync",
                   describe());
        src = static_cast<const char*>(staged);
      }
      if (even) {
        check(ncclReduceScatter(src, out, mine, t, nccl_op(op), comm_, stream_), "ncclReduceScatter");
      } else {
        // Uneven segments: segment j reduced onto rank j (one group, one launch).
        check(ncclGroupStart(), "ncclGroupStart");
        size_t off = 0;
        for (int j = 0; j < size(); ++j) {
          const size_t c = counts[static_cast<size_t>(j)];
          if (c) check(ncclReduce(src + off * es, out, c, t, nccl_op(op), j, comm_, stream_), "ncclReduce");
          off += c;
        }
        check(ncclGroupEnd(), "ncclGroupEnd");
      }
      if (staged) check_cuda(cudaFreeAsync(staged, stream_), "cudaFreeAsync", describe());
    });
    return true;
  }

  void do_host_all_gather(const void* send, void* recv, const std::vector<size_t>& bytes) override {
    host_->all_gather(send, recv, bytes, DType::U8);  // split's colors and keys live on the host
  }

  void do_host_all_to_all(const void* send, const std::vector<size_t>& send_bytes, void* recv,
                          const std::vector<size_t>& recv_bytes) override {
    host_->all_to_all(send, send_bytes, recv, recv_bytes, DType::U8);  // exchange_counts' counts are host values
  }

 private:
  void bind() { check_cuda(cudaSetDevice(device_), "cudaSetDevice", describe()); }

  void check(ncclResult_t r, const char* call) { check_nccl(r, call, describe(), comm_); }

  // Enqueues on the stream, then waits for it while watching for NCCL's asynchronous errors and the
  // watchdog's abort request (so a dead peer becomes an error here, not a hang).
  template <typename F>
  void run(const char* op, F&& enqueue) {
    LATHE_CHECK(!aborted_.load(), "{}: {} after the NCCL communicator was aborted", describe(), op);
    bind();
    enqueue();
    for (int spins = 0;; ++spins) {
      const cudaError_t q = cudaStreamQuery(stream_);
      if (q == cudaSuccess) return;
      if (q != cudaErrorNotReady) check_cuda(q, "cudaStreamQuery", fmt::format("{}: {}", describe(), op));
      ncclResult_t async = ncclSuccess;
      check_nccl(ncclCommGetAsyncError(comm_, &async), "ncclCommGetAsyncError", describe(), comm_);
      if (async != ncclSuccess && async != ncclInProgress) {
        abort_here();
        check_nccl(async, op, describe());
      }
      if (abort_requested_.load()) {
        abort_here();
        throw_error("{}: {} aborted by the watchdog (parallel.timeout_s)", describe(), op);
      }
      if (spins < 1000)
        std::this_thread::yield();
      else
        std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  // On the progress thread: abort once (ncclCommAbort frees the communicator).
  void abort_here() {
    bool expected = false;
    if (aborted_.compare_exchange_strong(expected, true)) ncclCommAbort(comm_);
  }

  // On the watchdog's thread: ask the progress thread (polling in run) to abort, wait up to 2 s for
  // it, then abort from here (the progress thread may be stuck inside an NCCL call).
  void abort_from_watchdog() {
    abort_requested_.store(true);
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(2);
    while (!aborted_.load() && std::chrono::steady_clock::now() < until)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    if (!aborted_.load()) {
      cudaSetDevice(device_);
      abort_here();
    }
  }

  std::unique_ptr<Communicator> owned_host_;
  Communicator* host_;
  int device_;
  cudaStream_t stream_ = nullptr;
  void* scratch_ = nullptr;
  ncclComm_t comm_ = nullptr;
  int hook_ = -1;
  std::atomic<bool> abort_requested_{false}, aborted_{false};
};

}  // namespace

std::unique_ptr<Communicator> make_nccl_communicator(Communicator& host, int device) {
  const std::string where = host.describe();
  check_cuda(cudaSetDevice(device), "cudaSetDevice", where);
  // One rank per GPU: two ranks of a node on one device would fail inside NCCL's init with less to
  // go on (the backend picks local rank modulo the device count).
  cudaDeviceProp prop{};
  check_cuda(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties", where);
  int count = 0;
  check_cuda(cudaGetDeviceCount(&count), "cudaGetDeviceCount", where);
  (void)device_for_local_rank(local_rank(host), count);
  check_distinct_devices(host, host_name(), uuid_hex(prop.uuid));
  return std::make_unique<NcclCommunicator>(nullptr, &host, device, host.name(), host.shared_watchdog());
}

#endif

}  // namespace lathe::dist
