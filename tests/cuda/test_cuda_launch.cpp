// The CPU-side logic of the CUDA backend, tested in every build (kernels/cuda/launch.h: grid sizes,
// partial counts, scratch sizes, device choice from the launcher's local rank), and in CUDA builds
// (LATHE_HAVE_CUDA, set for this test only) the backend's memory and conversions, which skip with
// the cudaGetDeviceCount error where no GPU is present (never reported as passed).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "error_of.h"
#include "kernels/backend.h"
#include "kernels/cuda/launch.h"
#ifdef LATHE_HAVE_CUDA
#include "kernels/cuda/ops.h"
#endif

using namespace lathe;
using namespace lathe::cuda;

namespace {

using lathe::test::error_of;

TEST(CudaLaunch, Grid1dCoversEveryElementWithinLimits) {
  EXPECT_EQ(grid_1d(0), 1);  // an empty launch still has a valid grid (the kernel's loop does nothing)
  EXPECT_EQ(grid_1d(1), 1);
  EXPECT_EQ(grid_1d(kThreads), 1);
  EXPECT_EQ(grid_1d(kThreads + 1), 2);
  EXPECT_EQ(grid_1d(100003), (100003 + kThreads - 1) / kThreads);
  EXPECT_EQ(grid_1d(int64_t{1} << 40), kMaxBlocks);  // grid-stride loop covers the rest
  for (int64_t n : {1, 31, 255, 256, 257, 65537}) EXPECT_GE(grid_1d(n) * kThreads, n) << n;
  EXPECT_EQ(grid_rows(1), 1);
  EXPECT_EQ(grid_rows(kWarpsPerBlock * 3 + 1), 4);
  EXPECT_EQ(grid_rows(int64_t{1} << 40), kMaxBlocks);
}

TEST(CudaLaunch, NormPartialsAndScratchSizes) {
  EXPECT_EQ(norm_partials(1), 1);
  EXPECT_EQ(norm_partials(67), 67);
  EXPECT_EQ(norm_partials(1 << 20), kNormPartials);
  // Scratch depends on C only (the Ops slot has no N): the largest partial count times the row.
  EXPECT_EQ(layernorm_scratch_bytes(768), static_cast<size_t>(kNormPartials) * 2 * 768 * 4);
  EXPECT_EQ(rmsnorm_scratch_bytes(4096), static_cast<size_t>(kNormPartials) * 4096 * 4);
}

TEST(CudaLaunch, ColSumPlanCoversEveryRowOnce) {
  for (int64_t M : {1, 2, 31, 32, 33, 67, 1000, 16384, 65536, 1 << 22})
    for (int64_t N : {1, 67, 50257}) {
      const ColSumPlan p = col_sum_plan(M, N);
      ASSERT_GE(p.partials, 1) << M;
      ASSERT_LE(p.partials, kColSumMaxPartials) << M;
      // Chunks [k*rows, min((k+1)*rows, M)) for k < partials: all non-empty, together exactly M rows.
      EXPECT_GE(p.partials * p.rows_per_partial, M) << M;
      EXPECT_LT((p.partials - 1) * p.rows_per_partial, M) << M;
      EXPECT_EQ(p.scratch_bytes, static_cast<size_t>(p.partials * N) * 4);
      if (M >= kColSumMinRows * 2) {
        EXPECT_GE(p.rows_per_partial, kColSumMinRows) << M;
      }
    }
  EXPECT_EQ(col_sum_plan(16384, 768).partials, kColSumMaxPartials);  // GPT-2 124M at B*T = 16K
}

TEST(CudaLaunch, DeviceFromLocalRankModuloDeviceCount) {
  DeviceChoice c = choose_device(nullptr, nullptr, 8);
  EXPECT_EQ(c.device, 0);
  EXPECT_EQ(c.source, "default (no local rank set)");
  c = choose_device("3", nullptr, 8);
  EXPECT_EQ(c.device, 3);
  EXPECT_EQ(c.local_rank, 3);
  EXPECT_EQ(c.source, "OMPI_COMM_WORLD_LOCAL_RANK=3");
  c = choose_device("9", "1", 8);  // Open MPI's variable wins; 9 ranks on 8 GPUs share
  EXPECT_EQ(c.device, 1);
  c = choose_device(nullptr, "5", 2);
  EXPECT_EQ(c.device, 1);
  EXPECT_EQ(c.source, "LOCAL_RANK=5");
}

TEST(CudaLaunch, BadLocalRankOrNoDeviceIsAClearError) {
  std::string m = error_of([] { choose_device("x1", nullptr, 2); });
  EXPECT_NE(m.find("OMPI_COMM_WORLD_LOCAL_RANK='x1' is not a non-negative integer"), std::string::npos) << m;
  m = error_of([] { choose_device(nullptr, "-1", 2); });
  EXPECT_NE(m.find("LOCAL_RANK='-1' is not a non-negative integer"), std::string::npos) << m;
  m = error_of([] { choose_device(nullptr, "", 2); });
  EXPECT_NE(m.find("LOCAL_RANK=''"), std::string::npos) << m;
  m = error_of([] { choose_device("0", nullptr, 0); });
  EXPECT_NE(m.find("no CUDA device"), std::string::npos) << m;
}

TEST(CudaBackend, RegisteredAsCudaWithOneTablePerDtypeOrTheStandIn) {
  const Backend& b = backend_by_name("cuda");
  EXPECT_EQ(&b, &cuda_backend());
  EXPECT_EQ(b.device(), DeviceKind::Cuda);
#ifdef LATHE_HAVE_CUDA
  ASSERT_EQ(b.op_tables().size(), 3u);
  EXPECT_EQ(b.op_tables()[0]->dtype, DType::F32);
  EXPECT_EQ(b.op_tables()[1]->dtype, DType::BF16);
  EXPECT_EQ(b.op_tables()[2]->dtype, DType::F16);
  for (const Ops* t : b.op_tables()) EXPECT_EQ(std::string(t->backend), "cuda");
#else
  EXPECT_TRUE(b.op_tables().empty());
  EXPECT_NE(b.unavailable().find("built without CUDA"), std::string::npos) << b.unavailable();
#endif
}

#ifdef LATHE_HAVE_CUDA
#define SKIP_WITHOUT_GPU()                                                  \
  do {                                                                      \
    if (const std::string why = cuda_backend().unavailable(); !why.empty()) \
      GTEST_SKIP() << "no usable GPU here: " << why;                        \
  } while (0)

TEST(CudaBackend, MemoryRoundTripMemsetAndDeviceCopy) {
  SKIP_WITHOUT_GPU();
  const Backend& b = cuda_backend();
  std::vector<float> h(1001);
  for (size_t i = 0; i < h.size(); ++i) h[i] = static_cast<float>(i) * 0.5f - 3.0f;
  void* d1 = b.alloc(h.size() * 4);
  void* d2 = b.alloc(h.size() * 4);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(d1) % 64, 0u);
  b.copy(d1, h.data(), h.size() * 4, CopyKind::HostToDevice);
  b.copy(d2, d1, h.size() * 4, CopyKind::DeviceToDevice);
  std::vector<float> back(h.size(), -1.0f);
  b.copy(back.data(), d2, h.size() * 4, CopyKind::DeviceToHost);
  EXPECT_EQ(std::memcmp(back.data(), h.data(), h.size() * 4), 0);
  b.memset(d2, 0, 40);
  b.copy(back.data(), d2, h.size() * 4, CopyKind::DeviceToHost);
  for (int i = 0; i < 10; ++i) EXPECT_EQ(back[i], 0.0f);
  EXPECT_EQ(back[10], h[10]);
  b.free(d1);
  b.free(d2);
  DeviceBuffer buf(b, 37, DType::BF16);  // zero-initialised through memset
  std::vector<uint16_t> z(37, 7);
  b.copy(z.data(), buf.data(), buf.bytes(), CopyKind::DeviceToHost);
  for (uint16_t v : z) EXPECT_EQ(v, 0);
}

