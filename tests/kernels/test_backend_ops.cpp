// Every op of every backend op table against the double references (as ggml's test-backend-ops):
// ONE case list, run for each (backend, compute dtype) table the registry reports; likewise the
// step ops (optimizer update, gradient norm, non-finite check, scale) of every backend's StepOps. A table that
// lacks an op reports that case as skipped ("not supported"), never as passed. The step ops are in
// test_backend_step_ops.cpp, the registry's own checks in test_backend_registry.cpp.
//
// How a case runs: inputs are drawn in fp32, rounded to the table's dtype where the table reads
// them in that dtype (so the double reference sees exactly the kernel's inputs), copied into
// backend memory with guard elements behind every buffer, the op runs forward and backward, the
// results come back through Backend::copy and are compared with the reference (parameter
// gradients onto random prefills: the += contract; "=" outputs pre-filled with NaN). The guard
// elements must be unchanged afterwards (no write past a buffer).
//
// Tolerance per dtype, per element: |got - want| <= tol * (1 + max|want|) + tol * |want|.
//   fp32 5e-5: the bound of the per-op tests (test_ops_*.cpp; attention's dqkv needs 5e-5, the
//        others are within 1e-5..3e-5): fp32 rounding of sums over up to 67 terms.
//   bf16 3e-2: outputs and saved activations are rounded to bf16 (relative 2^-8 = 3.9e-3 each);
//        a backward reads up to ~4 rounded intermediates (e.g. layernorm dinp: out, mean-centred
//        input, dout) and the error of a difference of rounded terms is relative to the larger
//        term, so 8 x 2^-8 (MLX and ggml use ~1e-2 for single bf16 ops).
//   fp16 4e-3: the same with 2^-11 = 4.9e-4 per rounding (8 x 2^-11).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "backend_buffers.h"
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

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
const int64_t kOdd[] = {1, 3, 31, 33, 67};

double tolerance(DType dt) {
  switch (dt) {
    case DType::F32:
      return 5e-5;
    case DType::BF16:
      return 3e-2;
    case DType::F16:
      return 4e-3;
    default:
      return 0.0;
  }
}

// ---- a table under test and its memory ---------------------------------------------------------

struct Target {
  const Backend* backend;
  const Ops* ops;
  std::string variant = {};  // "cudnn": the table of Backend::cudnn_attention_ops (attention cases only)
  std::string name() const {
    return std::string(backend->name()) + "_" + compute_dtype_name(ops->dtype) + (variant.empty() ? "" : "_" + variant);
  }
};

