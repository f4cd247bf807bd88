#include "core/blas_env.h"

#include <cblas.h>
#include <dirent.h>
#include <fmt/format.h>
#include <omp.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace lathe {

std::string blas_kernel_name() {
  const char* name = openblas_get_corename();
  return name ? name : "unknown";
}

namespace {

// A positive integer from the environment, or 0 when unset / not a number.
long env_count(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return 0;
  char* end = nullptr;
  const long n = std::strtol(v, &end, 10);
  return (end != nullptr && (*end == '\0' || *end == ',') && n > 0) ? n : 0;
}

// Runnable tasks on the machine other than this process: /proc/loadavg's "running/total" field
// counts the runnable tasks now (this one included). The median of a few samples 2 ms apart, so
// a compiler starting or ending at that moment does not decide it.
int other_runnable_tasks() {
  std::vector<int> samples;
  for (int i = 0; i < 5; ++i) {
    std::ifstream f("/proc/loadavg");
    std::string a, b, c, running;
    if (!(f >> a >> b >> c >> running)) return 0;
    samples.push_back(std::atoi(running.c_str()) - 1);
    if (i + 1 < 5) std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  std::sort(samples.begin(), samples.end());
  return std::max(samples[samples.size() / 2], 0);
}

// The CPUs this process may run on.
int allowed_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  const int n =
      sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN));
  return n < 1 ? 1 : n;
}

// Threads of this process that are runnable now (state R in /proc/self/task/*/stat: the caller,
// and OpenMP workers still spinning after a region).
int own_running_threads() {
  DIR* d = opendir("/proc/self/task");
  if (d == nullptr) return 1;
  int n = 0;
  while (const dirent* e = readdir(d)) {
    if (e->d_name[0] == '.') continue;
    std::ifstream f(std::string("/proc/self/task/") + e->d_name + "/stat");
    std::string line;
    if (!std::getline(f, line)) continue;
    const size_t close = line.rfind(')');  // the name may hold spaces and parentheses
    if (close != std::string::npos && close + 2 < line.size() && line[close + 2] == 'R') ++n;
  }
  closedir(d);
  return std::max(n, 1);
}

double seconds_now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

int procs_running(const std::string& proc_stat) {
  std::istringstream in(proc_stat);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("procs_running ", 0) == 0) return std::atoi(line.c_str() + 14);
  }
  return -1;
}

int threads_for_load(int cpus, int max_threads, int other_busy) {
  return std::clamp(cpus - std::max(other_busy, 0), 1, std::max(max_threads, 1));
}

LoadFollower::LoadFollower(int max_threads, int cpus)
    : max_threads_(max_threads), threads_(max_threads), cpus_(cpus > 0 ? cpus : allowed_cpus()) {
  const char* v = std::getenv("LATHE_FOLLOW_LOAD");
  enabled_ = max_threads > 1 && !(v != nullptr && std::strcmp(v, "0") == 0);
}

int LoadFollower::observe(int other_busy) {
  samples_.push_back(std::max(other_busy, 0));
  if (static_cast<int>(samples_.size()) > kWindow) samples_.erase(samples_.begin());
  std::vector<int> sorted = samples_;
  std::sort(sorted.begin(), sorted.end());
  // The lower median: switching (either way) needs a majority of the window, not a tie.
  return threads_for_load(cpus_, max_threads_, sorted[(sorted.size() - 1) / 2]);
}

std::string LoadFollower::poll() {
  if (!enabled_) return "";
  const double now = seconds_now();
  if (now - last_ < kLoadCheckSeconds) return "";
  last_ = now;
  std::ifstream f("/proc/stat");
  std::stringstream text;
  text << f.rdbuf();
  const int running = procs_running(text.str());
  if (running < 0) {  // no /proc/stat (not Linux?): keep the thread count
    enabled_ = false;
    return "";
  }
  const int other = std::max(running - own_running_threads(), 0);
  const int want = observe(other);
  if (want == threads_) return "";
  threads_ = want;
  omp_set_num_threads(want);
  if (noted_ || want == max_threads_) return "";
  noted_ = true;
  return fmt::format(
      "lathe: note: {} other busy task(s) arrived on {} CPUs: running {} thread(s) instead of {} while they "
      "last (fp32 results do not depend on the thread count; LATHE_FOLLOW_LOAD=0 keeps {})\n",
      other, cpus_, want, max_threads_, max_threads_);
}

