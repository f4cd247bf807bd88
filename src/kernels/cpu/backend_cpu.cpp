// The CPU backend: host memory, the CPU op tables (kernels/cpu/tables.cpp) and step ops
// (kernels/cpu/step.cpp: optim/'s own AdamW, LAMB and gradient norm). The fp32 table's
// slots are the kernels behind kernels/cpu/ops.h's functions (both are the F32 instance of each
// op's template), so results are those of the direct calls, bit for bit.
#include <cstdlib>
#include <cstring>

#include "core/error.h"
#include "kernels/cpu/step.h"
#include "kernels/cpu/tables.h"

namespace lathe {

namespace {

class CpuBackend final : public Backend {
 public:
  std::string_view name() const override { return "cpu"; }
  DeviceKind device() const override { return DeviceKind::Host; }
  void* alloc(size_t bytes) const override {
    const size_t rounded = (bytes + 63) / 64 * 64;  // aligned_alloc wants a multiple of the alignment
    LATHE_CHECK(rounded >= bytes, "cpu backend: allocation of {} bytes overflows", bytes);
    void* p = std::aligned_alloc(64, rounded == 0 ? 64 : rounded);
    LATHE_CHECK(p != nullptr, "out of memory allocating {} bytes", rounded);
    return p;
  }
  void free(void* p) const override { std::free(p); }
  void memset(void* dst, int value, size_t bytes) const override {
    if (bytes) std::memset(dst, value, bytes);
  }
  void copy(void* dst, const void* src, size_t bytes, CopyKind) const override {
    if (bytes) std::memcpy(dst, src, bytes);
  }
  void synchronize() const override {}
  std::vector<const Ops*> op_tables() const override { return {&cpu::fp32_ops(), &cpu::bf16_ops(), &cpu::fp16_ops()}; }
  const StepOps* step_ops() const override { return &cpu::step_ops(); }
};

}  // namespace

const Backend& cpu_backend() {
  static const CpuBackend backend;
  return backend;
}

}  // namespace lathe
