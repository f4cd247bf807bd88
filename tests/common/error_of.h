// What the C++ tests share (tests/CMakeLists.txt puts tests/common on every test's include path):
// the message of the error a call ends in, for tests that check what a refusal names.
#pragma once

#include <exception>
#include <string>
#include <utility>

#include "core/error.h"

namespace lathe::test {

// The message of the lathe::Error that f() throws, or "" when f returns. Other exceptions are not
// caught, so a refusal that is not a lathe::Error fails the test instead of passing as a message.
template <class F>
std::string error_of(F&& f) {
  try {
    std::forward<F>(f)();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// For code that also fails through other libraries (CUDA, NCCL, MPI, the standard library): the
// message of any std::exception f() throws, or "(no error)" when f returns.
template <class F>
std::string exception_of(F&& f) {
  try {
    std::forward<F>(f)();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace lathe::test
