// bf16 GEMMs and fp32 <-> bf16 conversion for the CPU backend's bf16 compute path (issue 9).
//
// Same contract as the fp32 matmul in ops.h (PyTorch nn.Linear layout, weight[N, K]):
//  * bf16 operands are raw bit patterns (uint16_t: the upper half of an fp32), products are
//    accumulated in fp32;
//  * parameter gradients (dweight, dbias) are fp32 and always ACCUMULATE (+=) into the fp32
//    gradient buffer; input gradients are "=" or "+=" as asked;
//  * lathe allocates nothing per call except at the first call for a new shape, which creates and
//    caches the oneDNN primitive and its scratch memory (per calling thread, keyed by shape,
//    operation, accumulate/bias/dtype variant and the OpenMP thread count), so training steps
//    reuse them (oneDNN's execute itself still makes a few small bookkeeping allocations);
//  * results are deterministic for a fixed thread count (two calls give bit-identical results).
// The GEMMs run on oneDNN (Debian's libdnnl-dev, OpenMP build: the same libgomp workers as the
// rest of lathe). Built without oneDNN, every GEMM here throws an error naming the package.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace lathe::cpu {

// ---- availability ----------------------------------------------------------------------------
// True when lathe was built with oneDNN (the GEMMs below work).
bool bf16_matmul_available();
// True when the CPU has AVX512-BF16 (vdpbf16ps / vcvtne2ps2bf16). Without it oneDNN still gives
// correct bf16 GEMMs on a slower path (bf16 converted to fp32 inside the kernel).
bool cpu_has_avx512_bf16();
// One line for logs: "oneDNN 2.6.3 (OpenMP), forward GEMM brg:avx512_core_bf16" or why the
// bf16 GEMMs are unavailable. Creates (and caches) one small primitive to ask oneDNN.
std::string bf16_matmul_backend_info();

// ---- conversion (OpenMP-parallel, vectorised) --------------------------------------------------
// Round to nearest, ties to even; bit-identical to fp32_to_bf16 in core/dtype.h for every input:
// NaN stays NaN (quiet bit set, sign and payload's upper bits kept), infinities stay infinite,
// fp32 subnormals round to the nearest bf16 subnormal (not flushed to zero), values that round
// above the largest bf16 become infinity.
void convert_fp32_to_bf16(uint16_t* dst, const float* src, int64_t n);
// Exact (bf16 is a prefix of fp32).
void convert_bf16_to_fp32(float* dst, const uint16_t* src, int64_t n);

// ---- matmul, bf16 operands, fp32 accumulation --------------------------------------------------
// out[M,N] = inp[M,K] @ weight[N,K]^T (+ bias[N] if bias != nullptr), fp32 out.
// accumulate=true adds into out instead of overwriting it (out += inp @ weight^T + bias).
void matmul_forward_bf16(float* out, const uint16_t* inp, const uint16_t* weight, const float* bias, int64_t M,
                         int64_t K, int64_t N, bool accumulate = false);
// The same with a bf16 out (each output element rounded once, from the fp32 sum incl. bias).
void matmul_forward_bf16_out_bf16(uint16_t* out, const uint16_t* inp, const uint16_t* weight, const float* bias,
                                  int64_t M, int64_t K, int64_t N);

// dinp[M,K] (= or += per accumulate_dinp) dout[M,N] @ weight[N,K]     (skipped if dinp == nullptr)
// dweight[N,K] += dout^T @ inp, fp32, accumulated into the fp32 buffer (skipped if dweight == nullptr)
// dbias[N] += column sums of dout (fp32, each column summed in row order) (skipped if dbias == nullptr)
void matmul_backward_bf16(float* dinp, float* dweight, float* dbias, const uint16_t* dout, const uint16_t* inp,
                          const uint16_t* weight, int64_t M, int64_t K, int64_t N, bool accumulate_dinp = false);
// The same with a bf16 dinp ("=" only: the input gradient is rounded once from its fp32 sum).
void matmul_backward_bf16_dinp_bf16(uint16_t* dinp, float* dweight, float* dbias, const uint16_t* dout,
                                    const uint16_t* inp, const uint16_t* weight, int64_t M, int64_t K, int64_t N);

// Number of cached primitives of the calling thread (tests: a second call with the same shape
// must not create another).
size_t bf16_matmul_cache_size();

}  // namespace lathe::cpu
