// Full training steps (forward + backward + AdamW) of a model preset at B x T on random tokens.
// Prints one JSON line: ms/step (mean after warm-up), tokens/s, MFU against a GEMM probe, peak
// RSS and lathe's analytical memory estimate.
//   bench_train_step PRESET B T [STEPS] [--set key=value]  e.g. bench_train_step gpt2-124m 4 64 10
#include <fmt/format.h>
#include <omp.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "config/model_config.h"
#include "core/blas_env.h"
#include "core/rng.h"
#include "core/sysinfo.h"
#include "core/timer.h"
#include "models/model.h"
#include "optim/clip.h"
#include "optim/optimizer.h"
#include "train/peak.h"

using namespace lathe;

int main(int argc, char** argv) {
  ensure_fast_runtime(argc, argv);
  if (argc < 4) {
    std::fprintf(stderr, "usage: %s PRESET B T [STEPS]\n", argv[0]);
    return 2;
  }
  const std::string preset = argv[1];
  const int64_t B = std::atoll(argv[2]), T = std::atoll(argv[3]);
  const int steps = argc > 4 ? std::atoi(argv[4]) : 6;
  ModelConfig cfg = ModelConfig::preset(preset);
  const double peak = measure_peak_gflops();
  auto model = build_model(cfg);
  model->init_weights(1);
  model->allocate(B, T);
  optim::OptimConfig oc;
  auto opt = optim::make_optimizer(oc, model->num_params());
  std::vector<optim::ParamRange> ranges;
  for (auto& s : model->params().specs()) ranges.push_back({s.offset, size_t(s.numel()), s.decay});
  std::vector<int32_t> tok(B * T), tgt(B * T);
  Rng rng(3);
  for (auto& t : tok) t = int32_t(rng.below(cfg.vocab_size));
  for (auto& t : tgt) t = int32_t(rng.below(cfg.vocab_size));
  const double est = double(model->num_params()) * 16 + double(model->activation_bytes());
  double total = 0, fb = 0, upd = 0;
  int measured = 0;
  for (int s = 0; s < steps + 1; ++s) {
    const double t0 = now_seconds();
    model->zero_grad();
    model->forward_backward(tok.data(), tgt.data(), B, T, 1.0f / (B * T), true);
    const double t1 = now_seconds();
    const double norm = optim::global_grad_norm(model->grad_data(), model->num_params());
    opt->step(model->param_data(), model->grad_data(), ranges, 1e-4, s + 1, optim::clip_coefficient(norm, 1.0));
    const double t2 = now_seconds();
    if (s > 0) {  // first step is warm-up
      total += t2 - t0;
      fb += t1 - t0;
      upd += t2 - t1;
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
                      {"threads", omp_get_max_threads()},
                      {"blas_kernel", blas_kernel_name()},
                      {"params", model->num_params()},
                      {"ms_per_step", ms},
                      {"ms_forward_backward", 1e3 * fb / measured},
                      {"ms_optimizer", 1e3 * upd / measured},
                      {"tokens_per_s", tok_s},
                      {"peak_gflops", peak},
                      {"mfu", mfu},
                      {"peak_rss_mb", peak_rss_bytes() / 1e6},
                      {"estimate_mb", est / 1e6}};
  fmt::print("{}\n", j.dump());
  return 0;
}
