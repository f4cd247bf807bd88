// Runtime settings that must be in the environment before the process starts, because
// OpenBLAS and libgomp read them when they load. ensure_fast_runtime() sets what is missing and
// re-executes the binary once (a user's own settings are always respected):
//  * OPENBLAS_CORETYPE=SkylakeX where OpenBLAS 0.3.21 (Debian 12) does not recognise an AVX-512
//    CPU and picks AVX2 or generic kernels: "Prescott" on some Xeons (e.g. family 6 model 207,
//    every GEMM ~5x slower), "Haswell"/"Zen" on AMD Zen 4/5 (~2x slower). Not with LATHE_CPU_ISA=avx2.
//  * How idle OpenMP workers wait. A training step is hundreds of short parallel regions; when an
//    idle worker sleeps, waking its (virtual) CPU took a full scheduler tick (4 ms) on the
//    development VMs, which made 2 threads 5x slower than 1 (1273 ms vs 247 ms per step of the
//    L=4 C=256 benchmark). Spinning forever (OMP_WAIT_POLICY=ACTIVE, the old default) collapses
//    when the cores are shared: a spinning worker holds the core the thread it waits for needs
//    (lathe generate at 2 threads with 2 other busy processes: 134-165 ms/token vs 0.6-0.9 idle).
//    So: when this process's OpenMP threads x local MPI ranks + the other runnable tasks exceed
//    the CPUs it may run on, it says so in one line and waits passively; otherwise workers spin
//    for a bounded time (GOMP_SPINCOUNT=kSpinCount) and then sleep, so load that arrives later
//    costs a bounded amount too (bench/bench_oversubscribed.py measures both).
//    OMP_WAIT_POLICY or GOMP_SPINCOUNT set by the user are always kept.
#pragma once
#include <string>
#include <utility>
#include <vector>

namespace lathe {

// GOMP_SPINCOUNT when the CPUs are not oversubscribed (libgomp: about 100k spins per ms, so ~0.2 ms:
// longer than the gaps between the parallel regions of a step or a token, short enough that load
// arriving after start costs little). Measured with bench/bench_oversubscribed.py on a 2-core
// machine that other jobs kept busy: generate at 2 threads 16-70 ms/token with 20000, 56-76 with
// 200000, 231-358 with ACTIVE, 4-13 passive.
inline constexpr const char* kSpinCount = "20000";

// What decides the wait policy at start.
struct OmpLoad {
  int cpus = 1;         // CPUs this process may run on (sched_getaffinity)
  int threads = 1;      // OMP_NUM_THREADS (first level), else one per CPU
  int local_ranks = 1;  // processes of this job on this host (Open MPI / MPICH / torchrun variables)
  int other_busy = 0;   // runnable tasks other than this one (/proc/loadavg, median of 5 samples)
  bool oversubscribed() const;
};
OmpLoad omp_load();

// What ensure_fast_runtime() sets: the variables missing from the environment (name, value; none
// when LATHE_RUNTIME_SET is set) and the note line to print ("" for none). The Python package
// (python/lathe/__init__.py) applies them before its extension loads OpenBLAS and libgomp.
struct RuntimeSettings {
  std::vector<std::pair<std::string, std::string>> env;
  std::string note;
};
RuntimeSettings fast_runtime_settings();

// Call first thing in main() (lathe calls it for invocations that run a command, not for --help or
// --version). Returns only if no re-exec was needed (or it failed).
void ensure_fast_runtime(int argc, char** argv);

// The note line printed for this process at start ("" for none; without the newline), which the
// run log copies into OUTPUT/train.log (train/run_log.cpp): it is printed before the run directory
// exists, by the process that re-executes itself, so the re-executed one finds it in the
// environment (LATHE_RUNTIME_NOTE, read and removed by ensure_fast_runtime so that no child
// process inherits it). The Python package sets the note its import printed.
const std::string& runtime_note();
void set_runtime_note(std::string note);

// Load that arrives AFTER start (issue 22 item 5). GOMP_SPINCOUNT and OMP_WAIT_POLICY are read
// once when libgomp loads, so the start-up choice cannot follow the load; the thread count can.
// With 2 threads on 2 cores and 2 busy processes arriving mid-run, every fork/join of a token's
// ~30 tiny parallel regions waits for the other thread to get its time slice back (bounded spin:
// ~4.5x slower per token than idle); on 1 thread there is nothing to wait for. LoadFollower
// re-reads the load every kLoadCheckSeconds between units of work and sets omp_set_num_threads.
//
// Determinism rule: the thread count may change mid-run only where no kernel's arithmetic depends
// on it. lathe's fp32 kernels split rows, heads or output columns between threads (each output is
// summed by one thread in a fixed order), their reductions over rows sum a fixed number of parts
// (core/parallel.h, reduction_parts: fixed for a training run at start), and OpenBLAS sgemm/sgemv
// split the outputs, never K; so fp32 inference and fp32 training give the same bits on any thread
// count (tests/cli/test_load_follow.py and tests/train/test_thread_follow.py check runs switched
// mid-way against unswitched ones). `lathe generate` (fp32) polls between tokens, `lathe train`
// (fp32 on the CPU) before each step (train/run_control.h). oneDNN's 16-bit GEMMs may split K by
// thread count, so bf16/fp16 runs keep their count and rely on the bounded spin.
inline constexpr double kLoadCheckSeconds = 0.05;

// "procs_running N" of /proc/stat (runnable tasks now, all CPUs, this process's threads included);
// -1 when the text has no such line.
int procs_running(const std::string& proc_stat);

// Threads to use when `other_busy` runnable tasks that are not ours share `cpus` CPUs with a run
// that wants `max_threads`: the CPUs left over, at least 1, at most max_threads.
int threads_for_load(int cpus, int max_threads, int other_busy);

class LoadFollower {
 public:
  // max_threads: the count to return to when the load goes (omp_get_max_threads() at start).
  // Disabled (poll() does nothing) when max_threads is 1 or LATHE_FOLLOW_LOAD=0.
  // cpus: the CPUs to share (0: those this process may run on).
  explicit LoadFollower(int max_threads, int cpus = 0);
  // Call between units of work (tokens), outside parallel regions. Every kLoadCheckSeconds it
  // samples the load; the decision is the median of the last kWindow samples, so a compiler that
  // starts or ends in between does not flip it. Returns a note line ("" for none) the first time it
  // leaves max_threads.
  std::string poll();
  // The decision poll() makes from one sample of other runnable tasks: the thread count the median
  // of the last kWindow samples asks for (does not set it).
  int observe(int other_busy);
  int threads() const { return threads_; }
  bool enabled() const { return enabled_; }
  static constexpr int kWindow = 5;

 private:
  int max_threads_, threads_, cpus_;
  bool enabled_, noted_ = false;
  double last_ = 0;
  std::vector<int> samples_;
};

// "SkylakeX", "Haswell", "Prescott", ... as OpenBLAS reports it.
std::string blas_kernel_name();

}  // namespace lathe
