// lathe._lathe: the module's entry point; each part of the API is bound in its own file.
#include "python/bindings.h"

#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "core/blas_env.h"

NB_MODULE(_lathe, m) {
  m.doc() = "lathe's engine (the same C++ libraries as the lathe binary); use the package `lathe`";
  m.attr("__version__") = LATHE_VERSION;
  // What `lathe` sets before it re-executes itself (core/blas_env.h): lathe/_runtime.py applies it.
  m.def("_runtime_settings", [] {
    const lathe::RuntimeSettings s = lathe::fast_runtime_settings();
    return std::make_pair(s.env, s.note);
  });
  // The note _runtime.py printed (the binary's note): train.log starts with it (train/run_log.h).
  m.def("_set_runtime_note", [](std::string note) { lathe::set_runtime_note(std::move(note)); });
  lathe::py::bind_errors(m);
  lathe::py::bind_train(m);
  lathe::py::bind_data(m);
  lathe::py::bind_model(m);
  lathe::py::bind_plan(m);
}
