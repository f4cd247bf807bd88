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

// Load arriving mid-run (LoadFollower): /proc/stat's procs_running, the thread count the load
// leaves room for, and the median window that keeps a few samples from flipping it.
TEST(LoadFollower, ProcsRunningFromProcStat) {
  const std::string stat =
      "cpu  10132153 290696 3084719 46828483 16683 0 25195 0 0 0\n"
      "cpu0 1393280 32966 572056 13343292 6130 0 17875 0 0 0\n"
      "intr 1462898 0 0\nctxt 2345\nbtime 1700000000\nprocesses 3000\n"
      "procs_running 7\nprocs_blocked 1\nsoftirq 1 2 3\n";
  EXPECT_EQ(procs_running(stat), 7);
  EXPECT_EQ(procs_running("cpu 1 2 3\nprocs_running 13"), 13);   // last line without a newline
  EXPECT_EQ(procs_running("cpu 1 2 3\nprocs_blocked 4\n"), -1);  // no such line: unknown
  EXPECT_EQ(procs_running("xprocs_running 3\n"), -1);             // the key starts the line
}

TEST(LoadFollower, ThreadsForLoad) {
  EXPECT_EQ(threads_for_load(2, 2, 0), 2);   // idle: all threads
  EXPECT_EQ(threads_for_load(2, 2, 1), 1);   // one core taken
  EXPECT_EQ(threads_for_load(2, 2, 2), 1);   // both cores taken (issue 22): 1, never 0
  EXPECT_EQ(threads_for_load(2, 2, 12), 1);
  EXPECT_EQ(threads_for_load(16, 8, 4), 8);  // room to spare: the run's own count, not more
  EXPECT_EQ(threads_for_load(16, 8, 10), 6);
  EXPECT_EQ(threads_for_load(4, 4, -3), 4);  // a negative estimate counts as none
}

TEST(LoadFollower, LowerMedianOfTheLastFiveSamplesDecides) {
  LoadFollower f(2, 2);  // 2 threads on 2 CPUs
  // other busy tasks per sample -> threads; the window holds the last 5 samples.
  const std::vector<std::pair<int, int>> seq = {
      {0, 2}, {0, 2}, {0, 2}, {2, 2},  // one busy sample: stays
      {2, 2},                          // [0 0 0 2 2]: still a minority
      {2, 1},                          // [0 0 2 2 2]: drops to 1
      {0, 1}, {0, 1},                  // [2 2 2 0 0]: stays at 1
      {0, 2}};                         // [2 2 0 0 0]: back to 2
  for (size_t i = 0; i < seq.size(); ++i) EXPECT_EQ(f.observe(seq[i].first), seq[i].second) << "sample " << i;
}

TEST(LoadFollower, DisabledForOneThreadOrByTheEnvironment) {
  const char* v = std::getenv("LATHE_FOLLOW_LOAD");
  const std::optional<std::string> old = v ? std::optional<std::string>(v) : std::nullopt;
  unsetenv("LATHE_FOLLOW_LOAD");
  EXPECT_FALSE(LoadFollower(1).enabled());
  EXPECT_TRUE(LoadFollower(2).enabled());
  setenv("LATHE_FOLLOW_LOAD", "0", 1);
  EXPECT_FALSE(LoadFollower(2).enabled());
  EXPECT_EQ(LoadFollower(2).poll(), "");
  if (old) setenv("LATHE_FOLLOW_LOAD", old->c_str(), 1); else unsetenv("LATHE_FOLLOW_LOAD");
}

}  // namespace
}  // namespace lathe