// ---- an emulated bf16 table (test only) ---------------------------------------------------------
// Every op of the CPU fp32 table wrapped in bf16 <-> fp32 conversions: inputs widened, the fp32
// kernel run, outputs rounded once. It checks the harness's non-fp32 path (conversions, element
// offsets, tolerances) before a real bf16 table exists; it allocates per call, which a real
// table must not.
namespace emu {
constexpr DType kDt = DType::BF16;
VecF in(const void* p, int64_t n) {
  VecF v(static_cast<size_t>(n));
  if (p) from_dtype(p, v.data(), v.size(), kDt);
  return v;
}
void out(void* p, const VecF& v) {
  if (p) to_dtype(v.data(), p, v.size(), kDt);
}
float* fp(VecF& v, const void* orig) { return orig ? v.data() : nullptr; }
const Ops& f32() { return ops_for(cpu_backend(), DType::F32); }

Ops make() {
  Ops o = f32();  // fp32-only slots (scratch sizes, rope_tables) as they are
  o.backend = "emu";
  o.dtype = kDt;
  o.matmul_forward = [](void* y, const void* x, const void* w, const float* b, int64_t M, int64_t K, int64_t N,
                        bool acc) {
    VecF yv = acc ? in(y, M * N) : VecF(M * N), xv = in(x, M * K), wv = in(w, N * K);
    f32().matmul_forward(yv.data(), xv.data(), wv.data(), b, M, K, N, acc);
    out(y, yv);
  };
  o.matmul_backward = [](void* dx, float* dw, float* db, const void* g, const void* x, const void* w, int64_t M,
                         int64_t K, int64_t N, bool acc) {
    VecF dxv = acc ? in(dx, M * K) : VecF(M * K), gv = in(g, M * N), xv = in(x, M * K), wv = in(w, N * K);
    f32().matmul_backward(fp(dxv, dx), dw, db, gv.data(), xv.data(), wv.data(), M, K, N, acc);
    out(dx, dxv);
  };
  o.matmul_bias_gelu_forward = [](void* y, void* pre, const void* x, const void* w, const float* b, int64_t M,
                                  int64_t K, int64_t N) {
    VecF yv(M * N), pv(M * N), xv = in(x, M * K), wv = in(w, N * K);
    f32().matmul_forward(pv.data(), xv.data(), wv.data(), b, M, K, N, false);
    out(pre, pv);
    pv = in(pre, M * N);  // the GELU reads the rounded pre, as the CPU bf16 table does
    f32().gelu_forward(yv.data(), pv.data(), M * N);
    out(y, yv);
  };
  o.embedding_forward = [](void* y, const int32_t* tok, const void* wte, const void* wpe, int64_t B, int64_t T,
                           int64_t C, const int32_t* pos, int64_t vb, int64_t vr) {
    int64_t V = 0;
    for (int64_t i = 0; i < B * T; ++i)
      if (tok[i] >= vb && tok[i] - vb < vr) V = std::max<int64_t>(V, tok[i] - vb + 1);
    VecF yv(B * T * C), te = in(wte, V * C), pe = in(wpe, T * C);
    f32().embedding_forward(yv.data(), tok, te.data(), fp(pe, wpe), B, T, C, pos, vb, vr);
    out(y, yv);
  };
  o.embedding_backward = [](float* dwte, float* dwpe, const void* g, const int32_t* tok, int64_t B, int64_t T,
                            int64_t C, const int32_t* pos, int64_t vb, int64_t vr) {
    VecF gv = in(g, B * T * C);
    f32().embedding_backward(dwte, dwpe, gv.data(), tok, B, T, C, pos, vb, vr);
  };
  o.layernorm_forward = [](void* y, float* mean, float* rstd, const void* x, const float* w, const float* b, int64_t N,
                           int64_t C, float eps) {
    VecF yv(N * C), xv = in(x, N * C);
    f32().layernorm_forward(yv.data(), mean, rstd, xv.data(), w, b, N, C, eps);
    out(y, yv);
  };
  o.layernorm_backward = [](void* dx, float* dw, float* db, const void* g, const void* x, const float* w,
                            const float* mean, const float* rstd, int64_t N, int64_t C, void* scratch) {
    VecF dxv = in(dx, N * C), gv = in(g, N * C), xv = in(x, N * C);
    f32().layernorm_backward(dxv.data(), dw, db, gv.data(), xv.data(), w, mean, rstd, N, C, scratch);
    out(dx, dxv);
  };
  o.rmsnorm_forward = [](void* y, float* rstd, const void* x, const float* w, int64_t N, int64_t C, float eps) {
    VecF yv(N * C), xv = in(x, N * C);
    f32().rmsnorm_forward(yv.data(), rstd, xv.data(), w, N, C, eps);
    out(y, yv);
  };
  o.rmsnorm_backward = [](void* dx, float* dw, const void* g, const void* x, const float* w, const float* rstd,
                          int64_t N, int64_t C, void* scratch) {
    VecF dxv = in(dx, N * C), gv = in(g, N * C), xv = in(x, N * C);
    f32().rmsnorm_backward(dxv.data(), dw, gv.data(), xv.data(), w, rstd, N, C, scratch);
    out(dx, dxv);
  };
  o.head_rmsnorm_forward = [](void* x, void* saved, float* rstd, const float* w, int64_t N, int64_t heads, int64_t D,
                              int64_t stride, float eps) {
    const int64_t n = (N - 1) * stride + heads * D;  // the span the rows cover
    VecF xv = in(x, n), sv(N * heads * D);
    f32().head_rmsnorm_forward(xv.data(), sv.data(), rstd, w, N, heads, D, stride, eps);
    out(x, xv);
    out(saved, sv);
  };
  o.head_rmsnorm_backward = [](void* dx, float* dw, const void* saved, const float* w, const float* rstd, int64_t N,
                               int64_t heads, int64_t D, int64_t stride, void* scratch) {
    const int64_t n = (N - 1) * stride + heads * D;
    VecF dxv = in(dx, n), sv = in(saved, N * heads * D);
    f32().head_rmsnorm_backward(dxv.data(), dw, sv.data(), w, rstd, N, heads, D, stride, scratch);
    out(dx, dxv);
  };
  o.gelu_forward = [](void* y, const void* x, int64_t n) {
    VecF yv(n), xv = in(x, n);
    f32().gelu_forward(yv.data(), xv.data(), n);
    out(y, yv);
  };
  o.gelu_backward = [](void* dx, const void* x, const void* g, int64_t n) {
    VecF dxv(n), xv = in(x, n), gv = in(g, n);
    f32().gelu_backward(dxv.data(), xv.data(), gv.data(), n);
    out(dx, dxv);
  };
  o.gelu_erf_forward = [](void* y, const void* x, int64_t n) {
    VecF yv(n), xv = in(x, n);
    f32().gelu_erf_forward(yv.data(), xv.data(), n);
    out(y, yv);
  };
  o.gelu_erf_backward = [](void* dx, const void* x, const void* g, int64_t n) {
    VecF dxv(n), xv = in(x, n), gv = in(g, n);
    f32().gelu_erf_backward(dxv.data(), xv.data(), gv.data(), n);
    out(dx, dxv);
  };
  o.swiglu_forward = [](void* y, const void* x, int64_t N, int64_t F) {
    VecF yv(N * F), xv = in(x, N * 2 * F);
    f32().swiglu_forward(yv.data(), xv.data(), N, F);
    out(y, yv);
  };
  o.swiglu_backward = [](void* dx, const void* x, const void* g, int64_t N, int64_t F) {
    VecF dxv(N * 2 * F), xv = in(x, N * 2 * F), gv = in(g, N * F);
    f32().swiglu_backward(dxv.data(), xv.data(), gv.data(), N, F);
    out(dx, dxv);
  };
  o.geglu_forward = [](void* y, const void* x, int64_t N, int64_t F) {
    VecF yv(N * F), xv = in(x, N * 2 * F);
    f32().geglu_forward(yv.data(), xv.data(), N, F);
    out(y, yv);
  };
  o.geglu_backward = [](void* dx, const void* x, const void* g, int64_t N, int64_t F) {
    VecF dxv(N * 2 * F), xv = in(x, N * 2 * F), gv = in(g, N * F);
    f32().geglu_backward(dxv.data(), xv.data(), gv.data(), N, F);
    out(dx, dxv);
  };
  o.residual_forward = [](void* y, const void* a, const void* b, int64_t n) {
    VecF yv(n), av = in(a, n), bv = in(b, n);
    f32().residual_forward(yv.data(), av.data(), bv.data(), n);
    out(y, yv);
  };
  o.bias_add = [](void* y, const float* bias, int64_t N, int64_t C) {
    VecF yv = in(y, N * C);
    f32().bias_add(yv.data(), bias, N, C);
    out(y, yv);
  };
  o.scale_forward = [](void* x, float sc, int64_t n) {
    VecF xv = in(x, n);
    f32().scale_forward(xv.data(), sc, n);
    out(x, xv);
  };
  // In place on rows of `stride` elements: widen the whole span the kernel touches (bf16 -> fp32
  // -> bf16 is exact for the columns it leaves alone).
  o.rope_forward = [](void* x, const float* cs, const float* sn, int64_t B, int64_t T, int64_t H, int64_t D,
                      int64_t rot, int64_t stride, const int32_t* pos) {
    VecF xv = in(x, (B * T - 1) * stride + H * D);
    f32().rope_forward(xv.data(), cs, sn, B, T, H, D, rot, stride, pos);
    out(x, xv);
  };
  o.rope_backward = [](void* x, const float* cs, const float* sn, int64_t B, int64_t T, int64_t H, int64_t D,
                       int64_t rot, int64_t stride, const int32_t* pos) {
    VecF xv = in(x, (B * T - 1) * stride + H * D);
    f32().rope_backward(xv.data(), cs, sn, B, T, H, D, rot, stride, pos);
    out(x, xv);
  };
  o.attention_forward = [](void* y, float* lse, const void* qkv, int64_t B, int64_t T, int64_t H, int64_t KVH,
                           int64_t D, void* scratch, const int32_t* ds, int64_t win, float sc, float cap) {
    VecF yv(B * T * H * D), qv = in(qkv, B * T * (H + 2 * KVH) * D);
    f32().attention_forward(yv.data(), lse, qv.data(), B, T, H, KVH, D, scratch, ds, win, sc, cap);
    out(y, yv);
  };
  o.attention_backward = [](void* dqkv, const void* g, const void* qkv, const void* y, const float* lse, int64_t B,
                            int64_t T, int64_t H, int64_t KVH, int64_t D, void* scratch, const int32_t* ds, int64_t win,
                            float sc, float cap) {
    const int64_t nq = B * T * (H + 2 * KVH) * D, ny = B * T * H * D;
    VecF dqv(nq), gv = in(g, ny), qv = in(qkv, nq), yv = in(y, ny);
    f32().attention_backward(dqv.data(), gv.data(), qv.data(), yv.data(), lse, B, T, H, KVH, D, scratch, ds, win, sc,
                             cap);
    out(dqkv, dqv);
  };
  o.lm_head_loss = [](float* losses, void* dx, float* dw, const void* x, const void* w, const int32_t* tg, int64_t N,
                      int64_t C, int64_t V, float gs, bool backward, void* scratch, int64_t chunk,
                      const VocabParallel* vp, float cap) {
    VecF dxv(N * C), xv = in(x, N * C), wv = in(w, V * C);
    const double total = f32().lm_head_loss(losses, fp(dxv, dx), dw, xv.data(), wv.data(), tg, N, C, V, gs, backward,
                                            scratch, chunk, vp, cap);
    out(dx, dxv);
    return total;
  };
  o.logits_forward = [](float* y, const void* x, const void* w, int64_t M, int64_t C, int64_t V) {
    VecF xv = in(x, M * C), wv = in(w, V * C);
    f32().logits_forward(y, xv.data(), wv.data(), M, C, V);
  };
  return o;
}

class Backend final : public lathe::Backend {
 public:
  std::string_view name() const override { return "emu"; }
  DeviceKind device() const override { return DeviceKind::Host; }
  void* alloc(size_t bytes) const override { return cpu_backend().alloc(bytes); }
  void free(void* p) const override { cpu_backend().free(p); }
  void memset(void* d, int v, size_t n) const override { cpu_backend().memset(d, v, n); }
  void copy(void* d, const void* s, size_t n, CopyKind k) const override { cpu_backend().copy(d, s, n, k); }
  void synchronize() const override {}
  std::vector<const Ops*> op_tables() const override {
    static const Ops table = make();
    return {&table};
  }
};
const Backend& backend() {
  static const Backend b;
  return b;
}
}  // namespace emu

