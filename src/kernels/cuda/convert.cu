// Element conversions between fp32, bf16 and fp16 on the device (kernels/cuda/ops.h: convert):
// round to nearest even (cuda_bf16.h / cuda_fp16.h _rn intrinsics, bit-identical to core/dtype.h's
// host conversions for every non-NaN input, tested in tests/cuda/test_cuda_launch.cpp).
#include <string>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace lathe::cuda {

namespace {

template <class Dst, class Src>
__global__ void convert_kernel(Dst* __restrict__ dst, const Src* __restrict__ src, int64_t n) {
  LATHE_GRID_LOOP(i, n) dst[i] = from_f<Dst>(to_f(src[i]));
}

template <class Dst>
void convert_from(Dst* dst, const void* src, DType src_dtype, int64_t n) {
  const unsigned grid = blocks(n);
  switch (src_dtype) {
    case DType::F32:
      convert_kernel<<<grid, kThreads, 0, stream()>>>(dst, static_cast<const float*>(src), n);
      break;
    case DType::BF16:
      convert_kernel<<<grid, kThreads, 0, stream()>>>(dst, static_cast<const __nv_bfloat16*>(src), n);
      break;
    case DType::F16:
      convert_kernel<<<grid, kThreads, 0, stream()>>>(dst, static_cast<const __half*>(src), n);
      break;
    default:
      fail("cuda convert: no conversion from " + std::string(dtype_name(src_dtype)) + " (fp32, bf16, fp16 only)");
  }
  LATHE_CUDA_LAUNCHED(convert_kernel);
}

}  // namespace

void convert(void* dst, DType dst_dtype, const void* src, DType src_dtype, int64_t n) {
  if (n <= 0) return;
  if (dst_dtype == src_dtype) {
    LATHE_CUDA_CHECK(
        cudaMemcpyAsync(dst, src, static_cast<size_t>(n) * dtype_size(dst_dtype), cudaMemcpyDeviceToDevice, stream()));
    return;
  }
  switch (dst_dtype) {
    case DType::F32:
      return convert_from(static_cast<float*>(dst), src, src_dtype, n);
    case DType::BF16:
      return convert_from(static_cast<__nv_bfloat16*>(dst), src, src_dtype, n);
    case DType::F16:
      return convert_from(static_cast<__half*>(dst), src, src_dtype, n);
    default:
      fail("cuda convert: no conversion to " + std::string(dtype_name(dst_dtype)) + " (fp32, bf16, fp16 only)");
  }
}

}  // namespace lathe::cuda
