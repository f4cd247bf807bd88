#include "core/dtype.h"

#include <immintrin.h>

#include "core/error.h"

namespace lathe {

std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::F32:
      return "F32";
    case DType::BF16:
      return "BF16";
    case DType::F16:
      return "F16";
    case DType::I32:
      return "I32";
    case DType::U16:
      return "U16";
    case DType::I64:
      return "I64";
    case DType::U8:
      return "U8";
    case DType::F64:
      return "F64";
  }
  return "?";
}

DType dtype_from_name(std::string_view name, std::string_view what) {
  if (name == "F32") return DType::F32;
  if (name == "BF16") return DType::BF16;
  if (name == "F16") return DType::F16;
  if (name == "I32") return DType::I32;
  if (name == "U16") return DType::U16;
  if (name == "I64") return DType::I64;
  if (name == "U8") return DType::U8;
  if (name == "F64") return DType::F64;
  throw_error("{}: unknown dtype '{}' (expected one of F32, BF16, F16, I32, U16, I64, U8, F64)", what, name);
}

uint16_t fp32_to_fp16(float f) { return static_cast<uint16_t>(_cvtss_sh(f, 0)); }
float fp16_to_fp32(uint16_t h) { return _cvtsh_ss(h); }

}  // namespace lathe
