// Backend registry and op-table lookup (see backend.h).
#include "kernels/backend.h"

#include <fmt/format.h>

#include <cstdint>

#include "core/buffer.h"
#include "core/error.h"

namespace lathe {

std::string_view device_kind_name(DeviceKind k) {
  switch (k) {
    case DeviceKind::Host:
      return "host";
    case DeviceKind::Cuda:
      return "cuda";
  }
  return "?";
}

std::string compute_dtype_name(DType t) {
  switch (t) {
    case DType::F32:
      return "fp32";
    case DType::BF16:
      return "bf16";
    case DType::F16:
      return "fp16";
    default:
      return std::string(dtype_name(t));
  }
}

const std::vector<const Backend*>& backends() {
  // Explicit list (no static registration), so the set of backends is visible in one place.
  static const std::vector<const Backend*> all = {&cpu_backend(), &cuda_backend()};
  return all;
}

const Backend& backend_by_name(std::string_view name) {
  std::vector<std::string_view> names;
  for (const Backend* b : backends()) {
    if (b->name() == name) return *b;
    names.push_back(b->name());
  }
  throw_error("unknown backend '{}' (known: {})", name, fmt::join(names, ", "));
}

const Ops* find_ops(const Backend& backend, DType compute) {
  for (const Ops* t : backend.op_tables())
    if (t && t->dtype == compute) return t;
  return nullptr;
}

const Ops& ops_for(const Backend& backend, DType compute) {
  static const Ops kEmpty{};
  const Ops* table = find_ops(backend, compute);
  const Ops& t = table ? *table : kEmpty;
  const char* missing = nullptr;
  for_each_op(t, [&](const char* name, bool implemented) {
    if (!implemented && !missing) missing = name;
  });
  if (!missing) return t;
  // Which dtypes of this backend do implement the missing op (the alternatives to ask for).
  std::vector<std::string> have;
  for (const Ops* other : backend.op_tables()) {
    if (!other) continue;
    bool has = false;
    for_each_op(*other, [&](const char* name, bool implemented) {
      if (std::string_view(name) == missing) has = implemented;
    });
    if (has) have.push_back(compute_dtype_name(other->dtype));
  }
  throw_error("[{}] no {} implementation on {}; implemented: {}", missing, compute_dtype_name(compute), backend.name(),
              have.empty() ? std::string("none") : fmt::format("{}", fmt::join(have, ", ")));
}

const Ops* Backend::cudnn_attention_ops(DType, std::string* why) const {
  *why = fmt::format("the {} backend has no cuDNN attention (cuDNN's SDPA runs on device: cuda)", name());
  return nullptr;
}

const Ops& ops_for(const Backend& backend, DType compute, std::string_view attention_kernel) {
  if (attention_kernel == "lathe") return ops_for(backend, compute);
  if (attention_kernel != "cudnn") throw_error("unknown attention kernel '{}' (known: lathe, cudnn)", attention_kernel);
  std::string why;
  const Ops* t = backend.cudnn_attention_ops(compute, &why);
  if (!t)
    throw_error("attention kernel cudnn: not available on {} in {}: {}", backend.name(), compute_dtype_name(compute),
                why);
  return *t;
}

std::vector<std::pair<const Backend*, DType>> implemented_ops() {
  std::vector<std::pair<const Backend*, DType>> out;
  for (const Backend* b : backends())
    for (const Ops* t : b->op_tables()) {
      if (!t) continue;
      bool complete = true;
      for_each_op(*t, [&](const char*, bool implemented) { complete = complete && implemented; });
      if (complete) out.push_back({b, t->dtype});
    }
  return out;
}

void DeviceBuffer::resize(const Backend& backend, size_t count, DType dtype, bool touch) {
  release();
  backend_ = &backend;
  dtype_ = dtype;
  if (count == 0) return;
  LATHE_CHECK(count <= SIZE_MAX / dtype_size(dtype), "{} buffer of {} {} elements: the byte size overflows",
              backend.name(), count, dtype_name(dtype));
  ptr_ = backend.alloc(count * dtype_size(dtype));
  count_ = count;
  if (!touch && backend.device() == DeviceKind::Host)
    zero_untouched(ptr_, bytes());
  else
    zero();
}

void DeviceBuffer::zero() {
  if (ptr_) backend_->memset(ptr_, 0, bytes());
}

void DeviceBuffer::release() {
  if (ptr_) backend_->free(ptr_);
  ptr_ = nullptr;
  count_ = 0;
}

}  // namespace lathe
