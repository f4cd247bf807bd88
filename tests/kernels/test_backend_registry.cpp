// The backend registry's own checks: which tables each backend has and that they are complete,
// the errors that name a missing op, dtype or backend, the CPU fp32 table against kernels/cpu/ops.h
// bit for bit, and DeviceBuffer.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "config/rope_scaling.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/rng.h"
#include "error_of.h"
#include "gradcheck_basic.h"
#include "kernels/backend.h"
#include "kernels/cpu/ops.h"
#include "reference_ops.h"

using namespace lathe;
using namespace lathe::test;
using lathe::test::error_of;

namespace {

TEST(BackendRegistry, CpuBf16AndFp16AreImplementedAndComplete) {
  for (DType dt : {DType::BF16, DType::F16}) {
    const Ops& o = ops_for(cpu_backend(), dt);
    EXPECT_EQ(o.dtype, dt);
    bool found = false;
    for (auto [b, d] : implemented_ops()) found = found || (b == &cpu_backend() && d == dt);
    EXPECT_TRUE(found) << compute_dtype_name(dt);
  }
}

TEST(BackendRegistry, CpuFp32IsImplementedAndComplete) {
  const Ops& o = ops_for(cpu_backend(), DType::F32);
  EXPECT_EQ(std::string(o.backend), "cpu");
  EXPECT_EQ(o.dtype, DType::F32);
  bool found = false;
  for (auto [b, dt] : implemented_ops()) found = found || (b == &cpu_backend() && dt == DType::F32);
  EXPECT_TRUE(found);
  EXPECT_EQ(&backend_by_name("cpu"), &cpu_backend());
  EXPECT_EQ(cpu_backend().device(), DeviceKind::Host);
}

TEST(BackendRegistry, UnimplementedDtypeNamesOpDtypeBackendAndTheImplementedOnes) {
  // F64 has no CPU table at all: the first op is reported, with the dtypes that do have it.
  const std::string msg = error_of([] { ops_for(cpu_backend(), DType::F64); });
  EXPECT_EQ(msg, "[matmul_forward] no F64 implementation on cpu; implemented: fp32, bf16, fp16") << msg;
  EXPECT_EQ(&backend_by_name("cuda"), &cuda_backend());
  if (!cuda_backend().op_tables().empty()) return;  // a CUDA build: tests/cuda/test_cuda_launch.cpp
  const std::string cuda = error_of([] { ops_for(backend_by_name("cuda"), DType::F32); });
  EXPECT_EQ(cuda, "[matmul_forward] no fp32 implementation on cuda; implemented: none");
}

TEST(BackendRegistry, UnknownBackendNamesTheKnownOnes) {
  const std::string msg = error_of([] { backend_by_name("metal"); });
  EXPECT_NE(msg.find("unknown backend 'metal' (known: cpu, cuda)"), std::string::npos) << msg;
}

TEST(BackendRegistry, NoCudaStubRefusesMemoryWithAClearError) {
  const Backend& b = no_cuda_backend();  // linked in every build (the registry's "cuda" without CUDA)
  EXPECT_NE(b.unavailable().find("built without CUDA"), std::string::npos) << b.unavailable();
  EXPECT_EQ(b.name(), "cuda");
  EXPECT_EQ(b.device(), DeviceKind::Cuda);
  const std::string msg = error_of([&] { b.alloc(16); });
  EXPECT_NE(msg.find("[alloc] no CUDA implementation"), std::string::npos) << msg;
  EXPECT_NE(error_of([&] { b.synchronize(); }).find("[synchronize] no CUDA implementation"), std::string::npos);
  EXPECT_NE(error_of([&] { DeviceBuffer buf(b, 4, DType::F32); }).find("no CUDA implementation"), std::string::npos);
}

// A backend with a complete fp32 table and a bf16 table that lacks one op: ops_for refuses bf16
// naming that op, lists fp32 as the dtype that has it, and implemented_ops() omits the partial one.
class FakeBackend final : public Backend {
 public:
  FakeBackend() : fp32_(cpu_fp32()), bf16_(cpu_fp32()) {
    fp32_.backend = bf16_.backend = "fake";
    bf16_.dtype = DType::BF16;
    bf16_.embedding_forward = nullptr;
  }
  std::string_view name() const override { return "fake"; }
  DeviceKind device() const override { return DeviceKind::Host; }
  void* alloc(size_t bytes) const override { return cpu_backend().alloc(bytes); }
  void free(void* p) const override { cpu_backend().free(p); }
  void memset(void* d, int v, size_t n) const override { cpu_backend().memset(d, v, n); }
  void copy(void* d, const void* s, size_t n, CopyKind k) const override { cpu_backend().copy(d, s, n, k); }
  void synchronize() const override {}
  std::vector<const Ops*> op_tables() const override { return {&fp32_, &bf16_}; }