// Every table of every backend, complete or partial (a partial table's missing ops are skipped),
// then the emulated bf16 table above.
std::vector<Target> all_targets() {
  std::vector<Target> v;
  for (const Backend* b : backends())
    for (const Ops* t : b->op_tables())
      if (t) v.push_back({b, t});
  // The cuDNN SDPA tables (model.attention_kernel: cudnn) where this build has them: the CUDA
  // build's bf16 / fp16 (skipped without a GPU like the other CUDA tables).
  for (const Backend* b : backends())
    for (DType dt : {DType::BF16, DType::F16}) {
      std::string why;
      if (const Ops* t = b->cudnn_attention_ops(dt, &why)) v.push_back({b, t, "cudnn"});
    }
  v.push_back({&emu::backend(), emu::backend().op_tables()[0]});
  return v;
}

// Per-case helper: act() buffers are in the table's dtype, f32() buffers fp32 in every table.
struct Run {
  const Target& t;
  std::string tag;
  std::vector<std::unique_ptr<IntDev>> int_bufs = {};
  const int32_t* ints(const std::vector<int32_t>& host) {
    int_bufs.push_back(std::make_unique<IntDev>(*t.backend, host));
    return int_bufs.back()->p();
  }
  DType act_dt() const { return t.ops->dtype; }
  double tol() const { return tolerance(act_dt()); }
  VecF act_in(VecF v) const { return rounded(std::move(v), act_dt()); }
  std::unique_ptr<Dev> act(const VecF& host, const char* what) const {
    return std::make_unique<Dev>(*t.backend, host, act_dt(), tag + " " + what);
  }
  std::unique_ptr<Dev> f32(const VecF& host, const char* what) const {
    return std::make_unique<Dev>(*t.backend, host, DType::F32, tag + " " + what);
  }
  std::unique_ptr<Dev> scratch(size_t bytes) const {
    return std::make_unique<Dev>(*t.backend, VecF((bytes + 3) / 4 + 1, kNaN), DType::F32, tag + " scratch");
  }
  void check(const Dev& got, const VecD& want, const std::string& what) const {
    const double tl = tol();
    expect_close(got.down(), want, tl * (1.0 + max_abs(want)), tl, tag + " " + what);
  }
  // Element by element: tol() absolute + tol() relative, not scaled by the largest value (which a
  // few large inputs would make loose enough to let a near-miss formula through).
  void check_elementwise(const Dev& got, const VecD& want, const std::string& what) const {
    expect_close(got.down(), want, tol(), tol(), tag + " " + what);
  }
};

VecD plus(const VecF& a, const VecD& b) {
  VecD r(b.size());
  for (size_t i = 0; i < b.size(); ++i) r[i] = a[i] + b[i];
  return r;
}
std::string dims(std::initializer_list<int64_t> d) {
  std::string s;
  for (int64_t x : d) {
    if (!s.empty()) s += 'x';
    s += std::to_string(x);
  }
  return s;
}

// ============================== the case list: one function per op ==============================

void case_matmul(const Target& t) {
  struct S {
    int64_t M, K, N;
  };
  const S shapes[] = {{1, 1, 1}, {1, 3, 31}, {3, 33, 67}, {33, 67, 1}, {67, 31, 33}, {31, 67, 3}, {67, 67, 67}};
  for (const S& s : shapes)
    for (int bias = 0; bias < 2; ++bias) {
      const int64_t M = s.M, K = s.K, N = s.N;
      Run r{t, "matmul " + dims({M, K, N}) + (bias ? " bias" : "")};
      Rng rng(100 + M * 7 + K * 13 + N * 17 + bias);
      VecF x = r.act_in(randn(M * K, rng)), w = r.act_in(randn(N * K, rng)), b = randn(N, rng),
           g = r.act_in(randn(M * N, rng));
      VecD bd = to_double(b), ref, rdx, rdw, rdb;
      ref_matmul_fwd(ref, to_double(x), to_double(w), bias ? &bd : nullptr, M, K, N);
      ref_matmul_bwd(rdx, rdw, rdb, to_double(g), to_double(x), to_double(w), M, K, N);
      auto dx = r.act(x, "x"), dw = r.act(w, "w"), db = r.f32(b, "b"), dg = r.act(g, "dout");
      float* bp = bias ? db->f() : nullptr;

      auto out = r.act(VecF(M * N, kNaN), "out");
      t.ops->matmul_forward(out->p(), dx->p(), dw->p(), bp, M, K, N, false);
      r.check(*out, ref, "forward");
      const VecF pre = r.act_in(randn(M * N, rng));
      auto acc = r.act(pre, "out accumulate");
      t.ops->matmul_forward(acc->p(), dx->p(), dw->p(), bp, M, K, N, true);
      r.check(*acc, plus(pre, ref), "forward accumulate");

      const VecF pre_w = randn(N * K, rng), pre_b = randn(N, rng), pre_x = r.act_in(randn(M * K, rng));
      auto gx = r.act(VecF(M * K, kNaN), "dinp"), gw = r.f32(pre_w, "dweight"), gb = r.f32(pre_b, "dbias");
      t.ops->matmul_backward(gx->p(), gw->f(), bias ? gb->f() : nullptr, dg->p(), dx->p(), dw->p(), M, K, N, false);
      r.check(*gx, rdx, "dinp");
      r.check(*gw, plus(pre_w, rdw), "dweight (+=)");
      if (bias) r.check(*gb, plus(pre_b, rdb), "dbias (+=)");
      auto gx2 = r.act(pre_x, "dinp accumulate");
      t.ops->matmul_backward(gx2->p(), nullptr, nullptr, dg->p(), dx->p(), dw->p(), M, K, N, true);
      r.check(*gx2, plus(pre_x, rdx), "dinp accumulate");
      auto gw3 = r.f32(VecF(N * K, 0.0f), "dweight only");
      t.ops->matmul_backward(nullptr, gw3->f(), nullptr, dg->p(), dx->p(), dw->p(), M, K, N, false);
      r.check(*gw3, rdw, "dweight only (dinp null)");
    }
}

// The fused GELU MLP up-projection: pre = x @ w^T (+ b) and out = gelu(pre) against the double
// reference of the pair. Shapes with N a multiple of 8 (cuBLASLt's epilogue applies: 64, 104) and
// odd ones (the CUDA table's unfused fallback). The GELU of a fused epilogue reads the fp32
// accumulator and one of the unfused pair the rounded pre: out is checked against gelu of the exact
// pre, which both meet within the dtype's tolerance (one extra rounding of pre, |gelu'| <= 1.13).
void case_matmul_gelu(const Target& t) {
  struct S {
    int64_t M, K, N;
  };
  const S shapes[] = {{1, 1, 1}, {3, 33, 67}, {67, 31, 33}, {33, 67, 64}, {67, 64, 104}};
  for (const S& s : shapes)
    for (int bias = 0; bias < 2; ++bias) {
      const int64_t M = s.M, K = s.K, N = s.N;
      Run r{t, "matmul_gelu " + dims({M, K, N}) + (bias ? " bias" : "")};
      Rng rng(150 + M * 7 + K * 13 + N * 17 + bias);
      VecF x = r.act_in(randn(M * K, rng)), w = r.act_in(randn(N * K, rng)), b = randn(N, rng);
      VecD bd = to_double(b), pre;
      ref_matmul_fwd(pre, to_double(x), to_double(w), bias ? &bd : nullptr, M, K, N);
      VecD act(pre.size());
      for (size_t i = 0; i < pre.size(); ++i) act[i] = ref_gelu(pre[i]);
      auto dx = r.act(x, "x"), dw = r.act(w, "w"), db = r.f32(b, "b");
      auto out = r.act(VecF(M * N, kNaN), "out"), dpre = r.act(VecF(M * N, kNaN), "pre");
      t.ops->matmul_bias_gelu_forward(out->p(), dpre->p(), dx->p(), dw->p(), bias ? db->f() : nullptr, M, K, N);
      r.check(*dpre, pre, "pre");
      r.check(*out, act, "out = gelu(pre)");
    }
}

