// The Communicator contract on Open MPI: the checks of dist_checks.h on the world communicator of
// an mpirun job (CTest runs this binary with -np 2 and -np 3; every rank runs every test). Run
// without mpirun, the world is the one-rank communicator and the same checks apply.
#include <gtest/gtest.h>

#include <memory>

#include "dist/comm.h"
#include "dist_checks.h"

namespace {
lathe::dist::Communicator* world = nullptr;
}

TEST(CommMpi, AllReduce) { testing_checks::all_reduce(*world); }
TEST(CommMpi, ReduceScatter) { testing_checks::reduce_scatter(*world); }
TEST(CommMpi, ReduceScatterInPieces) { testing_checks::reduce_scatter_in_pieces(*world); }
TEST(CommMpi, AllGather) { testing_checks::all_gather(*world); }
TEST(CommMpi, Broadcast) { testing_checks::broadcast(*world); }
TEST(CommMpi, SendRecv) { testing_checks::send_recv(*world); }
TEST(CommMpi, SendRecvRingOfLargeMessages) { testing_checks::sendrecv_ring(*world); }
TEST(CommMpi, Split) { testing_checks::split(*world); }
TEST(CommMpi, AllToAllv) { testing_checks::all_to_allv(*world); }
TEST(CommMpi, AsyncOrder) { testing_checks::async_order(*world); }

TEST(CommMpi, LaunchedAsExpected) {
  const char* want = std::getenv("LATHE_TEST_EXPECT_RANKS");
  if (want) {
    EXPECT_EQ(world->size(), std::atoi(want)) << "mpirun did not give the expected world size";
  }
}

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  auto comm = lathe::dist::make_world_communicator(60.0);
  world = comm.get();
  // Only rank 0 prints the gtest report; every rank's failures still set its exit code.
  if (world->rank() != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
  }
  int rc = RUN_ALL_TESTS();
  // Every rank must agree: a failure on any rank fails the job.
  int64_t worst = rc;
  world->all_reduce(&worst, 1, lathe::DType::I64, lathe::dist::ReduceOp::Max);
  comm.reset();
  return static_cast<int>(worst);
}
