// lathe._lathe.Recipe and train(): config/recipe.h's load_recipe (what `lathe train` validates) and
// train/trainer.h's train() (what `lathe train` runs), in this process, with the GIL released.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <fmt/format.h>

#include <csignal>
#include <optional>
#include <stdexcept>

#include "config/recipe.h"
#include "core/stop.h"
#include "dist/comm.h"
#include "python/bindings.h"
#include "train/trainer.h"

namespace lathe::py {

namespace {

// Thrown through train() when an on_step callback raised (not KeyboardInterrupt): unwinds the run
// as any error would; the callback's Python exception is raised instead.
struct CallbackRaised : std::exception {
  const char* what() const noexcept override { return "on_step raised"; }
};

nb::dict run_train(const Recipe& recipe, nb::object on_metrics, const std::string& resume, bool overwrite,
                   bool quiet, int64_t stop_after) {
  // Under mpirun every process runs this (as `lathe train`); alone it is a one-rank world.
  auto world = dist::make_world_communicator(recipe.parallel.timeout_s);
  TrainOptions opts;
  opts.world = world.get();
  opts.resume = resume;
  opts.overwrite = overwrite;
  opts.quiet = quiet;
  opts.stop_after_steps = stop_after;
  // SIGINT/SIGTERM as `lathe train` takes them (checkpoint at the next step boundary), in place of
  // Python's handler while train() runs; a KeyboardInterrupt raised by on_step requests the same.
  opts.handle_signals = true;
  std::optional<nb::python_error> raised;  // the callback's exception, raised after train() returns
  if (!on_metrics.is_none()) {
    opts.on_metrics = [&](const nlohmann::json& j) {
      if (raised) return;  // nothing more after the callback raised
      const std::string s = j.dump();
      nb::gil_scoped_acquire gil;
      try {
        on_metrics(nb::str(s.data(), s.size()));
      } catch (nb::python_error& e) {
        const bool interrupt = e.matches(PyExc_KeyboardInterrupt);
        raised.emplace(std::move(e));
        if (!interrupt) throw CallbackRaised();
        g_stop_request.store(SIGINT);  // as SIGINT: a checkpoint at the next step boundary
      }
    };
  }
  TrainResult res;
  try {
    nb::gil_scoped_release release;
    res = train(recipe, opts);
  } catch (const CallbackRaised&) {
  }
  if (raised) {
    nb::python_error e = std::move(*raised);
    raised.reset();
    throw e;
  }
  if (res.interrupted && g_stop_request.load() != 0) {
    const int sig = g_stop_request.load();
    const std::string msg = fmt::format(
        "training stopped by {}: checkpoint {} saved at step {}; lathe.train(..., resume='auto') continues",
        sig == SIGTERM ? "SIGTERM" : "SIGINT", res.last_checkpoint, res.end_step);
    if (sig == SIGTERM) {
      PyErr_SetObject(PyExc_SystemExit, nb::int_(kExitInterrupted).ptr());
    } else {
      PyErr_SetString(PyExc_KeyboardInterrupt, msg.c_str());
    }
    throw nb::python_error();
  }
  nb::dict d;
  d["output_dir"] = recipe.output.dir;
  d["steps"] = res.end_step;
  d["start_step"] = res.start_step;
  d["losses"] = res.losses;
  d["final_val_loss"] = res.final_val_loss < 0 ? nb::none() : nb::cast(res.final_val_loss);
  d["model_dir"] = res.model_dir;
  d["last_checkpoint"] = res.last_checkpoint;
  d["resumed_from"] = res.resumed_from;
  d["interrupted"] = res.interrupted;
  return d;
}

}  // namespace

void bind_train(nb::module_& m) {
  nb::class_<Recipe>(m, "Recipe", "A validated recipe (config/recipe.h); use lathe.Recipe")
      .def("to_json", [](const Recipe& r) { return r.to_json().dump(); })
      .def("to_yaml", &Recipe::to_yaml)
      .def_prop_ro("output_dir", [](const Recipe& r) { return r.output.dir; })
      .def_prop_ro("notes", [](const Recipe& r) { return r.notes; });
  m.def(
      "load_recipe",
      [](const std::string& path, const std::vector<std::string>& sets) { return load_recipe(path, sets); },
      nb::arg("path"), nb::arg("overrides"), "load_recipe(path, ['key=value', ...]) as `lathe train --set`");
  m.def("train", &run_train, nb::arg("recipe"), nb::arg("on_metrics").none(), nb::arg("resume"),
        nb::arg("overwrite"), nb::arg("quiet"), nb::arg("stop_after"));
}

}  // namespace lathe::py
