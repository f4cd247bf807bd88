// Where a training step's time goes, per op and per compute dtype: every op of a model's layer at
// its real shapes, through the CPU op tables (kernels/backend.h), best of REPS after a warm-up.
// Prints one line per op with ms for each dtype, then the per-step totals (layer ops x n_layer +
// embedding + head), so a dtype that is slower than expected shows which op is to blame. Rows
// starting with spaces break the lm head down (not added to the total).
// On a shared machine run with OMP_WAIT_POLICY=passive: spinning idle workers of other processes
// otherwise turn short parallel regions into multiples of the scheduler's 4 ms slice.
//   bench_ops_dtype PRESET B T [REPS]    e.g. bench_ops_dtype gpt2-124m 4 256
#include <fmt/format.h>
#include <omp.h>

#include <algorithm>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "config/model_config.h"
#include "core/blas_env.h"
#include "core/rng.h"
#include "core/timer.h"
#include "kernels/backend.h"

using namespace lathe;

namespace {

struct Buf {
  DeviceBuffer b;
  Buf(size_t n, DType dt) : b(cpu_backend(), n, dt) {
    // Small random values in every dtype (bit patterns of N(0, 0.5) rounded).
    Rng rng(n);
    if (dt == DType::F32) {
      auto* p = static_cast<float*>(b.data());
      for (size_t i = 0; i < n; ++i) p[i] = 0.5f * rng.normal();
    } else if (dt == DType::BF16) {
      auto* p = static_cast<uint16_t*>(b.data());
      for (size_t i = 0; i < n; ++i) p[i] = fp32_to_bf16(0.5f * rng.normal());
    } else if (dt == DType::F16) {
      auto* p = static_cast<uint16_t*>(b.data());
      for (size_t i = 0; i < n; ++i) p[i] = fp32_to_fp16(0.5f * rng.normal());
    }
  }
  void* p() { return b.data(); }
  float* f() { return static_cast<float*>(b.data()); }
};

double best_ms(int reps, const std::function<void()>& f) {
  f();  // warm-up (oneDNN primitive creation)
  double best = 1e30;
  for (int i = 0; i < reps; ++i) {
    const double t0 = now_seconds();
    f();
    best = std::min(best, now_seconds() - t0);
  }
  return best * 1e3;
}

}  // namespace

