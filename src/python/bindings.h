// The parts of the extension module lathe._lathe (src/python/bind_*.cpp), registered by bindings.cpp.
// The Python API with its docstrings is python/lathe/__init__.py; these are its native halves.
#pragma once
#include <nanobind/nanobind.h>

namespace lathe::py {

namespace nb = nanobind;

// lathe.Error: C++ exceptions become it with the message the CLI prints (bind_errors.cpp).
void bind_errors(nb::module_& m);
// Recipe, load_recipe, train (bind_train.cpp).
void bind_train(nb::module_& m);
// Tokenizer, IndexedDataset (bind_data.cpp).
void bind_data(nb::module_& m);
// Model (bind_model.cpp).
void bind_model(nb::module_& m);
// plan, check (bind_plan.cpp).
void bind_plan(nb::module_& m);

}  // namespace lathe::py
