// Checked integer arithmetic for sizes, shapes and offsets computed from input (recipes,
// config.json, file headers). In Release a wrapped product would train a model whose buffers
// disagree with its tensor table; these throw instead, naming what was being computed.
//   int64_t n = checked_mul(rows, cols, "model.vocab_size x model.n_embd");
#pragma once
#include <cstdint>
#include <initializer_list>
#include <string_view>

#include "core/error.h"

namespace lathe {

inline int64_t checked_mul(int64_t a, int64_t b, std::string_view what) {
  int64_t r;
  if (__builtin_mul_overflow(a, b, &r))
    throw_error("{}: {} x {} overflows a 64-bit integer (a dimension is far too large)", what, a, b);
  return r;
}

inline int64_t checked_add(int64_t a, int64_t b, std::string_view what) {
  int64_t r;
  if (__builtin_add_overflow(a, b, &r))
    throw_error("{}: {} + {} overflows a 64-bit integer (a dimension is far too large)", what, a, b);
  return r;
}

// Product of all factors (each must be >= 0), e.g. the element count of a shape.
inline int64_t checked_product(std::initializer_list<int64_t> factors, std::string_view what) {
  int64_t r = 1;
  for (int64_t f : factors) {
    if (f < 0) throw_error("{}: negative factor {}", what, f);
    r = checked_mul(r, f, what);
  }
  return r;
}

}  // namespace lathe