void case_embedding(const Target& t) {
  const int64_t V = 5;
  for (int64_t B : {1, 3})
    for (int64_t T : kOdd)
      for (int64_t C : {1, 33, 67})
        for (int wpe = 0; wpe < 2; ++wpe) {
          Run r{t, "embedding " + dims({B, T, C, V}) + (wpe ? " wpe" : "")};
          Rng rng(200 + B * 100 + T * 10 + C + wpe);
          std::vector<int32_t> tok(B * T);
          for (auto& k : tok) k = static_cast<int32_t>(rng.below(V));  // repeated tokens
          VecF wte = r.act_in(randn(V * C, rng)), wpv = r.act_in(randn(T * C, rng)),
               g = r.act_in(randn(B * T * C, rng));
          VecD wped = to_double(wpv), ref, rdwte, rdwpe;
          ref_embedding_fwd(ref, tok, to_double(wte), wpe ? &wped : nullptr, B, T, C);
          ref_embedding_bwd(rdwte, rdwpe, to_double(g), tok, V, B, T, C);
          auto dwte_in = r.act(wte, "wte"), dwpe_in = r.act(wpv, "wpe"), dg = r.act(g, "dout");
          auto out = r.act(VecF(B * T * C, kNaN), "out");
          t.ops->embedding_forward(out->p(), r.ints(tok), dwte_in->p(), wpe ? dwpe_in->p() : nullptr, B, T, C, nullptr,
                                   0, V);
          r.check(*out, ref, "forward");
          const VecF pre_te = randn(V * C, rng), pre_pe = randn(T * C, rng);
          auto gte = r.f32(pre_te, "dwte"), gpe = r.f32(pre_pe, "dwpe");
          t.ops->embedding_backward(gte->f(), wpe ? gpe->f() : nullptr, dg->p(), r.ints(tok), B, T, C, nullptr, 0, V);
          r.check(*gte, plus(pre_te, rdwte), "dwte (+=)");
          if (wpe) r.check(*gpe, plus(pre_pe, rdwpe), "dwpe (+=)");
        }
}

void case_layernorm(const Target& t) {
  const float eps = 1e-5f;
  for (int64_t N : kOdd)
    for (int64_t C : kOdd)
      for (int bias = 0; bias < 2; ++bias) {
        Run r{t, "layernorm " + dims({N, C}) + (bias ? " bias" : "")};
        Rng rng(300 + N * 100 + C + bias);
        VecF x = randn(N * C, rng, 2.0f);
        for (auto& v : x) v += 0.5f;  // nonzero mean
        x = r.act_in(x);
        VecF w = randn(C, rng), b = randn(C, rng), g = r.act_in(randn(N * C, rng));
        VecD bd = to_double(b), ref, rmean, rrstd, rdx, rdw, rdb;
        ref_layernorm_fwd(ref, rmean, rrstd, to_double(x), to_double(w), bias ? &bd : nullptr, N, C, eps);
        ref_layernorm_bwd(rdx, rdw, rdb, to_double(g), to_double(x), to_double(w), N, C, eps);
        auto dx = r.act(x, "x"), dw = r.f32(w, "w"), db = r.f32(b, "b"), dg = r.act(g, "dout");
        auto out = r.act(VecF(N * C, kNaN), "out"), mean = r.f32(VecF(N, kNaN), "mean"),
             rstd = r.f32(VecF(N, kNaN), "rstd");
        t.ops->layernorm_forward(out->p(), mean->f(), rstd->f(), dx->p(), dw->f(), bias ? db->f() : nullptr, N, C, eps);
        r.check(*out, ref, "forward out");
        r.check(*mean, rmean, "forward mean");
        r.check(*rstd, rrstd, "forward rstd");
        auto scratch = r.scratch(t.ops->layernorm_scratch_bytes(C));
        const VecF pre_x = r.act_in(randn(N * C, rng)), pre_w = randn(C, rng), pre_b = randn(C, rng);
        auto gx = r.act(pre_x, "dinp"), gw = r.f32(pre_w, "dweight"), gb = r.f32(pre_b, "dbias");
        t.ops->layernorm_backward(gx->p(), gw->f(), bias ? gb->f() : nullptr, dg->p(), dx->p(), dw->f(), mean->f(),
                                  rstd->f(), N, C, scratch->p());
        r.check(*gx, plus(pre_x, rdx), "dinp (+=)");
        r.check(*gw, plus(pre_w, rdw), "dweight (+=)");
        if (bias) r.check(*gb, plus(pre_b, rdb), "dbias (+=)");
      }
}

void case_rmsnorm(const Target& t) {
  const float eps = 1e-6f;
  for (int64_t N : kOdd)
    for (int64_t C : kOdd) {
      Run r{t, "rmsnorm " + dims({N, C})};
      Rng rng(400 + N * 100 + C);
      VecF x = r.act_in(randn(N * C, rng, 2.0f)), w = randn(C, rng), g = r.act_in(randn(N * C, rng));
      VecD ref, rrstd, rdx, rdw;
      ref_rmsnorm_fwd(ref, rrstd, to_double(x), to_double(w), N, C, eps);
      ref_rmsnorm_bwd(rdx, rdw, to_double(g), to_double(x), to_double(w), N, C, eps);
      auto dx = r.act(x, "x"), dw = r.f32(w, "w"), dg = r.act(g, "dout");
      auto out = r.act(VecF(N * C, kNaN), "out"), rstd = r.f32(VecF(N, kNaN), "rstd");
      t.ops->rmsnorm_forward(out->p(), rstd->f(), dx->p(), dw->f(), N, C, eps);
      r.check(*out, ref, "forward out");
      r.check(*rstd, rrstd, "forward rstd");
      auto scratch = r.scratch(t.ops->rmsnorm_scratch_bytes(C));
      const VecF pre_x = r.act_in(randn(N * C, rng)), pre_w = randn(C, rng);
      auto gx = r.act(pre_x, "dinp"), gw = r.f32(pre_w, "dweight");
      t.ops->rmsnorm_backward(gx->p(), gw->f(), dg->p(), dx->p(), dw->f(), rstd->f(), N, C, scratch->p());
      r.check(*gx, plus(pre_x, rdx), "dinp (+=)");
      r.check(*gw, plus(pre_w, rdw), "dweight (+=)");
    }
}

