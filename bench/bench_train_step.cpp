// Full training steps (forward + backward + AdamW + for bf16/fp16 the refresh of the weight
// copies) of a model preset at B x T on random tokens, computing in fp32, bf16 or fp16.
// Prints one JSON line: ms/step (mean after warm-up) and cpu_ms_per_step (the CPU time of all of
// the process's threads per step), tokens/s, MFU against a GEMM probe of the compute dtype (fp32:
// sgemm; bf16: oneDNN bf16 GEMM at the model's largest GEMM shape), peak RSS and lathe's analytical
// memory estimate. --recompute plans the activations with that recompute
// mode (models/recompute.h); activation_mb is the arena it allocated. --plan prints, without
// running, one line per recompute mode: the activation arena's bytes from the plan and the estimate.
//   bench_train_step PRESET B T [STEPS] [--dtype fp32|bf16|fp16] [--recompute none|selective|full] [--plan]
//   e.g. bench_train_step gpt2-124m 4 256 5 --dtype bf16 --recompute full
#include <fmt/format.h>
#include <omp.h>
#include <time.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "config/model_config.h"
#include "core/blas_env.h"
#include "core/error.h"
#include "core/rng.h"
#include "core/sysinfo.h"
#include "core/timer.h"
#include "kernels/cpu/ops_bf16.h"
#include "models/memory.h"
#include "models/model.h"
#include "optim/clip.h"
#include "optim/optimizer.h"
#include "train/peak.h"

using namespace lathe;

namespace {

// CPU seconds of the whole process (all threads): on a machine shared with other jobs this is
// steadier than wall time, which includes the time the scheduler gave to them.
double process_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// GFLOP/s of the bf16 GEMM on oneDNN at out[M,N] = inp[M,K] @ w[N,K]^T, best of 5 after warm-up.
double measure_bf16_peak_gflops(int64_t M, int64_t K, int64_t N) {
  std::vector<uint16_t> a(M * K), w(N * K), out(M * N);
  Rng rng(5);
  for (auto& x : a) x = fp32_to_bf16(rng.normal());
  for (auto& x : w) x = fp32_to_bf16(rng.normal());
  double best = 1e30;
  for (int i = 0; i < 6; ++i) {
    const double t0 = now_seconds();
    cpu::matmul_forward_bf16_out_bf16(out.data(), a.data(), w.data(), nullptr, M, K, N);
    if (i > 0) best = std::min(best, now_seconds() - t0);
  }
  return 2.0 * M * K * N / best / 1e9;
}

}  // namespace

