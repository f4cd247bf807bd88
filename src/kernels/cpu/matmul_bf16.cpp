// bf16 linear layer forward/backward on oneDNN matmul (contract in ops_bf16.h).
//
// Why oneDNN: Debian's OpenBLAS 0.3.21 has no sbgemm; oneDNN 2.6.3's brgemm matmul runs bf16 at
// 2-4x the fp32 sgemm rate on AVX512-BF16 (bench/bench_matmul_bf16.py); an own vdpbf16ps kernel
// (in that bench) reached 93-100% of oneDNN's rate, not more. Debian builds it
// with the OpenMP runtime (libgomp), so its GEMMs run on the same OpenMP workers as OpenBLAS and
// our own kernels, and sequentially when called from inside a parallel region.
//
// The three GEMMs as oneDNN matmuls (row-major; a "transposed" operand is a stride swap, no copy):
//   forward   out[M,N]     = inp[M,K]     @ (weight[N,K])^T     weights strides {1, K}
//   backward  dinp[M,K]    = dout[M,N]    @ weight[N,K]
//   backward  dweight[N,K] += (dout[M,N])^T @ inp[M,K]          src strides {1, N}, sum post-op
// "+=" is oneDNN's sum post-op (dst = gemm + dst, in fp32).
//
// Primitive cache: creating a oneDNN primitive takes milliseconds (it JITs kernels; ~5 ms here),
// far too slow per training-step GEMM. Each calling thread keeps its own map from (shape, op,
// variant, OpenMP thread count) to the primitive, its memory objects (only their data pointers
// change per call) and its scratchpad (user-managed, allocated once), so no two threads ever share a scratchpad
// (in-process data-parallel tests run one model per thread). Execution goes through the C API
// with a fixed argument array, so this file allocates nothing per call after the first (oneDNN's
// execute still builds its small argument map internally).
//
// Determinism: for a fixed primitive (thread count included in the key) oneDNN's brgemm matmul
// splits work statically and reduces any K split in a fixed order; tests check bit-identical
// repeats.
//
// Two paths, chosen once per process (bf16_gemm_path, issue 22):
//  * onednn: the above, where oneDNN can create a bf16 matmul (oneDNN 2.6 needs at least
//    avx512_core for bf16; AVX512-BF16 / AMX run it natively, plain AVX-512 emulates the bf16
//    dot products inside its kernels);
//  * fp32: everywhere else (AVX2-only CPUs, oneDNN capped by DNNL_MAX_CPU_ISA, LATHE_CPU_ISA=avx2,
//    lathe built without oneDNN). Each bf16 operand is widened to fp32 once per call (exact: bf16
//    is the upper half of an fp32), in parallel, into per-thread scratch grown once and reused;
//    the fp32 GEMM (cpu::matmul_forward / matmul_backward, the fp32 model's own) computes with fp32
//    accumulation; a bf16 destination is rounded once (round to nearest even) from the fp32 result
//    including the bias. Same numerics as the oneDNN path up to the fp32 summation order, same
//    dst / bias / accumulate semantics; deterministic as the fp32 GEMM is (fixed thread count). It
//    does the fp32 GEMM's work plus the widening, so bf16 is not faster than fp32 there.
#include <omp.h>

#include <cstring>
#include <memory>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "kernels/cpu/col_sums.h"
#include "kernels/cpu/isa.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/ops_bf16.h"
#include "kernels/cpu/storage.h"

#ifdef LATHE_HAVE_DNNL
#include <oneapi/dnnl/dnnl.hpp>
#endif