// Per-head RMSNorm in place on strided rows (Qwen3's q_norm / k_norm on the q or k block of a fused
// qkv row): the reference gathers the rows, normalises them as rmsnorm does and scatters them back;
// the elements between the rows (the rest of the qkv row) must come back untouched.
void case_head_rmsnorm(const Target& t) {
  const float eps = 1e-6f;
  for (int64_t N : {1, 3, 33})
    for (int64_t heads : {1, 3})
      for (int64_t D : {1, 31, 64}) {
        const int64_t gap = 5, stride = heads * D + gap, rows = N * heads;
        Run r{t, "head_rmsnorm " + dims({N, heads, D})};
        Rng rng(450 + N * 100 + heads * 10 + D);
        const VecF buf = r.act_in(randn(N * stride, rng, 2.0f)), w = randn(D, rng),
                   g = r.act_in(randn(N * stride, rng));
        auto at = [&](int64_t row, int64_t c) { return (row / heads) * stride + (row % heads) * D + c; };
        VecD x(rows * D), gr(rows * D);
        for (int64_t i = 0; i < rows; ++i)
          for (int64_t c = 0; c < D; ++c) x[i * D + c] = buf[at(i, c)], gr[i * D + c] = g[at(i, c)];
        VecD ref, rrstd, rdx, rdw;
        ref_rmsnorm_fwd(ref, rrstd, x, to_double(w), rows, D, eps);
        ref_rmsnorm_bwd(rdx, rdw, gr, x, to_double(w), rows, D, eps);
        VecD want_fwd = to_double(buf), want_bwd = to_double(g);
        for (int64_t i = 0; i < rows; ++i)
          for (int64_t c = 0; c < D; ++c) want_fwd[at(i, c)] = ref[i * D + c], want_bwd[at(i, c)] = rdx[i * D + c];
        auto dx = r.act(buf, "x"), dw = r.f32(w, "w"), saved = r.act(VecF(rows * D, kNaN), "saved");
        auto rstd = r.f32(VecF(rows, kNaN), "rstd");
        t.ops->head_rmsnorm_forward(dx->p(), saved->p(), rstd->f(), dw->f(), N, heads, D, stride, eps);
        r.check(*dx, want_fwd, "forward (in place, gaps untouched)");
        r.check(*saved, x, "forward saved rows");
        r.check(*rstd, rrstd, "forward rstd");
        auto scratch = r.scratch(t.ops->head_rmsnorm_scratch_bytes(D));
        const VecF pre_w = randn(D, rng);
        auto gw = r.f32(pre_w, "dweight"), dg = r.act(g, "dout");
        t.ops->head_rmsnorm_backward(dg->p(), gw->f(), saved->p(), dw->f(), rstd->f(), N, heads, D, stride,
                                     scratch->p());
        r.check(*dg, want_bwd, "backward (overwrites dout, gaps untouched)");
        r.check(*gw, plus(pre_w, rdw), "dweight (+=)");
      }
}

// Both GELUs: tanh (gelu_*) and exact (gelu_erf_*), against their double formulas.
void check_gelu(const Target& t, bool exact) {
  const char* name = exact ? "gelu_erf" : "gelu";
  const auto fwd = exact ? t.ops->gelu_erf_forward : t.ops->gelu_forward;
  const auto bwd = exact ? t.ops->gelu_erf_backward : t.ops->gelu_backward;
  for (int64_t n : {1, 3, 31, 33, 67, 100003}) {
    Run r{t, std::string(name) + " n=" + std::to_string(n)};
    Rng rng(500 + n);
    VecF x = randn(n, rng, 3.0f);
    const float special[] = {0.0f, -12.0f, 12.0f, -5.0f, 5.0f, -0.3f, 1e-4f, -60.0f, 60.0f};
    for (size_t i = 0; i < std::size(special) && i < x.size(); ++i) x[i] = special[i];
    x = r.act_in(x);
    const VecF g = r.act_in(randn(n, rng));
    VecD ref(n), rdx(n);
    for (int64_t i = 0; i < n; ++i) {
      ref[i] = exact ? ref_gelu_erf(x[i]) : ref_gelu(x[i]);
      rdx[i] = (exact ? ref_gelu_erf_grad(x[i]) : ref_gelu_grad(x[i])) * g[i];
    }
    auto dx = r.act(x, "x"), dg = r.act(g, "dout"), out = r.act(VecF(n, kNaN), "out"),
         gx = r.act(VecF(n, kNaN), "dinp");
    // The exact GELU is checked element by element too: the tanh approximation is within 5e-4 of
    // it, which the scaled tolerance of the +-60 inputs would accept in fp32.
    auto chk = [&](const Dev& got, const VecD& want, const char* what) {
      r.check(got, want, what);
      if (exact) r.check_elementwise(got, want, std::string(what) + " (element by element)");
    };
    fwd(out->p(), dx->p(), n);
    chk(*out, ref, "forward");
    bwd(gx->p(), dx->p(), dg->p(), n);
    chk(*gx, rdx, "backward");
    bwd(dg->p(), dx->p(), dg->p(), n);  // dinp may alias dout
    chk(*dg, rdx, "backward aliased");
  }
}

void case_gelu(const Target& t) { check_gelu(t, false); }
void case_gelu_erf(const Target& t) { check_gelu(t, true); }

void case_swiglu(const Target& t) {
  for (int64_t N : kOdd)
    for (int64_t F : kOdd) {
      Run r{t, "swiglu " + dims({N, F})};
      Rng rng(600 + N * 100 + F);
      VecF x = randn(N * 2 * F, rng, 3.0f);
      x[0] = -40.0f;
      x[x.size() / 2] = 40.0f;
      x = r.act_in(x);
      const VecF g = r.act_in(randn(N * F, rng));
      VecD ref, rdx;
      ref_swiglu_fwd(ref, to_double(x), N, F);
      ref_swiglu_bwd(rdx, to_double(x), to_double(g), N, F);
      auto dx = r.act(x, "x"), dg = r.act(g, "dout"), out = r.act(VecF(N * F, kNaN), "out"),
           gx = r.act(VecF(N * 2 * F, kNaN), "dinp");
      t.ops->swiglu_forward(out->p(), dx->p(), N, F);
      r.check(*out, ref, "forward");
      t.ops->swiglu_backward(gx->p(), dx->p(), dg->p(), N, F);
      r.check(*gx, rdx, "backward");
    }
}

// GeGLU (Gemma 2's MLP): the tanh GELU of the gate times up, with the same extreme gates as swiglu.
void case_geglu(const Target& t) {
  for (int64_t N : kOdd)
    for (int64_t F : kOdd) {
      Run r{t, "geglu " + dims({N, F})};
      Rng rng(650 + N * 100 + F);
      VecF x = randn(N * 2 * F, rng, 3.0f);
      x[0] = -40.0f;
      x[x.size() / 2] = 40.0f;
      x = r.act_in(x);
      const VecF g = r.act_in(randn(N * F, rng));
      VecD ref, rdx;
      ref_geglu_fwd(ref, to_double(x), N, F);
      ref_geglu_bwd(rdx, to_double(x), to_double(g), N, F);
      auto dx = r.act(x, "x"), dg = r.act(g, "dout"), out = r.act(VecF(N * F, kNaN), "out"),
           gx = r.act(VecF(N * 2 * F, kNaN), "dinp");
      t.ops->geglu_forward(out->p(), dx->p(), N, F);
      r.check(*out, ref, "forward");
      t.ops->geglu_backward(gx->p(), dx->p(), dg->p(), N, F);
      r.check(*gx, rdx, "backward");
    }
}

