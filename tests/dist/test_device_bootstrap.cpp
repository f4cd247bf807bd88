// The CPU-side logic of device communicators (dist/device_bootstrap.h), over the thread
// communicator: the launcher's local rank from its environment, local ranks from host names,
// one GPU per rank, the unique-id bootstrap of a group and of split groups (what NCCL's init
// receives), a root failure reaching every rank, the Communicator hooks a device implementation
// overrides (its own reductions, host exchange for split), and the watchdog's abort hooks.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "core/error.h"
#include "dist/comm.h"
#include "dist/device_bootstrap.h"
#include "dist/nccl_comm.h"
#include "error_of.h"

using namespace lathe;
using namespace lathe::dist;

namespace {

std::string error_of(const std::function<void()>& f) { return lathe::test::exception_of(f); }

auto env_of(std::map<std::string, std::string> vars) {
  return [vars = std::move(vars)](const char* name) -> const char* {
    auto it = vars.find(name);
    return it == vars.end() ? nullptr : it->second.c_str();
  };
}

TEST(LocalRank, FromEachLauncher) {
  EXPECT_FALSE(local_rank_from_env(env_of({})).has_value());
  auto ompi = local_rank_from_env(env_of({{"OMPI_COMM_WORLD_LOCAL_RANK", "3"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "8"}}));
  ASSERT_TRUE(ompi);
  EXPECT_EQ(ompi->rank, 3);
  EXPECT_EQ(ompi->size, 8);
  EXPECT_EQ(ompi->source, "OMPI_COMM_WORLD_LOCAL_RANK");
  auto mpich = local_rank_from_env(env_of({{"MPI_LOCALRANKID", "1"}, {"MPI_LOCALNRANKS", "2"}}));
  ASSERT_TRUE(mpich);
  EXPECT_EQ(mpich->rank, 1);
  auto torchrun = local_rank_from_env(env_of({{"LOCAL_RANK", "0"}, {"LOCAL_WORLD_SIZE", "4"}}));
  ASSERT_TRUE(torchrun);
  EXPECT_EQ(torchrun->size, 4);
  // Open MPI wins over a stray LOCAL_RANK.
  auto both = local_rank_from_env(env_of({{"LOCAL_RANK", "5"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}}));
  ASSERT_TRUE(both);
  EXPECT_EQ(both->rank, 1);
  EXPECT_EQ(both->size, 2);  // no size variable: at least rank + 1
  // Slurm's uneven "2(x3)" per-node counts are not a size: fall through (here: to nothing).
  EXPECT_FALSE(local_rank_from_env(env_of({{"SLURM_LOCALID", "1"}, {"SLURM_NTASKS_PER_NODE", "2(x3)"}})));
  auto slurm = local_rank_from_env(env_of({{"SLURM_LOCALID", "1"}, {"SLURM_NTASKS_PER_NODE", "4"}}));
  ASSERT_TRUE(slurm);
  EXPECT_EQ(slurm->rank, 1);
}

TEST(LocalRank, MalformedLauncherValuesNameTheVariable) {
  std::string e = error_of([] { local_rank_from_env(env_of({{"OMPI_COMM_WORLD_LOCAL_RANK", "x1"}})); });
  EXPECT_NE(e.find("OMPI_COMM_WORLD_LOCAL_RANK='x1'"), std::string::npos) << e;
  e = error_of([] { local_rank_from_env(env_of({{"LOCAL_RANK", "4"}, {"LOCAL_WORLD_SIZE", "4"}})); });
  EXPECT_NE(e.find("LOCAL_RANK=4 is not below LOCAL_WORLD_SIZE=4"), std::string::npos) << e;
  e = error_of([] { local_rank_from_env(env_of({{"MPI_LOCALRANKID", "0"}, {"MPI_LOCALNRANKS", "0"}})); });
  EXPECT_NE(e.find("MPI_LOCALNRANKS='0'"), std::string::npos) << e;
  e = error_of([] { local_rank_from_env(env_of({{"LOCAL_RANK", "-1"}})); });
  EXPECT_NE(e.find("LOCAL_RANK='-1'"), std::string::npos) << e;
}

TEST(LocalRank, FromHostNamesOverTheCommunicator) {
  // Ranks 0, 2, 3 on node "a", 1 and 4 on "b".
  const std::vector<std::string> hosts = {"a", "b", "a", "a", "b"};
  std::vector<LocalRank> got(hosts.size());
  run_threads(5,
              [&](Communicator& c) { got[static_cast<size_t>(c.rank())] = local_rank_from_hosts(c, hosts[c.rank()]); });
  const int want_rank[] = {0, 0, 1, 2, 1}, want_size[] = {3, 2, 3, 3, 2};
  for (size_t r = 0; r < hosts.size(); ++r) {
    EXPECT_EQ(got[r].rank, want_rank[r]) << "rank " << r;
    EXPECT_EQ(got[r].size, want_size[r]) << "rank " << r;
    EXPECT_EQ(got[r].source, "host names");
  }
}

TEST(DeviceChoice, OneGpuPerRank) {
  EXPECT_EQ(device_for_local_rank({0, 8, "t"}, 8), 0);
  EXPECT_EQ(device_for_local_rank({7, 8, "t"}, 8), 7);
  EXPECT_EQ(device_for_local_rank({1, 2, "t"}, 8), 1);
  EXPECT_EQ(device_for_local_rank({3, 4, "t"}, 1), 0);  // launcher bound one GPU per rank
  std::string e = error_of([] { device_for_local_rank({3, 4, "OMPI_COMM_WORLD_LOCAL_RANK"}, 2); });
  EXPECT_NE(e.find("4 ranks on this node"), std::string::npos) << e;
  EXPECT_NE(e.find("but 2 GPUs visible"), std::string::npos) << e;
  EXPECT_NE(e.find("OMPI_COMM_WORLD_LOCAL_RANK"), std::string::npos) << e;
  e = error_of([] { device_for_local_rank({0, 1, "t"}, 0); });
  EXPECT_NE(e.find("no GPU visible"), std::string::npos) << e;
  EXPECT_NE(e.find("device: cpu"), std::string::npos) << e;
}

TEST(DeviceChoice, TwoRanksOnOneGpuAreNamed) {
  run_threads(3, [](Communicator& c) {
    const std::string uuid[] = {"GPU-aa", "GPU-bb", "GPU-cc"};
    check_distinct_devices(c, "node1", uuid[c.rank()]);  // distinct: fine
    // Rank 2 reports rank 0's UUID from another host (UUIDs are per node in this check): fine.
    check_distinct_devices(c, c.rank() == 2 ? "node2" : "node1", c.rank() == 1 ? "GPU-bb" : "GPU-aa");
  });
  std::string e = error_of([] {
    run_threads(3, [](Communicator& c) { check_distinct_devices(c, "node1", c.rank() == 1 ? "GPU-bb" : "GPU-aa"); });
  });
  EXPECT_NE(e.find("ranks 0 and 2 both use GPU GPU-aa on host node1"), std::string::npos) << e;
}

// What an NCCL init receives, per rank: (id, rank, size).
struct InitCall {
  std::string id;
  int rank = -1, size = -1;
};

TEST(Bootstrap, EveryRankGetsRootsIdThenInits) {
  std::atomic<int> made{0};
  std::vector<InitCall> calls(4);
  run_threads(4, [&](Communicator& c) {
    bootstrap_group(
        c, 16,
        [&](void* id) {
          ++made;
          std::memcpy(id, "unique-id-000001", 16);
        },
        [&](const void* id, int rank, int size) {
          calls[static_cast<size_t>(c.rank())] = {std::string(static_cast<const char*>(id), 16), rank, size};
        });
  });
  EXPECT_EQ(made.load(), 1);  // only rank 0 creates the id
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(calls[static_cast<size_t>(r)].id, "unique-id-000001");
    EXPECT_EQ(calls[static_cast<size_t>(r)].rank, r);
    EXPECT_EQ(calls[static_cast<size_t>(r)].size, 4);
  }
}

