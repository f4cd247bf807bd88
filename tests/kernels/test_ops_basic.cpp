// Tests for the basic CPU kernels (matmul, embedding, layernorm, rmsnorm, gelu, swiglu, residual,
// rope). For every op:
//   * fp32 forward vs a plain-loop double reference;
//   * fp32 backward vs the plain-loop double analytic backward, with gradient buffers pre-filled
//     with nonzero values to check the += / = conventions of ops.h;
//   * the double analytic backward vs central finite differences of the double forward;
//   * two identical calls give bit-identical results (at sizes large enough to take the OpenMP paths).
// Sizes include 1, 3, 31, 33, 67 so that vector tails and thread splits are exercised.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "config/rope_scaling.h"
#include "gradcheck_basic.h"
#include "kernels/cpu/ops.h"
#include "reference_ops.h"

using namespace lathe;
using namespace lathe::test;
using lathe::cpu::matmul_backward;
using lathe::cpu::matmul_forward;

namespace {

const int64_t kOdd[] = {1, 3, 31, 33, 67};
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

std::string shape_str(std::initializer_list<int64_t> dims) {
  std::string s = "[";
  for (int64_t d : dims) s += std::to_string(d) + ",";
  s.back() = ']';
  return s;
}

VecD add(const VecF& a, const VecD& b) {
  VecD r(b.size());
  for (size_t i = 0; i < b.size(); ++i) r[i] = a[i] + b[i];
  return r;
}

// Tolerance scaled to the magnitude of the expected values.
double atol_for(const VecD& want, double rel = 1e-5) { return rel * (1.0 + max_abs(want)); }

}  // namespace

// ============================================ matmul ============================================

struct MMShape {
  int64_t M, K, N;
};
const MMShape kMMShapes[] = {{1, 1, 1},    {1, 3, 31},  {3, 33, 67},  {33, 67, 1},
                             {67, 31, 33}, {31, 67, 3}, {67, 67, 67}, {3, 1, 33}};

TEST(Matmul, ForwardBackwardVsReferenceAndFD) {
  for (const auto& s : kMMShapes) {
    for (int with_bias = 0; with_bias < 2; ++with_bias) {
      const int64_t M = s.M, K = s.K, N = s.N;
      const std::string tag = "matmul " + shape_str({M, K, N}) + (with_bias ? " bias" : " nobias");
      Rng rng(1000 + M * 7 + K * 13 + N * 17 + with_bias);
      VecF x = randn(M * K, rng), w = randn(N * K, rng), b = randn(N, rng), g = randn(M * N, rng);
      VecD xd = to_double(x), wd = to_double(w), bd = to_double(b), gd = to_double(g);
      const float* bp = with_bias ? b.data() : nullptr;
      const VecD* bdp = with_bias ? &bd : nullptr;

      VecD ref;
      ref_matmul_fwd(ref, xd, wd, bdp, M, K, N);
      // accumulate=false overwrites: NaN pre-fill must vanish.
      VecF out(M * N, kNaN);
      matmul_forward(out.data(), x.data(), w.data(), bp, M, K, N);
      expect_close(out, ref, atol_for(ref), 1e-5, tag + " forward");
      // accumulate=true adds.
      VecF acc = randn(M * N, rng);
      VecD want_acc = add(acc, ref);
      matmul_forward(acc.data(), x.data(), w.data(), bp, M, K, N, true);
      expect_close(acc, want_acc, atol_for(want_acc), 1e-5, tag + " forward accumulate");

      VecD rdx, rdw, rdb;
      ref_matmul_bwd(rdx, rdw, rdb, gd, xd, wd, M, K, N);
      // dinp overwritten (NaN pre-fill), dweight/dbias accumulate onto random pre-fill.
      VecF dx(M * K, kNaN), dw = randn(N * K, rng), db = randn(N, rng);
      VecD want_dw = add(dw, rdw), want_db = add(db, rdb);
      matmul_backward(dx.data(), dw.data(), with_bias ? db.data() : nullptr, g.data(), x.data(), w.data(), M, K, N);
      expect_close(dx, rdx, atol_for(rdx), 1e-5, tag + " dinp");
      expect_close(dw, want_dw, atol_for(want_dw), 1e-5, tag + " dweight");
      if (with_bias) expect_close(db, want_db, atol_for(want_db), 1e-5, tag + " dbias");
      // accumulate_dinp=true adds; null dweight/dbias are skipped.
      VecF dx2 = randn(M * K, rng);
      VecD want_dx2 = add(dx2, rdx);
      matmul_backward(dx2.data(), nullptr, nullptr, g.data(), x.data(), w.data(), M, K, N, true);
      expect_close(dx2, want_dx2, atol_for(want_dx2), 1e-5, tag + " dinp accumulate");
      // dinp == nullptr: only parameter gradients.
      VecF dw3(N * K, 0.0f), db3(N, 0.0f);
      matmul_backward(nullptr, dw3.data(), db3.data(), g.data(), x.data(), w.data(), M, K, N);
      expect_close(dw3, rdw, atol_for(rdw), 1e-5, tag + " dweight only");
      expect_close(db3, rdb, atol_for(rdb), 1e-5, tag + " dbias only");

      // Analytic double backward vs finite differences of the double forward.
      auto loss = [&] {
        VecD o;
        ref_matmul_fwd(o, xd, wd, bdp, M, K, N);
        return dot(o, gd);
      };
      check_fd(loss, xd, rdx, rng, tag + " FD dinp");
      check_fd(loss, wd, rdw, rng, tag + " FD dweight");
      if (with_bias) check_fd(loss, bd, rdb, rng, tag + " FD dbias");
    }
  }
}

