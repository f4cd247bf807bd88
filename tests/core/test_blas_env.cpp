// The start-up wait-policy decision (core/blas_env.h): oversubscribed when this process's OpenMP
// threads x local ranks + other runnable tasks exceed the CPUs; omp_load() reads the thread and
// rank counts from the environment.
#include <gtest/gtest.h>

#include <cstdlib>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/blas_env.h"

namespace lathe {
namespace {

OmpLoad load(int cpus, int threads, int ranks, int busy) {
  OmpLoad l;
  l.cpus = cpus;
  l.threads = threads;
  l.local_ranks = ranks;
  l.other_busy = busy;
  return l;
}

TEST(OmpLoad, OversubscribedWhenThreadsRanksAndOtherWorkExceedTheCpus) {
  EXPECT_FALSE(load(2, 2, 1, 0).oversubscribed());  // idle machine: spin (bounded)
  EXPECT_FALSE(load(2, 1, 1, 1).oversubscribed());  // one thread, one core taken: fits
  EXPECT_TRUE(load(2, 2, 1, 2).oversubscribed());   // both cores busy elsewhere (issue 22)
  EXPECT_TRUE(load(2, 2, 1, 1).oversubscribed());   // one core busy elsewhere
  EXPECT_TRUE(load(2, 1, 3, 0).oversubscribed());   // mpirun -np 3 on 2 cores
  EXPECT_FALSE(load(16, 4, 4, 0).oversubscribed());
  EXPECT_TRUE(load(16, 4, 4, 1).oversubscribed());
}

TEST(OmpLoad, ReadsThreadsAndLocalRanksFromTheEnvironment) {
  const char* old_threads = std::getenv("OMP_NUM_THREADS");
  const std::string saved = old_threads ? old_threads : "";
  setenv("OMP_NUM_THREADS", "3,1", 1);  // nested list: the first level counts
  setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "5", 1);
  const OmpLoad l = omp_load();
  EXPECT_EQ(l.threads, 3);
  EXPECT_EQ(l.local_ranks, 5);
  EXPECT_GE(l.cpus, 1);
  EXPECT_GE(l.other_busy, 0);
  EXPECT_TRUE(l.oversubscribed() == (15 + l.other_busy > l.cpus));
  unsetenv("OMPI_COMM_WORLD_LOCAL_SIZE");
  if (old_threads) setenv("OMP_NUM_THREADS", saved.c_str(), 1); else unsetenv("OMP_NUM_THREADS");
}

// fast_runtime_settings(): what `lathe` re-executes with and the Python package applies. The user's
// own settings are kept; without them the wait policy is decided by omp_load(); with
// LATHE_RUNTIME_SET (after the re-exec, or once the package applied them) nothing more.
TEST(FastRuntime, SettingsKeepTheUsersAndFollowTheLoad) {
  auto saved = [](const char* n) { const char* v = std::getenv(n); return v ? std::optional<std::string>(v) : std::nullopt; };
  const char* names[] = {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "LATHE_RUNTIME_SET", "OPENBLAS_CORETYPE"};
  std::vector<std::optional<std::string>> old;
  for (const char* n : names) old.push_back(saved(n));
  setenv("OPENBLAS_CORETYPE", "Haswell", 1);  // the user's: kept
  setenv("OMP_WAIT_POLICY", "PASSIVE", 1);
  unsetenv("GOMP_SPINCOUNT");
  unsetenv("LATHE_RUNTIME_SET");
  RuntimeSettings s = fast_runtime_settings();
  EXPECT_TRUE(s.env.empty());
  EXPECT_EQ(s.note, "");
  unsetenv("OMP_WAIT_POLICY");
  s = fast_runtime_settings();
  ASSERT_EQ(s.env.size(), 1u);
  // Which one depends on this machine's load at the moment (omp_load): either answer is whole.
  if (s.env[0].first == "OMP_WAIT_POLICY") {
    EXPECT_EQ(s.env[0].second, "PASSIVE");
    EXPECT_NE(s.note.find("threads wait passively"), std::string::npos) << s.note;
  } else {
    EXPECT_EQ(s.env[0], (std::pair<std::string, std::string>("GOMP_SPINCOUNT", kSpinCount)));
    EXPECT_EQ(s.note, "");
  }
  setenv("LATHE_RUNTIME_SET", "1", 1);
  EXPECT_TRUE(fast_runtime_settings().env.empty());
  for (size_t i = 0; i < old.size(); ++i) {
    if (old[i]) setenv(names[i], old[i]->c_str(), 1); else unsetenv(names[i]);
  }
}

}  // namespace
}  // namespace lathe
