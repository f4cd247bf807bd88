// The "cuda" backend of a build without CUDA: it links everywhere and refuses every use with an
// error that says why, so code written against the seam compiles and fails clearly here.
// It implements no dtype, so ops_for(no_cuda_backend(), ...) names each missing op.
#include "core/error.h"
#include "kernels/backend.h"

namespace lathe {

namespace {

[[noreturn]] void no_cuda(const char* what) {
  throw_error("[{}] no CUDA implementation: this lathe was built without CUDA (use the cpu backend)", what);
}

class NoCudaBackend final : public Backend {
 public:
  std::string_view name() const override { return "cuda"; }
  DeviceKind device() const override { return DeviceKind::Cuda; }
  void* alloc(size_t) const override { no_cuda("alloc"); }
  void free(void* p) const override {
    if (p) no_cuda("free");  // nothing was ever allocated here
  }
  void memset(void*, int, size_t) const override { no_cuda("memset"); }
  void copy(void*, const void*, size_t, CopyKind) const override { no_cuda("copy"); }
  void synchronize() const override { no_cuda("synchronize"); }
  std::vector<const Ops*> op_tables() const override { return {}; }
  std::string unavailable() const override { return "this lathe was built without CUDA (cmake -DLATHE_CUDA=ON)"; }
};

}  // namespace

const Backend& no_cuda_backend() {
  static const NoCudaBackend backend;
  return backend;
}

}  // namespace lathe
