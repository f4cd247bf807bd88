// The job `lathe plan` plans (src/cli/cmd_plan.cpp) and the Python package's lathe.plan: a recipe's
// model and batch on `world` ranks, the machine figures given or measured here, and every
// data x tensor x pipeline layout the planner (parallel/plan.h) estimates, valid and rejected.
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "config/recipe.h"
#include "parallel/plan.h"

namespace lathe {

// What `lathe plan`'s options give; 0 = the default (recipe's, measured here, or world).
struct PlanAssumptions {
  int64_t world = 0;          // --world (required, >= 1)
  int64_t global_batch = 0;   // --global-batch
  int64_t gpus_per_node = 0;  // --gpus-per-node
  double memory_gb = 0;       // --memory-gb
  double peak_gflops = 0;     // --peak-gflops
  double link_gbps = 0;       // --link-gbps
  double intra_gbps = 0;      // --intra-gbps
  std::vector<int64_t> virtual_stages{1};  // --virtual-stages
};

struct JobPlan {
  plan::Job job;
  plan::Machine machine;
  std::string peak_src, link_src, mem_src;  // where each machine figure came from
  std::vector<plan::Estimate> all;          // every layout, valid and rejected
};

// `path` names the recipe in errors. Throws for a recipe the planner does not model.
JobPlan plan_job(const Recipe& r, const std::string& path, const PlanAssumptions& a);
// `lathe plan --json`'s document.
nlohmann::json plan_json(const JobPlan& p, const Recipe& r, const std::string& path);

}  // namespace lathe