namespace lathe::cpu {

namespace {

// Below this many elements an OpenMP fork costs more than the loop itself.
constexpr int64_t kParallelMin = 1 << 14;

void check_dims(const char* fn, int64_t M, int64_t K, int64_t N) {
  LATHE_CHECK(M >= 0 && K >= 0 && N >= 0, "{}: negative dimension (M={}, K={}, N={})", fn, M, K, N);
}

// out[M,N] = bias (or 0), or out += bias when accumulating: the whole result when K == 0.
template <typename T>
void fill_k0(T* out, const float* bias, int64_t M, int64_t N, bool accumulate) {
#pragma omp parallel for schedule(static) if (M * N >= kParallelMin)
  for (int64_t i = 0; i < M; ++i) {
    for (int64_t j = 0; j < N; ++j) {
      const float b = bias ? bias[j] : 0.0f;
      if constexpr (std::is_same_v<T, float>) {
        out[i * N + j] = accumulate ? out[i * N + j] + b : b;
      } else {
        out[i * N + j] = Bf16::st(b);
      }
    }
  }
}

// dbias[N] += column sums of dout[M,N] (bf16), each column summed in row order in fp32.
void bias_backward(float* dbias, const uint16_t* dout, int64_t M, int64_t N) {
  add_column_sums(dbias, dout, M, N, [](uint16_t x) { return Bf16::ld(x); });
}

#ifdef LATHE_HAVE_DNNL

enum class Op : uint8_t { Forward, BackwardData, BackwardWeights };

struct Key {
  int64_t M, K, N;
  Op op;
  bool accumulate, bias, dst_bf16;
  int threads;
  bool operator==(const Key&) const = default;
};

struct KeyHash {
  size_t operator()(const Key& k) const {
    size_t h = std::hash<int64_t>()(k.M);
    auto mix = [&h](size_t v) { h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2); };
    mix(std::hash<int64_t>()(k.K));
    mix(std::hash<int64_t>()(k.N));
    mix(static_cast<size_t>(k.op) | (size_t{k.accumulate} << 2) | (size_t{k.bias} << 3) | (size_t{k.dst_bf16} << 4));
    mix(static_cast<size_t>(k.threads));
    return h;
  }
};

struct AlignedFree {
  void operator()(void* p) const { std::free(p); }
};

struct Entry {
  dnnl::primitive prim;
  dnnl::memory src, wei, bias, dst, scratch;
  std::unique_ptr<void, AlignedFree> scratch_buf;
  std::string impl;
};

const char* op_name(Op op) {
  switch (op) {
    case Op::Forward:
      return "forward";
    case Op::BackwardData:
      return "backward (input gradient)";
    case Op::BackwardWeights:
      return "backward (weight gradient)";
  }
  return "?";
}

dnnl::engine& engine() {
  static dnnl::engine e(dnnl::engine::kind::cpu, 0);
  return e;
}

struct ThreadCache {
  dnnl::stream stream{engine()};
  std::unordered_map<Key, Entry, KeyHash> map;
};

ThreadCache& thread_cache() {
  thread_local ThreadCache c;
  return c;
}

using dt = dnnl::memory::data_type;
using tag = dnnl::memory::format_tag;

Entry make_entry(const Key& k) {
  const dt dst_dt = k.dst_bf16 ? dt::bf16 : dt::f32;
  dnnl::memory::desc src, wei, dst, bias;
  switch (k.op) {
    case Op::Forward:  // [M,K] @ [K,N] where weights are weight[N,K] read with strides {1, K}
      src = dnnl::memory::desc({k.M, k.K}, dt::bf16, tag::ab);
      wei = dnnl::memory::desc({k.K, k.N}, dt::bf16, dnnl::memory::dims{1, k.K});
      dst = dnnl::memory::desc({k.M, k.N}, dst_dt, tag::ab);
      if (k.bias) bias = dnnl::memory::desc({1, k.N}, dt::f32, tag::ab);
      break;
    case Op::BackwardData:  // dout[M,N] @ weight[N,K]
      src = dnnl::memory::desc({k.M, k.N}, dt::bf16, tag::ab);
      wei = dnnl::memory::desc({k.N, k.K}, dt::bf16, tag::ab);
      dst = dnnl::memory::desc({k.M, k.K}, dst_dt, tag::ab);
      break;
    case Op::BackwardWeights:  // dout^T [N,M] (strides {1, N}) @ inp[M,K]
      src = dnnl::memory::desc({k.N, k.M}, dt::bf16, dnnl::memory::dims{1, k.N});
      wei = dnnl::memory::desc({k.M, k.K}, dt::bf16, tag::ab);
      dst = dnnl::memory::desc({k.N, k.K}, dst_dt, tag::ab);
      break;
  }
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  if (k.accumulate) {
    dnnl::post_ops po;
    po.append_sum(1.0f);
    attr.set_post_ops(po);
  }
  Entry e;
  try {
    const auto d = k.bias ? dnnl::matmul::desc(src, wei, bias, dst) : dnnl::matmul::desc(src, wei, dst);
    const dnnl::matmul::primitive_desc pd(d, attr, engine());
    e.prim = dnnl::matmul(pd);
    e.impl = pd.impl_info_str();
    const size_t scratch_bytes = pd.scratchpad_desc().get_size();
    if (scratch_bytes > 0) {
      e.scratch_buf.reset(std::aligned_alloc(64, (scratch_bytes + 63) / 64 * 64));
      LATHE_CHECK(e.scratch_buf != nullptr, "bf16 matmul {}: cannot allocate {} bytes of oneDNN scratch memory",
                  op_name(k.op), scratch_bytes);
      e.scratch = dnnl::memory(pd.scratchpad_desc(), engine(), e.scratch_buf.get());
    }
    e.src = dnnl::memory(src, engine(), DNNL_MEMORY_NONE);
    e.wei = dnnl::memory(wei, engine(), DNNL_MEMORY_NONE);
    e.dst = dnnl::memory(dst, engine(), DNNL_MEMORY_NONE);
    if (k.bias) e.bias = dnnl::memory(bias, engine(), DNNL_MEMORY_NONE);
  } catch (const dnnl::error& err) {
    throw_error("bf16 matmul {} (M={}, K={}, N={}): oneDNN could not create the GEMM: {} (status {})", op_name(k.op),
                k.M, k.K, k.N, err.what(), static_cast<int>(err.status));
  }
  return e;
}

// A training run uses a handful of shapes; generation or evaluation with many different row
// counts could add one entry per count, so the cache is emptied when it reaches this size (the
// shapes in use are recreated once).
constexpr size_t kMaxCached = 512;

Entry& lookup(const Key& k) {
  auto& map = thread_cache().map;
  auto it = map.find(k);
  if (it == map.end()) {
    Entry e = make_entry(k);
    if (map.size() >= kMaxCached) map.clear();
    it = map.emplace(k, std::move(e)).first;
  }
  return it->second;
}

// One GEMM through the cached primitive; pointers are only read for const operands.
void run(const Key& k, void* dst, const void* src, const void* wei, const float* bias) {
  Entry& e = lookup(k);
  dnnl_exec_arg_t args[5];
  int n = 0;
  auto bind = [&](int arg, dnnl::memory& m, const void* p) {
    dnnl_status_t st = dnnl_memory_set_data_handle_v2(m.get(), const_cast<void*>(p), nullptr);
    LATHE_CHECK(st == dnnl_success, "bf16 matmul {}: oneDNN set_data_handle failed (status {})", op_name(k.op),
                static_cast<int>(st));
    args[n++] = {arg, m.get()};
  };
  bind(DNNL_ARG_SRC, e.src, src);
  bind(DNNL_ARG_WEIGHTS, e.wei, wei);
  bind(DNNL_ARG_DST, e.dst, dst);
  if (k.bias) bind(DNNL_ARG_BIAS, e.bias, bias);
  if (e.scratch) args[n++] = {DNNL_ARG_SCRATCHPAD, e.scratch.get()};
  ThreadCache& c = thread_cache();
  dnnl_status_t st = dnnl_primitive_execute(e.prim.get(), c.stream.get(), n, args);
  if (st == dnnl_success) st = dnnl_stream_wait(c.stream.get());
  LATHE_CHECK(st == dnnl_success, "bf16 matmul {} (M={}, K={}, N={}): oneDNN execution failed (status {})",
              op_name(k.op), k.M, k.K, k.N, static_cast<int>(st));
}

Key key(Op op, int64_t M, int64_t K, int64_t N, bool accumulate, bool bias, bool dst_bf16) {
  return Key{M, K, N, op, accumulate, bias, dst_bf16, omp_get_max_threads()};
}

#endif  // LATHE_HAVE_DNNL

// ---- path choice ---------------------------------------------------------------------------------

struct PathChoice {
  Bf16Gemm path = Bf16Gemm::Fp32;
  std::string detail;  // onednn: its implementation name; fp32: why oneDNN is not used
};

PathChoice choose_path() {
  PathChoice c;
#ifdef LATHE_HAVE_DNNL
  const dnnl_version_t* v = dnnl_version();
  if (cpu_isa() < Isa::Avx512) {
    c.detail = fmt::format("oneDNN {}.{}.{} has bf16 GEMMs from avx512 up only", v->major, v->minor, v->patch);
    return c;
  }
  // Creating one primitive is the test (and caches it for this thread): oneDNN may still refuse,
  // e.g. when capped below the CPU by its own environment variable.
  try {
    c.detail = lookup(key(Op::Forward, 64, 64, 64, false, false, false)).impl;
    c.path = Bf16Gemm::OneDnn;
  } catch (const Error& e) {
    c.detail = e.what();
  }
#else
  c.detail = "lathe was built without oneDNN (libdnnl-dev)";
#endif
  return c;
}

const PathChoice& path_choice() {
  static const PathChoice c = choose_path();
  return c;
}

// Test override of this thread's path (ops_bf16.h): -1 none, else a Bf16Gemm.
thread_local int forced_path = -1;

// ---- fp32 path -------------------------------------------------------------------------------------

// Per-thread fp32 operands (in-process data-parallel tests run one model per thread), grown on
// the first call that needs more and then reused: no allocation per training step.
float* scratch(int slot, int64_t floats) {
  static thread_local std::vector<float> bufs[4];
  std::vector<float>& b = bufs[slot];
  if (b.size() < static_cast<size_t>(floats)) b.resize(static_cast<size_t>(floats));
  return b.data();
}

const float* widened(int slot, const uint16_t* src, int64_t n) {
  float* dst = scratch(slot, n);
  convert_bf16_to_fp32(dst, src, n);
  return dst;
}

// dst = r (+ bias per column) (+ dst when accumulating), or the bf16 of r (+ bias): oneDNN's order
// (the GEMM's fp32 sum, then the bias, then the sum post-op's dst), one fp32 rounding each. The
// old dst is added after the GEMM, never fed into its K loop (as a beta = 1 sgemm would), so a
// gradient accumulated in two parts gets the bits of the two parts summed (tied weights across
// pipeline stages give the bits of one process, as on the oneDNN path).
template <typename T>
void epilogue(T* dst, const float* r, const float* bias, int64_t rows, int64_t cols, bool accumulate) {
#pragma omp parallel for schedule(static) if (rows * cols >= kParallelMin)
  for (int64_t i = 0; i < rows; ++i) {
    const float* __restrict ri = r + i * cols;
    T* __restrict di = dst + i * cols;
    for (int64_t j = 0; j < cols; ++j) {
      const float v = bias ? ri[j] + bias[j] : ri[j];
      if constexpr (std::is_same_v<T, float>) {
        di[j] = accumulate ? v + di[j] : v;
      } else {
        di[j] = Bf16::st(v);
      }
    }
  }
}

template <typename T>
void forward_fp32(T* out, const uint16_t* inp, const uint16_t* weight, const float* bias, int64_t M, int64_t K,
                  int64_t N, bool accumulate) {
  const float* x = widened(0, inp, M * K);
  const float* w = widened(1, weight, N * K);
  if constexpr (std::is_same_v<T, float>) {
    if (bias == nullptr && !accumulate) return matmul_forward(out, x, w, nullptr, M, K, N, false);
  }
  float* o = scratch(2, M * N);
  matmul_forward(o, x, w, nullptr, M, K, N, false);
  epilogue(out, o, bias, M, N, accumulate);
}

// dinp and dweight of matmul_backward_bf16 (dbias is summed from the bf16 dout by the caller,
// as on the oneDNN path); dout is widened once for both.
template <typename T>
void backward_fp32(T* dinp, float* dweight, const uint16_t* dout, const uint16_t* inp, const uint16_t* weight,
                   int64_t M, int64_t K, int64_t N, bool accumulate_dinp) {
  const float* g = widened(0, dout, M * N);
  if (dinp != nullptr) {
    const float* w = widened(1, weight, N * K);
    float* d = nullptr;  // "=" into an fp32 dinp directly, else through scratch and the epilogue
    if constexpr (std::is_same_v<T, float>) d = accumulate_dinp ? nullptr : dinp;
    const bool direct = d != nullptr;
    if (!direct) d = scratch(2, M * K);
    matmul_backward(d, nullptr, nullptr, g, nullptr, w, M, K, N, false);
    if (!direct) epilogue(dinp, d, nullptr, M, K, accumulate_dinp);
  }
  if (dweight != nullptr) {
    const float* x = widened(1, inp, M * K);
    float* d = scratch(3, N * K);  // matmul_backward adds into dweight: from zero, the GEMM alone
#pragma omp parallel for schedule(static) if (N * K >= kParallelMin)
    for (int64_t i = 0; i < N; ++i) std::memset(d + i * K, 0, sizeof(float) * K);
    matmul_backward(nullptr, d, nullptr, g, x, nullptr, M, K, N, false);
    epilogue(dweight, d, nullptr, N, K, true);
  }
}

template <typename T>
void forward_impl(const char* fn, T* out, const uint16_t* inp, const uint16_t* weight, const float* bias, int64_t M,
                  int64_t K, int64_t N, bool accumulate) {
  check_dims(fn, M, K, N);
  if (M == 0 || N == 0) return;
  if (K == 0) return fill_k0(out, bias, M, N, accumulate);
  if (bf16_gemm_path() == Bf16Gemm::Fp32) return forward_fp32(out, inp, weight, bias, M, K, N, accumulate);
#ifdef LATHE_HAVE_DNNL
  run(key(Op::Forward, M, K, N, accumulate, bias != nullptr, std::is_same_v<T, uint16_t>), out, inp, weight, bias);
#endif
}

template <typename T>
void backward_impl(const char* fn, T* dinp, float* dweight, float* dbias, const uint16_t* dout, const uint16_t* inp,
                   const uint16_t* weight, int64_t M, int64_t K, int64_t N, bool accumulate_dinp) {
  check_dims(fn, M, K, N);
  const bool gemm_dinp = dinp != nullptr && M > 0 && K > 0 && N > 0;
  const bool gemm_dweight = dweight != nullptr && M > 0 && N > 0 && K > 0;
  if (dinp != nullptr && M > 0 && K > 0 && N == 0 && !accumulate_dinp) std::memset(dinp, 0, sizeof(T) * M * K);
  if (bf16_gemm_path() == Bf16Gemm::Fp32) {
    if (gemm_dinp || gemm_dweight)
      backward_fp32(gemm_dinp ? dinp : nullptr, gemm_dweight ? dweight : nullptr, dout, inp, weight, M, K, N,
                    accumulate_dinp);
  } else {
#ifdef LATHE_HAVE_DNNL
    if (gemm_dinp)
      run(key(Op::BackwardData, M, K, N, accumulate_dinp, false, std::is_same_v<T, uint16_t>), dinp, dout, weight,
          nullptr);
    if (gemm_dweight) run(key(Op::BackwardWeights, M, K, N, true, false, false), dweight, dout, inp, nullptr);
#endif
  }
  if (dbias != nullptr && M > 0 && N > 0) bias_backward(dbias, dout, M, N);
}

}  // namespace