TEST(CudaBackend, HugeAllocationFailsNamingSizeAndFreeMemory) {
  SKIP_WITHOUT_GPU();
  const std::string m = error_of([] { cuda_backend().alloc(size_t{1} << 50); });
  EXPECT_NE(m.find("cudaMalloc of 1125899906842624 bytes"), std::string::npos) << m;
  EXPECT_NE(m.find("GiB free"), std::string::npos) << m;
  // The backend still works after the failure (the error is not sticky).
  void* p = cuda_backend().alloc(64);
  cuda_backend().free(p);
}

// cuda::convert is bit-identical to core/dtype.h's conversions (round to nearest even, NaN stays
// NaN, infinities, subnormals, overflow to infinity) in both directions.
TEST(CudaBackend, ConvertMatchesTheHostConversionsBitForBit) {
  SKIP_WITHOUT_GPU();
  const Backend& b = cuda_backend();
  std::vector<float> x = {0.0f,
                          -0.0f,
                          1.0f,
                          -1.5f,
                          3.14159265f,
                          1e-40f,
                          -1e-42f,
                          65504.0f,
                          65520.0f,
                          1e30f,
                          3.4e38f,
                          std::numeric_limits<float>::infinity(),
                          -std::numeric_limits<float>::infinity(),
                          std::numeric_limits<float>::quiet_NaN(),
                          1.00390625f,
                          1.01171875f,
                          5.96e-8f,
                          2.98e-8f};
  for (int i = 0; i < 1000; ++i)
    x.push_back(std::ldexp(static_cast<float>(i * 7919 % 1000) / 997.0f - 0.5f, i % 60 - 30));
  const int64_t n = static_cast<int64_t>(x.size());
  void* src = b.alloc(n * 4);
  void* h16 = b.alloc(n * 2);
  void* f32 = b.alloc(n * 4);
  b.copy(src, x.data(), n * 4, CopyKind::HostToDevice);
  for (DType dt : {DType::BF16, DType::F16}) {
    convert(h16, dt, src, DType::F32, n);
    std::vector<uint16_t> got(n);
    b.copy(got.data(), h16, n * 2, CopyKind::DeviceToHost);
    for (int64_t i = 0; i < n; ++i) {
      const uint16_t want = dt == DType::BF16 ? fp32_to_bf16(x[i]) : fp32_to_fp16(x[i]);
      const bool nan = std::isnan(x[i]);
      if (nan)
        EXPECT_TRUE(std::isnan(dt == DType::BF16 ? bf16_to_fp32(got[i]) : fp16_to_fp32(got[i]))) << i;
      else
        EXPECT_EQ(got[i], want) << dtype_name(dt) << " x=" << x[i];
    }
    convert(f32, DType::F32, h16, dt, n);
    std::vector<float> wide(n);
    b.copy(wide.data(), f32, n * 4, CopyKind::DeviceToHost);
    for (int64_t i = 0; i < n; ++i) {
      const float want = dt == DType::BF16 ? bf16_to_fp32(got[i]) : fp16_to_fp32(got[i]);
      if (std::isnan(want))
        EXPECT_TRUE(std::isnan(wide[i]));
      else
        EXPECT_EQ(wide[i], want) << i;
    }
  }
  b.free(src);
  b.free(h16);
  b.free(f32);
}

