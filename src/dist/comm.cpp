#include "dist/comm.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <map>
#include <mutex>
#include <thread>

#include "core/error.h"
#include "core/trace.h"

namespace lathe::dist {

namespace {
using Clock = std::chrono::steady_clock;

class TaskWork final : public Work {
 public:
  void wait() override {
    std::unique_lock<std::mutex> lk(m_);
    cv_.wait(lk, [&] { return done_; });
    if (error_) std::rethrow_exception(error_);
  }
  bool done() const override {
    std::lock_guard<std::mutex> lk(m_);
    return done_;
  }
  void finish(std::exception_ptr e) {
    {
      std::lock_guard<std::mutex> lk(m_);
      done_ = true;
      error_ = e;
    }
    cv_.notify_all();
  }

 private:
  mutable std::mutex m_;
  std::condition_variable cv_;
  bool done_ = false;
  std::exception_ptr error_;
};

template <typename T>
void combine(T* acc, const T* x, size_t n, ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
      for (size_t i = 0; i < n; ++i) acc[i] += x[i];
      break;
    case ReduceOp::Max:
      for (size_t i = 0; i < n; ++i) acc[i] = std::max(acc[i], x[i]);
      break;
    case ReduceOp::Min:
      for (size_t i = 0; i < n; ++i) acc[i] = std::min(acc[i], x[i]);
      break;
  }
}

void combine(DType t, void* acc, const void* x, size_t n, ReduceOp op) {
  switch (t) {
    case DType::F32:
      return combine(static_cast<float*>(acc), static_cast<const float*>(x), n, op);
    case DType::F64:
      return combine(static_cast<double*>(acc), static_cast<const double*>(x), n, op);
    case DType::I32:
      return combine(static_cast<int32_t*>(acc), static_cast<const int32_t*>(x), n, op);
    case DType::I64:
      return combine(static_cast<int64_t*>(acc), static_cast<const int64_t*>(x), n, op);
    default:
      throw_error("communicator: reductions support F32, F64, I32 and I64, not {}", dtype_name(t));
  }
}
}  // namespace

std::vector<size_t> even_counts(size_t total, int n) {
  std::vector<size_t> c(static_cast<size_t>(n), total / static_cast<size_t>(n));
  for (size_t i = 0; i < total % static_cast<size_t>(n); ++i) ++c[i];
  return c;
}

// ---------------------------------------------------------------------------------------------
// Watchdog

struct Watchdog::Slot {
  std::string description;
  const char* op = nullptr;
  uint64_t seq = 0;
  Clock::time_point start;
  bool active = false;
};

struct Watchdog::State {
  std::mutex m;
  std::condition_variable cv;
  std::deque<Slot> slots;  // deque: references stay valid as slots are added
  std::map<int, std::function<void()>> abort_hooks;
  int next_hook = 0;
  bool stop = false;
  std::thread thread;
};

Watchdog::Watchdog(double timeout_s, std::function<void(const std::string&)> on_timeout)
    : timeout_s_(timeout_s), on_timeout_(std::move(on_timeout)), state_(std::make_unique<State>()) {
  if (!on_timeout_)
    on_timeout_ = [](const std::string&) {
      std::fflush(stdout);
      std::_Exit(134);
    };
  if (timeout_s_ > 0) state_->thread = std::thread([this] { run(); });
}

Watchdog::~Watchdog() {
  {
    std::lock_guard<std::mutex> lk(state_->m);
    state_->stop = true;
  }
  state_->cv.notify_all();
  if (state_->thread.joinable()) state_->thread.join();
}

int Watchdog::register_slot(std::string description) {
  std::lock_guard<std::mutex> lk(state_->m);
  Slot slot;
  slot.description = std::move(description);
  state_->slots.push_back(std::move(slot));
  return static_cast<int>(state_->slots.size()) - 1;
}

void Watchdog::begin(int slot, const char* op, uint64_t seq) {
  std::lock_guard<std::mutex> lk(state_->m);
  Slot& s = state_->slots[static_cast<size_t>(slot)];
  s.op = op;
  s.seq = seq;
  s.start = Clock::now();
  s.active = true;
}

void Watchdog::end(int slot) {
  std::lock_guard<std::mutex> lk(state_->m);
  state_->slots[static_cast<size_t>(slot)].active = false;
}

int Watchdog::add_abort_hook(std::function<void()> hook) {
  std::lock_guard<std::mutex> lk(state_->m);
  const int id = state_->next_hook++;
  state_->abort_hooks.emplace(id, std::move(hook));
  return id;
}