TEST(Matmul, LargeParallelDeterministic) {
  const int64_t M = 131, K = 257, N = 263;
  Rng rng(7);
  VecF x = randn(M * K, rng), w = randn(N * K, rng), b = randn(N, rng), g = randn(M * N, rng);
  VecD ref, rdx, rdw, rdb;
  ref_matmul_fwd(ref, to_double(x), to_double(w), nullptr, M, K, N);
  VecD bd = to_double(b);
  ref_matmul_fwd(ref, to_double(x), to_double(w), &bd, M, K, N);
  ref_matmul_bwd(rdx, rdw, rdb, to_double(g), to_double(x), to_double(w), M, K, N);
  VecF o1(M * N), o2(M * N);
  matmul_forward(o1.data(), x.data(), w.data(), b.data(), M, K, N);
  matmul_forward(o2.data(), x.data(), w.data(), b.data(), M, K, N);
  expect_close(o1, ref, atol_for(ref), 1e-5, "large forward");
  EXPECT_TRUE(bit_equal(o1, o2));
  VecF pre_w = randn(N * K, rng), pre_b = randn(N, rng);
  VecF dx1(M * K), dw1 = pre_w, db1 = pre_b, dx2(M * K), dw2 = pre_w, db2 = pre_b;
  matmul_backward(dx1.data(), dw1.data(), db1.data(), g.data(), x.data(), w.data(), M, K, N);
  matmul_backward(dx2.data(), dw2.data(), db2.data(), g.data(), x.data(), w.data(), M, K, N);
  expect_close(dx1, rdx, atol_for(rdx), 1e-5, "large dinp");
  VecD want_dw = add(pre_w, rdw), want_db = add(pre_b, rdb);
  expect_close(dw1, want_dw, atol_for(want_dw), 1e-5, "large dweight");
  expect_close(db1, want_db, atol_for(want_db), 1e-5, "large dbias");
  EXPECT_TRUE(bit_equal(dx1, dx2));
  EXPECT_TRUE(bit_equal(dw1, dw2));
  EXPECT_TRUE(bit_equal(db1, db2));
}

TEST(Matmul, SingleRowLargeN) {
  // M = 1 takes the sgemv path (generation); large N exercises its threading.
  const int64_t M = 1, K = 257, N = 5003;
  Rng rng(8);
  VecF x = randn(M * K, rng), w = randn(N * K, rng), b = randn(N, rng);
  VecD bd = to_double(b), ref;
  ref_matmul_fwd(ref, to_double(x), to_double(w), &bd, M, K, N);
  VecF o1(M * N, kNaN), o2(M * N, kNaN);
  matmul_forward(o1.data(), x.data(), w.data(), b.data(), M, K, N);
  matmul_forward(o2.data(), x.data(), w.data(), b.data(), M, K, N);
  expect_close(o1, ref, atol_for(ref), 1e-5, "M=1 forward bias");
  EXPECT_TRUE(bit_equal(o1, o2));
  ref_matmul_fwd(ref, to_double(x), to_double(w), nullptr, M, K, N);
  VecF o3(M * N, kNaN);
  matmul_forward(o3.data(), x.data(), w.data(), nullptr, M, K, N);
  expect_close(o3, ref, atol_for(ref), 1e-5, "M=1 forward nobias");
  VecF acc = randn(M * N, rng);
  VecD want = add(acc, ref);
  matmul_forward(acc.data(), x.data(), w.data(), nullptr, M, K, N, true);
  expect_close(acc, want, atol_for(want), 1e-5, "M=1 forward accumulate");
}