Bf16Gemm bf16_gemm_process_path() { return path_choice().path; }

Bf16Gemm bf16_gemm_path() {
  return forced_path >= 0 ? static_cast<Bf16Gemm>(forced_path) : bf16_gemm_process_path();
}

const char* bf16_gemm_name(Bf16Gemm path) { return path == Bf16Gemm::OneDnn ? "onednn" : "fp32"; }

void bf16_gemm_force_for_thread(std::optional<Bf16Gemm> path) {
  LATHE_CHECK(!path || *path != Bf16Gemm::OneDnn || bf16_gemm_process_path() == Bf16Gemm::OneDnn,
              "bf16_gemm_force_for_thread(onednn): this process cannot use oneDNN's bf16 GEMMs ({})",
              path_choice().detail);
  forced_path = path ? static_cast<int>(*path) : -1;
}

std::string lowp_compute_line(std::string_view compute) {
  const std::string cap = cpu_isa_cap_reason();
  const std::string isa = fmt::format("cpu instruction set {}{}", isa_name(cpu_isa()),
                                      cap.empty() ? std::string() : " (capped by " + cap + ")");
  if (compute == "fp16")
    return isa + ": fp16 GEMMs widen their operands to fp32 and run the fp32 GEMM (no fp16 GEMM kernels on CPUs); "
                 "fp16 will not be faster than fp32 on this CPU, only smaller";
  const PathChoice& c = path_choice();
  if (c.path == Bf16Gemm::OneDnn)
    return fmt::format("{}: {} GEMMs on oneDNN ({}){}", isa, compute, c.detail,
                       cpu_isa() >= Isa::Avx512Bf16
                           ? ""
                           : "; no AVX512-BF16: bf16 products emulated in fp32, bf16 may not be faster than fp32 here");
  return fmt::format(
      "{}: {} GEMMs widen their operands to fp32 and run the fp32 GEMM ({}); bf16 will not be faster than fp32 on "
      "this CPU, only smaller (same numerics: bf16 storage, fp32 accumulation)",
      isa, compute, c.detail);
}