TEST(Bootstrap, RootFailureReachesEveryRankWithoutHang) {
  std::mutex m;
  std::vector<std::string> errors;
  std::atomic<int> inits{0};
  run_threads(3, [&](Communicator& c) {
    const std::string e = error_of([&] {
      bootstrap_group(
          c, 128, [](void*) { throw Error("ncclGetUniqueId failed: unhandled system error"); },
          [&](const void*, int, int) { ++inits; });
    });
    std::lock_guard<std::mutex> lk(m);
    errors.push_back(e);
  });
  EXPECT_EQ(inits.load(), 0);
  ASSERT_EQ(errors.size(), 3u);
  for (const auto& e : errors) {
    EXPECT_NE(e.find("rank 0 of group 'world' could not create the unique id"), std::string::npos) << e;
    EXPECT_NE(e.find("ncclGetUniqueId failed: unhandled system error"), std::string::npos) << e;
  }
}

TEST(Bootstrap, SplitGroupsGetTheirOwnIdAndMembersInKeyOrder) {
  // 6 ranks as data x tensor = 3 x 2: tensor groups {0,1}, {2,3}, {4,5} (color r/2), data groups
  // {0,2,4}, {1,3,5} (color r%2). Each group's root makes a distinct id; every member of a group
  // inits with that id, its rank in the group and the group size. Key reverses the tensor order.
  std::mutex m;
  int next_id = 0;
  auto make = [&](void* id) {
    std::lock_guard<std::mutex> lk(m);
    const std::string s = "id-" + std::to_string(next_id++);
    std::memset(id, 0, 8);
    std::memcpy(id, s.data(), s.size());
  };
  std::vector<InitCall> tp(6), dp(6);
  run_threads(6, [&](Communicator& world) {
    const int r = world.rank();
    auto tpg = world.split(r / 2, -r, "tp");
    bootstrap_group(*tpg, 8, make, [&](const void* id, int rank, int size) {
      tp[static_cast<size_t>(r)] = {static_cast<const char*>(id), rank, size};
    });
    auto dpg = world.split(r % 2, r, "dp");
    bootstrap_group(*dpg, 8, make, [&](const void* id, int rank, int size) {
      dp[static_cast<size_t>(r)] = {static_cast<const char*>(id), rank, size};
    });
  });
  std::set<std::string> tp_ids, dp_ids;
  for (int r = 0; r < 6; ++r) {
    const auto& t = tp[static_cast<size_t>(r)];
    EXPECT_EQ(t.id, tp[static_cast<size_t>(r ^ 1)].id) << "tensor group of rank " << r;
    EXPECT_EQ(t.size, 2);
    EXPECT_EQ(t.rank, 1 - r % 2) << "key -r puts the higher world rank first";
    tp_ids.insert(t.id);
    const auto& d = dp[static_cast<size_t>(r)];
    EXPECT_EQ(d.id, dp[static_cast<size_t>(r % 2)].id) << "data group of rank " << r;
    EXPECT_EQ(d.size, 3);
    EXPECT_EQ(d.rank, r / 2);
    dp_ids.insert(d.id);
  }
  EXPECT_EQ(tp_ids.size(), 3u);
  EXPECT_EQ(dp_ids.size(), 2u);
  for (const auto& id : tp_ids) EXPECT_EQ(dp_ids.count(id), 0u) << "ids are never reused across groups";
}

