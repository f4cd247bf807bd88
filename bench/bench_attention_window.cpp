// Sliding-window attention (issue 25 item 5) against full causal attention, CPU fp32, forward +
// backward on the same inputs: `bench_attention_window [T [window [H [D [iters]]]]]`, by default
// T = 8192, window 1024, H = 4 (MHA), D = 64, B = 1, the fastest of 3 alternated runs each.
// Prints both times, their ratio, the ratio of [16 x 16] score tiles computed (the work the
// kernel skips: tiles left of each query block's window are never computed), the thread count
// and the CPU model. Full causal attention needs about T^2 / 2 scores, the window T x (window +
// 32): at T = 8192 and window 1024 the ideal time ratio is about 2 x 1056 / 8192 = 0.26.
#include <omp.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <random>
#include <string>

#include "core/buffer.h"
#include "core/timer.h"
#include "kernels/cpu/ops.h"

using namespace lathe;

namespace {

std::string cpu_model() {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  return "unknown";
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t T = argc > 1 ? std::atoll(argv[1]) : 8192, W = argc > 2 ? std::atoll(argv[2]) : 1024,
                H = argc > 3 ? std::atoll(argv[3]) : 4, D = argc > 4 ? std::atoll(argv[4]) : 64,
                iters = argc > 5 ? std::atoll(argv[5]) : 3, B = 1, KVH = H, ld = (H + 2 * KVH) * D;
  Buffer<float> qkv(B * T * ld), out(B * T * H * D), lse(B * H * T), dout(B * T * H * D), dqkv(B * T * ld),
      scratch(cpu::attention_scratch_floats(T, D));
  std::mt19937 gen(1);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (size_t i = 0; i < qkv.size(); ++i) qkv.data()[i] = nd(gen);
  for (size_t i = 0; i < dout.size(); ++i) dout.data()[i] = nd(gen);
  // Forward + backward with window w (0 = full causal): seconds, and forward score tiles.
  auto run = [&](int64_t w, int64_t* tiles) {
    const cpu::AttentionTiles a = cpu::attention_tiles();
    const double t0 = now_seconds();
    cpu::attention_forward(out.data(), lse.data(), qkv.data(), B, T, H, KVH, D, scratch.data(), nullptr, w);
    cpu::attention_backward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), B, T, H, KVH, D,
                            scratch.data(), nullptr, w);
    const double s = now_seconds() - t0;
    *tiles = cpu::attention_tiles().forward - a.forward;
    return s;
  };
  // Alternated, fastest of each: other processes on a shared machine disturb both alike.
  double full = 1e300, win = 1e300;
  int64_t full_tiles = 0, win_tiles = 0;
  for (int64_t it = 0; it < iters; ++it) {
    full = std::min(full, run(0, &full_tiles));
    win = std::min(win, run(W, &win_tiles));
  }
  std::printf("attention fwd+bwd fp32 B=%ld T=%ld H=%ld D=%ld, %d thread(s), CPU: %s\n", (long)B, (long)T, (long)H,
              (long)D, omp_get_max_threads(), cpu_model().c_str());
  std::printf("  full causal      %9.1f ms  (%ld score tiles)\n", full * 1e3, (long)full_tiles);
  std::printf("  window %-8ld  %9.1f ms  (%ld score tiles)\n", (long)W, win * 1e3, (long)win_tiles);
  std::printf("  time ratio window / full = %.3f   tile ratio = %.3f   (window / T = %.3f)\n", win / full,
              static_cast<double>(win_tiles) / static_cast<double>(full_tiles),
              static_cast<double>(W) / static_cast<double>(T));
  return 0;
}
