// lathe._lathe.plan and check: `lathe plan --json`'s layouts (train/plan_job.h) and `lathe check`'s
// checks (train/check.h), on a loaded recipe.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <string>
#include <vector>

#include "core/error.h"
#include "python/bindings.h"
#include "train/check.h"
#include "train/plan_job.h"

namespace lathe::py {

namespace {

std::string plan(const Recipe& r, const std::string& path, const PlanAssumptions& a) {
  LATHE_CHECK(a.world >= 1 && a.world <= (int64_t{1} << 20), "plan: world = {} must be in [1, 2^20]", a.world);
  LATHE_CHECK(a.gpus_per_node <= a.world,
              "plan: gpus_per_node = {} is more than world = {} (the ranks of the job per node: at most the world size)",
              a.gpus_per_node, a.world);
  for (const int64_t v : a.virtual_stages)
    LATHE_CHECK(v >= 1 && v <= 1024, "plan: virtual_stages value {} must be in [1, 1024]", v);
  nb::gil_scoped_release release;  // the GEMM probe and memcpy measurement take a moment
  return plan_json(plan_job(r, path, a), r, path).dump();
}

// The lines `lathe check` prints ("ok   ..." / "note ..."), in order; throws at the first failure.
std::vector<std::string> check(Recipe r, const std::string& path, int64_t world, const std::string& resume,
                               bool overwrite) {
  LATHE_CHECK(world >= 1 && world <= (int64_t{1} << 20), "check: world = {} must be in [1, 2^20]", world);
  TrainOptions opts;
  opts.resume = resume;
  opts.overwrite = overwrite;
  std::vector<std::string> lines;
  auto ok = [&](const std::string& l) { lines.push_back("ok   " + l); };
  auto note = [&](const std::string& l) { lines.push_back("note " + l); };
  {
    nb::gil_scoped_release release;
    check_recipe(r, path, opts, world, PreflightLog{ok, note});
  }
  lines.push_back("ok   lathe train " + path + " can start");
  return lines;
}

}  // namespace

void bind_plan(nb::module_& m) {
  nb::class_<PlanAssumptions>(m, "PlanAssumptions")
      .def(nb::init<>())
      .def_rw("world", &PlanAssumptions::world)
      .def_rw("global_batch", &PlanAssumptions::global_batch)
      .def_rw("gpus_per_node", &PlanAssumptions::gpus_per_node)
      .def_rw("memory_gb", &PlanAssumptions::memory_gb)
      .def_rw("peak_gflops", &PlanAssumptions::peak_gflops)
      .def_rw("link_gbps", &PlanAssumptions::link_gbps)
      .def_rw("intra_gbps", &PlanAssumptions::intra_gbps)
      .def_rw("virtual_stages", &PlanAssumptions::virtual_stages);
  m.def("plan", &plan, nb::arg("recipe"), nb::arg("path"), nb::arg("assumptions"));
  m.def("check", &check, nb::arg("recipe"), nb::arg("path"), nb::arg("world"), nb::arg("resume"),
        nb::arg("overwrite"));
}

}  // namespace lathe::py
