// Element types. Training math is fp32 today; bf16/fp16 are listed so that buffers, safetensors
// I/O and checkpoints carry a dtype from the start (mixed precision lands later).
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

namespace lathe {

enum class DType : uint8_t { F32, BF16, F16, I32, U16, I64, U8, F64 };

constexpr size_t dtype_size(DType t) {
  switch (t) {
    case DType::F32:
      return 4;
    case DType::BF16:
      return 2;
    case DType::F16:
      return 2;
    case DType::I32:
      return 4;
    case DType::U16:
      return 2;
    case DType::I64:
      return 8;
    case DType::U8:
      return 1;
    case DType::F64:
      return 8;
  }
  return 0;
}

// Names as safetensors spells them ("F32", "BF16", ...).
std::string_view dtype_name(DType t);
// Throws lathe::Error naming `what` when the name is unknown.
DType dtype_from_name(std::string_view name, std::string_view what = "dtype");

// Round-to-nearest-even fp32 -> bf16 and exact bf16 -> fp32.
inline uint16_t fp32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
inline float bf16_to_fp32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
uint16_t fp32_to_fp16(float f);
float fp16_to_fp32(uint16_t h);

}  // namespace lathe
