// A Tensor here is a non-owning view: pointer + shape + dtype. Storage lives in flat buffers
// (parameters, gradients, optimizer moments: core/buffer.h) or in the per-step activation arena,
// so views are cheap to copy and nothing allocates in the hot loop.
#pragma once
#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "core/dtype.h"

namespace lathe {

using Shape = std::vector<int64_t>;

inline int64_t numel(const Shape& s) {
  int64_t n = 1;
  for (auto d : s) n *= d;
  return n;
}
std::string shape_str(const Shape& s);  // "[768, 2304]"

struct Tensor {
  void* data = nullptr;
  Shape shape;
  DType dtype = DType::F32;

  int64_t numel() const { return lathe::numel(shape); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype); }
  float* f32() const { return static_cast<float*>(data); }
};

}  // namespace lathe