OmpLoad omp_load() {
  OmpLoad l;
  l.cpus = allowed_cpus();
  // OMP_NUM_THREADS may be a list ("4,2": the first level counts); libgomp's default is one per CPU.
  l.threads = static_cast<int>(env_count("OMP_NUM_THREADS"));
  if (l.threads == 0) l.threads = l.cpus;
  for (const char* name : {"OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "LOCAL_WORLD_SIZE"}) {
    if (const long n = env_count(name)) {
      l.local_ranks = static_cast<int>(n);
      break;
    }
  }
  l.other_busy = other_runnable_tasks();
  return l;
}

bool OmpLoad::oversubscribed() const { return threads * local_ranks + other_busy > cpus; }

RuntimeSettings fast_runtime_settings() {
  RuntimeSettings out;
  if (std::getenv("LATHE_RUNTIME_SET") != nullptr) return out;  // already re-executed once
  // OpenBLAS 0.3.21 (Debian 12) knows no AVX-512 AMD core: Zen 4/5 get its AVX2 "Haswell"/"Zen"
  // kernels (sgemm ~105 GFLOP/s on one Zen 5 core against 180-210 with "SkylakeX"; the small GPT-2
  // step at T=256 1.15 s -> 0.6 s), and some Xeons get the generic "Prescott". Where the CPU has
  // AVX-512 (and LATHE_CPU_ISA does not cap lathe to AVX2) use the SkylakeX kernels.
  const char* isa_cap = std::getenv("LATHE_CPU_ISA");
  const bool capped_to_avx2 = isa_cap != nullptr && std::strcmp(isa_cap, "avx2") == 0;
  const char* core = openblas_get_corename();
  const bool avx2_kernels =
      std::strcmp(core, "Prescott") == 0 || std::strcmp(core, "Haswell") == 0 || std::strcmp(core, "Zen") == 0;
  if (std::getenv("OPENBLAS_CORETYPE") == nullptr && avx2_kernels && !capped_to_avx2) {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512dq")) {
      out.env.emplace_back("OPENBLAS_CORETYPE", "SkylakeX");
    }
  }
  if (std::getenv("OMP_WAIT_POLICY") == nullptr && std::getenv("GOMP_SPINCOUNT") == nullptr) {
    const OmpLoad l = omp_load();
    if (l.oversubscribed()) {
      out.env.emplace_back("OMP_WAIT_POLICY", "PASSIVE");
      const long local_rank = env_count("OMPI_COMM_WORLD_LOCAL_RANK") + env_count("MPI_LOCALRANKID");
      if (local_rank == 0) {
        out.note = fmt::format(
            "lathe: note: {} OpenMP threads x {} local process(es) + {} other busy task(s) > {} CPUs: "
            "threads wait passively (OMP_WAIT_POLICY=PASSIVE; set OMP_WAIT_POLICY or GOMP_SPINCOUNT to "
            "choose)\n",
            l.threads, l.local_ranks, l.other_busy, l.cpus);
      }
    } else {
      out.env.emplace_back("GOMP_SPINCOUNT", kSpinCount);
    }
  }
  return out;
}

namespace {

std::string& note_store() {
  static std::string note;
  return note;
}

}  // namespace

const std::string& runtime_note() { return note_store(); }

void set_runtime_note(std::string note) {
  while (!note.empty() && note.back() == '\n') note.pop_back();
  note_store() = std::move(note);
}

void ensure_fast_runtime(int argc, char** argv) {
  (void)argc;
  if (const char* carried = std::getenv("LATHE_RUNTIME_NOTE")) {  // printed before the re-execution
    set_runtime_note(carried);
    unsetenv("LATHE_RUNTIME_NOTE");
  }
  const RuntimeSettings s = fast_runtime_settings();
  if (!s.note.empty()) {
    std::fputs(s.note.c_str(), stderr);
    set_runtime_note(s.note);
  }
  if (s.env.empty()) return;
  for (const auto& [name, value] : s.env) setenv(name.c_str(), value.c_str(), 1);
  setenv("LATHE_RUNTIME_SET", "1", 1);
  if (!runtime_note().empty()) setenv("LATHE_RUNTIME_NOTE", runtime_note().c_str(), 1);
  execv("/proc/self/exe", argv);
  std::fprintf(stderr, "lathe: note: could not re-execute with the tuned OpenBLAS/OpenMP settings; running as is\n");
}

}  // namespace lathe