int main(int argc, char** argv) {
  ensure_fast_runtime(argc, argv);
  std::vector<std::string> pos;
  DType dtype = DType::F32;
  Recompute recompute = Recompute::None;
  bool plan_only = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--plan") {
      plan_only = true;
    } else if (a == "--recompute" && i + 1 < argc) {
      try {
        recompute = parse_recompute(argv[++i], "--recompute");
      } catch (const Error& e) {
        std::fprintf(stderr, "%s\n", e.what());
        return 2;
      }
    } else if (a == "--dtype" && i + 1 < argc) {
      const std::string d = argv[++i];
      dtype = d == "bf16" ? DType::BF16 : d == "fp16" ? DType::F16 : DType::F32;
      if (d != "bf16" && d != "fp16" && d != "fp32") {
        std::fprintf(stderr, "--dtype %s: expected fp32, bf16 or fp16\n", d.c_str());
        return 2;
      }
    } else {
      pos.push_back(a);
    }
  }
  if (pos.size() < 3) {
    std::fprintf(stderr,
                 "usage: %s PRESET B T [STEPS] [--dtype fp32|bf16|fp16] [--recompute none|selective|full] [--plan]\n",
                 argv[0]);
    return 2;
  }
  const std::string preset = pos[0];
  const int64_t B = std::atoll(pos[1].c_str()), T = std::atoll(pos[2].c_str());
  const int steps = pos.size() > 3 ? std::atoi(pos[3].c_str()) : 6;
  ModelConfig cfg = ModelConfig::preset(preset);
  if (plan_only) {
    for (Recompute rc : {Recompute::None, Recompute::Selective, Recompute::Full}) {
      const MemoryEstimate e = estimate_memory(cfg, B, T, 2, 1, dtype, rc);
      nlohmann::json j = {{"preset", preset},
                          {"B", B},
                          {"T", T},
                          {"dtype", compute_dtype_name(dtype)},
                          {"recompute", recompute_name(rc)},
                          {"activation_bytes", e.activation_bytes},
                          {"activation_mb", e.activation_bytes / 1e6},
                          {"estimate_mb", e.total_bytes() / 1e6}};
      fmt::print("{}\n", j.dump());
    }
    return 0;
  }
  // MFU against the peak of the dtype the GEMMs run in (the MLP GEMM shape: the largest per layer).
  const double peak = dtype == DType::BF16 ? measure_bf16_peak_gflops(B * T, cfg.hidden_size, cfg.intermediate_size)
                                           : measure_peak_gflops();
  auto model = build_model(cfg, ComputeSpec{nullptr, dtype});
  model->init_weights(1);
  model->allocate(B, T, 2, recompute);
  optim::OptimConfig oc;
  auto opt = optim::make_optimizer(oc, model->num_params());
  std::vector<optim::ParamRange> ranges;
  for (auto& s : model->params().specs()) ranges.push_back({s.offset, size_t(s.numel()), s.decay});
  std::vector<int32_t> tok(B * T), tgt(B * T);
  Rng rng(3);
  for (auto& t : tok) t = int32_t(rng.below(cfg.vocab_size));
  for (auto& t : tgt) t = int32_t(rng.below(cfg.vocab_size));
  const double est = double(estimate_memory(cfg, B, T, 2, 1, dtype, recompute).total_bytes());
  double total = 0, fb = 0, upd = 0, cpu_fb = 0, cpu_total = 0;
  int measured = 0;
  for (int s = 0; s < steps + 1; ++s) {
    const double t0 = now_seconds(), c0 = process_cpu_seconds();
    model->zero_grad();
    model->forward_backward(tok.data(), tgt.data(), B, T, 1.0f / (B * T), true);
    const double t1 = now_seconds(), c1 = process_cpu_seconds();
    const double norm = optim::global_grad_norm(model->grad_data(), model->num_params());
    opt->step(model->param_data(), model->grad_data(), ranges, 1e-4, s + 1, optim::clip_coefficient(norm, 1.0));
    model->refresh_compute_weights();  // counted in the optimizer's time
    const double t2 = now_seconds(), c2 = process_cpu_seconds();
    if (s > 0) {  // first step is warm-up
      total += t2 - t0;
      fb += t1 - t0;
      upd += t2 - t1;
      cpu_fb += c1 - c0;
      cpu_total += c2 - c0;
      ++measured;
    }
  }
  const double ms = 1e3 * total / measured;
  const double tok_s = B * T / (total / measured);
  const double mfu = model->flops_per_token(T) * tok_s / (peak * 1e9);
  nlohmann::json j = {{"impl", "lathe"},
                      {"preset", preset},
                      {"B", B},
                      {"T", T},
                      {"dtype", compute_dtype_name(dtype)},
                      {"recompute", recompute_name(recompute)},
                      {"threads", omp_get_max_threads()},
                      {"blas_kernel", blas_kernel_name()},
                      {"params", model->num_params()},
                      {"ms_per_step", ms},
                      {"ms_forward_backward", 1e3 * fb / measured},
                      {"ms_optimizer", 1e3 * upd / measured},
                      {"cpu_ms_forward_backward", 1e3 * cpu_fb / measured},
                      {"cpu_ms_per_step", 1e3 * cpu_total / measured},
                      {"tokens_per_s", tok_s},
                      {"peak_gflops", peak},
                      {"peak_probe", dtype == DType::BF16 ? "bf16 oneDNN GEMM" : "fp32 sgemm"},
                      {"mfu", mfu},
                      {"peak_rss_mb", peak_rss_bytes() / 1e6},
                      {"activation_mb", model->activation_bytes() / 1e6},
                      {"estimate_mb", est / 1e6}};
  fmt::print("{}\n", j.dump());
  return 0;
}