// ========================================== embedding ==========================================

void run_embedding_case(int64_t B, int64_t T, int64_t C, int64_t V, bool with_wpe, bool fd, uint64_t seed) {
  const std::string tag = "embedding " + shape_str({B, T, C, V}) + (with_wpe ? " wpe" : " nowpe");
  Rng rng(seed);
  std::vector<int32_t> tok(B * T);
  for (auto& t : tok) t = static_cast<int32_t>(rng.below(V));  // V small: repeated tokens
  VecF wte = randn(V * C, rng), wpe = randn(T * C, rng), g = randn(B * T * C, rng);
  VecD wted = to_double(wte), wped = to_double(wpe), gd = to_double(g);
  VecD ref;
  ref_embedding_fwd(ref, tok, wted, with_wpe ? &wped : nullptr, B, T, C);
  VecF out(B * T * C, kNaN);
  cpu::embedding_forward(out.data(), tok.data(), wte.data(), with_wpe ? wpe.data() : nullptr, B, T, C);
  expect_close(out, ref, 1e-6, 1e-6, tag + " forward");

  VecD rdwte, rdwpe;
  ref_embedding_bwd(rdwte, rdwpe, gd, tok, V, B, T, C);
  VecF dwte = randn(V * C, rng), dwpe = randn(T * C, rng);
  VecD want_wte = add(dwte, rdwte), want_wpe = add(dwpe, rdwpe);
  VecF dwte2 = dwte, dwpe2 = dwpe;
  cpu::embedding_backward(dwte.data(), with_wpe ? dwpe.data() : nullptr, g.data(), tok.data(), B, T, C);
  expect_close(dwte, want_wte, atol_for(want_wte), 1e-5, tag + " dwte");
  if (with_wpe) expect_close(dwpe, want_wpe, atol_for(want_wpe), 1e-5, tag + " dwpe");
  cpu::embedding_backward(dwte2.data(), with_wpe ? dwpe2.data() : nullptr, g.data(), tok.data(), B, T, C);
  EXPECT_TRUE(bit_equal(dwte, dwte2)) << tag;
  EXPECT_TRUE(bit_equal(dwpe, dwpe2)) << tag;

  if (fd) {
    auto loss = [&] {
      VecD o;
      ref_embedding_fwd(o, tok, wted, with_wpe ? &wped : nullptr, B, T, C);
      return dot(o, gd);
    };
    check_fd(loss, wted, rdwte, rng, tag + " FD dwte");
    if (with_wpe) check_fd(loss, wped, rdwpe, rng, tag + " FD dwpe");
  }
}

TEST(Embedding, ForwardBackwardOddShapes) {
  for (int64_t B : {1, 3})
    for (int64_t T : kOdd)
      for (int64_t C : kOdd)
        for (int with_wpe = 0; with_wpe < 2; ++with_wpe)
          run_embedding_case(B, T, C, 5, with_wpe, true, 2000 + B * 100 + T * 10 + C + with_wpe);
}

TEST(Embedding, LargeParallelDeterministic) {
  run_embedding_case(4, 67, 131, 50, true, false, 11);
  run_embedding_case(3, 129, 67, 1000, true, false, 12);
}

// ========================================== layernorm ==========================================

