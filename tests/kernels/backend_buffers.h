// What test_backend_ops.cpp and test_backend_step_ops.cpp share: conversions between fp32 host
// values and a table's element type, and buffers in backend memory with guard bytes behind them
// (a write past the end fails the test when the buffer is read back or freed).
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "gradcheck_basic.h"
#include "kernels/backend.h"

namespace lathe::test {

// ---- conversions between fp32 host values and a table's element type ---------------------------

inline void to_dtype(const float* src, void* dst, size_t n, DType dt) {
  switch (dt) {
    case DType::F32:
      std::memcpy(dst, src, n * sizeof(float));
      return;
    case DType::BF16:
      for (size_t i = 0; i < n; ++i) static_cast<uint16_t*>(dst)[i] = fp32_to_bf16(src[i]);
      return;
    case DType::F16:
      for (size_t i = 0; i < n; ++i) static_cast<uint16_t*>(dst)[i] = fp32_to_fp16(src[i]);
      return;
    default:
      throw_error("test_backend_ops: no conversion to {}", dtype_name(dt));
  }
}
inline void from_dtype(const void* src, float* dst, size_t n, DType dt) {
  switch (dt) {
    case DType::F32:
      std::memcpy(dst, src, n * sizeof(float));
      return;
    case DType::BF16:
      for (size_t i = 0; i < n; ++i) dst[i] = bf16_to_fp32(static_cast<const uint16_t*>(src)[i]);
      return;
    case DType::F16:
      for (size_t i = 0; i < n; ++i) dst[i] = fp16_to_fp32(static_cast<const uint16_t*>(src)[i]);
      return;
    default:
      throw_error("test_backend_ops: no conversion from {}", dtype_name(dt));
  }
}
// The values a buffer of `dt` can hold: what the kernel really reads.
inline VecF rounded(VecF v, DType dt) {
  std::vector<uint8_t> tmp(v.size() * dtype_size(dt));
  to_dtype(v.data(), tmp.data(), v.size(), dt);
  from_dtype(tmp.data(), v.data(), v.size(), dt);
  return v;
}

constexpr size_t kGuardBytes = 64;
constexpr uint8_t kGuardByte = 0xA5;

// A buffer of `n` elements of `dt` in backend memory, followed by guard bytes that must survive
// (checked at every read-back and when the buffer is freed).
class Dev {
 public:
  Dev(const Backend& b, const VecF& host, DType dt, std::string what)
      : b_(&b), n_(host.size()), dt_(dt), what_(std::move(what)) {
    const size_t bytes = n_ * dtype_size(dt_);
    p_ = b_->alloc(bytes + kGuardBytes);
    std::vector<uint8_t> stage(bytes + kGuardBytes, kGuardByte);
    to_dtype(host.data(), stage.data(), n_, dt_);
    b_->copy(p_, stage.data(), stage.size(), CopyKind::HostToDevice);
  }
  ~Dev() {
    down();  // checks the guard bytes of every buffer, also those never read back (scratch)
    b_->free(p_);
  }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;

  void* p() { return p_; }
  float* f() { return static_cast<float*>(p_); }  // only for fp32 buffers
  VecF down() const {
    const size_t bytes = n_ * dtype_size(dt_);
    std::vector<uint8_t> stage(bytes + kGuardBytes);
    b_->synchronize();
    b_->copy(stage.data(), p_, stage.size(), CopyKind::DeviceToHost);
    for (size_t i = bytes; i < stage.size(); ++i)
      if (stage[i] != kGuardByte) {
        ADD_FAILURE() << what_ << ": write past the end of the buffer (guard byte " << i - bytes << ")";
        break;
      }
    VecF out(n_);
    from_dtype(stage.data(), out.data(), n_, dt_);
    return out;
  }

 private:
  const Backend* b_;
  void* p_ = nullptr;
  size_t n_;
  DType dt_;
  std::string what_;
};

// int32 inputs (tokens, positions, targets, doc_start) in backend memory: every pointer a table
// receives is the backend's (on the CUDA backend, device memory).
class IntDev {
 public:
  IntDev(const Backend& b, const std::vector<int32_t>& host) : b_(&b) {
    p_ = b_->alloc(std::max<size_t>(host.size(), 1) * sizeof(int32_t));
    if (!host.empty()) b_->copy(p_, host.data(), host.size() * sizeof(int32_t), CopyKind::HostToDevice);
  }
  ~IntDev() {
    b_->synchronize();
    b_->free(p_);
  }
  IntDev(const IntDev&) = delete;
  IntDev& operator=(const IntDev&) = delete;
  const int32_t* p() const { return static_cast<const int32_t*>(p_); }

 private:
  const Backend* b_;
  void* p_ = nullptr;
};

}  // namespace lathe::test
