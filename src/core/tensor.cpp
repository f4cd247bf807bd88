#include "core/tensor.h"

#include <fmt/format.h>

namespace lathe {

std::string shape_str(const Shape& s) { return fmt::format("[{}]", fmt::join(s, ", ")); }

}  // namespace lathe
