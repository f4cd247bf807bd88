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
//    reuse them (oneDNN's execute itself still makes a few small bookkeeping allocations); on the
//    fp32 path, per-thread fp32 operand copies are grown on first need and reused;
//  * results are deterministic for a fixed thread count (two calls give bit-identical results).
// Two paths, chosen once per process (matmul_bf16.cpp): oneDNN's bf16 matmul (Debian's
// libdnnl-dev, OpenMP build) where it can be created (AVX-512 and up), else operands widened to
// fp32 and the fp32 GEMM (AVX2-only CPUs, oneDNN capped by DNNL_MAX_CPU_ISA, LATHE_CPU_ISA=avx2,
// built without oneDNN): same numerics up to the fp32 summation order, not faster than fp32.
#pragma once
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace lathe::cpu {

// ---- availability and path ---------------------------------------------------------------------
// True: the GEMMs below work on every x86-64 CPU (the fp32 path needs no oneDNN). Kept for callers
// written when they needed oneDNN.
bool bf16_matmul_available();

enum class Bf16Gemm : int { OneDnn = 0, Fp32 = 1 };
// The process's path, chosen at the first call: OneDnn where cpu_isa() (kernels/cpu/isa.h) is
// avx512 or above and oneDNN creates a bf16 matmul, else Fp32.
Bf16Gemm bf16_gemm_process_path();
// The calling thread's path: the process's, unless a test forced another on this thread.
Bf16Gemm bf16_gemm_path();
// "onednn" / "fp32" (logs, run_info.json's bf16_gemm).
const char* bf16_gemm_name(Bf16Gemm path);
// Tests: run this thread's bf16 GEMMs on `path` (nullopt: back to the process's path). Forcing
// OneDnn in a process that cannot use it throws, saying why.
void bf16_gemm_force_for_thread(std::optional<Bf16Gemm> path);
// The one start line of a bf16 / fp16 run (`lathe train`, `lathe check`): the instruction set
// found (and what capped it), the GEMM path of `compute` ("bf16" or "fp16"), and, where that path
// is not native, that it will not be faster than fp32 on this CPU.
std::string lowp_compute_line(std::string_view compute);
// True when the CPU has AVX512-BF16 (vdpbf16ps / vcvtne2ps2bf16). Without it oneDNN still gives
// correct bf16 GEMMs on a slower path (bf16 converted to fp32 inside the kernel).
bool cpu_has_avx512_bf16();
// One line for logs: "oneDNN 2.6.3 (OpenMP), forward GEMM brg:avx512_core_bf16", or the fp32
// path and why oneDNN is not used.
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