void run_layernorm_case(int64_t N, int64_t C, bool with_bias, bool fd, uint64_t seed) {
  const std::string tag = "layernorm " + shape_str({N, C}) + (with_bias ? " bias" : " nobias");
  const float eps = 1e-5f;
  Rng rng(seed);
  VecF x = randn(N * C, rng, 2.0f), w = randn(C, rng), b = randn(C, rng), g = randn(N * C, rng);
  for (auto& v : x) v += 0.5f;  // nonzero mean
  VecD xd = to_double(x), wd = to_double(w), bd = to_double(b), gd = to_double(g);
  VecD ref, rmean, rrstd;
  ref_layernorm_fwd(ref, rmean, rrstd, xd, wd, with_bias ? &bd : nullptr, N, C, eps);
  VecF out(N * C, kNaN), mean(N, kNaN), rstd(N, kNaN);
  cpu::layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), with_bias ? b.data() : nullptr, N, C,
                         eps);
  expect_close(out, ref, atol_for(ref), 1e-5, tag + " forward out");
  expect_close(mean, rmean, atol_for(rmean), 1e-5, tag + " forward mean");
  expect_close(rstd, rrstd, 1e-6, 2e-5, tag + " forward rstd");

  VecD rdx, rdw, rdb;
  ref_layernorm_bwd(rdx, rdw, rdb, gd, xd, wd, N, C, eps);
  VecF scratch(cpu::layernorm_scratch_floats(C), kNaN);
  VecF dx = randn(N * C, rng), dw = randn(C, rng), db = randn(C, rng);
  VecF dx2 = dx, dw2 = dw, db2 = db;
  VecD want_dx = add(dx, rdx), want_dw = add(dw, rdw), want_db = add(db, rdb);
  // The kernel uses the saved fp32 mean/rstd, as the model will.
  cpu::layernorm_backward(dx.data(), dw.data(), with_bias ? db.data() : nullptr, g.data(), x.data(), w.data(),
                          mean.data(), rstd.data(), N, C, scratch.data());
  expect_close(dx, want_dx, atol_for(want_dx, 3e-5), 3e-5, tag + " dinp");
  expect_close(dw, want_dw, atol_for(want_dw), 1e-5, tag + " dweight");
  if (with_bias) expect_close(db, want_db, atol_for(want_db), 1e-5, tag + " dbias");
  cpu::layernorm_backward(dx2.data(), dw2.data(), with_bias ? db2.data() : nullptr, g.data(), x.data(), w.data(),
                          mean.data(), rstd.data(), N, C, scratch.data());
  EXPECT_TRUE(bit_equal(dx, dx2) && bit_equal(dw, dw2) && bit_equal(db, db2)) << tag << " determinism";

  if (fd) {
    auto loss = [&] {
      VecD o, m, r;
      ref_layernorm_fwd(o, m, r, xd, wd, with_bias ? &bd : nullptr, N, C, eps);
      return dot(o, gd);
    };
    check_fd(loss, xd, rdx, rng, tag + " FD dinp");
    check_fd(loss, wd, rdw, rng, tag + " FD dweight");
    if (with_bias) check_fd(loss, bd, rdb, rng, tag + " FD dbias");
  }
}

TEST(LayerNorm, ForwardBackwardOddShapes) {
  for (int64_t N : kOdd)
    for (int64_t C : kOdd)
      for (int with_bias = 0; with_bias < 2; ++with_bias)
        run_layernorm_case(N, C, with_bias, true, 3000 + N * 100 + C + with_bias);
}

TEST(LayerNorm, LargeParallelDeterministic) {
  run_layernorm_case(257, 131, true, false, 31);
  run_layernorm_case(67, 768, true, false, 32);
}

// =========================================== rmsnorm ===========================================