// Two runs of the same backward on the same inputs give the same bits (no atomics: parameter
// gradients reduced in a fixed order), at sizes where every multi-block path is taken: dbias over
// 4099 rows (several column-sum partials), layernorm over more rows than kNormPartials, embedding
// with heavily repeated tokens.
TEST(CudaBackend, BackwardsAreBitReproducible) {
  SKIP_WITHOUT_GPU();
  const Backend& b = cuda_backend();
  const Ops& o = *find_ops(b, DType::BF16);
  const int64_t M = 4099, K = 96, N = 200, V = 7;
  std::vector<uint16_t> hx(M * K), hw(N * K), hg(M * N);
  uint32_t s = 1;
  auto rnd = [&] {
    s = s * 1664525u + 1013904223u;
    return fp32_to_bf16(static_cast<float>(static_cast<int32_t>(s >> 8) - (1 << 23)) / (1 << 23));
  };
  for (auto* v : {&hx, &hw, &hg})
    for (auto& e : *v) e = rnd();
  std::vector<int32_t> tok(M);
  for (int64_t i = 0; i < M; ++i) tok[i] = static_cast<int32_t>((i * 31) % V);
  auto up = [&](const void* h, size_t bytes) {
    void* d = b.alloc(bytes);
    b.copy(d, h, bytes, CopyKind::HostToDevice);
    return d;
  };
  void *x = up(hx.data(), hx.size() * 2), *w = up(hw.data(), hw.size() * 2), *g = up(hg.data(), hg.size() * 2);
  void* t = up(tok.data(), tok.size() * 4);
  std::vector<float> ones(std::max(N, K), 1.0f);
  void* lw = up(ones.data(), K * 4);
  auto run = [&] {
    std::vector<std::vector<float>> r;
    void* dw = b.alloc(N * K * 4);
    void* db = b.alloc(N * 4);
    void* dx = b.alloc(M * K * 2);
    void* mean = b.alloc(M * 4);
    void* rstd = b.alloc(M * 4);
    void* ln = b.alloc(M * K * 2);
    void* lgw = b.alloc(K * 4);
    void* lgb = b.alloc(K * 4);
    void* dwte = b.alloc(V * K * 4);
    void* sc = b.alloc(o.layernorm_scratch_bytes(K));
    for (void* p : {dw, db, lgw, lgb, dwte})
      b.memset(p, 0, p == db ? N * 4 : p == dw ? N * K * 4 : p == dwte ? V * K * 4 : K * 4);
    b.memset(dx, 0, M * K * 2);
    o.matmul_backward(dx, static_cast<float*>(dw), static_cast<float*>(db), g, x, w, M, K, N, false);
    o.layernorm_forward(ln, static_cast<float*>(mean), static_cast<float*>(rstd), x, static_cast<float*>(lw), nullptr,
                        M, K, 1e-5f);
    o.layernorm_backward(dx, static_cast<float*>(lgw), static_cast<float*>(lgb), x, x, static_cast<float*>(lw),
                         static_cast<float*>(mean), static_cast<float*>(rstd), M, K, sc);
    o.embedding_backward(static_cast<float*>(dwte), nullptr, x, static_cast<const int32_t*>(t), 1, M, K, nullptr, 0, V);
    for (auto [p, n] :
         std::initializer_list<std::pair<void*, int64_t>>{{dw, N * K}, {db, N}, {lgw, K}, {lgb, K}, {dwte, V * K}}) {
      r.emplace_back(n);
      b.copy(r.back().data(), p, n * 4, CopyKind::DeviceToHost);
    }
    std::vector<uint16_t> hdx(M * K);
    b.copy(hdx.data(), dx, M * K * 2, CopyKind::DeviceToHost);
    r.emplace_back(hdx.begin(), hdx.end());
    for (void* p : {dw, db, dx, mean, rstd, ln, lgw, lgb, dwte, sc}) b.free(p);
    return r;
  };
  const auto r1 = run(), r2 = run();
  const char* names[] = {"dweight", "dbias", "layernorm dweight", "layernorm dbias", "dwte", "dinp"};
  for (size_t i = 0; i < r1.size(); ++i)
    EXPECT_EQ(std::memcmp(r1[i].data(), r2[i].data(), r1[i].size() * 4), 0) << names[i] << " differs between runs";
  for (void* p : {x, w, g, t, lw}) b.free(p);
}
#endif

}  // namespace