 private:
  static Ops cpu_fp32() { return ops_for(cpu_backend(), DType::F32); }
  Ops fp32_, bf16_;
};

// model.attention_kernel: "lathe" is ops_for's table; "cudnn" is refused where there is none, naming
// the backend, the dtype and why (the CPU backend has none; a CPU-only build's cuda stand-in has none).
TEST(BackendRegistry, CudnnAttentionKernelIsRefusedWhereMissing) {
  EXPECT_EQ(&ops_for(cpu_backend(), DType::BF16, "lathe"), &ops_for(cpu_backend(), DType::BF16));
  std::string e = error_of([&] { ops_for(cpu_backend(), DType::BF16, "cudnn"); });
  EXPECT_EQ(e,
            "attention kernel cudnn: not available on cpu in bf16: the cpu backend has no cuDNN attention (cuDNN's "
            "SDPA runs on device: cuda)");
  EXPECT_NE(error_of([&] { ops_for(cpu_backend(), DType::F32, "flash"); }).find("unknown attention kernel 'flash'"),
            std::string::npos);
  std::string why;
  const Ops* t = cuda_backend().cudnn_attention_ops(DType::F32, &why);
  EXPECT_EQ(t, nullptr);  // fp32: never (cuDNN's SDPA is bf16 / fp16), or no cuDNN at all
  EXPECT_FALSE(why.empty());
  if (const Ops* b = cuda_backend().cudnn_attention_ops(DType::BF16, &why)) {  // CUDA build with cuDNN
    const Ops& plain = ops_for(cuda_backend(), DType::BF16);
    EXPECT_NE(b->attention_forward, plain.attention_forward);
    EXPECT_EQ(b->matmul_forward, plain.matmul_forward);  // only the attention slots differ
    EXPECT_EQ(&ops_for(cuda_backend(), DType::BF16, "cudnn"), b);
  } else {
    EXPECT_NE(error_of([&] { ops_for(cuda_backend(), DType::BF16, "cudnn"); }).find("not available on cuda"),
              std::string::npos);
  }
}

TEST(BackendRegistry, PartialTableNamesTheMissingOp) {
  const FakeBackend fake;
  EXPECT_EQ(error_of([&] { ops_for(fake, DType::BF16); }),
            "[embedding_forward] no bf16 implementation on fake; implemented: fp32");
  EXPECT_EQ(error_of([&] { ops_for(fake, DType::F16); }),
            "[matmul_forward] no fp16 implementation on fake; implemented: fp32, bf16");
  EXPECT_EQ(&ops_for(fake, DType::F32), fake.op_tables()[0]);
  EXPECT_NE(find_ops(fake, DType::BF16), nullptr);  // registered, but not usable
}

// The CPU fp32 table IS the kernels of ops.h: the model's results through it are those of direct
// calls, bit for bit (what keeps checkpoints, resume and parity results unchanged by the seam).
TEST(BackendRegistry, CpuFp32TableIsTheOpsHKernelsBitForBit) {
  const Ops& o = ops_for(cpu_backend(), DType::F32);
  Rng rng(77);
  const int64_t B = 2, T = 33, C = 67, H = 4, KVH = 2, D = 8, N = B * T, V = 31, Q = (H + 2 * KVH) * D;
  const VecF x = randn(N * C, rng), w = randn(V * C, rng), b = randn(V, rng), g = randn(N * V, rng);
  auto same = [](const VecF& a, const VecF& c, const char* what) { EXPECT_TRUE(bit_equal(a, c)) << what; };
  {
    VecF o1(N * V), o2(N * V), dx1(N * C), dx2(N * C), dw1(V * C, 0.5f), dw2(V * C, 0.5f), db1(V, 1), db2(V, 1);
    cpu::matmul_forward(o1.data(), x.data(), w.data(), b.data(), N, C, V);
    o.matmul_forward(o2.data(), x.data(), w.data(), b.data(), N, C, V, false);
    same(o1, o2, "matmul_forward");
    cpu::matmul_backward(dx1.data(), dw1.data(), db1.data(), g.data(), x.data(), w.data(), N, C, V);
    o.matmul_backward(dx2.data(), dw2.data(), db2.data(), g.data(), x.data(), w.data(), N, C, V, false);
    same(dx1, dx2, "matmul_backward dinp");
    same(dw1, dw2, "matmul_backward dweight");
    same(db1, db2, "matmul_backward dbias");
    VecF pre(N * V), act1(N * V), act2(N * V);
    o.matmul_bias_gelu_forward(act2.data(), pre.data(), x.data(), w.data(), b.data(), N, C, V);
    same(o1, pre, "matmul_bias_gelu_forward pre");
    cpu::gelu_forward(act1.data(), o1.data(), N * V);
    same(act1, act2, "matmul_bias_gelu_forward out");
  }
  {
    VecF o1(N * C), o2(N * C), m1(N), m2(N), r1(N), r2(N), s1(o.layernorm_scratch_bytes(C) / 4), s2 = s1;
    const VecF lw = randn(C, rng), lb = randn(C, rng), lg = randn(N * C, rng);
    cpu::layernorm_forward(o1.data(), m1.data(), r1.data(), x.data(), lw.data(), lb.data(), N, C, 1e-5f);
    o.layernorm_forward(o2.data(), m2.data(), r2.data(), x.data(), lw.data(), lb.data(), N, C, 1e-5f);
    same(o1, o2, "layernorm_forward");
    VecF d1(N * C, 0.25f), d2 = d1, w1(C), w2(C), bb1(C), bb2(C);
    cpu::layernorm_backward(d1.data(), w1.data(), bb1.data(), lg.data(), x.data(), lw.data(), m1.data(), r1.data(), N,
                            C, s1.data());
    o.layernorm_backward(d2.data(), w2.data(), bb2.data(), lg.data(), x.data(), lw.data(), m2.data(), r2.data(), N, C,
                         s2.data());
    same(d1, d2, "layernorm_backward dinp");
    same(w1, w2, "layernorm_backward dweight");
    cpu::rmsnorm_forward(o1.data(), r1.data(), x.data(), lw.data(), N, C, 1e-6f);
    o.rmsnorm_forward(o2.data(), r2.data(), x.data(), lw.data(), N, C, 1e-6f);
    same(o1, o2, "rmsnorm_forward");
    VecF rs1(o.rmsnorm_scratch_bytes(C) / 4), rs2 = rs1;
    cpu::rmsnorm_backward(d1.data(), w1.data(), lg.data(), x.data(), lw.data(), r1.data(), N, C, rs1.data());
    o.rmsnorm_backward(d2.data(), w2.data(), lg.data(), x.data(), lw.data(), r2.data(), N, C, rs2.data());
    same(d1, d2, "rmsnorm_backward dinp");
    same(w1, w2, "rmsnorm_backward dweight");
    cpu::gelu_forward(o1.data(), x.data(), N * C);
    o.gelu_forward(o2.data(), x.data(), N * C);
    same(o1, o2, "gelu_forward");
    cpu::gelu_backward(o1.data(), x.data(), lg.data(), N * C);
    o.gelu_backward(o2.data(), x.data(), lg.data(), N * C);
    same(o1, o2, "gelu_backward");
    cpu::residual_forward(o1.data(), x.data(), lg.data(), N * C);
    o.residual_forward(o2.data(), x.data(), lg.data(), N * C);
    same(o1, o2, "residual_forward");
  }
  {
    const int64_t F = 31;
    const VecF in = randn(N * 2 * F, rng), dg = randn(N * F, rng);
    VecF o1(N * F), o2(N * F), d1(N * 2 * F), d2(N * 2 * F);
    cpu::swiglu_forward(o1.data(), in.data(), N, F);
    o.swiglu_forward(o2.data(), in.data(), N, F);
    same(o1, o2, "swiglu_forward");
    cpu::swiglu_backward(d1.data(), in.data(), dg.data(), N, F);
    o.swiglu_backward(d2.data(), in.data(), dg.data(), N, F);
    same(d1, d2, "swiglu_backward");
  }
  {
    std::vector<int32_t> tok(N);
    for (auto& t : tok) t = static_cast<int32_t>(rng.below(V));
    const VecF wpe = randn(T * C, rng), dg = randn(N * C, rng);
    VecF o1(N * C), o2(N * C), dte1(V * C), dte2(V * C), dpe1(T * C), dpe2(T * C);
    cpu::embedding_forward(o1.data(), tok.data(), w.data(), wpe.data(), B, T, C);
    o.embedding_forward(o2.data(), tok.data(), w.data(), wpe.data(), B, T, C, nullptr, 0, V);
    same(o1, o2, "embedding_forward");
    cpu::embedding_backward(dte1.data(), dpe1.data(), dg.data(), tok.data(), B, T, C);
    o.embedding_backward(dte2.data(), dpe2.data(), dg.data(), tok.data(), B, T, C, nullptr, 0, V);
    same(dte1, dte2, "embedding_backward dwte");
    same(dpe1, dpe2, "embedding_backward dwpe");
    VecF l1(N), l2(N), gx1(N * C), gx2(N * C), gw1(V * C), gw2(V * C);
    VecF sc1(o.lm_head_loss_scratch_bytes(16, V) / 4), sc2 = sc1;
    const double t1 = cpu::lm_head_loss(l1.data(), gx1.data(), gw1.data(), x.data(), w.data(), tok.data(), N, C, V,
                                        0.1f, true, sc1.data(), 16);
    const double t2 = o.lm_head_loss(l2.data(), gx2.data(), gw2.data(), x.data(), w.data(), tok.data(), N, C, V, 0.1f,
                                     true, sc2.data(), 16, nullptr, 0.0f);
    EXPECT_EQ(t1, t2);
    same(l1, l2, "lm_head_loss losses");
    same(gx1, gx2, "lm_head_loss dx");
    same(gw1, gw2, "lm_head_loss dw");
  }
  {
    VecF c1(T * D / 2), s1(T * D / 2), c2(T * D / 2), s2(T * D / 2);
    cpu::rope_tables(c1.data(), s1.data(), T, D / 2, rope_default_inv_freq(D, 10000.0).data(), 1.0f);
    o.rope_tables(c2.data(), s2.data(), T, D / 2, rope_default_inv_freq(D, 10000.0).data(), 1.0f);
    same(c1, c2, "rope_tables cos");
    VecF qkv1 = randn(N * Q, rng), qkv2 = qkv1;
    cpu::rope_forward(qkv1.data() + H * D, c1.data(), s1.data(), B, T, KVH, D, D, Q);
    o.rope_forward(qkv2.data() + H * D, c2.data(), s2.data(), B, T, KVH, D, D, Q, nullptr);
    same(qkv1, qkv2, "rope_forward");
    cpu::rope_backward(qkv1.data(), c1.data(), s1.data(), B, T, H, D, D, Q);
    o.rope_backward(qkv2.data(), c2.data(), s2.data(), B, T, H, D, D, Q, nullptr);
    same(qkv1, qkv2, "rope_backward");
    VecF a1(N * H * D), a2(N * H * D), lse1(B * H * T), lse2(B * H * T), dq1(N * Q), dq2(N * Q);
    VecF as1(o.attention_scratch_bytes(T, D) / 4), as2 = as1;
    const VecF dout = randn(N * H * D, rng);
    cpu::attention_forward(a1.data(), lse1.data(), qkv1.data(), B, T, H, KVH, D, as1.data());
    o.attention_forward(a2.data(), lse2.data(), qkv2.data(), B, T, H, KVH, D, as2.data(), nullptr, 0, 0.0f, 0.0f);
    same(a1, a2, "attention_forward out");
    same(lse1, lse2, "attention_forward lse");
    cpu::attention_backward(dq1.data(), dout.data(), qkv1.data(), a1.data(), lse1.data(), B, T, H, KVH, D, as1.data());
    o.attention_backward(dq2.data(), dout.data(), qkv2.data(), a2.data(), lse2.data(), B, T, H, KVH, D, as2.data(),
                         nullptr, 0, 0.0f, 0.0f);
    same(dq1, dq2, "attention_backward");
    EXPECT_EQ(o.attention_scratch_bytes(T, D), cpu::attention_scratch_floats(T, D) * sizeof(float));
    EXPECT_EQ(o.layernorm_scratch_bytes(C), cpu::layernorm_scratch_floats(C) * sizeof(float));
    EXPECT_EQ(o.rmsnorm_scratch_bytes(C), cpu::rmsnorm_scratch_floats(C) * sizeof(float));
  }
}

TEST(BackendRegistry, DeviceBufferIsZeroedAlignedAndCarriesItsDtype) {
  DeviceBuffer buf(cpu_backend(), 37, DType::BF16);
  EXPECT_EQ(buf.size(), 37u);
  EXPECT_EQ(buf.bytes(), 74u);
  EXPECT_EQ(buf.dtype(), DType::BF16);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(buf.data()) % 64, 0u);
  const auto* p = static_cast<const uint8_t*>(buf.data());
  for (size_t i = 0; i < buf.bytes(); ++i) ASSERT_EQ(p[i], 0) << i;
  DeviceBuffer moved = std::move(buf);
  EXPECT_EQ(moved.size(), 37u);
  EXPECT_EQ(buf.data(), nullptr);
}

}  // namespace
