// Device choice from the launcher's local rank (see launch.h). Plain C++: part of the CUDA
// backend library, tested without a GPU.
#include "kernels/cuda/launch.h"

#include <charconv>
#include <cstring>

#include "core/error.h"

namespace lathe::cuda {

namespace {
int parse_rank(const char* name, const char* value) {
  int r = -1;
  const char* end = value + std::strlen(value);
  const auto [p, ec] = std::from_chars(value, end, r);
  LATHE_CHECK(ec == std::errc() && p == end && p != value && r >= 0,
              "{}='{}' is not a non-negative integer: the CUDA backend picks the GPU from the local rank; "
              "fix or unset {}",
              name, value, name);
  return r;
}
}  // namespace

DeviceChoice choose_device(const char* ompi_local_rank, const char* local_rank, int device_count) {
  LATHE_CHECK(device_count >= 1, "no CUDA device to choose from (device count {})", device_count);
  DeviceChoice c{0, 0, "default (no local rank set)"};
  if (ompi_local_rank != nullptr) {
    c.local_rank = parse_rank("OMPI_COMM_WORLD_LOCAL_RANK", ompi_local_rank);
    c.source = std::string("OMPI_COMM_WORLD_LOCAL_RANK=") + ompi_local_rank;
  } else if (local_rank != nullptr) {
    c.local_rank = parse_rank("LOCAL_RANK", local_rank);
    c.source = std::string("LOCAL_RANK=") + local_rank;
  }
  c.device = c.local_rank % device_count;
  return c;
}

}  // namespace lathe::cuda