void case_residual(const Target& t) {
  for (int64_t n : {1, 3, 31, 33, 67, 100003}) {
    Run r{t, "residual n=" + std::to_string(n)};
    Rng rng(700 + n);
    const VecF a = r.act_in(randn(n, rng)), b = r.act_in(randn(n, rng));
    VecD ref(n);
    for (int64_t i = 0; i < n; ++i) ref[i] = static_cast<double>(a[i]) + b[i];
    auto da = r.act(a, "a"), db = r.act(b, "b"), out = r.act(VecF(n, kNaN), "out");
    t.ops->residual_forward(out->p(), da->p(), db->p(), n);
    r.check(*out, ref, "forward");
    t.ops->residual_forward(da->p(), da->p(), db->p(), n);  // out may alias a
    r.check(*da, ref, "forward aliased");
  }
}

void case_bias_add(const Target& t) {
  for (int64_t N : {1, 3, 67})
    for (int64_t C : {1, 5, 33, 1031}) {
      Run r{t, "bias_add " + dims({N, C})};
      Rng rng(750 + N * 10 + C);
      const VecF y = r.act_in(randn(N * C, rng));
      auto bias = r.f32(randn(C, rng), "bias");
      const VecF b = bias->down();
      VecD ref(N * C);
      for (int64_t i = 0; i < N * C; ++i) ref[i] = static_cast<double>(y[i]) + b[i % C];
      auto dy = r.act(y, "out");
      t.ops->bias_add(dy->p(), bias->f(), N, C);
      r.check(*dy, ref, "forward");
    }
}

// In-place scale (gemma2's embedding x sqrt(hidden), rounded to the dtype by the caller) and the
// fp32 norm weight offset (its 1 + w).
void case_scale(const Target& t) {
  for (int64_t n : {1, 3, 67, 100003}) {
    Run r{t, "scale n=" + std::to_string(n)};
    Rng rng(760 + n);
    const VecF x = r.act_in(randn(n, rng, 3.0f));
    const float sc = r.act_in(VecF{std::sqrt(48.0f)})[0];
    VecD ref(n);
    for (int64_t i = 0; i < n; ++i) ref[i] = static_cast<double>(x[i]) * sc;
    auto dx = r.act(x, "x");
    t.ops->scale_forward(dx->p(), sc, n);
    r.check_elementwise(*dx, ref, "forward");
    const VecF w = randn(n, rng);
    auto dw = r.f32(w, "w"), dout = r.f32(VecF(n, kNaN), "out");
    t.ops->offset_weights(dout->f(), dw->f(), 1.0f, n);
    const VecF got = dout->down();
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(got[i], 1.0f + w[i]) << r.tag << " offset_weights element " << i;
  }
}

void case_rope(const Target& t) {
  for (int64_t B : {1, 3})
    for (int64_t T : kOdd)
      for (int64_t H : {1, 3})
        for (int64_t D : {2, 34, 66})
          for (int64_t rot : {D, D - 4}) {  // D - 4: partial rotary (the last 4 dims pass through)
            if (rot < 2) continue;
            Run r{t, "rope " + dims({B, T, H, D, rot})};
            // Rows hold columns before (offset) and after the rotated heads, which must not change:
            // the k section of a fused qkv row.
            const int64_t offset = 5, stride = offset + H * D + 7, half = rot / 2;
            Rng rng(800 + B * 1000 + T * 10 + H + D + rot);
            auto cs = r.f32(VecF(T * half, kNaN), "cos"), sn = r.f32(VecF(T * half, kNaN), "sin");
            t.ops->rope_tables(cs->f(), sn->f(), T, half, rope_default_inv_freq(rot, 10000.0).data(), 1.0f);
            const VecF csh = cs->down(), snh = sn->down();
            for (int64_t tt = 0; tt < T; ++tt)
              for (int64_t i = 0; i < half; ++i) {
                const double angle = tt * std::pow(10000.0, -2.0 * i / rot);
                const double tl = 1e-6 + angle * (std::log(10000.0) * 6e-8 + 3e-7);  // as test_ops_basic
                ASSERT_NEAR(csh[tt * half + i], std::cos(angle), tl) << r.tag << " cos t=" << tt << " i=" << i;
                ASSERT_NEAR(snh[tt * half + i], std::sin(angle), tl) << r.tag << " sin t=" << tt << " i=" << i;
              }
            const VecF x = r.act_in(randn(B * T * stride, rng)), g = r.act_in(randn(B * T * stride, rng));
            VecD ref, rdx;
            ref_rope_fwd(ref, to_double(x), to_double(csh), to_double(snh), B, T, H, D, stride, offset, nullptr, rot);
            ref_rope_bwd(rdx, to_double(g), to_double(csh), to_double(snh), B, T, H, D, stride, offset, nullptr, rot);
            // In place on a pointer `offset` elements into each row (element size of the dtype).
            const size_t off_bytes = offset * dtype_size(r.act_dt());
            auto y = r.act(x, "x");
            t.ops->rope_forward(static_cast<char*>(y->p()) + off_bytes, cs->f(), sn->f(), B, T, H, D, rot, stride,
                                nullptr);
            r.check(*y, ref, "forward");
            auto dx = r.act(g, "dx");
            t.ops->rope_backward(static_cast<char*>(dx->p()) + off_bytes, cs->f(), sn->f(), B, T, H, D, rot, stride,
                                 nullptr);
            r.check(*dx, rdx, "backward");
          }
}

void case_attention(const Target& t) {
  const std::pair<int64_t, int64_t> heads[] = {{1, 1}, {4, 2}, {6, 1}, {3, 3}};
  for (int64_t B : {1, 2})
    for (int64_t T : kOdd)
      for (int64_t D : {1, 3, 8, 64})  // 8, 64: cuDNN's SDPA runs them (1, 3: lathe's kernels)
        for (auto [H, KVH] : heads) {
          const AttnShape s{B, T, H, KVH, D};
          Run r{t, "attention " + dims({B, T, H, KVH, D})};
          Rng rng(900 + B * 1000 + T * 10 + D + H * 7 + KVH);
          const int64_t ld = (H + 2 * KVH) * D;
          const VecF qkv = r.act_in(randn(B * T * ld, rng)), g = r.act_in(randn(B * T * H * D, rng));
          VecD ref, rlse;
          ref_attention_fwd(ref, rlse, to_double(qkv), s);
          const VecD rdqkv = ref_attention_bwd(to_double(qkv), to_double(g), s);
          auto dq = r.act(qkv, "qkv"), dg = r.act(g, "dout"), out = r.act(VecF(B * T * H * D, kNaN), "out"),
               lse = r.f32(VecF(B * H * T, kNaN), "lse"), gq = r.act(VecF(B * T * ld, kNaN), "dqkv");
          auto scratch = r.scratch(t.ops->attention_scratch_bytes(T, D));
          t.ops->attention_forward(out->p(), lse->f(), dq->p(), B, T, H, KVH, D, scratch->p(), nullptr, 0, 0.0f, 0.0f);
          r.check(*out, ref, "forward out");
          r.check(*lse, rlse, "forward lse");
          t.ops->attention_backward(gq->p(), dg->p(), dq->p(), out->p(), lse->f(), B, T, H, KVH, D, scratch->p(),
                                    nullptr, 0, 0.0f, 0.0f);
          r.check(*gq, rdqkv, "dqkv");
        }
}