void run_rmsnorm_case(int64_t N, int64_t C, bool fd, uint64_t seed) {
  const std::string tag = "rmsnorm " + shape_str({N, C});
  const float eps = 1e-6f;
  Rng rng(seed);
  VecF x = randn(N * C, rng, 2.0f), w = randn(C, rng), g = randn(N * C, rng);
  VecD xd = to_double(x), wd = to_double(w), gd = to_double(g);
  VecD ref, rrstd;
  ref_rmsnorm_fwd(ref, rrstd, xd, wd, N, C, eps);
  VecF out(N * C, kNaN), rstd(N, kNaN);
  cpu::rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), N, C, eps);
  expect_close(out, ref, atol_for(ref), 1e-5, tag + " forward out");
  expect_close(rstd, rrstd, 1e-6, 2e-5, tag + " forward rstd");

  VecD rdx, rdw;
  ref_rmsnorm_bwd(rdx, rdw, gd, xd, wd, N, C, eps);
  VecF scratch(cpu::rmsnorm_scratch_floats(C), kNaN);
  VecF dx = randn(N * C, rng), dw = randn(C, rng);
  VecF dx2 = dx, dw2 = dw;
  VecD want_dx = add(dx, rdx), want_dw = add(dw, rdw);
  cpu::rmsnorm_backward(dx.data(), dw.data(), g.data(), x.data(), w.data(), rstd.data(), N, C, scratch.data());
  expect_close(dx, want_dx, atol_for(want_dx, 3e-5), 3e-5, tag + " dinp");
  expect_close(dw, want_dw, atol_for(want_dw), 1e-5, tag + " dweight");
  cpu::rmsnorm_backward(dx2.data(), dw2.data(), g.data(), x.data(), w.data(), rstd.data(), N, C, scratch.data());
  EXPECT_TRUE(bit_equal(dx, dx2) && bit_equal(dw, dw2)) << tag << " determinism";

  if (fd) {
    auto loss = [&] {
      VecD o, r;
      ref_rmsnorm_fwd(o, r, xd, wd, N, C, eps);
      return dot(o, gd);
    };
    check_fd(loss, xd, rdx, rng, tag + " FD dinp");
    check_fd(loss, wd, rdw, rng, tag + " FD dweight");
  }
}

TEST(RMSNorm, ForwardBackwardOddShapes) {
  for (int64_t N : kOdd)
    for (int64_t C : kOdd) run_rmsnorm_case(N, C, true, 4000 + N * 100 + C);
}

TEST(RMSNorm, LargeParallelDeterministic) {
  run_rmsnorm_case(257, 131, false, 41);
  run_rmsnorm_case(67, 768, false, 42);
}

// ============================================ GELU ============================================

void run_gelu_case(int64_t n, uint64_t seed) {
  const std::string tag = "gelu n=" + std::to_string(n);
  Rng rng(seed);
  VecF x = randn(n, rng, 3.0f), g = randn(n, rng);
  // Include the saturated tails and zero.
  const float special[] = {0.0f, -12.0f, 12.0f, -5.0f, 5.0f, -0.3f, 1e-4f, -60.0f, 60.0f};
  for (size_t i = 0; i < std::size(special) && i < x.size(); ++i) x[i] = special[i];
  VecD ref(n), rdx(n);
  for (int64_t i = 0; i < n; ++i) {
    ref[i] = ref_gelu(x[i]);
    rdx[i] = ref_gelu_grad(x[i]) * g[i];
  }
  VecF out(n, kNaN);
  cpu::gelu_forward(out.data(), x.data(), n);
  expect_close(out, ref, 1e-6, 2e-6, tag + " forward");
  VecF dx(n, kNaN);
  cpu::gelu_backward(dx.data(), x.data(), g.data(), n);
  expect_close(dx, rdx, 2e-6, 1e-5, tag + " backward");
  // dinp may alias dout.
  VecF inplace = g;
  cpu::gelu_backward(inplace.data(), x.data(), inplace.data(), n);
  EXPECT_TRUE(bit_equal(inplace, dx)) << tag << " aliased backward";
  VecF out2(n), dx2(n);
  cpu::gelu_forward(out2.data(), x.data(), n);
  cpu::gelu_backward(dx2.data(), x.data(), g.data(), n);
  EXPECT_TRUE(bit_equal(out, out2) && bit_equal(dx, dx2)) << tag << " determinism";

  // Analytic derivative vs finite differences of the double forward (probe a subset).
  VecD xd = to_double(x), gd = to_double(g);
  auto loss = [&] {
    double s = 0.0;
    for (int64_t i = 0; i < n; ++i) s += ref_gelu(xd[i]) * gd[i];
    return s;
  };
  check_fd(loss, xd, rdx, rng, tag + " FD");
}

TEST(Gelu, ForwardBackward) {
  for (int64_t n : kOdd) run_gelu_case(n, 5000 + n);
  run_gelu_case(100003, 51);  // parallel path
}

