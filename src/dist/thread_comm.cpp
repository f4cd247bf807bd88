// N ranks as N threads of one process (run_threads): the same Communicator contract as MPI, for
// fast unit tests of everything built on it. Ranks meet at a generation barrier: each posts its
// buffer pointers, all wait, each copies what it needs straight from the others' buffers, all
// wait again (so no buffer is reused while another rank still reads it).
#include <fmt/format.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <thread>
#include <tuple>

#include "core/error.h"
#include "dist/comm.h"

namespace lathe::dist {

namespace {

struct GroupState {
  explicit GroupState(int n, std::shared_ptr<std::atomic<bool>> failed)
      : n(n), ptrs(static_cast<size_t>(n)), sizes(static_cast<size_t>(n)), failed(std::move(failed)) {}
  const int n;
  std::mutex m;
  std::condition_variable cv;
  int arrived = 0;
  uint64_t generation = 0;
  std::vector<const void*> ptrs;
  std::vector<std::vector<size_t>> sizes;
  std::map<std::tuple<int, int, int>, std::deque<std::vector<char>>> mail;   // (src, dst, tag)
  std::map<std::pair<uint64_t, int>, std::shared_ptr<GroupState>> children;  // (split number, leader)
  std::shared_ptr<std::atomic<bool>> failed;                                 // set when any rank of the run threw

  // Waits on the condition, waking every 20 ms to notice a failed peer (which would never arrive).
  template <typename Pred>
  void wait(std::unique_lock<std::mutex>& lk, Pred pred) {
    while (!pred()) {
      if (failed->load()) throw_error("thread communicator: another rank failed; abandoning this collective");
      cv.wait_for(lk, std::chrono::milliseconds(20));
    }
  }

  void barrier() {
    std::unique_lock<std::mutex> lk(m);
    const uint64_t gen = generation;
    if (++arrived == n) {
      arrived = 0;
      ++generation;
      cv.notify_all();
      return;
    }
    wait(lk, [&] { return generation != gen; });
  }
};

class ThreadCommunicator final : public Communicator {
 public:
  ThreadCommunicator(int rank, std::shared_ptr<GroupState> g, std::string name, std::shared_ptr<Watchdog> wd)
      : Communicator(rank, g->n, std::move(name), std::move(wd)), g_(std::move(g)) {}
  ~ThreadCommunicator() override { stop_progress(); }

 protected:
  void do_all_gather(const void* send, void* recv, const std::vector<size_t>& bytes) override {
    post(send, {});
    size_t off = 0;
    for (int r = 0; r < size(); ++r) {
      const size_t b = bytes[static_cast<size_t>(r)];
      if (b && static_cast<char*>(recv) + off != g_->ptrs[static_cast<size_t>(r)])
        std::memcpy(static_cast<char*>(recv) + off, g_->ptrs[static_cast<size_t>(r)], b);
      off += b;
    }
    g_->barrier();
  }

  void do_all_to_all(const void* send, const std::vector<size_t>& send_bytes, void* recv,
                     const std::vector<size_t>& recv_bytes) override {
    post(send, send_bytes);
    const size_t me = static_cast<size_t>(rank());
    size_t out = 0;
    for (size_t i = 0; i < static_cast<size_t>(size()); ++i) {
      const auto& their = g_->sizes[i];
      size_t off = 0;
      for (size_t k = 0; k < me; ++k) off += their[k];
      LATHE_CHECK(their[me] == recv_bytes[i], "{}: all_to_all: rank {} sends {} bytes, rank {} expects {}", describe(),
                  i, their[me], me, recv_bytes[i]);
      if (their[me])
        std::memcpy(static_cast<char*>(recv) + out, static_cast<const char*>(g_->ptrs[i]) + off, their[me]);
      out += their[me];
    }
    g_->barrier();
  }

  void do_broadcast(void* buf, size_t bytes, int root) override {
    post(buf, {bytes});
    if (rank() != root) {
      LATHE_CHECK(g_->sizes[static_cast<size_t>(root)][0] == bytes, "{}: broadcast of {} bytes, root sends {}",
                  describe(), bytes, g_->sizes[static_cast<size_t>(root)][0]);
      std::memcpy(buf, g_->ptrs[static_cast<size_t>(root)], bytes);
    }
    g_->barrier();
  }