int main(int argc, char** argv) {
  ensure_fast_runtime(argc, argv);
  if (argc < 4) {
    std::fprintf(stderr, "usage: %s PRESET B T [REPS]\n", argv[0]);
    return 2;
  }
  const ModelConfig cfg = ModelConfig::preset(argv[1]);
  const int64_t B = std::atoll(argv[2]), T = std::atoll(argv[3]);
  const int reps = argc > 4 ? std::atoi(argv[4]) : 3;
  const int64_t N = B * T, C = cfg.hidden_size, H = cfg.num_attention_heads, KV = cfg.num_key_value_heads,
                D = cfg.head_dim(), Q = (H + 2 * KV) * D, F = cfg.intermediate_size, V = cfg.vocab_size,
                L = cfg.num_hidden_layers;
  const bool gpt2 = cfg.is_gpt2();
  const int64_t FF = gpt2 ? F : 2 * F, chunk = std::min<int64_t>(N, 256);  // the model's lm-head chunk
  const std::vector<DType> dts = {DType::F32, DType::BF16};
  struct Row {
    std::string op;
    bool per_layer;
    std::vector<double> ms;
  };
  std::vector<Row> rows;
  for (size_t di = 0; di < dts.size(); ++di) {
    const DType dt = dts[di];
    const Ops& o = ops_for(cpu_backend(), dt);
    Buf x(N * std::max({C, Q, FF}), dt), y(N * std::max({C, Q, FF}), dt),
        g(std::max(N * std::max({C, Q, FF}), chunk * V), dt);
    Buf w(std::max({Q, FF, C, V}) * std::max(C, F), dt);
    Buf gw(std::max({Q, FF, C, V}) * std::max(C, F), DType::F32), bias(std::max({Q, FF, C}), DType::F32),
        gb(std::max({Q, FF, C}), DType::F32), nw(C, DType::F32), stat(N, DType::F32), stat2(N, DType::F32),
        lse(B * H * T, DType::F32), losses(N, DType::F32);
    const size_t scratch_bytes = std::max({o.attention_scratch_bytes(T, D), o.layernorm_scratch_bytes(C),
                                           o.rmsnorm_scratch_bytes(C), o.lm_head_loss_scratch_bytes(chunk, V)});
    DeviceBuffer scratch(cpu_backend(), scratch_bytes, DType::U8);
    std::vector<int32_t> tok(N);
    Rng rng(1);
    for (auto& t : tok) t = static_cast<int32_t>(rng.below(V));
    auto add = [&](const std::string& op, bool per_layer, const std::function<void()>& f) {
      const double ms = best_ms(reps, f);
      auto it = std::find_if(rows.begin(), rows.end(), [&](const Row& r) { return r.op == op; });
      if (it == rows.end()) {
        rows.push_back({op, per_layer, std::vector<double>(dts.size(), 0.0)});
        it = rows.end() - 1;
      }
      it->ms[di] = ms;
    };
    const float* bp = bias.f();
    struct G {
      const char* name;
      int64_t K, Nout;
    };
    const G gemms[] = {{"qkv", C, Q}, {"o", H * D, C}, {"fc", C, FF}, {"proj", F, C}};
    for (const G& m : gemms) {
      add(fmt::format("matmul fwd {} ({}x{}x{})", m.name, N, m.K, m.Nout), true,
          [&] { o.matmul_forward(y.p(), x.p(), w.p(), bp, N, m.K, m.Nout, false); });
      add(fmt::format("matmul bwd {}", m.name), true,
          [&] { o.matmul_backward(x.p(), gw.f(), gb.f(), g.p(), y.p(), w.p(), N, m.K, m.Nout, false); });
    }
    if (gpt2) {
      add("layernorm fwd x2", true, [&] {
        for (int i = 0; i < 2; ++i) o.layernorm_forward(y.p(), stat.f(), stat2.f(), x.p(), nw.f(), bp, N, C, 1e-5f);
      });
      add("layernorm bwd x2", true, [&] {
        for (int i = 0; i < 2; ++i)
          o.layernorm_backward(y.p(), gw.f(), gb.f(), g.p(), x.p(), nw.f(), stat.f(), stat2.f(), N, C, scratch.data());
      });
      add("gelu fwd", true, [&] { o.gelu_forward(y.p(), x.p(), N * F); });
      add("gelu bwd", true, [&] { o.gelu_backward(y.p(), x.p(), g.p(), N * F); });
    } else {
      add("rmsnorm fwd x2", true, [&] {
        for (int i = 0; i < 2; ++i) o.rmsnorm_forward(y.p(), stat.f(), x.p(), nw.f(), N, C, 1e-5f);
      });
      add("rmsnorm bwd x2", true, [&] {
        for (int i = 0; i < 2; ++i)
          o.rmsnorm_backward(y.p(), gw.f(), g.p(), x.p(), nw.f(), stat.f(), N, C, scratch.data());
      });
      add("swiglu fwd", true, [&] { o.swiglu_forward(y.p(), x.p(), N, F); });
      add("swiglu bwd", true, [&] { o.swiglu_backward(y.p(), x.p(), g.p(), N, F); });
    }
    add("residual x2", true, [&] {
      for (int i = 0; i < 2; ++i) o.residual_forward(y.p(), y.p(), x.p(), N * C);
    });
    add("attention fwd", true,
        [&] { o.attention_forward(y.p(), lse.f(), x.p(), B, T, H, KV, D, scratch.data(), nullptr, 0, 0.0f, 0.0f); });
    add("attention bwd", true, [&] {
      o.attention_backward(g.p(), y.p(), x.p(), y.p(), lse.f(), B, T, H, KV, D, scratch.data(), nullptr, 0, 0.0f, 0.0f);
    });
    add("embedding fwd+bwd", false, [&] {
      o.embedding_forward(y.p(), tok.data(), w.p(), gpt2 ? x.p() : nullptr, B, T, C, nullptr, 0, V);
      o.embedding_backward(gw.f(), nullptr, g.p(), tok.data(), B, T, C, nullptr, 0, V);
    });
    add(fmt::format("  its fwd GEMMs ({}x{}x{}) x{}", chunk, C, V, N / chunk), false, [&] {
      for (int64_t n0 = 0; n0 < N; n0 += chunk) o.logits_forward(gw.f(), x.p(), w.p(), chunk, C, V);
    });
    add(fmt::format("  its bwd GEMMs x{}", N / chunk), false, [&] {
      for (int64_t n0 = 0; n0 < N; n0 += chunk)
        o.matmul_backward(y.p(), gw.f(), nullptr, g.p(), x.p(), w.p(), chunk, C, V, false);
    });
    add("   dinp only", false, [&] {
      for (int64_t n0 = 0; n0 < N; n0 += chunk)
        o.matmul_backward(y.p(), nullptr, nullptr, g.p(), x.p(), w.p(), chunk, C, V, false);
    });
    add("   dweight only", false, [&] {
      for (int64_t n0 = 0; n0 < N; n0 += chunk)
        o.matmul_backward(nullptr, gw.f(), nullptr, g.p(), x.p(), w.p(), chunk, C, V, false);
    });
    add(fmt::format("lm_head_loss fwd+bwd (V={})", V), false, [&] {
      o.lm_head_loss(losses.f(), y.p(), gw.f(), x.p(), w.p(), tok.data(), N, C, V, 1.0f / N, true, scratch.data(),
                     chunk, nullptr, 0.0f);
    });
  }
  fmt::print("{} B={} T={} threads={} blas={}\n{:<44}", argv[1], B, T, omp_get_max_threads(), blas_kernel_name(), "op");
  for (DType dt : dts) fmt::print("{:>10}", compute_dtype_name(dt) + " ms");
  fmt::print("{:>8}\n", "ratio");
  std::vector<double> total(dts.size(), 0.0);
  for (const Row& r : rows) {
    fmt::print("{:<44}", r.op + (r.per_layer ? fmt::format(" x{}", L) : ""));
    for (size_t i = 0; i < dts.size(); ++i) {
      fmt::print("{:>10.2f}", r.ms[i]);
      if (r.op[0] != ' ') total[i] += r.ms[i] * (r.per_layer ? static_cast<double>(L) : 1.0);  // not sub-rows
    }
    fmt::print("{:>8.2f}\n", r.ms[0] / r.ms[1]);
  }
  fmt::print("{:<44}", "step (forward + backward, no optimizer)");
  for (double t : total) fmt::print("{:>10.1f}", t);
  fmt::print("{:>8.2f}\n", total[0] / total[1]);
  return 0;
}