// A device communicator built as the NCCL one is: device buffers for every operation, a host
// communicator of the same ranks for split's exchange, its own reductions. Here the "device"
// memory is host memory in a registry, so the test can see which path each operation takes.
class FakeDeviceComm final : public Communicator {
 public:
  FakeDeviceComm(std::unique_ptr<Communicator> host, std::shared_ptr<std::set<const void*>> device_mem,
                 std::shared_ptr<std::atomic<int>> own_reductions)
      : Communicator(host->rank(), host->size(), host->name(), nullptr),
        host_(std::move(host)),
        dev_(std::move(device_mem)),
        own_(std::move(own_reductions)) {}
  FakeDeviceComm(Communicator& borrowed, std::shared_ptr<std::set<const void*>> device_mem,
                 std::shared_ptr<std::atomic<int>> own_reductions)
      : Communicator(borrowed.rank(), borrowed.size(), borrowed.name(), nullptr),
        borrowed_(&borrowed),
        dev_(std::move(device_mem)),
        own_(std::move(own_reductions)) {}
  ~FakeDeviceComm() override { stop_progress(); }

 protected:
  Communicator& host() { return host_ ? *host_ : *borrowed_; }
  void need_device(const void* p, const char* op) {
    LATHE_CHECK(dev_->count(p), "{}: {} got a host buffer", describe(), op);
  }
  void do_all_gather(const void* send, void* recv, const std::vector<size_t>& bytes) override {
    need_device(recv, "all_gather");
    host().all_gather(send, recv, bytes, DType::U8);
  }
  // Only the public all_to_all (device buffers) comes here: reductions take their own kernels
  // (do_all_reduce / do_reduce_scatter below), and their host staging would fail need_device.
  void do_all_to_all(const void* send, const std::vector<size_t>& sb, void* recv,
                     const std::vector<size_t>& rb) override {
    need_device(send, "all_to_all");
    need_device(recv, "all_to_all");
    host().all_to_all(send, sb, recv, rb, DType::U8);
  }
  void do_broadcast(void* buf, size_t bytes, int root) override {
    need_device(buf, "broadcast");
    host().broadcast(buf, bytes, root);
  }
  void do_send(const void* buf, size_t bytes, int dst, int tag) override { host().send(buf, bytes, dst, tag); }
  void do_recv(void* buf, size_t bytes, int src, int tag) override { host().recv(buf, bytes, src, tag); }
  void do_barrier() override { host().barrier(); }
  std::unique_ptr<Communicator> do_split(int color, const std::vector<int>& members, const std::string& name) override {
    const int key =
        color < 0 ? 0 : static_cast<int>(std::find(members.begin(), members.end(), rank()) - members.begin());
    auto sub = host().split(color, key, name);
    if (!sub) return nullptr;
    return std::make_unique<FakeDeviceComm>(std::move(sub), dev_, own_);
  }
  bool do_all_reduce(void* buf, size_t count, DType dtype, ReduceOp op) override {
    need_device(buf, "all_reduce");
    ++*own_;
    host().all_reduce(buf, count, dtype, op);
    return true;
  }
  bool do_reduce_scatter(const void* send, void* recv, const std::vector<size_t>& counts, DType dtype,
                         ReduceOp op) override {
    need_device(send, "reduce_scatter");
    ++*own_;
    host().reduce_scatter(send, recv, counts, dtype, op);
    return true;
  }
  void do_host_all_gather(const void* send, void* recv, const std::vector<size_t>& bytes) override {
    host().all_gather(send, recv, bytes, DType::U8);
  }
  void do_host_all_to_all(const void* send, const std::vector<size_t>& sb, void* recv,
                          const std::vector<size_t>& rb) override {
    ++*host_counts_;
    host().all_to_all(send, sb, recv, rb, DType::U8);
  }

