// A run's `device` (cpu | cuda) -> the kernel backend it computes on, refused with the reason when
// this build or machine cannot run it (lathe check and lathe train both ask here, through preflight).
#pragma once
#include <string>
#include <string_view>

#include "kernels/backend.h"

namespace lathe {

// "" when `backend` can be used in this process, else why not: a build without CUDA (the no-CUDA
// stand-in's error) or no visible GPU (the CUDA runtime's error). Probes with one small allocation,
// so whatever the backend's own initialisation checks (driver, device count, device selection) is
// what decides.
std::string backend_unavailable_reason(const Backend& backend);

// The backend of `device` (the recipe's key; `source` names the recipe in errors): cpu_backend()
// for "cpu"; for "cuda" the backend named "cuda" after the probe above. Throws lathe::Error
// "<source>: device: cuda: <why> (<fix>)" naming the key, the value and the fix (rebuild with
// -DLATHE_CUDA=ON, make a GPU visible, or set device: cpu).
const Backend& select_backend(std::string_view device, std::string_view source);

}  // namespace lathe
