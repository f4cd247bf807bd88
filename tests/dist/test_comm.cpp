// Communicator contract on the in-process thread implementation (comm.h): uneven counts, in-place
// gathers, rank-ordered (bit-identical) reductions, sub-groups, async ordering, point-to-point
// matching by tag, failure propagation and the watchdog message. The MPI implementation runs the
// same checks under mpirun (test_comm_mpi).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <thread>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/trace.h"
#include "dist/comm.h"
#include "dist_checks.h"

using namespace lathe;
using namespace lathe::dist;

class CommThreads : public ::testing::TestWithParam<int> {};

TEST_P(CommThreads, AllReduceIsRankOrderedAndIdenticalOnEveryRank) {
  run_threads(GetParam(), [](Communicator& c) { testing_checks::all_reduce(c); });
}
TEST_P(CommThreads, ReduceScatterUnevenCounts) {
  run_threads(GetParam(), [](Communicator& c) { testing_checks::reduce_scatter(c); });
}
TEST_P(CommThreads, ReduceScatterInPiecesDisjointInPlaceAndOverlapping) {
  run_threads(GetParam(), [](Communicator& c) { testing_checks::reduce_scatter_in_pieces(c); });
}
TEST_P(CommThreads, AllGatherUnevenAndInPlace) {
  run_threads(GetParam(), [](Communicator& c) { testing_checks::all_gather(c); });
}
TEST_P(CommThreads, BroadcastFromEveryRoot) {
  run_threads(GetParam(), [](Communicator& c) { testing_checks::broadcast(c); });
}
TEST_P(CommThreads, SendRecvMatchesByTagInOrder) {
  run_threads(GetParam(), [](Communicator& c) { testing_checks::send_recv(c); });
}
TEST_P(CommThreads, SendRecvRingOfLargeMessages) {
  run_threads(GetParam(), [](Communicator& c) { testing_checks::sendrecv_ring(c); });
}
TEST_P(CommThreads, SplitIntoSubGroups) {
  run_threads(GetParam(), [](Communicator& c) { testing_checks::split(c); });
}
TEST_P(CommThreads, AllToAllvWithPerPeerCountsAndAnEmptyReceiver) {
  run_threads(GetParam(), [](Communicator& c) { testing_checks::all_to_allv(c); });
}
TEST_P(CommThreads, AsyncOperationsCompleteInIssueOrder) {
  run_threads(GetParam(), [](Communicator& c) { testing_checks::async_order(c); });
}

INSTANTIATE_TEST_SUITE_P(Ranks, CommThreads, ::testing::Values(1, 2, 3, 4, 5));

TEST(CommThreads, LocalCommunicatorIsTheOneRankCase) {
  auto c = make_local_communicator();
  EXPECT_EQ(c->size(), 1);
  testing_checks::all_reduce(*c);
  testing_checks::reduce_scatter(*c);
  testing_checks::all_gather(*c);
  testing_checks::split(*c);
  testing_checks::async_order(*c);
  testing_checks::all_to_allv(*c);
}

TEST(CommThreads, AnErrorOnOneRankEndsEveryRankWithThatError) {
  try {
    run_threads(3, [](Communicator& c) {
      if (c.rank() == 1) throw_error("rank 1 broke on purpose");
      std::vector<float> x(10, 1.0f);
      c.all_reduce(x.data(), x.size(), DType::F32);  // would wait for rank 1 forever
    });
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "rank 1 broke on purpose");
  }
}

TEST(CommThreads, MismatchedPointToPointSizesAreNamed) {
  try {
    run_threads(2, [](Communicator& c) {
      std::vector<char> b(c.rank() == 0 ? 8 : 4);
      if (c.rank() == 0)
        c.send(b.data(), b.size(), 1, 3);
      else
        c.recv(b.data(), b.size(), 0, 3);
    });
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("recv of 4 bytes from rank 0 tag 3, but 8 bytes were sent"), std::string::npos)
        << e.what();
  }
}

TEST(CommThreads, WatchdogNamesRankOperationSequenceGroupAndStep) {
  std::mutex m;
  std::vector<std::string> fired;
  auto wd = std::make_shared<Watchdog>(0.3, [&](const std::string& msg) {
    std::lock_guard<std::mutex> lk(m);
    fired.push_back(msg);
  });
  wd->set_step(7);
  run_threads(
      2,
      [](Communicator& c) {
        std::vector<float> x(4, 1.0f);
        c.all_reduce(x.data(), x.size(), DType::F32);                                     // #1, fine
        if (c.rank() == 1) std::this_thread::sleep_for(std::chrono::milliseconds(1200));  // stalled rank
        c.all_reduce(x.data(), x.size(), DType::F32);                                     // #2: rank 0 waits here
      },
      wd);
  ASSERT_EQ(fired.size(), 1u);  // the watchdog fires once, then stops watching
  const std::string& msg = fired[0];
  for (const char* part : {"group 'world' (rank 0 of 2)", "all_reduce #2", "at step 7", "parallel.timeout_s"})
    EXPECT_NE(msg.find(part), std::string::npos) << part << " missing from: " << msg;
}

TEST(CommThreads, EvenCountsCoverTheTotal) {
  // {1, 1, 0, 0} is also the constant GCC 12.2 + AVX-512 miscompiled (cmake/gcc_avx512_constant_probe.cpp).
  EXPECT_EQ(even_counts(10, 3), (std::vector<size_t>{4, 3, 3}));
  EXPECT_EQ(even_counts(2, 4), (std::vector<size_t>{1, 1, 0, 0}));
}

// Profiler spans (core/trace.h): each collective is a span on its group's communication thread,
// with the bytes it moves.
TEST(CommThreads, CollectivesAreTracedOnTheCommThreadWithBytes) {
  lathe::trace::start();
  lathe::dist::run_threads(2, [](lathe::dist::Communicator& c) {
    std::vector<float> v(1000, 1.0f);
    c.all_reduce(v.data(), v.size(), lathe::DType::F32);
  });
  lathe::trace::stop();
  const std::string path = (std::filesystem::temp_directory_path() / "lathe_test_comm_trace.json").string();
  lathe::trace::write_chrome_json(path, 0, "rank 0");
  std::ifstream f(path);
  const nlohmann::json j = nlohmann::json::parse(f);
  std::map<int, std::string> names;
  for (const auto& e : j["traceEvents"])
    if (e["ph"] == "M" && e["name"] == "thread_name") names[e["tid"].get<int>()] = e["args"]["name"];
  int spans = 0;
  for (const auto& e : j["traceEvents"])
    if (e["ph"] == "X" && e["name"] == "all_reduce") {
      ++spans;
      EXPECT_EQ(e["cat"], "comm");
      EXPECT_EQ(e["args"]["bytes"], 4000);
      EXPECT_EQ(names[e["tid"].get<int>()].rfind("comm ", 0), 0u) << names[e["tid"].get<int>()];
    }
  EXPECT_EQ(spans, 2);  // one per rank (two threads of this process)
  std::filesystem::remove(path);
}