 public:
  std::shared_ptr<std::atomic<int>> host_counts_ = std::make_shared<std::atomic<int>>(0);

 private:
  std::unique_ptr<Communicator> host_;
  Communicator* borrowed_ = nullptr;
  std::shared_ptr<std::set<const void*>> dev_;
  std::shared_ptr<std::atomic<int>> own_;
};

TEST(DeviceCommHooks, ReductionsAndSplitTakeTheDevicePaths) {
  auto own = std::make_shared<std::atomic<int>>(0);
  std::mutex m;
  run_threads(4, [&](Communicator& world) {
    std::vector<float> a(5), rs(2), g(8);
    auto dev = std::make_shared<std::set<const void*>>(std::set<const void*>{a.data(), rs.data(), g.data()});
    FakeDeviceComm d(world, dev, own);
    for (size_t i = 0; i < a.size(); ++i) a[i] = static_cast<float>(d.rank() + i);
    d.all_reduce(a.data(), a.size(), DType::F32);
    for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i], 6.0f + 4.0f * i);
    // A split (host exchange of colors) yields device groups of the same kind.
    auto pair = d.split(d.rank() / 2, d.rank(), "pair");
    ASSERT_TRUE(pair);
    EXPECT_EQ(pair->size(), 2);
    std::vector<float> x = {1.0f, 2.0f, 3.0f, 4.0f};
    dev->insert(x.data());
    pair->reduce_scatter(x.data(), rs.data(), {2, 2}, DType::F32);
    EXPECT_EQ(rs[0], pair->rank() == 0 ? 2.0f : 6.0f);
    pair->all_gather(rs.data(), g.data(), {2, 2}, DType::F32);
    EXPECT_EQ(g[3], 8.0f);
  });
  EXPECT_EQ(own->load(), 8);  // 4 all_reduce + 4 reduce_scatter, none through the host sum
}