TEST(Gelu, NaNPropagates) {
  // The trainer detects divergence from NaN losses; the activation must not swallow them.
  VecF x = {kNaN, 1.0f, -kNaN}, y(3), dx(3), g = {1.0f, kNaN, 1.0f};
  cpu::gelu_forward(y.data(), x.data(), 3);
  cpu::gelu_backward(dx.data(), x.data(), g.data(), 3);
  EXPECT_TRUE(std::isnan(y[0]) && std::isnan(y[2]) && !std::isnan(y[1]));
  EXPECT_TRUE(std::isnan(dx[0]) && std::isnan(dx[1]) && std::isnan(dx[2]));
  VecF sx = {kNaN, 2.0f, 0.5f, kNaN}, so(2);  // N=2, F=1: NaN gate in row 0, NaN up in row 1
  cpu::swiglu_forward(so.data(), sx.data(), 2, 1);
  EXPECT_TRUE(std::isnan(so[0]) && std::isnan(so[1]));
}

// ============================================ SwiGLU ============================================

void run_swiglu_case(int64_t N, int64_t F, bool fd, uint64_t seed) {
  const std::string tag = "swiglu " + shape_str({N, F});
  Rng rng(seed);
  VecF x = randn(N * 2 * F, rng, 3.0f), g = randn(N * F, rng);
  if (!x.empty()) {
    x[0] = -40.0f;
    x[x.size() / 2] = 40.0f;
  }
  VecD xd = to_double(x), gd = to_double(g);
  VecD ref, rdx;
  ref_swiglu_fwd(ref, xd, N, F);
  ref_swiglu_bwd(rdx, xd, gd, N, F);
  VecF out(N * F, kNaN), dx(N * 2 * F, kNaN);
  cpu::swiglu_forward(out.data(), x.data(), N, F);
  expect_close(out, ref, atol_for(ref, 2e-6), 2e-6, tag + " forward");
  cpu::swiglu_backward(dx.data(), x.data(), g.data(), N, F);
  expect_close(dx, rdx, atol_for(rdx, 2e-6), 1e-5, tag + " backward");
  VecF out2(N * F), dx2(N * 2 * F);
  cpu::swiglu_forward(out2.data(), x.data(), N, F);
  cpu::swiglu_backward(dx2.data(), x.data(), g.data(), N, F);
  EXPECT_TRUE(bit_equal(out, out2) && bit_equal(dx, dx2)) << tag << " determinism";
  if (fd) {
    auto loss = [&] {
      VecD o;
      ref_swiglu_fwd(o, xd, N, F);
      return dot(o, gd);
    };
    check_fd(loss, xd, rdx, rng, tag + " FD");
  }
}

TEST(SwiGLU, ForwardBackward) {
  for (int64_t N : kOdd)
    for (int64_t F : kOdd) run_swiglu_case(N, F, true, 6000 + N * 100 + F);
  run_swiglu_case(131, 257, false, 61);  // parallel path
}

// =========================================== residual ===========================================

TEST(Residual, ForwardAndAliasing) {
  for (int64_t n : {int64_t{1}, int64_t{3}, int64_t{31}, int64_t{33}, int64_t{67}, int64_t{100003}}) {
    Rng rng(7000 + n);
    VecF a = randn(n, rng), b = randn(n, rng);
    VecD ref(n);
    for (int64_t i = 0; i < n; ++i) ref[i] = static_cast<double>(a[i]) + b[i];
    VecF out(n, kNaN);
    cpu::residual_forward(out.data(), a.data(), b.data(), n);
    expect_close(out, ref, 1e-6, 1e-7, "residual n=" + std::to_string(n));
    VecF a2 = a, b2 = b;
    cpu::residual_forward(a2.data(), a2.data(), b.data(), n);  // out aliases a
    cpu::residual_forward(b2.data(), a.data(), b2.data(), n);  // out aliases b
    EXPECT_TRUE(bit_equal(a2, out) && bit_equal(b2, out)) << "residual aliasing n=" << n;
  }
}

// ============================================= RoPE =============================================