bool bf16_matmul_available() { return true; }

std::string bf16_matmul_backend_info() {
  const PathChoice& c = path_choice();
  if (c.path == Bf16Gemm::Fp32)
    return fmt::format("fp32 path: bf16 operands widened to fp32, fp32 GEMM ({}; cpu {})", c.detail,
                       isa_name(cpu_isa()));
#ifdef LATHE_HAVE_DNNL
  const dnnl_version_t* v = dnnl_version();
  return fmt::format("oneDNN {}.{}.{} ({}), forward GEMM {}{}", v->major, v->minor, v->patch,
                     v->cpu_runtime == DNNL_RUNTIME_OMP ? "OpenMP" : "not OpenMP: its own thread pool", c.detail,
                     cpu_isa() >= Isa::Avx512Bf16 ? "" : " (no AVX512-BF16: bf16 products emulated in fp32)");
#else
  return "?";
#endif
}

size_t bf16_matmul_cache_size() {
#ifdef LATHE_HAVE_DNNL
  return thread_cache().map.size();
#else
  return 0;
#endif
}

void matmul_forward_bf16(float* out, const uint16_t* inp, const uint16_t* weight, const float* bias, int64_t M,
                         int64_t K, int64_t N, bool accumulate) {
  forward_impl("matmul_forward_bf16", out, inp, weight, bias, M, K, N, accumulate);
}

void matmul_forward_bf16_out_bf16(uint16_t* out, const uint16_t* inp, const uint16_t* weight, const float* bias,
                                  int64_t M, int64_t K, int64_t N) {
  forward_impl("matmul_forward_bf16_out_bf16", out, inp, weight, bias, M, K, N, false);
}

void matmul_backward_bf16(float* dinp, float* dweight, float* dbias, const uint16_t* dout, const uint16_t* inp,
                          const uint16_t* weight, int64_t M, int64_t K, int64_t N, bool accumulate_dinp) {
  backward_impl("matmul_backward_bf16", dinp, dweight, dbias, dout, inp, weight, M, K, N, accumulate_dinp);
}

void matmul_backward_bf16_dinp_bf16(uint16_t* dinp, float* dweight, float* dbias, const uint16_t* dout,
                                    const uint16_t* inp, const uint16_t* weight, int64_t M, int64_t K, int64_t N) {
  backward_impl("matmul_backward_bf16_dinp_bf16", dinp, dweight, dbias, dout, inp, weight, M, K, N, false);
}

}  // namespace lathe::cpu
