#include "train/plan_job.h"

#include <fmt/format.h>

#include <algorithm>

#include "core/error.h"
#include "models/memory.h"
#include "train/peak.h"
#include "train/preflight.h"

namespace lathe {

JobPlan plan_job(const Recipe& r, const std::string& path, const PlanAssumptions& a) {
  const int64_t world = a.world;
  JobPlan p;
  plan::Job& job = p.job;
  job.context_allgather = r.parallel.context_impl == "allgather";
  job.model = r.model;
  job.world = world;
  job.micro_batch = r.training.micro_batch_size;
  job.seq_len = r.training.seq_len;
  job.global_batch = a.global_batch > 0 ? a.global_batch
                                        : r.training.micro_batch_size * r.training.grad_accum_steps *
                                              (r.parallel.data > 0 ? r.parallel.data : world);
  job.compute = compute_spec(r).dtype;
  std::vector<int64_t> virtual_stages = a.virtual_stages;
  std::sort(virtual_stages.begin(), virtual_stages.end());
  virtual_stages.erase(std::unique(virtual_stages.begin(), virtual_stages.end()), virtual_stages.end());
  job.virtual_stages = virtual_stages;

  plan::Machine& m = p.machine;
  double peak = a.peak_gflops, link = a.link_gbps;
  if (peak > 0) {
    p.peak_src = "given";
  } else if (r.training.peak_gflops > 0) {
    peak = r.training.peak_gflops;
    p.peak_src = "the recipe's training.peak_gflops";
  } else {
    peak = measure_peak_gflops();
    p.peak_src = "measured here: fp32 GEMM probe with this process's threads";
  }
  if (link > 0) {
    p.link_src = "given";
  } else {
    link = plan::measure_copy_gbps();
    p.link_src = "measured here: memcpy, as ranks on one machine exchange through shared memory";
  }
  m.peak_gflops = peak;
  m.inter_gbps = link;
  m.intra_gbps = a.intra_gbps > 0 ? a.intra_gbps : link;
  m.gpus_per_node = a.gpus_per_node > 0 ? a.gpus_per_node : world;
  if (a.memory_gb > 0) {
    m.memory_bytes = static_cast<int64_t>(a.memory_gb * 1e9);
    p.mem_src = "given";
  } else {
    const MachineMemory mm = machine_memory();
    m.memory_bytes = mm.bytes / world;
    p.mem_src = mm.bytes > 0 ? fmt::format("{} / world {}", mm.source, world) : "unknown: everything fits";
  }
  p.all = plan::enumerate(job, m);
  return p;
}

nlohmann::json plan_json(const JobPlan& p, const Recipe& r, const std::string& path) {
  const plan::Job& job = p.job;
  const plan::Machine& m = p.machine;
  nlohmann::json j{{"recipe", path},
                   {"world", job.world},
                   {"global_batch", job.global_batch},
                   {"micro_batch_size", job.micro_batch},
                   {"seq_len", job.seq_len},
                   {"params", r.model.num_parameters()},
                   {"machine",
                    {{"peak_gflops", m.peak_gflops},
                     {"peak_source", p.peak_src},
                     {"inter_gbps", m.inter_gbps},
                     {"intra_gbps", m.intra_gbps},
                     {"link_source", p.link_src},
                     {"gpus_per_node", m.gpus_per_node},
                     {"memory_bytes", m.memory_bytes},
                     {"memory_source", p.mem_src}}},
                   {"layouts", nlohmann::json::array()}};
  for (const auto& e : p.all) j["layouts"].push_back(plan::to_json(e));
  return j;
}

}  // namespace lathe