// Documents packed in samples (issue 11): embedding and RoPE with positions restarting per
// document, attention with doc_start, against the double references with those positions and
// each document's attention run separately. Documents of length 1 and ones cut by the sample end.
void case_documents(const Target& t) {
  for (int64_t T : {1, 7, 67, 130}) {
    const int64_t B = 2, C = 33, V = 5, H = 4, KVH = 2, D = 8, ld = (H + 2 * KVH) * D, half = D / 2;
    Rng rng(1200 + T);
    std::vector<int32_t> ds(B * T), pos(B * T), tok(B * T);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0, start = 0; i < T; ++i) {
        if (i > 0 && rng.below(5) == 0) start = i;  // documents of mean length 5, some of length 1
        ds[b * T + i] = static_cast<int32_t>(start);
        pos[b * T + i] = static_cast<int32_t>(i - start);
      }
    for (auto& k : tok) k = static_cast<int32_t>(rng.below(V));
    Run r{t, "documents " + dims({B, T})};
    // embedding with positions
    const VecF wte = r.act_in(randn(V * C, rng)), wpe = r.act_in(randn(T * C, rng)),
               g = r.act_in(randn(B * T * C, rng));
    VecD wped = to_double(wpe), ref, rdwte, rdwpe;
    ref_embedding_fwd(ref, tok, to_double(wte), &wped, B, T, C, &pos);
    ref_embedding_bwd(rdwte, rdwpe, to_double(g), tok, V, B, T, C, &pos);
    auto dte = r.act(wte, "wte"), dpe = r.act(wpe, "wpe"), dg = r.act(g, "dout");
    auto out = r.act(VecF(B * T * C, kNaN), "embedding out");
    t.ops->embedding_forward(out->p(), r.ints(tok), dte->p(), dpe->p(), B, T, C, r.ints(pos), 0, V);
    r.check(*out, ref, "embedding forward");
    auto gte = r.f32(VecF(V * C, 0.0f), "dwte"), gpe = r.f32(VecF(T * C, 0.0f), "dwpe");
    t.ops->embedding_backward(gte->f(), gpe->f(), dg->p(), r.ints(tok), B, T, C, r.ints(pos), 0, V);
    r.check(*gte, rdwte, "embedding dwte");
    r.check(*gpe, rdwpe, "embedding dwpe");
    // RoPE on the q section of a fused row with positions
    auto cs = r.f32(VecF(T * half, kNaN), "cos"), sn = r.f32(VecF(T * half, kNaN), "sin");
    t.ops->rope_tables(cs->f(), sn->f(), T, D / 2, rope_default_inv_freq(D, 10000.0).data(), 1.0f);
    const VecD csd = to_double(cs->down()), snd = to_double(sn->down());
    const VecF x = r.act_in(randn(B * T * ld, rng)), gx = r.act_in(randn(B * T * ld, rng));
    VecD rref, rdx;
    ref_rope_fwd(rref, to_double(x), csd, snd, B, T, H, D, ld, 0, &pos);
    ref_rope_bwd(rdx, to_double(gx), csd, snd, B, T, H, D, ld, 0, &pos);
    auto y = r.act(x, "rope x"), dy = r.act(gx, "rope dx");
    t.ops->rope_forward(y->p(), cs->f(), sn->f(), B, T, H, D, D, ld, r.ints(pos));
    r.check(*y, rref, "rope forward");
    t.ops->rope_backward(dy->p(), cs->f(), sn->f(), B, T, H, D, D, ld, r.ints(pos));
    r.check(*dy, rdx, "rope backward");
    // attention with doc_start
    const AttnShape s{B, T, H, KVH, D};
    const VecF qkv = r.act_in(randn(B * T * ld, rng)), ga = r.act_in(randn(B * T * H * D, rng));
    VecD aref, alse, adq;
    ref_attention_docs(aref, alse, adq, to_double(qkv), to_double(ga), ds, s);
    auto dq = r.act(qkv, "qkv"), dga = r.act(ga, "att dout"), aout = r.act(VecF(B * T * H * D, kNaN), "att out"),
         lse = r.f32(VecF(B * H * T, kNaN), "lse"), gq = r.act(VecF(B * T * ld, kNaN), "dqkv");
    auto scratch = r.scratch(t.ops->attention_scratch_bytes(T, D));
    t.ops->attention_forward(aout->p(), lse->f(), dq->p(), B, T, H, KVH, D, scratch->p(), r.ints(ds), 0, 0.0f, 0.0f);
    r.check(*aout, aref, "attention forward out");
    r.check(*lse, alse, "attention forward lse");
    t.ops->attention_backward(gq->p(), dga->p(), dq->p(), aout->p(), lse->f(), B, T, H, KVH, D, scratch->p(),
                              r.ints(ds), 0, 0.0f, 0.0f);
    r.check(*gq, adq, "attention dqkv");
  }
}

// Sliding-window attention (issue 25): keys j > t - window only, with and without documents,
// against the double reference with each query's first key (ref_first_keys).
void case_window(const Target& t) {
  for (int64_t T : {7, 67, 130})
    for (int64_t D : {3, 8})
      for (int64_t window : {1, 5, 16, 33})
        for (bool docs : {false, true}) {
          const int64_t B = 2, H = 4, KVH = 2, ld = (H + 2 * KVH) * D;
          const AttnShape s{B, T, H, KVH, D};
          Run r{t, "window " + dims({B, T, H, KVH, D, window, docs ? 1 : 0})};
          Rng rng(1500 + T * 10 + D + window);
          std::vector<int32_t> ds;
          if (docs) {
            ds.resize(B * T);
            for (int64_t b = 0; b < B; ++b)
              for (int64_t i = 0, start = 0; i < T; ++i) {
                if (i > 0 && rng.below(20) == 0) start = i;
                ds[b * T + i] = static_cast<int32_t>(start);
              }
          }
          const std::vector<int64_t> first = ref_first_keys(ds, window, s);
          const VecF qkv = r.act_in(randn(B * T * ld, rng)), g = r.act_in(randn(B * T * H * D, rng));
          VecD ref, rlse;
          ref_attention_fwd(ref, rlse, to_double(qkv), s, first.data());
          const VecD rdqkv = ref_attention_bwd(to_double(qkv), to_double(g), s, first.data());
          auto dq = r.act(qkv, "qkv"), dg = r.act(g, "dout"), out = r.act(VecF(B * T * H * D, kNaN), "out"),
               lse = r.f32(VecF(B * H * T, kNaN), "lse"), gq = r.act(VecF(B * T * ld, kNaN), "dqkv");
          const int32_t* dsp = docs ? r.ints(ds) : nullptr;
          auto scratch = r.scratch(t.ops->attention_scratch_bytes(T, D));
          t.ops->attention_forward(out->p(), lse->f(), dq->p(), B, T, H, KVH, D, scratch->p(), dsp, window, 0.0f, 0.0f);
          r.check(*out, ref, "forward out");
          r.check(*lse, rlse, "forward lse");
          t.ops->attention_backward(gq->p(), dg->p(), dq->p(), out->p(), lse->f(), B, T, H, KVH, D, scratch->p(), dsp,
                                    window, 0.0f, 0.0f);
          r.check(*gq, rdqkv, "dqkv");
        }
}

