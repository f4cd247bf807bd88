#include "core/error_message.h"

#include <fmt/format.h>

#include <filesystem>
#include <new>
#include <nlohmann/json.hpp>

namespace lathe {

std::string error_message(const std::exception& e) {
  if (dynamic_cast<const std::bad_alloc*>(&e))
    return "out of memory: an allocation failed (a dimension, batch or file too large for this machine's memory; "
           "lower it or free memory)";
  if (dynamic_cast<const nlohmann::json::exception*>(&e))
    return fmt::format("unexpected JSON value: {} (a file field has the wrong type)", e.what());
  return e.what();  // lathe::Error; a filesystem_error names the operation and the path(s)
}

}  // namespace lathe