void Watchdog::remove_abort_hook(int id) {
  std::lock_guard<std::mutex> lk(state_->m);
  state_->abort_hooks.erase(id);
}

void Watchdog::run() {
  std::unique_lock<std::mutex> lk(state_->m);
  const auto limit = std::chrono::duration<double>(timeout_s_);
  while (!state_->stop) {
    state_->cv.wait_for(lk, std::chrono::milliseconds(100));
    const auto now = Clock::now();
    for (const Slot& s : state_->slots) {
      if (!s.active || now - s.start < limit) continue;
      const int64_t step = step_.load();
      std::string msg = fmt::format(
          "lathe: watchdog: {}: {} #{} has not finished after {:.1f} s{} (parallel.timeout_s = {}); another rank "
          "is stuck, died or issued a different operation. Aborting the job.",
          s.description, s.op, s.seq, std::chrono::duration<double>(now - s.start).count(),
          step >= 0 ? fmt::format(" at step {}", step) : std::string(), timeout_s_);
      std::fprintf(stderr, "%s\n", msg.c_str());
      std::fflush(stderr);
      // Device communicators abort their in-flight work first (a copy: hooks may remove themselves).
      const auto hooks = state_->abort_hooks;
      lk.unlock();
      for (const auto& [id, hook] : hooks) hook();
      on_timeout_(msg);
      return;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Progress thread: runs the communicator's operations one after another, in issue order.

struct Communicator::Progress {
  std::mutex m;
  std::condition_variable cv;
  std::deque<std::function<void()>> tasks;
  bool stop = false;
  std::thread thread;

  explicit Progress(const std::string& name) {
    thread = std::thread([this, name] {
      trace::set_thread_name("comm " + name);  // the profiler's track of this group's operations
      std::unique_lock<std::mutex> lk(m);
      for (;;) {
        cv.wait(lk, [&] { return stop || !tasks.empty(); });
        if (tasks.empty()) return;  // stop requested and nothing left
        auto task = std::move(tasks.front());
        tasks.pop_front();
        lk.unlock();
        task();
        lk.lock();
      }
    });
  }
  ~Progress() {
    {
      std::lock_guard<std::mutex> lk(m);
      stop = true;
    }
    cv.notify_all();
    thread.join();
  }
  void push(std::function<void()> t) {
    {
      std::lock_guard<std::mutex> lk(m);
      tasks.push_back(std::move(t));
    }
    cv.notify_all();
  }
};

Communicator::Communicator(int rank, int size, std::string name, std::shared_ptr<Watchdog> watchdog)
    : rank_(rank), size_(size), name_(std::move(name)), watchdog_(std::move(watchdog)) {
  if (!watchdog_) watchdog_ = std::make_shared<Watchdog>(0.0);
  progress_ = std::make_unique<Progress>(name_);
}

Communicator::~Communicator() = default;

void Communicator::stop_progress() { progress_.reset(); }

std::string Communicator::describe() const { return fmt::format("group '{}' (rank {} of {})", name_, rank_, size_); }

WorkPtr Communicator::issue(const char* op, std::function<void()> fn, int64_t bytes) {
  LATHE_CHECK(progress_, "{}: {} issued after the communicator was shut down", describe(), op);
  auto work = std::make_shared<TaskWork>();
  const uint64_t seq = ++seq_;
  // The watchdog slot is registered lazily on first use (progress thread only touches it).
  auto wd = watchdog_;
  const std::string desc = describe();
  progress_->push([work, fn = std::move(fn), wd, op, seq, desc, bytes, this]() mutable {
    if (watchdog_slot_ < 0) watchdog_slot_ = wd->register_slot(desc);
    wd->begin(watchdog_slot_, op, seq);
    std::exception_ptr err;
    try {
      trace::Scope span(op, trace::Cat::Comm, bytes);
      fn();
    } catch (...) {
      err = std::current_exception();
    }
    wd->end(watchdog_slot_);
    work->finish(err);
  });
  return work;
}

void Communicator::reduce_scatter_now(const void* send, void* recv, const std::vector<size_t>& counts, DType dtype,
                                      ReduceOp op) {
  LATHE_CHECK(counts.size() == static_cast<size_t>(size_), "{}: reduce_scatter got {} counts for {} ranks", describe(),
              counts.size(), size_);
  const size_t es = dtype_size(dtype);
  const size_t mine = counts[static_cast<size_t>(rank_)];
  if (do_reduce_scatter(send, recv, counts, dtype, op)) return;  // the implementation's own (NCCL)
  if (size_ == 1) {
    if (recv != send && mine) std::memcpy(recv, send, mine * es);
    return;
  }
  // Everyone sends segment j to rank j; rank j receives its segment from every rank, in rank
  // order, and sums them in that order: the same bits whatever the transport does, and whatever
  // the pieces below (each element is still the rank-order sum of the same values).
  // Pieces: round k exchanges elements [k*piece, (k+1)*piece) of every segment, so the staging
  // (the pieces packed to send + the pieces received) stays within kReduceStagingBytes instead of
  // the whole send size (a 25 MB ZeRO bucket staged 50 MB on 2 ranks). The piece depends only on
  // the counts, the group and the dtype: every rank runs the same rounds. Writing recv's piece k
  // before round k+1 reads send is safe when recv is disjoint from send or is exactly this rank's
  // segment of it (round k has read that piece); any other overlap collects the result apart
  // (counts[rank] elements) and copies it into recv at the end.
  const int n = size_;
  std::vector<size_t> offset(static_cast<size_t>(n) + 1, 0);
  size_t most = 0;
  for (size_t j = 0; j < counts.size(); ++j) {
    offset[j + 1] = offset[j] + counts[j];
    most = std::max(most, counts[j]);
  }
  const auto in = reinterpret_cast<uintptr_t>(send), out = reinterpret_cast<uintptr_t>(recv);
  const uintptr_t own = in + offset[static_cast<size_t>(rank_)] * es;
  const bool direct = out + mine * es <= in || out >= in + offset.back() * es || out == own;
  std::vector<char> apart(direct ? 0 : mine * es);
  char* result = direct ? static_cast<char*>(recv) : apart.data();
  const size_t piece = std::max<size_t>(1, kReduceStagingBytes / 2 / es / static_cast<size_t>(n));
  const size_t rounds = std::max<size_t>(1, (most + piece - 1) / piece);
  std::vector<size_t> send_bytes(counts.size()), recv_bytes(counts.size());
  std::vector<char> packed, gathered;
  for (size_t k = 0; k < rounds; ++k) {
    const size_t lo = k * piece;
    auto part = [&](size_t j) { return counts[j] > lo ? std::min(piece, counts[j] - lo) : size_t{0}; };
    const size_t m = part(static_cast<size_t>(rank_));
    const char* src = static_cast<const char*>(send);
    if (rounds > 1) {  // this round's piece of every segment, back to back
      size_t at = 0;
      for (size_t j = 0; j < counts.size(); ++j) at += part(j) * es;
      packed.resize(at);
      at = 0;
      for (size_t j = 0; j < counts.size(); ++j) {
        if (part(j)) std::memcpy(packed.data() + at, src + (offset[j] + lo) * es, part(j) * es);
        at += part(j) * es;
      }
      src = packed.data();
    }
    for (size_t j = 0; j < counts.size(); ++j) {
      send_bytes[j] = part(j) * es;
      recv_bytes[j] = m * es;
    }
    gathered.resize(m * es * static_cast<size_t>(n));
    do_all_to_all(src, send_bytes, gathered.data(), recv_bytes);
    if (!m) continue;
    char* dst = result + lo * es;
    std::memcpy(dst, gathered.data(), m * es);
    for (int i = 1; i < n; ++i) combine(dtype, dst, gathered.data() + static_cast<size_t>(i) * m * es, m, op);
  }
  if (!direct && mine) std::memcpy(recv, apart.data(), mine * es);
}

WorkPtr Communicator::all_reduce_async(void* buf, size_t count, DType dtype, ReduceOp op) {
  return issue("all_reduce", [=, this] {
    if (size_ == 1) return;
    if (do_all_reduce(buf, count, dtype, op)) return;
    const auto counts = even_counts(count, size_);
    size_t offset = 0;
    for (int r = 0; r < rank_; ++r) offset += counts[static_cast<size_t>(r)];
    const size_t es = dtype_size(dtype);
    // Reduce this rank's segment in place, then gather every segment in place.
    char* mine = static_cast<char*>(buf) + offset * es;
    reduce_scatter_now(buf, mine, counts, dtype, op);
    std::vector<size_t> bytes(counts.size());
    for (size_t j = 0; j < counts.size(); ++j) bytes[j] = counts[j] * es;
    do_all_gather(mine, buf, bytes);
  }, static_cast<int64_t>(count * dtype_size(dtype)));
}

WorkPtr Communicator::reduce_scatter_async(const void* send, void* recv, const std::vector<size_t>& counts, DType dtype,
                                           ReduceOp op) {
  size_t total = 0;
  for (size_t c : counts) total += c;
  return issue("reduce_scatter", [=, this] { reduce_scatter_now(send, recv, counts, dtype, op); },
               static_cast<int64_t>(total * dtype_size(dtype)));
}

WorkPtr Communicator::all_gather_async(const void* send, void* recv, const std::vector<size_t>& counts, DType dtype) {
  LATHE_CHECK(counts.size() == static_cast<size_t>(size_), "{}: all_gather got {} counts for {} ranks", describe(),
              counts.size(), size_);
  return issue("all_gather", [=, this] {
    const size_t es = dtype_size(dtype);
    std::vector<size_t> bytes(counts.size());
    for (size_t j = 0; j < counts.size(); ++j) bytes[j] = counts[j] * es;
    // send may alias this rank's own segment of recv (implementations then skip that copy: MPI
    // with MPI_IN_PLACE), so no private copy of a possibly large shard is made.
    const char* own = static_cast<const char*>(send);
    do_all_gather(own, recv, bytes);
  }, static_cast<int64_t>([&] {
    size_t t = 0;
    for (size_t c : counts) t += c;
    return t * dtype_size(dtype);
  }()));
}

WorkPtr Communicator::all_to_all_async(const void* send, const std::vector<size_t>& send_counts, void* recv,
                                       const std::vector<size_t>& recv_counts, DType dtype) {
  LATHE_CHECK(send_counts.size() == static_cast<size_t>(size_) && recv_counts.size() == static_cast<size_t>(size_),
              "{}: all_to_all got {} send counts and {} receive counts for {} ranks", describe(), send_counts.size(),
              recv_counts.size(), size_);
  const size_t es = dtype_size(dtype);
  std::vector<size_t> sb(send_counts.size()), rb(recv_counts.size());
  size_t moved = 0;
  for (size_t j = 0; j < sb.size(); ++j) {
    sb[j] = send_counts[j] * es;
    rb[j] = recv_counts[j] * es;
    moved += sb[j] + rb[j];
  }
  if (size_ == 1)
    LATHE_CHECK(sb[0] == rb[0], "{}: all_to_all sends {} elements to itself but expects {}", describe(), send_counts[0],
                recv_counts[0]);
  return issue(
      "all_to_all", [=, this] { do_all_to_all(send, sb, recv, rb); }, static_cast<int64_t>(moved));
}

void Communicator::all_to_all(const void* send, const std::vector<size_t>& send_counts, void* recv,
                              const std::vector<size_t>& recv_counts, DType dtype) {
  all_to_all_async(send, send_counts, recv, recv_counts, dtype)->wait();
}

std::vector<size_t> Communicator::exchange_counts(const std::vector<size_t>& send_counts) {
  LATHE_CHECK(send_counts.size() == static_cast<size_t>(size_), "{}: exchange_counts got {} counts for {} ranks",
              describe(), send_counts.size(), size_);
  std::vector<uint64_t> mine(send_counts.begin(), send_counts.end()), theirs(send_counts.size());
  issue("exchange_counts", [&, this] {
    if (size_ == 1) {
      theirs = mine;
      return;
    }
    const std::vector<size_t> bytes(mine.size(), sizeof(uint64_t));
    do_host_all_to_all(mine.data(), bytes, theirs.data(), bytes);
  })->wait();
  return std::vector<size_t>(theirs.begin(), theirs.end());
}

WorkPtr Communicator::broadcast_async(void* buf, size_t bytes, int root) {
  LATHE_CHECK(root >= 0 && root < size_, "{}: broadcast root {} is not a rank", describe(), root);
  return issue("broadcast", [=, this] {
    if (size_ > 1) do_broadcast(buf, bytes, root);
  }, static_cast<int64_t>(bytes));
}

WorkPtr Communicator::send_async(const void* buf, size_t bytes, int dst, int tag) {
  LATHE_CHECK(dst >= 0 && dst < size_ && dst != rank_, "{}: send to rank {} (not another rank of the group)",
              describe(), dst);
  return issue("send", [=, this] { do_send(buf, bytes, dst, tag); }, static_cast<int64_t>(bytes));
}

WorkPtr Communicator::recv_async(void* buf, size_t bytes, int src, int tag) {
  LATHE_CHECK(src >= 0 && src < size_ && src != rank_, "{}: recv from rank {} (not another rank of the group)",
              describe(), src);
  return issue("recv", [=, this] { do_recv(buf, bytes, src, tag); }, static_cast<int64_t>(bytes));
}

void Communicator::all_reduce(void* buf, size_t count, DType dtype, ReduceOp op) {
  all_reduce_async(buf, count, dtype, op)->wait();
}
void Communicator::reduce_scatter(const void* send, void* recv, const std::vector<size_t>& counts, DType dtype,
                                  ReduceOp op) {
  LATHE_CHECK(counts.size() == static_cast<size_t>(size_), "{}: reduce_scatter got {} counts for {} ranks", describe(),
              counts.size(), size_);
  reduce_scatter_async(send, recv, counts, dtype, op)->wait();
}
void Communicator::all_gather(const void* send, void* recv, const std::vector<size_t>& counts, DType dtype) {
  all_gather_async(send, recv, counts, dtype)->wait();
}
void Communicator::broadcast(void* buf, size_t bytes, int root) { broadcast_async(buf, bytes, root)->wait(); }
WorkPtr Communicator::sendrecv_async(const void* send, size_t send_bytes, int dst, void* recv, size_t recv_bytes,
                                     int src, int tag) {
  LATHE_CHECK(dst >= 0 && dst < size_ && dst != rank_ && src >= 0 && src < size_ && src != rank_,
              "{}: sendrecv to rank {} from rank {} (both must be other ranks of the group)", describe(), dst, src);
  return issue("sendrecv", [=, this] { do_sendrecv(send, send_bytes, dst, recv, recv_bytes, src, tag); },
               static_cast<int64_t>(send_bytes + recv_bytes));
}
void Communicator::sendrecv(const void* send, size_t send_bytes, int dst, void* recv, size_t recv_bytes, int src,
                            int tag) {
  sendrecv_async(send, send_bytes, dst, recv, recv_bytes, src, tag)->wait();
}

void Communicator::send(const void* buf, size_t bytes, int dst, int tag) { send_async(buf, bytes, dst, tag)->wait(); }
void Communicator::recv(void* buf, size_t bytes, int src, int tag) { recv_async(buf, bytes, src, tag)->wait(); }
void Communicator::barrier() {
  issue("barrier", [this] {
    if (size_ > 1) do_barrier();
  })->wait();
}
void Communicator::synchronize() {
  issue("synchronize", [] {})->wait();
}

std::unique_ptr<Communicator> Communicator::split(int color, int key, const std::string& name) {
  std::unique_ptr<Communicator> out;
  issue("split", [&, this] {
    // Everyone learns everyone's (color, key); members of a color sort by (key, old rank).
    std::vector<int64_t> mine = {color, key}, all(2 * static_cast<size_t>(size_));
    std::vector<size_t> bytes(static_cast<size_t>(size_), sizeof(int64_t) * 2);
    if (size_ == 1)
      all = mine;
    else
      do_host_all_gather(mine.data(), all.data(), bytes);
    std::vector<std::pair<int64_t, int>> members;
    for (int r = 0; r < size_; ++r)
      if (all[2 * static_cast<size_t>(r)] == color) members.push_back({all[2 * static_cast<size_t>(r) + 1], r});
    std::sort(members.begin(), members.end());
    std::vector<int> ranks;
    for (auto& m : members) ranks.push_back(m.second);
    if (color < 0) ranks.clear();
    out = do_split(color, ranks, name);
  })->wait();
  return out;
}

// ---------------------------------------------------------------------------------------------
// Single rank.

namespace {
class LocalCommunicator final : public Communicator {
 public:
  LocalCommunicator(std::string name, std::shared_ptr<Watchdog> wd) : Communicator(0, 1, std::move(name), wd) {}
  ~LocalCommunicator() override { stop_progress(); }

 protected:
  void do_all_gather(const void* send, void* recv, const std::vector<size_t>& bytes) override {
    if (send != recv && bytes[0]) std::memcpy(recv, send, bytes[0]);
  }
  void do_all_to_all(const void* send, const std::vector<size_t>& sb, void* recv, const std::vector<size_t>&) override {
    if (send != recv && sb[0]) std::memcpy(recv, send, sb[0]);
  }
  void do_broadcast(void*, size_t, int) override {}
  void do_send(const void*, size_t, int, int) override { throw_error("{}: send on a one-rank group", describe()); }
  void do_recv(void*, size_t, int, int) override { throw_error("{}: recv on a one-rank group", describe()); }
  void do_barrier() override {}
  std::unique_ptr<Communicator> do_split(int color, const std::vector<int>&, const std::string& name) override {
    if (color < 0) return nullptr;
    return std::make_unique<LocalCommunicator>(name, watchdog());
  }
};
}  // namespace

std::unique_ptr<Communicator> make_local_communicator(std::shared_ptr<Watchdog> watchdog) {
  return std::make_unique<LocalCommunicator>("world", std::move(watchdog));
}

}  // namespace lathe::dist
