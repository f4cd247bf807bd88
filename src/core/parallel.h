#pragma once
#include <omp.h>

namespace lathe {
inline int max_threads() { return omp_get_max_threads(); }
}  // namespace lathe
