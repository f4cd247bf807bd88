#include "kernels/backend_select.h"

#include <fmt/format.h>

#include "core/error.h"

namespace lathe {

std::string backend_unavailable_reason(const Backend& backend) {
  if (backend.device() == DeviceKind::Host) return {};
  try {
    void* p = backend.alloc(64);
    backend.free(p);
    backend.synchronize();
  } catch (const std::exception& e) {
    return e.what();
  }
  return {};
}

const Backend& select_backend(std::string_view device, std::string_view source) {
  if (device == "cpu") return cpu_backend();
  LATHE_CHECK(device == "cuda", "{}: device: must be one of cpu, cuda (default cpu), got '{}'", source, device);
  const Backend& b = backend_by_name("cuda");
  const std::string why = backend_unavailable_reason(b);
  if (why.empty()) return b;
  const bool no_build = why.find("built without CUDA") != std::string::npos;
  throw_error("{}: device: cuda: {} ({})", source, why,
              no_build ? "rebuild with cmake -DLATHE_CUDA=ON on a machine with the CUDA toolkit, or set device: cpu"
                       : "make a GPU visible to this process (nvidia-smi, CUDA_VISIBLE_DEVICES), or set device: cpu");
}

}  // namespace lathe