TEST(Rope, TablesMatchDoubleAngles) {
  for (double theta : {10000.0, 500000.0})
    for (int64_t D : {2, 6, 34, 64, 66, 128})
      for (int64_t T : {1, 3, 67, 2048}) {
        const int64_t half = D / 2;
        VecF cs(T * half, kNaN), sn(T * half, kNaN);
        cpu::rope_tables(cs.data(), sn.data(), T, D / 2, rope_default_inv_freq(D, theta).data(), 1.0f);
        for (int64_t t = 0; t < T; ++t)
          for (int64_t i = 0; i < half; ++i) {
            const double angle = t * std::pow(theta, -2.0 * i / D);
            // The kernel reproduces torch's fp32 angle: relative error from the fp32 exponent
            // (~ln(theta) * 2^-24), power, reciprocal and product roundings.
            const double tol = 1e-6 + angle * (std::log(theta) * 6e-8 + 3e-7);
            ASSERT_NEAR(cs[t * half + i], std::cos(angle), tol) << "cos t=" << t << " i=" << i << " D=" << D;
            ASSERT_NEAR(sn[t * half + i], std::sin(angle), tol) << "sin t=" << t << " i=" << i << " D=" << D;
          }
      }
}

void run_rope_case(int64_t B, int64_t T, int64_t H, int64_t D, bool fd, uint64_t seed) {
  const std::string tag = "rope " + shape_str({B, T, H, D});
  // x rows hold extra columns before (offset) and after the rotated heads, which must not change:
  // this mimics passing the k section of a fused qkv row.
  const int64_t offset = 5, stride = offset + H * D + 7;
  const int64_t half = D / 2;
  Rng rng(seed);
  VecF cs(T * half), sn(T * half);
  cpu::rope_tables(cs.data(), sn.data(), T, D / 2, rope_default_inv_freq(D, 10000.0).data(), 1.0f);
  VecD csd = to_double(cs), snd = to_double(sn);
  VecF x = randn(B * T * stride, rng), g = randn(B * T * stride, rng);
  VecD xd = to_double(x), gd = to_double(g);
  VecD ref, rdx;
  ref_rope_fwd(ref, xd, csd, snd, B, T, H, D, stride, offset);
  ref_rope_bwd(rdx, gd, csd, snd, B, T, H, D, stride, offset);
  VecF y = x;
  cpu::rope_forward(y.data() + offset, cs.data(), sn.data(), B, T, H, D, D, stride);
  expect_close(y, ref, 1e-6, 1e-6, tag + " forward");
  VecF dx = g;
  cpu::rope_backward(dx.data() + offset, cs.data(), sn.data(), B, T, H, D, D, stride);
  expect_close(dx, rdx, 1e-6, 1e-6, tag + " backward");
  // Backward is the inverse rotation: backward(forward(x)) == x up to rounding.
  VecF rt = y;
  cpu::rope_backward(rt.data() + offset, cs.data(), sn.data(), B, T, H, D, D, stride);
  expect_close(rt, xd, 1e-5, 1e-5, tag + " round trip");
  VecF y2 = x;
  cpu::rope_forward(y2.data() + offset, cs.data(), sn.data(), B, T, H, D, D, stride);
  EXPECT_TRUE(bit_equal(y, y2)) << tag << " determinism";
  if (fd) {
    auto loss = [&] {
      VecD o;
      ref_rope_fwd(o, xd, csd, snd, B, T, H, D, stride, offset);
      return dot(o, gd);
    };
    check_fd(loss, xd, rdx, rng, tag + " FD");
  }
}

TEST(Rope, ForwardBackwardOddShapes) {
  for (int64_t B : {1, 3})
    for (int64_t T : kOdd)
      for (int64_t H : {1, 3})
        for (int64_t D : {2, 34, 66}) run_rope_case(B, T, H, D, true, 8000 + B * 1000 + T * 10 + H + D);
}

// RoPE scaling's attention factor multiplies the fp32 cos/sin (transformers: cos * attention_scaling).
TEST(Rope, TablesApplyAttentionFactor) {
  const int64_t T = 37, half = 5;
  const std::vector<float> inv = {1.0f, 0.3f, 0.07f, 0.011f, 0.0009f};
  VecF c1(T * half), s1(T * half), c2(T * half), s2(T * half);
  cpu::rope_tables(c1.data(), s1.data(), T, half, inv.data(), 1.0f);
  cpu::rope_tables(c2.data(), s2.data(), T, half, inv.data(), 1.25f);
  for (int64_t k = 0; k < T * half; ++k) {
    ASSERT_EQ(c2[k], c1[k] * 1.25f) << k;
    ASSERT_EQ(s2[k], s1[k] * 1.25f) << k;
  }
}

TEST(Rope, LargeParallelDeterministic) { run_rope_case(2, 131, 12, 64, false, 81); }
