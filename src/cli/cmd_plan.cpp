// lathe plan RECIPE --world N [--memory-gb G] [--peak-gflops F] [--link-gbps B] [--intra-gbps B]
//            [--gpus-per-node K] [--global-batch S] [--top K] [--json] [--set key=value ...]:
// every data x context x tensor x pipeline layout of an N-process job (sequence parallel, ZeRO 0/1/2,
// recompute none/selective/full), the memory per rank and a predicted step time
// (parallel/plan.h), sorted by predicted tokens/s; layouts the model cannot take are listed with
// the reason. Without --peak-gflops / --link-gbps the figures are measured on this machine (a GEMM
// probe, train/peak.cpp, and a memcpy: the ranks of a one-machine job exchange through shared
// memory); the header says which figures were measured and which given.
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>
#include <vector>

#include "cli/command.h"
#include "cli/validators.h"
#include "config/recipe.h"
#include "core/timer.h"
#include "models/memory.h"
#include "parallel/plan.h"
#include "train/plan_job.h"

namespace {

std::string count(double n) {
  if (n >= 1e9) return fmt::format("{:.1f}B", n / 1e9);
  if (n >= 1e6) return fmt::format("{:.1f}M", n / 1e6);
  return fmt::format("{:.1f}K", n / 1e3);
}

int run_plan(int argc, char** argv) {
  CLI::App app{"Plan a parallel layout: memory per rank and predicted speed of every data x tensor x pipeline layout",
               "lathe plan"};
  std::string path;
  std::vector<std::string> sets;
  int64_t world = 0, global_batch = 0, gpus_per_node = 0, top = 25;
  double memory_gb = 0, peak = 0, link = 0, intra = 0;
  bool json = false;
  app.add_option("recipe", path, "recipe file (YAML)")->required();
  app.add_option("--set", sets, "override a recipe value (repeatable)");
  app.add_option("--world", world, "number of processes (GPUs) of the job")
      ->required()
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  app.add_option("--memory-gb", memory_gb, "memory per rank in GB (default: this machine's memory / world)")
      ->check(lathe::cli::real_range(0, 1e9, /*lo_open=*/true));
  app.add_option("--peak-gflops", peak,
                 "per-rank GEMM throughput in GFLOP/s in the compute dtype (default: training.peak_gflops, else "
                 "measured here with a GEMM probe)")
      ->check(lathe::cli::real_range(1e-3, 1e12));
  app.add_option("--link-gbps", link,
                 "per-rank bandwidth between nodes, Gbit/s one direction (default: measured here with a memcpy)")
      ->check(lathe::cli::real_range(1e-6, 1e9));
  app.add_option("--intra-gbps", intra, "per-rank bandwidth inside a node, Gbit/s (default: --link-gbps)")
      ->check(lathe::cli::real_range(1e-6, 1e9));
  app.add_option("--gpus-per-node", gpus_per_node, "ranks per node (default: world, one machine)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  app.add_option("--global-batch", global_batch,
                 "samples per step (default: micro_batch_size x grad_accum_steps x parallel.data, or x world when "
                 "parallel.data is 0)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 40));
  app.add_option("--top", top, "rows of the table (0 = all valid layouts)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 30));
  std::vector<int64_t> virtual_stages{1};
  app.add_option("--virtual-stages", virtual_stages,
                 "model chunks per pipeline rank to try, e.g. 1,2,5 (> 1: Megatron's interleaved 1F1B)")
      ->delimiter(',')
      ->check(CLI::Range(int64_t{1}, int64_t{1024}));
  app.add_flag("--json", json, "print every layout (valid and rejected) as JSON");
  LATHE_CLI_PARSE(app, argc, argv);
  if (gpus_per_node > world) {  // ranks per node: a node of the job holds at most the whole job
    std::fprintf(stderr,
                 "lathe plan: usage error: --gpus-per-node %lld is more than --world %lld (the ranks of the job per "
                 "node: at most the world size)\n",
                 static_cast<long long>(gpus_per_node), static_cast<long long>(world));
    return 2;
  }

  lathe::Recipe r = lathe::load_recipe(path, sets);
  lathe::PlanAssumptions a;
  a.world = world;
  a.global_batch = global_batch;
  a.gpus_per_node = gpus_per_node;
  a.memory_gb = memory_gb;
  a.peak_gflops = peak;
  a.link_gbps = link;
  a.intra_gbps = intra;
  a.virtual_stages = virtual_stages;
  const lathe::JobPlan p = lathe::plan_job(r, path, a);
  const lathe::plan::Job& job = p.job;
  const lathe::plan::Machine& m = p.machine;
  const std::vector<lathe::plan::Estimate>& all = p.all;
  const std::string &peak_src = p.peak_src, &link_src = p.link_src, &mem_src = p.mem_src;
  peak = p.machine.peak_gflops;
  if (json) {
    fmt::print("{}\n", lathe::plan_json(p, r, path).dump(1));
    return 0;
  }
  // Memory columns in GB, or MB for models where every figure is below a GB.
  int64_t largest = 0;
  for (const auto& e : all)
    if (e.reject.empty()) largest = std::max(largest, e.memory.total());
  const bool in_gb = largest >= 1000000000;
  auto gb = [&](int64_t bytes) { return fmt::format("{:.2f}", static_cast<double>(bytes) / (in_gb ? 1e9 : 1e6)); };
  fmt::print(
      "lathe plan {}: {} ({} parameters, {} layers), {} ranks, global batch {} x seq_len {}, "
      "micro_batch_size {}, compute {}\n",
      path, r.model.model_type, count(static_cast<double>(r.model.num_parameters())), r.model.num_hidden_layers, world,
      job.global_batch, job.seq_len, job.micro_batch, r.precision.compute);
  fmt::print(
      "per rank: peak {:.1f} GFLOP/s ({}); links {:.1f} Gb/s inside a node of {}, {:.1f} Gb/s between nodes "
      "({}); memory {} ({})\n",
      peak, peak_src, m.intra_gbps, m.gpus_per_node, m.inter_gbps, link_src,
      m.memory_bytes > 0 ? lathe::format_bytes(m.memory_bytes) : std::string("unknown"), mem_src);
  fmt::print(
      "schedule 1F1B (vp > 1: interleaved 1F1B); memory per rank in {} (its heaviest pipeline stage): fp32 parameters "
      "+ gradients (+ "
      "compute-dtype weight copies), AdamW moments, activations (micro-batches held), comm buffers (messages, "
      "reduction staging, context K/V buffers); comm% = "
      "tensor + pipeline + data-parallel time + the context exchange compute does not hide, over the step\n\n",
      in_gb ? "GB" : "MB");
  fmt::print(
      "{:>3} {:>4} {:>6} {:>4} {:>2} {:>3} {:>3} {:>4} {:>9} {:>5}  {:>8} {:>8} {:>13} {:>6} {:>8} {:>4}  {:>9} {:>10} "
      "{:>5} {:>7} {:>5}\n",
      "#", "data", "tensor", "pipe", "vp", "ctx", "sp", "zero", "recompute", "mb", "par+grad", "moments",
      "activ.(held)", "comm", "total", "fits", "step s", "tokens/s", "MFU%", "bubble%", "comm%");
  int64_t shown = 0, valid = 0;
  for (const auto& e : all) {
    if (!e.reject.empty()) continue;
    ++valid;
    if (top > 0 && shown >= top) continue;
    ++shown;
    const auto& l = e.layout;
    const double comm = e.step_s > 0 ? (e.tp_s + e.pp_s + e.dp_s + e.cp_s) / e.step_s : 0;
    fmt::print(
        "{:>3} {:>4} {:>6} {:>4} {:>2} {:>3} {:>3} {:>4} {:>9} {:>5}  {:>8} {:>8} {:>13} {:>6} {:>8} {:>4}  {:>9.4g} "
        "{:>10.0f} "
        "{:>5.1f} {:>7.1f} {:>5.1f}\n",
        shown, l.data, l.tensor, l.pipeline, l.virtual_stages, l.context, l.sequence ? "on" : "-", l.zero,
        lathe::recompute_name(l.recompute), e.micro_batches,
        gb(e.memory.params + e.memory.grads + e.memory.compute_weights), gb(e.memory.moments),
        fmt::format("{} ({})", gb(e.memory.activations), e.memory.in_flight), gb(e.memory.comm), gb(e.memory.total()),
        e.fits ? "yes" : "NO", e.step_s, e.tokens_per_s, 100 * e.mfu, 100 * e.bubble, 100 * comm);
  }
  if (shown < valid) fmt::print("... {} more valid layouts (--top 0 shows all)\n", valid - shown);
  // Rejected layouts: one line per (data, tensor, pipeline, sp) and reason.
  std::map<std::string, std::vector<std::string>> by_reason;
  for (const auto& e : all) {
    if (e.reject.empty()) continue;
    const auto& l = e.layout;
    const std::string name = fmt::format("{}x{}x{}{}{}", l.data, l.tensor, l.pipeline,
                                         l.virtual_stages > 1 ? fmt::format("(v{})", l.virtual_stages) : std::string(),
                                         l.sequence ? "+sp" : "");
    auto& v = by_reason[e.reject];
    if (std::find(v.begin(), v.end(), name) == v.end()) v.push_back(name);
  }
  if (!by_reason.empty()) {
    fmt::print("\nrejected (data x tensor x pipeline):\n");
    for (const auto& [why, names] : by_reason) {
      std::string list;
      for (const auto& n : names) list += (list.empty() ? "" : ", ") + n;
      fmt::print("  {}: {}\n", list, why);
    }
  }
  std::fflush(stdout);
  return 0;
}

lathe::cli::Registrar reg("plan", "memory and predicted speed of every data x tensor x pipeline layout of a job",
                          run_plan);

}  // namespace