  void do_send(const void* buf, size_t bytes, int dst, int tag) override {
    std::lock_guard<std::mutex> lk(g_->m);
    const char* p = static_cast<const char*>(buf);
    g_->mail[{rank(), dst, tag}].emplace_back(p, p + bytes);
    g_->cv.notify_all();
  }

  void do_recv(void* buf, size_t bytes, int src, int tag) override {
    std::unique_lock<std::mutex> lk(g_->m);
    auto& q = g_->mail[{src, rank(), tag}];
    g_->wait(lk, [&] { return !q.empty(); });
    std::vector<char> msg = std::move(q.front());
    q.pop_front();
    LATHE_CHECK(msg.size() == bytes, "{}: recv of {} bytes from rank {} tag {}, but {} bytes were sent", describe(),
                bytes, src, tag, msg.size());
    if (bytes) std::memcpy(buf, msg.data(), bytes);
  }

  void do_barrier() override { g_->barrier(); }

  std::unique_ptr<Communicator> do_split(int color, const std::vector<int>& members, const std::string& name) override {
    const uint64_t split_no = splits_++;
    std::unique_ptr<Communicator> out;
    if (color >= 0) {
      const int leader = members.front();
      const int new_rank = static_cast<int>(std::find(members.begin(), members.end(), rank()) - members.begin());
      std::shared_ptr<GroupState> child;
      {
        std::unique_lock<std::mutex> lk(g_->m);
        auto key = std::make_pair(split_no, leader);
        if (rank() == leader) {
          child = std::make_shared<GroupState>(static_cast<int>(members.size()), g_->failed);
          g_->children[key] = child;
          g_->cv.notify_all();
        } else {
          g_->wait(lk, [&] { return g_->children.count(key) > 0; });
          child = g_->children[key];
        }
      }
      out = std::make_unique<ThreadCommunicator>(new_rank, child, name, watchdog());
    }
    g_->barrier();  // everyone has picked up its group: the registry entries can go
    if (rank() == 0) {
      std::lock_guard<std::mutex> lk(g_->m);
      for (auto it = g_->children.begin(); it != g_->children.end();)
        it = it->first.first == split_no ? g_->children.erase(it) : std::next(it);
    }
    return out;
  }

 private:
  // Publishes this rank's pointer and sizes, then waits until every rank has.
  void post(const void* p, std::vector<size_t> sizes) {
    {
      std::lock_guard<std::mutex> lk(g_->m);
      g_->ptrs[static_cast<size_t>(rank())] = p;
      g_->sizes[static_cast<size_t>(rank())] = std::move(sizes);
    }
    g_->barrier();
  }

  std::shared_ptr<GroupState> g_;
  uint64_t splits_ = 0;
};

}  // namespace

void run_threads(int n, const std::function<void(Communicator&)>& fn, std::shared_ptr<Watchdog> watchdog) {
  LATHE_CHECK(n >= 1, "run_threads: {} ranks", n);
  auto failed = std::make_shared<std::atomic<bool>>(false);
  auto group = std::make_shared<GroupState>(n, failed);
  auto wd = watchdog ? watchdog : std::make_shared<Watchdog>(0.0);
  std::vector<std::exception_ptr> errors(static_cast<size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        ThreadCommunicator comm(r, group, "world", wd);
        fn(comm);
        comm.synchronize();
      } catch (...) {
        errors[static_cast<size_t>(r)] = std::current_exception();
        failed->store(true);
      }
    });
  for (auto& t : threads) t.join();
  // Report the rank that failed first-hand, not the peers that gave up because of it.
  std::exception_ptr first;
  for (auto& e : errors) {
    if (!e) continue;
    try {
      std::rethrow_exception(e);
    } catch (const std::exception& ex) {
      if (std::string(ex.what()).find("another rank failed") == std::string::npos) std::rethrow_exception(e);
    }
    if (!first) first = e;
  }
  if (first) std::rethrow_exception(first);
}

}  // namespace lathe::dist