// all_to_allv on a device communicator: the counts step runs on the host (host vectors), the rows
// move with the device buffers through the implementation's all-to-all (NCCL: grouped send/recv).
TEST(DeviceCommHooks, AllToAllvCountsOnTheHostRowsOnTheDevice) {
  run_threads(3, [&](Communicator& world) {
    auto dev = std::make_shared<std::set<const void*>>();
    FakeDeviceComm d(world, dev, std::make_shared<std::atomic<int>>(0));
    // Rank r sends r+j rows of one float to rank j, except that rank 2 receives nothing.
    std::vector<size_t> send_counts(3);
    std::vector<float> send;
    for (int j = 0; j < 3; ++j) {
      send_counts[static_cast<size_t>(j)] = j == 2 ? 0 : static_cast<size_t>(d.rank() + j);
      for (size_t k = 0; k < send_counts[static_cast<size_t>(j)]; ++k) send.push_back(10.0f * d.rank() + j);
    }
    const auto recv_counts = d.exchange_counts(send_counts);  // host vectors: not in `dev`
    EXPECT_EQ(d.host_counts_->load(), 1);
    std::vector<float> recv(d.rank() == 2 ? 0 : 3 * static_cast<size_t>(d.rank()) + 3, -1.0f);
    send.reserve(1);  // a non-null device pointer even when empty
    recv.reserve(1);
    dev->insert(send.data());
    dev->insert(recv.data());
    d.all_to_all(send.data(), send_counts, recv.data(), recv_counts, DType::F32);
    std::vector<float> want;
    for (int i = 0; i < 3; ++i)
      for (size_t k = 0; k < (d.rank() == 2 ? 0 : static_cast<size_t>(i + d.rank())); ++k)
        want.push_back(10.0f * i + d.rank());
    EXPECT_EQ(recv, want);
  });
}

TEST(WatchdogAbortHooks, RunBeforeTheJobEndsAndCanBeRemoved) {
  std::mutex m;
  std::vector<std::string> events;
  auto wd = std::make_shared<Watchdog>(0.2, [&](const std::string&) {
    std::lock_guard<std::mutex> lk(m);
    events.push_back("on_timeout");
  });
  const int removed = wd->add_abort_hook([&] {
    std::lock_guard<std::mutex> lk(m);
    events.push_back("removed hook");
  });
  wd->add_abort_hook([&] {
    std::lock_guard<std::mutex> lk(m);
    events.push_back("ncclCommAbort");
  });
  wd->remove_abort_hook(removed);
  run_threads(
      2,
      [](Communicator& c) {
        std::vector<float> x(4, 1.0f);
        if (c.rank() == 1) std::this_thread::sleep_for(std::chrono::milliseconds(800));
        c.all_reduce(x.data(), x.size(), DType::F32);
      },
      wd);
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0], "ncclCommAbort");
  EXPECT_EQ(events[1], "on_timeout");
}

TEST(Nccl, WithoutNcclOrGpuTheRefusalNamesTheFix) {
  auto world = make_local_communicator();
  const std::string e = error_of([&] { make_nccl_communicator(*world, 0); });
  if (!have_nccl()) {
    EXPECT_NE(e.find("group 'world' (rank 0 of 1): NCCL is not available"), std::string::npos) << e;
    EXPECT_NE(e.find("-DLATHE_CUDA=ON"), std::string::npos) << e;
    EXPECT_NE(e.find("device: cpu"), std::string::npos) << e;
    return;
  }
  // A CUDA build: with a GPU the communicator is made (tests/train/test_nccl_gpu.cpp runs it);
  // without one, the CUDA error is named and the case cannot run here.
  if (e == "(no error)") GTEST_SKIP() << "a GPU is present: NCCL is exercised by test_nccl_gpu";
  EXPECT_NE(e.find("group 'world' (rank 0 of 1)"), std::string::npos) << e;
  GTEST_SKIP() << "NCCL build without a usable GPU: " << e;
}

}  // namespace