void case_lm_head_loss(const Target& t) {
  for (int64_t N : {1, 3, 31, 67})
    for (int64_t C : {3, 33})
      for (int64_t V : {1, 3, 67, 4099}) {
        // V = 4099: the CPU kernels cut a chunk of 31-67 rows into 2-3 column tiles (lm_head_tiles.h).
        if (V > 67 && N < 31) continue;
        Rng rng(1000 + N * 100 + C * 10 + V);
        std::vector<int32_t> tg(N);
        for (auto& k : tg) k = static_cast<int32_t>(rng.below(V));
        for (int64_t n = 0; n < N; n += 5)
          if (N > 1) tg[n] = -1;  // ignored rows
        const float gs = 0.37f;
        const VecF x = randn(N * C, rng), w = randn(V * C, rng);
        for (int64_t chunk : {int64_t{1}, std::max<int64_t>(1, N / 2), N}) {
          Run r{t, "lm_head_loss " + dims({N, C, V}) + " chunk " + std::to_string(chunk)};
          const VecF xq = r.act_in(x), wq = r.act_in(w);
          const LossRef ref = ref_lm_head_loss(to_double(xq), to_double(wq), tg, N, C, V, gs);
          const VecF pre_w = randn(V * C, rng);
          auto dx_in = r.act(xq, "x"), dw_in = r.act(wq, "w"), losses = r.f32(VecF(N, kNaN), "losses"),
               gx = r.act(VecF(N * C, kNaN), "dx"), gw = r.f32(pre_w, "dw");
          auto scratch = r.scratch(t.ops->lm_head_loss_scratch_bytes(std::min(chunk, N), V));
          const double total = t.ops->lm_head_loss(losses->f(), gx->p(), gw->f(), dx_in->p(), dw_in->p(), r.ints(tg), N,
                                                   C, V, gs, true, scratch->p(), chunk, nullptr, 0.0f);
          r.check(*losses, ref.losses, "losses");
          EXPECT_NEAR(total, ref.total, r.tol() * (1.0 + std::fabs(ref.total)) * N) << r.tag << " total";
          r.check(*gx, ref.dx, "dx");
          r.check(*gw, plus(pre_w, ref.dw), "dw (+=)");
          auto losses2 = r.f32(VecF(N, kNaN), "losses (forward only)");
          const double total2 = t.ops->lm_head_loss(losses2->f(), nullptr, nullptr, dx_in->p(), dw_in->p(), r.ints(tg),
                                                    N, C, V, gs, false, scratch->p(), chunk, nullptr, 0.0f);
          r.check(*losses2, ref.losses, "losses (forward only)");
          EXPECT_EQ(total, total2) << r.tag << " forward-only total differs from forward+backward";
        }
      }
}

void case_logits(const Target& t) {
  for (int64_t M : {1, 3, 67})
    for (int64_t C : {1, 33})
      for (int64_t V : {1, 31, 67}) {
        Run r{t, "logits " + dims({M, C, V})};
        Rng rng(1100 + M * 100 + C * 10 + V);
        const VecF x = r.act_in(randn(M * C, rng)), w = r.act_in(randn(V * C, rng));
        VecD ref;
        ref_matmul_fwd(ref, to_double(x), to_double(w), nullptr, M, C, V);
        auto dx = r.act(x, "x"), dw = r.act(w, "w"), out = r.f32(VecF(M * V, kNaN), "logits");
        t.ops->logits_forward(out->f(), dx->p(), dw->p(), M, C, V);
        // fp32 out from exactly the kernel's inputs: only fp32 accumulation error, in every dtype.
        expect_close(out->down(), ref, 5e-5 * (1.0 + max_abs(ref)), 5e-5, r.tag + " logits (fp32)");
      }
}

struct Case {
  const char* op;
  // The slots this case calls: a table lacking any of them skips the case ("not supported").
  std::vector<const char*> slots;
  std::function<void(const Target&)> run;
};

const std::vector<Case>& cases() {
  static const std::vector<Case> all = {
      {"matmul", {"matmul_forward", "matmul_backward"}, case_matmul},
      {"matmul_gelu", {"matmul_bias_gelu_forward"}, case_matmul_gelu},
      {"embedding", {"embedding_forward", "embedding_backward"}, case_embedding},
      {"layernorm", {"layernorm_forward", "layernorm_backward", "layernorm_scratch_bytes"}, case_layernorm},
      {"rmsnorm", {"rmsnorm_forward", "rmsnorm_backward", "rmsnorm_scratch_bytes"}, case_rmsnorm},
      {"head_rmsnorm",
       {"head_rmsnorm_forward", "head_rmsnorm_backward", "head_rmsnorm_scratch_bytes"},
       case_head_rmsnorm},
      {"gelu", {"gelu_forward", "gelu_backward"}, case_gelu},
      {"gelu_erf", {"gelu_erf_forward", "gelu_erf_backward"}, case_gelu_erf},
      {"swiglu", {"swiglu_forward", "swiglu_backward"}, case_swiglu},
      {"geglu", {"geglu_forward", "geglu_backward"}, case_geglu},
      {"residual", {"residual_forward"}, case_residual},
      {"bias_add", {"bias_add"}, case_bias_add},
      {"scale", {"scale_forward", "offset_weights"}, case_scale},
      {"rope", {"rope_tables", "rope_forward", "rope_backward"}, case_rope},
      {"attention", {"attention_forward", "attention_backward", "attention_scratch_bytes"}, case_attention},
      {"documents",
       {"embedding_forward", "embedding_backward", "rope_tables", "rope_forward", "rope_backward", "attention_forward",
        "attention_backward", "attention_scratch_bytes"},
       case_documents},
      {"window", {"attention_forward", "attention_backward", "attention_scratch_bytes"}, case_window},
      {"lm_head_loss", {"lm_head_loss", "lm_head_loss_scratch_bytes"}, case_lm_head_loss},
      {"logits", {"logits_forward"}, case_logits},
  };
  return all;
}

struct Param {
  Target target;
  const Case* c;
};
std::vector<Param> all_params() {
  std::vector<Param> v;
  for (const Target& t : all_targets())
    for (const Case& c : cases())
      // A variant table differs in its attention slots only.
      if (t.variant.empty() || std::string_view(c.op) == "attention" || std::string_view(c.op) == "documents" ||
          std::string_view(c.op) == "window")
        v.push_back({t, &c});
  return v;
}

void PrintTo(const Param& p, std::ostream* os) { *os << p.target.name() << " " << p.c->op; }

class BackendOps : public ::testing::TestWithParam<Param> {};

TEST_P(BackendOps, MatchesDoubleReference) {
  const Param& p = GetParam();
  // A backend that cannot run here (the CUDA backend without a GPU) is skipped, saying why.
  if (const std::string why = p.target.backend->unavailable(); !why.empty())
    GTEST_SKIP() << p.target.name() << " cannot run here: " << why;
  for (const char* slot : p.c->slots) {
    bool implemented = false, known = false;
    for_each_op(*p.target.ops, [&](const char* name, bool has) {
      if (std::string_view(name) == slot) known = true, implemented = has;
    });
    ASSERT_TRUE(known) << "case " << p.c->op << " names an unknown slot " << slot;
    if (!implemented) GTEST_SKIP() << "not supported: " << slot << " on " << p.target.name();
  }
  p.c->run(p.target);
}

INSTANTIATE_TEST_SUITE_P(Registry, BackendOps, ::testing::ValuesIn(all_params()),
                         [](const ::testing::TestParamInfo<Param>& i) {
                           return i.param.target.name() + "_" + i.param.c->op;
                         });

// Every op slot of Ops has a case (a new op must come with its case).
TEST(BackendOps, EveryOpHasACase) {
  for_each_op(Ops{}, [&](const char* name, bool) {
    bool covered = false;
    for (const Case& c : cases())
      for (const char* s : c.slots) covered = covered || std::string_view(s) == name;
    EXPECT_TRUE(covered) << "no case in test_backend_ops.cpp calls " << name;
  });
}

}  // namespace
