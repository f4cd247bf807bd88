// Block attention (context parallelism, issue 27) against the one-rank kernel on the same work:
// one block whose queries and keys are the whole sequence (positions 0..T-1, causal), so the block
// kernel computes exactly what attention_forward / attention_backward compute. B=1, H=8, D=64,
// fp32, T=1024 and 2048 (or the T values given as arguments). Also the load-balanced case of a
// context-2 rank (rows of chunks 0 and 3 of 4) against each source's block.
// Times are the fastest of several runs (a shared machine disturbs the others); run with
// OMP_NUM_THREADS=1 for one core's figure.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "core/buffer.h"
#include "core/parallel.h"
#include "core/timer.h"
#include "kernels/cpu/ops.h"

using namespace lathe;

namespace {

void fill(float* p, size_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  for (size_t i = 0; i < n; ++i) p[i] = d(gen);
}

template <typename F>
double time_ms(F&& f, int iters) {
  f();
  double best = 1e300;
  for (int it = 0; it < iters; ++it) {
    const double a = now_seconds();
    f();
    best = std::min(best, now_seconds() - a);
  }
  return best * 1e3;
}

void bench(int64_t T, int64_t H, int64_t D, int iters) {
  const int64_t B = 1, KVH = H, ld = (H + 2 * KVH) * D, ldo = H * D;
  Buffer<float> qkv(B * T * ld), out(B * T * ldo), lse(B * H * T), dout(B * T * ldo), dqkv(B * T * ld),
      scratch(cpu::attention_scratch_floats(T, D));
  fill(qkv.data(), qkv.size(), 1);
  fill(dout.data(), dout.size(), 2);
  const double fwd = time_ms(
      [&] { cpu::attention_forward(out.data(), lse.data(), qkv.data(), B, T, H, KVH, D, scratch.data()); }, iters);
  const double bwd = time_ms(
      [&] {
        cpu::attention_backward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), B, T, H, KVH, D,
                                scratch.data());
      },
      iters);
  std::vector<int32_t> pos(T);
  for (int64_t t = 0; t < T; ++t) pos[t] = static_cast<int32_t>(t);
  cpu::BlockAttention a;
  a.B = B, a.Tq = T, a.Tk = T, a.H = H, a.KVH = KVH, a.D = D;
  a.q = qkv.data(), a.ldq = ld, a.k = qkv.data() + H * D, a.ldk = ld, a.v = qkv.data() + (H + KVH) * D, a.ldv = ld;
  a.q_pos = pos.data(), a.k_pos = pos.data();
  const double bfwd = time_ms([&] { cpu::attention_block_forward(a, out.data(), ldo, lse.data()); }, iters);
  const double bbwd = time_ms(
      [&] {
        std::fill(dqkv.data(), dqkv.data() + dqkv.size(), 0.0f);
        cpu::attention_block_backward(a, out.data(), dout.data(), ldo, lse.data(), dqkv.data(), ld, dqkv.data() + H * D,
                                      ld, dqkv.data() + (H + KVH) * D, ld);
      },
      iters);
  std::printf(
      "T=%ld H=%ld D=%ld fp32, causal: one-rank fwd %.2f ms bwd %.2f ms | one block fwd %.2f ms bwd %.2f ms "
      "(%.2fx / %.2fx the one-rank time)\n",
      (long)T, (long)H, (long)D, fwd, bwd, bfwd, bbwd, bfwd / fwd, bbwd / bwd);
  // A context-2 rank: rows of chunks 0 and 3 (of 4) against its own block and the other rank's.
  const int64_t C = T / 4, Tl = 2 * C;
  std::vector<int32_t> r0, r1;
  for (int64_t t = 0; t < C; ++t) r0.push_back(static_cast<int32_t>(t)), r1.push_back(static_cast<int32_t>(C + t));
  for (int64_t t = 0; t < C; ++t)
    r0.push_back(static_cast<int32_t>(3 * C + t)), r1.push_back(static_cast<int32_t>(2 * C + t));
  a.Tq = a.Tk = Tl;
  double cfwd = 0.0, cbwd = 0.0;
  for (const auto* kp : {&r0, &r1}) {
    a.q_pos = r0.data(), a.k_pos = kp->data();
    cfwd += time_ms([&] { cpu::attention_block_forward(a, out.data(), ldo, lse.data()); }, iters);
    cbwd += time_ms(
        [&] {
          cpu::attention_block_backward(a, out.data(), dout.data(), ldo, lse.data(), dqkv.data(), ld,
                                        dqkv.data() + H * D, ld, dqkv.data() + (H + KVH) * D, ld);
        },
        iters);
  }
  std::printf("  context 2, rank 0's two blocks (T/2 rows each): fwd %.2f ms bwd %.2f ms (%.2fx of one-rank fwd+bwd)\n",
              cfwd, cbwd, (cfwd + cbwd) / (fwd + bwd));
}

}  // namespace

int main(int argc, char** argv) {
  std::printf("threads: %d\n", max_threads());
  std::vector<int64_t> Ts;
  for (int i = 1; i < argc; ++i) Ts.push_back(std::atol(argv[i]));
  if (Ts.empty()) Ts = {1024, 2048};
  for (int64_t T : Ts) bench(T, 8, 64, 3);
  return 0;
}
