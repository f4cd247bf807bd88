// lathe.Error: every C++ exception that crosses into Python (lathe::Error, bad_alloc, filesystem
// and JSON library errors) becomes lathe.Error with the message `lathe` prints after "error: "
// (core/error_message.h). Python exceptions raised inside callbacks pass through unchanged.
#include <nanobind/nanobind.h>

#include <exception>

#include "core/error.h"
#include "core/error_message.h"
#include "python/bindings.h"

namespace lathe::py {

namespace {
PyObject* g_error = nullptr;
}

void bind_errors(nb::module_& m) {
  g_error = PyErr_NewExceptionWithDoc("lathe._lathe.Error",
                                      "An error of the lathe engine, with the message the lathe binary prints after "
                                      "'error: ' (the file, key or value at fault and the fix).",
                                      PyExc_RuntimeError, nullptr);
  m.attr("Error") = nb::handle(g_error);
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const nb::python_error&) {
      throw;  // a Python exception (a callback's): nanobind restores it
    } catch (const nb::builtin_exception&) {
      throw;  // nanobind's own (type errors of arguments and the like)
    } catch (const std::exception& e) {
      PyErr_SetString(g_error, error_message(e).c_str());
    }
  });
}

}  // namespace lathe::py
