// Tests for the bf16 GEMMs and fp32 <-> bf16 conversion (src/kernels/cpu/ops_bf16.h).
//
// Tolerances (derived, not tuned):
//  * Against a double reference computed on the SAME bf16-rounded inputs: a product of two bf16
//    values is exact in fp32 (8 x 8 significant bits), so the only error is fp32 accumulation.
//    Summing n terms in fp32 in any order (sequential, blocked or tree) errs by at most
//    gamma_n = n*u/(1-n*u) times the sum of |terms|, u = 2^-24. Here n = K products + bias + the
//    accumulated old value <= 132, so gamma_n <= 7.9e-6; the test uses 1e-5 * sum|terms| and
//    checks that this covers gamma_n for every size it runs. A bf16 output is rounded once more:
//    + 2^-8 * |result| (bf16 keeps 8 significant bits: for 2^e <= |v| < 2^(e+1) an ulp is
//    2^(e-7), round to nearest errs by at most half of it, 2^(e-8) <= 2^-8 * |v|).
//  * Against the fp32 path (cpu::matmul_* on the unrounded fp32 inputs): each input rounded to
//    bf16 errs by at most 2^-8 relative, so a product by at most 2*2^-8 + 2^-16 relative; with the
//    fp32 accumulation of both paths: (2^-7 + 2^-16 + 2e-5) * sum|x*w|.
//  * Conversion: exact bit patterns derived by hand (comments give the derivation).
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "core/rng.h"
#include "kernels/cpu/isa.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/ops_bf16.h"

using namespace lathe;

namespace {

const int64_t kSizes[] = {1, 3, 31, 33, 67, 130};
constexpr double kAccumRel = 1e-5;                         // fp32 accumulation, see above
constexpr double kBf16Rel = 1.0 / 256.0;                   // 2^-8: one bf16 rounding
constexpr double kInputRel = 2.0 / 256.0 + 1.0 / 65536.0;  // product of two bf16-rounded inputs

uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Random fp32 values (with a spread of magnitudes) and their bf16 rounding.
struct Mat {
  std::vector<float> f;     // original fp32
  std::vector<uint16_t> h;  // bf16 of f (scalar converter of core/dtype.h)
  std::vector<double> d;    // the bf16 values as double
  Mat(int64_t n, Rng& rng, float scale) : f(n), h(n), d(n) {
    for (int64_t i = 0; i < n; ++i) {
      f[i] = rng.normal() * scale * (rng.uniform() < 0.1f ? 8.0f : 1.0f);
      h[i] = fp32_to_bf16(f[i]);
      d[i] = bf16_to_fp32(h[i]);
    }
  }
};

std::string shape(int64_t M, int64_t K, int64_t N) {
  return "M=" + std::to_string(M) + " K=" + std::to_string(K) + " N=" + std::to_string(N);
}

void gamma_covers(int64_t n_terms) {
  const double u = std::ldexp(1.0, -24);
  const double gamma = n_terms * u / (1.0 - n_terms * u);
  ASSERT_LE(gamma, kAccumRel) << "tolerance 1e-5 does not cover fp32 accumulation of " << n_terms << " terms";
}

// Checks got[i] against want[i] within rel * mag[i] (+ out_rel * |want[i]|).
void expect_close(const float* got, const std::vector<double>& want, const std::vector<double>& mag, double rel,
                  double out_rel, const std::string& what) {
  int bad = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double tol = rel * mag[i] + out_rel * std::fabs(want[i]);
    if (!(std::fabs(got[i] - want[i]) <= tol)) {
      if (++bad <= 3)
        ADD_FAILURE() << what << " [" << i << "]: got " << got[i] << " want " << want[i] << " tol " << tol;
    }
  }
  EXPECT_EQ(bad, 0) << what;
}

std::vector<float> to_f32(const std::vector<uint16_t>& h) {
  std::vector<float> f(h.size());
  for (size_t i = 0; i < h.size(); ++i) f[i] = bf16_to_fp32(h[i]);
  return f;
}

// ======================================= forward =======================================

// out = x @ w^T + b (+ old): reference value and sum of |terms| per element.
void ref_forward(std::vector<double>& out, std::vector<double>& mag, const std::vector<double>& x,
                 const std::vector<double>& w, const std::vector<double>* b, const std::vector<float>* old, int64_t M,
                 int64_t K, int64_t N) {
  out.assign(M * N, 0.0);
  mag.assign(M * N, 0.0);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      double s = 0, a = 0;
      for (int64_t k = 0; k < K; ++k) {
        const double t = x[i * K + k] * w[j * K + k];
        s += t;
        a += std::fabs(t);
      }
      if (b) s += (*b)[j], a += std::fabs((*b)[j]);
      if (old) s += (*old)[i * N + j], a += std::fabs((*old)[i * N + j]);
      out[i * N + j] = s;
      mag[i * N + j] = a;
    }
}

// The GEMMs work on every x86-64 CPU, with or without oneDNN (the fp32 path needs none): the
// macro stays for the tests' structure and skips nothing.
#define REQUIRE_DNNL()                                                                  \
  do {                                                                                  \
    if (!cpu::bf16_matmul_available()) GTEST_SKIP() << cpu::bf16_matmul_backend_info(); \
  } while (0)

// Whatever the path, a GEMM gives its result (2x2 of exact bf16 values: 1*1 + 2*3 = 7 and so on).
TEST(MatmulBf16, Available) {
  std::printf("%s\n", cpu::bf16_matmul_backend_info().c_str());
  ASSERT_TRUE(cpu::bf16_matmul_available());
  const std::vector<uint16_t> x{0x3f80, 0x4000, 0x4040, 0x4080};  // [[1, 2], [3, 4]]
  const std::vector<uint16_t> w{0x3f80, 0x4040, 0x4000, 0x4080};  // [[1, 3], [2, 4]] (weight[N, K])
  std::vector<float> out(4);
  cpu::matmul_forward_bf16(out.data(), x.data(), w.data(), nullptr, 2, 2, 2);
  EXPECT_EQ(out, (std::vector<float>{7, 10, 15, 22}));
}

TEST(MatmulBf16, ForwardOddSizes) {
  REQUIRE_DNNL();
  Rng rng(1);
  int64_t shape_index = 0;
  for (int64_t M : kSizes)
    for (int64_t K : kSizes)
      for (int64_t N : kSizes) {
        gamma_covers(K + 2);
        Mat x(M * K, rng, 1.0f), w(N * K, rng, 0.5f), b(N, rng, 1.0f);
        // Each shape runs one of the 4 variants in turn (every variant meets every size; a full
        // cross product would create 4x the oneDNN primitives, ~5 ms each).
        {
          const int variant = static_cast<int>(shape_index++ % 4);
          const bool use_bias = variant & 1, accumulate = variant & 2;
          const std::string what = shape(M, K, N) + (use_bias ? " bias" : "") + (accumulate ? " accumulate" : "");
          std::vector<float> old(M * N);
          for (auto& v : old) v = rng.normal();
          std::vector<float> out = old;
          cpu::matmul_forward_bf16(out.data(), x.h.data(), w.h.data(), use_bias ? b.f.data() : nullptr, M, K, N,
                                   accumulate);
          std::vector<double> bd(b.f.begin(), b.f.end()), want, mag;
          ref_forward(want, mag, x.d, w.d, use_bias ? &bd : nullptr, accumulate ? &old : nullptr, M, K, N);
          expect_close(out.data(), want, mag, kAccumRel, 0.0, "fwd vs double " + what);

          // Against the fp32 path on the unrounded inputs.
          std::vector<float> out32 = old;
          cpu::matmul_forward(out32.data(), x.f.data(), w.f.data(), use_bias ? b.f.data() : nullptr, M, K, N,
                              accumulate);
          std::vector<double> want32(out32.begin(), out32.end()), mag32;
          std::vector<double> xf(x.f.begin(), x.f.end()), wf(w.f.begin(), w.f.end()), dummy;
          ref_forward(dummy, mag32, xf, wf, nullptr, nullptr, M, K, N);
          std::vector<double> full_mag;
          ref_forward(dummy, full_mag, xf, wf, use_bias ? &bd : nullptr, accumulate ? &old : nullptr, M, K, N);
          for (size_t i = 0; i < mag32.size(); ++i)
            mag32[i] = kInputRel * mag32[i] + 2 * kAccumRel * (1 + kInputRel) * full_mag[i];
          expect_close(out.data(), want32, mag32, 1.0, 0.0, "fwd vs fp32 path " + what);
          if (HasFailure()) return;
        }
        // bf16 out: the fp32 result rounded once.
        std::vector<uint16_t> outh(M * N, 0xffff);  // NaN garbage must be overwritten
        cpu::matmul_forward_bf16_out_bf16(outh.data(), x.h.data(), w.h.data(), b.f.data(), M, K, N);
        std::vector<double> bd(b.f.begin(), b.f.end()), want, mag;
        ref_forward(want, mag, x.d, w.d, &bd, nullptr, M, K, N);
        expect_close(to_f32(outh).data(), want, mag, kAccumRel, kBf16Rel, "fwd bf16 out " + shape(M, K, N));
        if (HasFailure()) return;
      }
}

// ======================================= backward =======================================

TEST(MatmulBf16, BackwardOddSizes) {
  REQUIRE_DNNL();
  Rng rng(2);
  int64_t shape_index = 0;
  for (int64_t M : kSizes)
    for (int64_t K : kSizes)
      for (int64_t N : kSizes) {
        gamma_covers(std::max(M, N) + 1);
        Mat x(M * K, rng, 1.0f), w(N * K, rng, 0.5f), g(M * N, rng, 1.0f);
        // Reference: dx = g @ w, dw = g^T @ x, db = colsum g, each with sum |terms|.
        std::vector<double> dx(M * K), dxm(M * K), dw(N * K), dwm(N * K), db(N), dbm(N);
        for (int64_t i = 0; i < M; ++i)
          for (int64_t k = 0; k < K; ++k)
            for (int64_t j = 0; j < N; ++j) {
              const double t = g.d[i * N + j] * w.d[j * K + k];
              dx[i * K + k] += t, dxm[i * K + k] += std::fabs(t);
            }
        for (int64_t j = 0; j < N; ++j)
          for (int64_t k = 0; k < K; ++k)
            for (int64_t i = 0; i < M; ++i) {
              const double t = g.d[i * N + j] * x.d[i * K + k];
              dw[j * K + k] += t, dwm[j * K + k] += std::fabs(t);
            }
        for (int64_t j = 0; j < N; ++j)
          for (int64_t i = 0; i < M; ++i) db[j] += g.d[i * N + j], dbm[j] += std::fabs(g.d[i * N + j]);

        // One of the 16 variants per shape in turn, as in the forward test.
        const int variant = static_cast<int>(shape_index++ % 16);
        {
          const bool acc = variant & 1, has_dx = !(variant & 2), has_dw = !(variant & 4), has_db = !(variant & 8);
          const std::string what = shape(M, K, N) + (acc ? " accumulate_dinp" : "") + (has_dx ? "" : " dinp=null") +
                                   (has_dw ? "" : " dweight=null") + (has_db ? "" : " dbias=null");
          // Gradient buffers start nonzero: parameter grads must accumulate, dinp per flag.
          std::vector<float> dx0(M * K), dw0(N * K), db0(N);
          for (auto* v : {&dx0, &dw0, &db0})
            for (auto& e : *v) e = rng.normal();
          std::vector<float> gdx = dx0, gdw = dw0, gdb = db0;
          cpu::matmul_backward_bf16(has_dx ? gdx.data() : nullptr, has_dw ? gdw.data() : nullptr,
                                    has_db ? gdb.data() : nullptr, g.h.data(), x.h.data(), w.h.data(), M, K, N, acc);
          auto with_old = [](const std::vector<double>& r, const std::vector<double>& m, const std::vector<float>& old,
                             bool add, std::vector<double>& want, std::vector<double>& mag) {
            want = r, mag = m;
            if (add)
              for (size_t i = 0; i < r.size(); ++i) want[i] += old[i], mag[i] += std::fabs(old[i]);
          };
          std::vector<double> want, mag;
          if (has_dx) {
            with_old(dx, dxm, dx0, acc, want, mag);
            expect_close(gdx.data(), want, mag, kAccumRel, 0.0, "dinp " + what);
          } else {
            EXPECT_EQ(gdx, dx0) << what;
          }
          if (has_dw) {
            with_old(dw, dwm, dw0, true, want, mag);
            expect_close(gdw.data(), want, mag, kAccumRel, 0.0, "dweight " + what);
          } else {
            EXPECT_EQ(gdw, dw0) << what;
          }
          if (has_db) {
            with_old(db, dbm, db0, true, want, mag);
            expect_close(gdb.data(), want, mag, kAccumRel, 0.0, "dbias " + what);
          } else {
            EXPECT_EQ(gdb, db0) << what;
          }
          if (HasFailure()) return;
        }

        // Against the fp32 path on the unrounded inputs, all gradients starting from zero (dinp
        // with this shape's accumulate flag: the primitive made above is reused, and from zero
        // "+=" and "=" agree).
        std::vector<float> a_dx(M * K, 0.f), a_dw(N * K, 0.f), a_db(N, 0.f);
        std::vector<float> b_dx = a_dx, b_dw = a_dw, b_db = a_db;
        cpu::matmul_backward_bf16(a_dx.data(), a_dw.data(), a_db.data(), g.h.data(), x.h.data(), w.h.data(), M, K, N,
                                  variant & 1);
        cpu::matmul_backward(b_dx.data(), b_dw.data(), b_db.data(), g.f.data(), x.f.data(), w.f.data(), M, K, N);
        // |g*w| with the unrounded values bounds the bf16-rounded ones within 2^-7: use (1 + 2^-7) of it.
        std::vector<double> m(M * K, 0.0);
        for (int64_t i = 0; i < M; ++i)
          for (int64_t k = 0; k < K; ++k) {
            double s = 0;
            for (int64_t j = 0; j < N; ++j) s += std::fabs(double(g.f[i * N + j]) * w.f[j * K + k]);
            m[i * K + k] = (kInputRel + 2 * kAccumRel * (1 + kInputRel)) * s;
          }
        expect_close(a_dx.data(), std::vector<double>(b_dx.begin(), b_dx.end()), m, 1.0, 0.0,
                     "dinp vs fp32 path " + shape(M, K, N));
        m.assign(N * K, 0.0);
        for (int64_t j = 0; j < N; ++j)
          for (int64_t k = 0; k < K; ++k) {
            double s = 0;
            for (int64_t i = 0; i < M; ++i) s += std::fabs(double(g.f[i * N + j]) * x.f[i * K + k]);
            m[j * K + k] = (kInputRel + 2 * kAccumRel * (1 + kInputRel)) * s;
          }
        expect_close(a_dw.data(), std::vector<double>(b_dw.begin(), b_dw.end()), m, 1.0, 0.0,
                     "dweight vs fp32 path " + shape(M, K, N));
        m.assign(N, 0.0);
        // dbias sums dout only: one bf16 rounding per term (2^-8), plus accumulation.
        for (int64_t j = 0; j < N; ++j)
          for (int64_t i = 0; i < M; ++i)
            m[j] += (kBf16Rel + 2 * kAccumRel * (1 + kBf16Rel)) * std::fabs(g.f[i * N + j]);
        expect_close(a_db.data(), std::vector<double>(b_db.begin(), b_db.end()), m, 1.0, 0.0,
                     "dbias vs fp32 path " + shape(M, K, N));

        // bf16 dinp (every other shape: a primitive costs milliseconds to create): the fp32 input
        // gradient rounded once; garbage in dinp must be overwritten.
        if (variant & 2) continue;
        std::vector<uint16_t> hdx(M * K, 0x7fc0);
        cpu::matmul_backward_bf16_dinp_bf16(hdx.data(), nullptr, nullptr, g.h.data(), x.h.data(), w.h.data(), M, K, N);
        expect_close(to_f32(hdx).data(), dx, dxm, kAccumRel, kBf16Rel, "bf16 dinp " + shape(M, K, N));
        if (HasFailure()) return;
      }
}

// Degenerate sizes: K == 0 gives bias (or 0, or out += bias); M or N == 0 touches nothing.
TEST(MatmulBf16, EmptyDimensions) {
  const float bias[3] = {1.5f, -2.0f, 0.25f};
  std::vector<float> out(6, 7.0f);
  cpu::matmul_forward_bf16(out.data(), nullptr, nullptr, bias, 2, 0, 3);
  EXPECT_EQ(out, (std::vector<float>{1.5f, -2.0f, 0.25f, 1.5f, -2.0f, 0.25f}));
  cpu::matmul_forward_bf16(out.data(), nullptr, nullptr, bias, 2, 0, 3, true);
  EXPECT_EQ(out, (std::vector<float>{3.0f, -4.0f, 0.5f, 3.0f, -4.0f, 0.5f}));
  cpu::matmul_forward_bf16(out.data(), nullptr, nullptr, nullptr, 2, 0, 3);
  EXPECT_EQ(out, std::vector<float>(6, 0.0f));
  std::vector<uint16_t> outh(6, 0x7fc0);
  cpu::matmul_forward_bf16_out_bf16(outh.data(), nullptr, nullptr, bias, 2, 0, 3);
  // 1.5 = 0x3fc00000, -2 = 0xc0000000, 0.25 = 0x3e800000: all exact in bf16.
  EXPECT_EQ(outh, (std::vector<uint16_t>{0x3fc0, 0xc000, 0x3e80, 0x3fc0, 0xc000, 0x3e80}));
  std::vector<float> untouched(6, 7.0f);
  cpu::matmul_forward_bf16(untouched.data(), nullptr, nullptr, bias, 0, 4, 3);
  cpu::matmul_forward_bf16(untouched.data(), nullptr, nullptr, bias, 2, 4, 0);
  EXPECT_EQ(untouched, std::vector<float>(6, 7.0f));
  // Backward with N == 0: dinp = 0 (or unchanged with accumulate); nothing else to do.
  std::vector<float> dx(6, 7.0f), dw(1, 3.0f), db(1, 3.0f);
  cpu::matmul_backward_bf16(dx.data(), dw.data(), db.data(), nullptr, nullptr, nullptr, 2, 3, 0, true);
  EXPECT_EQ(dx, std::vector<float>(6, 7.0f));
  cpu::matmul_backward_bf16(dx.data(), dw.data(), db.data(), nullptr, nullptr, nullptr, 2, 3, 0);
  EXPECT_EQ(dx, std::vector<float>(6, 0.0f));
  EXPECT_EQ(dw[0], 3.0f);
  EXPECT_EQ(db[0], 3.0f);
  EXPECT_THROW(cpu::matmul_forward_bf16(out.data(), nullptr, nullptr, nullptr, -1, 2, 3), Error);
}

// Two calls give bit-identical results, at shapes large enough for oneDNN to split the work
// (including a small-M*N, long-K shape where it may split K); the second call reuses the cached
// primitive.
TEST(MatmulBf16, DeterministicAndCached) {
  REQUIRE_DNNL();
  Rng rng(3);
  const int64_t shapes[][3] = {{256, 768, 2304}, {64, 4096, 64}, {1, 768, 3072}};
  for (const auto& s : shapes) {
    const int64_t M = s[0], K = s[1], N = s[2];
    Mat x(M * K, rng, 1.0f), w(N * K, rng, 0.02f), g(M * N, rng, 1.0f), b(N, rng, 1.0f);
    std::vector<float> out1(M * N), out2(M * N), dx1(M * K), dx2(M * K), dw1(N * K, 0.5f), dw2(N * K, 0.5f), db1(N),
        db2(N);
    cpu::matmul_forward_bf16(out1.data(), x.h.data(), w.h.data(), b.f.data(), M, K, N);
    cpu::matmul_backward_bf16(dx1.data(), dw1.data(), db1.data(), g.h.data(), x.h.data(), w.h.data(), M, K, N);
    const size_t cached = cpu::bf16_matmul_cache_size();
    cpu::matmul_forward_bf16(out2.data(), x.h.data(), w.h.data(), b.f.data(), M, K, N);
    cpu::matmul_backward_bf16(dx2.data(), dw2.data(), db2.data(), g.h.data(), x.h.data(), w.h.data(), M, K, N);
    EXPECT_EQ(cpu::bf16_matmul_cache_size(), cached) << "a repeated shape created another primitive";
    EXPECT_EQ(0, std::memcmp(out1.data(), out2.data(), out1.size() * 4)) << shape(M, K, N);
    EXPECT_EQ(0, std::memcmp(dx1.data(), dx2.data(), dx1.size() * 4)) << shape(M, K, N);
    EXPECT_EQ(0, std::memcmp(dw1.data(), dw2.data(), dw1.size() * 4)) << shape(M, K, N);
    EXPECT_EQ(0, std::memcmp(db1.data(), db2.data(), db1.size() * 4)) << shape(M, K, N);
  }
}

// Several threads at once (in-process data-parallel tests run one model per thread), each on its
// own data: each thread has its own primitives and scratchpads (packed operands), so results
// equal those of the same calls made one thread after the other, bit for bit.
TEST(MatmulBf16, ConcurrentThreads) {
  REQUIRE_DNNL();
  constexpr int kThreads = 3;
  const int64_t M = 128, K = 384, N = 320;
  std::vector<Mat> xs, ws, gs;
  for (int t = 0; t < kThreads; ++t) {
    Rng rng(10 + t);
    xs.emplace_back(M * K, rng, 1.0f), ws.emplace_back(N * K, rng, 0.1f), gs.emplace_back(M * N, rng, 1.0f);
  }
  auto run_all = [&](int t, std::vector<float>& out, std::vector<float>& dx, std::vector<float>& dw) {
    // One OpenMP thread per caller: the callers already fill the cores (and oversubscribed
    // spinning OpenMP teams would make the test slow).
    omp_set_num_threads(1);
    out.assign(M * N, 0.f), dx.assign(M * K, 0.f), dw.assign(N * K, 0.f);
    for (int rep = 0; rep < 20; ++rep) {
      cpu::matmul_forward_bf16(out.data(), xs[t].h.data(), ws[t].h.data(), nullptr, M, K, N, rep > 0);
      cpu::matmul_backward_bf16(dx.data(), dw.data(), nullptr, gs[t].h.data(), xs[t].h.data(), ws[t].h.data(), M, K, N,
                                rep > 0);
    }
  };
  std::vector<std::vector<float>> outs(kThreads), dxs(kThreads), dws(kThreads);
  for (int t = 0; t < kThreads; ++t) std::thread([&, t] { run_all(t, outs[t], dxs[t], dws[t]); }).join();
  std::vector<std::vector<float>> pouts(kThreads), pdxs(kThreads), pdws(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) threads.emplace_back([&, t] { run_all(t, pouts[t], pdxs[t], pdws[t]); });
  for (auto& t : threads) t.join();
  for (int t = 0; t < kThreads; ++t) {
    EXPECT_EQ(pouts[t], outs[t]) << "thread " << t;
    EXPECT_EQ(pdxs[t], dxs[t]) << "thread " << t;
    EXPECT_EQ(pdws[t], dws[t]) << "thread " << t;
  }
}

// ======================================= the two paths =======================================

// gamma_n = n u / (1 - n u), u = 2^-24: the worst relative error (to the sum of |terms|) of an
// fp32 sum of n terms in any order.
double gamma_fp32(int64_t n) {
  const double u = std::ldexp(1.0, -24);
  return n * u / (1.0 - n * u);
}

// Both paths sum the same terms exactly representable in fp32 (a product of two bf16 values has
// at most 16 significant bits), each in its own order: each is within gamma_n * sum|terms| of the
// exact sum, so they are within 2 gamma_n * sum|terms| of each other. A bf16 destination is the
// fp32 result rounded once by each path (error <= 2^-8 of the fp32 value, which is itself within
// (1 + 2^-7) of the rounded one): up to 2^-8 (1 + 2^-7) (|a| + |b|) more.
void expect_paths_agree(const std::vector<float>& a, const std::vector<float>& b, const std::vector<double>& mag,
                        int64_t n_terms, bool bf16_dst, const std::string& what) {
  ASSERT_EQ(a.size(), b.size());
  const double g2 = 2 * gamma_fp32(n_terms), r = std::ldexp(1.0, -8) * (1 + std::ldexp(1.0, -7));
  int bad = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double tol = g2 * mag[i] + (bf16_dst ? r * (std::fabs(a[i]) + std::fabs(b[i])) : 0.0);
    if (!(std::fabs(double(a[i]) - b[i]) <= tol) && ++bad <= 3)
      ADD_FAILURE() << what << " [" << i << "]: onednn " << a[i] << " fp32 path " << b[i] << " tol " << tol;
  }
  EXPECT_EQ(bad, 0) << what;
}

// Everything one shape's GEMMs produce on the calling thread's path.
struct PathResult {
  std::vector<float> out, outh, dx, dxh, dw, db;
};

PathResult run_path(cpu::Bf16Gemm path, const Mat& x, const Mat& w, const Mat& g, const Mat& b,
                    const std::vector<float>& old, int64_t M, int64_t K, int64_t N) {
  cpu::bf16_gemm_force_for_thread(path);
  PathResult r;
  r.out = old;  // out += x w^T + b
  cpu::matmul_forward_bf16(r.out.data(), x.h.data(), w.h.data(), b.f.data(), M, K, N, true);
  std::vector<uint16_t> h(M * N, 0x7fc0);
  cpu::matmul_forward_bf16_out_bf16(h.data(), x.h.data(), w.h.data(), b.f.data(), M, K, N);
  r.outh = to_f32(h);
  r.dx.assign(M * K, 0.25f), r.dw.assign(N * K, -0.5f), r.db.assign(N, 1.0f);  // dx "=", dw and db "+="
  cpu::matmul_backward_bf16(r.dx.data(), r.dw.data(), r.db.data(), g.h.data(), x.h.data(), w.h.data(), M, K, N);
  std::vector<uint16_t> hdx(M * K, 0x7fc0);
  cpu::matmul_backward_bf16_dinp_bf16(hdx.data(), nullptr, nullptr, g.h.data(), x.h.data(), w.h.data(), M, K, N);
  r.dxh = to_f32(hdx);
  cpu::bf16_gemm_force_for_thread(std::nullopt);
  return r;
}

// Issue 22: the fp32 path (what an AVX2-only CPU runs) equals oneDNN's within the bound derived
// above, for every output of every entry point, at sizes where both split their work; it is also
// bit-identical from one call to the next. Where this process cannot use oneDNN (an AVX2 CPU,
// DNNL_MAX_CPU_ISA=AVX2) the comparison is skipped: the tests above then check the fp32 path
// against the exact reference.
TEST(MatmulBf16, Fp32PathMatchesOneDnn) {
  if (cpu::bf16_gemm_process_path() != cpu::Bf16Gemm::OneDnn)
    GTEST_SKIP() << "no oneDNN bf16 path in this process: " << cpu::bf16_matmul_backend_info();
  Rng rng(21);
  const int64_t shapes[][3] = {{64, 768, 200}, {33, 2048, 17}, {1, 1000, 129}, {130, 67, 300}};
  for (const auto& s : shapes) {
    const int64_t M = s[0], K = s[1], N = s[2];
    const std::string what = shape(M, K, N);
    Mat x(M * K, rng, 1.0f), w(N * K, rng, 0.05f), g(M * N, rng, 1.0f), b(N, rng, 1.0f);
    std::vector<float> old(M * N);
    for (auto& v : old) v = rng.normal();
    const PathResult nat = run_path(cpu::Bf16Gemm::OneDnn, x, w, g, b, old, M, K, N);
    const PathResult f32 = run_path(cpu::Bf16Gemm::Fp32, x, w, g, b, old, M, K, N);
    const PathResult f32b = run_path(cpu::Bf16Gemm::Fp32, x, w, g, b, old, M, K, N);
    for (auto [p, q] : {std::pair{&f32.out, &f32b.out}, {&f32.outh, &f32b.outh}, {&f32.dx, &f32b.dx},
                        {&f32.dxh, &f32b.dxh}, {&f32.dw, &f32b.dw}, {&f32.db, &f32b.db}})
      EXPECT_EQ(0, std::memcmp(p->data(), q->data(), p->size() * 4)) << "fp32 path not deterministic " << what;

    // sum |terms| of each output, on the bf16 values.
    std::vector<double> fwd(M * N), fwdh(M * N), dxm(M * K, 0.0), dwm(N * K, 0.0);
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) {
        double a = std::fabs(b.d[j]);
        for (int64_t k = 0; k < K; ++k) a += std::fabs(x.d[i * K + k] * w.d[j * K + k]);
        fwdh[i * N + j] = a;
        fwd[i * N + j] = a + std::fabs(old[i * N + j]);
        for (int64_t k = 0; k < K; ++k) {
          dxm[i * K + k] += std::fabs(g.d[i * N + j] * w.d[j * K + k]);
          dwm[j * K + k] += std::fabs(g.d[i * N + j] * x.d[i * K + k]);
        }
      }
    for (auto& v : dwm) v += 0.5;  // the old value -0.5
    expect_paths_agree(nat.out, f32.out, fwd, K + 2, false, "forward += " + what);
    expect_paths_agree(nat.outh, f32.outh, fwdh, K + 1, true, "forward bf16 out " + what);
    expect_paths_agree(nat.dx, f32.dx, dxm, N, false, "dinp " + what);
    expect_paths_agree(nat.dxh, f32.dxh, dxm, N, true, "bf16 dinp " + what);
    expect_paths_agree(nat.dw, f32.dw, dwm, M + 1, false, "dweight " + what);
    // dbias: the same column sums of the bf16 dout on both paths.
    EXPECT_EQ(nat.db, f32.db) << what;
    if (HasFailure()) return;
  }
}

// "+=" adds the old value after the GEMM, as oneDNN's sum post-op does (dst = fp32(gemm + dst)):
// the result is bit for bit the GEMM from zero plus the old value, one rounding per element. A
// gradient accumulated in two parts (the tied wte: lm head here, embedding there; split over
// pipeline stages and summed by a collective) then has the same bits wherever the parts are
// computed. Long reductions (1024: several K blocks of a blocked GEMM, which a beta = 1 sgemm
// would add into the old value one block at a time), on every path this process has.
TEST(MatmulBf16, AccumulateAddsAfterTheGemm) {
  std::vector<cpu::Bf16Gemm> paths{cpu::Bf16Gemm::Fp32};
  if (cpu::bf16_gemm_process_path() == cpu::Bf16Gemm::OneDnn) paths.push_back(cpu::Bf16Gemm::OneDnn);
  Rng rng(31);
  const int64_t M = 1024, K = 1024, N = 48;
  Mat x(M * K, rng, 1.0f), w(N * K, rng, 0.05f), g(M * N, rng, 1.0f), b(N, rng, 1.0f);
  std::vector<float> old_out(M * N), old_dx(M * K), old_dw(N * K);
  for (auto* v : {&old_out, &old_dx, &old_dw})
    for (auto& e : *v) e = rng.normal() * 3.0f;
  for (cpu::Bf16Gemm path : paths) {
    SCOPED_TRACE(cpu::bf16_gemm_name(path));
    cpu::bf16_gemm_force_for_thread(path);
    std::vector<float> zero_out(M * N), acc_out = old_out;
    cpu::matmul_forward_bf16(zero_out.data(), x.h.data(), w.h.data(), b.f.data(), M, K, N);
    cpu::matmul_forward_bf16(acc_out.data(), x.h.data(), w.h.data(), b.f.data(), M, K, N, true);
    std::vector<float> zero_dx(M * K), acc_dx = old_dx, zero_dw(N * K, 0.0f), acc_dw = old_dw;
    cpu::matmul_backward_bf16(zero_dx.data(), zero_dw.data(), nullptr, g.h.data(), x.h.data(), w.h.data(), M, K, N);
    cpu::matmul_backward_bf16(acc_dx.data(), acc_dw.data(), nullptr, g.h.data(), x.h.data(), w.h.data(), M, K, N,
                              true);
    cpu::bf16_gemm_force_for_thread(std::nullopt);
    int bad = 0;
    for (size_t i = 0; i < acc_out.size(); ++i) bad += bits(acc_out[i]) != bits(zero_out[i] + old_out[i]);
    EXPECT_EQ(bad, 0) << "forward +=: elements that are not fp32(gemm + bias) + old";
    bad = 0;
    for (size_t i = 0; i < acc_dx.size(); ++i) bad += bits(acc_dx[i]) != bits(zero_dx[i] + old_dx[i]);
    EXPECT_EQ(bad, 0) << "dinp +=: elements that are not gemm + old";
    bad = 0;
    for (size_t i = 0; i < acc_dw.size(); ++i) bad += bits(acc_dw[i]) != bits(zero_dw[i] + old_dw[i]);
    EXPECT_EQ(bad, 0) << "dweight +=: elements that are not gemm + old";
  }
}

// The start line names the instruction set and the path; where the path is not native it says
// that bf16 is not faster than fp32. Run again with DNNL_MAX_CPU_ISA=AVX2 and LATHE_CPU_ISA=avx2
// (CTest's avx2_ registration, tests/CMakeLists.txt), the process must take the fp32 path.
TEST(MatmulBf16, StartLineNamesPath) {
  const std::string line = cpu::lowp_compute_line("bf16");
  std::printf("%s\n", line.c_str());
  EXPECT_NE(line.find(std::string("cpu instruction set ") + cpu::isa_name(cpu::cpu_isa())), std::string::npos)
      << line;
  EXPECT_LE(cpu::cpu_isa(), cpu::cpu_isa_hardware());
  if (cpu::bf16_gemm_process_path() == cpu::Bf16Gemm::Fp32) {
    EXPECT_NE(line.find("bf16 will not be faster than fp32 on this CPU"), std::string::npos) << line;
  } else {
    EXPECT_NE(line.find("oneDNN"), std::string::npos) << line;
    EXPECT_GE(cpu::cpu_isa(), cpu::Isa::Avx512);
  }
  const char* dnnl_cap = std::getenv("DNNL_MAX_CPU_ISA");
  const char* lathe_cap = std::getenv("LATHE_CPU_ISA");
  if ((dnnl_cap && std::string(dnnl_cap) == "AVX2") || (lathe_cap && std::string(lathe_cap) == "avx2")) {
    EXPECT_EQ(cpu::bf16_gemm_process_path(), cpu::Bf16Gemm::Fp32);
    EXPECT_LE(cpu::cpu_isa(), cpu::Isa::Avx2);
    if (cpu::cpu_isa_hardware() > cpu::Isa::Avx2) {
      EXPECT_NE(line.find("(capped by "), std::string::npos) << line;
    }
  }
  const std::string fp16 = cpu::lowp_compute_line("fp16");
  EXPECT_NE(fp16.find("fp16 will not be faster than fp32 on this CPU"), std::string::npos) << fp16;
}

// ======================================= conversion =======================================

struct Case {
  uint32_t in;
  uint16_t out;
};
// Expected values from the bit patterns: bf16 keeps the upper 16 bits; the lower 16 decide the
// rounding: < 0x8000 down, > 0x8000 up, == 0x8000 a tie that goes to the even upper half.
const Case kCases[] = {
    {0x3f800000, 0x3f80},  // 1.0: exact
    {0x3f807fff, 0x3f80},  // just below the tie: down
    {0x3f808000, 0x3f80},  // tie, 0x3f80 even: stays
    {0x3f808001, 0x3f81},  // just above the tie: up
    {0x3f818000, 0x3f82},  // tie, 0x3f81 odd: up to even 0x3f82
    {0xbf808000, 0xbf80},  // negative tie, even: stays (magnitude rounding, sign kept)
    {0xbf818000, 0xbf82},  // negative tie, odd: away to even
    {0x3fffffff, 0x4000},  // mantissa carry into the exponent: 1.99999988 -> 2.0
    {0x7f7f7fff, 0x7f7f},  // below the tie at the top: largest finite bf16
    {0x7f7fffff, 0x7f80},  // FLT_MAX rounds above the largest bf16: +inf
    {0xff7fffff, 0xff80},  // -FLT_MAX: -inf
    {0x7f800000, 0x7f80},  // +inf
    {0xff800000, 0xff80},  // -inf
    {0x7f800001, 0x7fc0},  // signalling NaN, payload only in the low bits: quiet bit (0x40) set
    {0x7fc00000, 0x7fc0},  // quiet NaN
    {0xffbfffff, 0xffff},  // negative NaN: 0xffbf | 0x40 (not rounded up into the sign)
    {0x7fffffff, 0x7fff},  // NaN with all bits: stays NaN, no carry into the sign
    {0x00000000, 0x0000},  // +0
    {0x80000000, 0x8000},  // -0
    {0x00008000, 0x0000},  // subnormal tie 2^-149*0x8000 between 0 and 0x0001: even 0
    {0x00008001, 0x0001},  // subnormal above the tie: smallest bf16 subnormal
    {0x00018000, 0x0002},  // subnormal tie, 0x0001 odd: up to 0x0002
    {0x80018000, 0x8002},  // negative subnormal tie
    {0x00010000, 0x0001},  // exact subnormal
    {0x007fffff, 0x0080},  // largest fp32 subnormal rounds up to the smallest normal
    {0x00000001, 0x0000},  // smallest fp32 subnormal: down to 0
};

TEST(ConvertBf16, HandDerivedPatterns) {
  // Every case at every position of a vector block and in the scalar tail, in arrays long
  // enough for the OpenMP path, surrounded by normal values (so one subnormal lane sits among
  // normal lanes of the same block).
  const size_t nc = std::size(kCases);
  for (int64_t n : {int64_t{1}, int64_t{31}, int64_t{33}, int64_t{100}, int64_t{70001}}) {
    for (size_t c = 0; c < nc; ++c) {
      std::vector<float> src(n);
      std::vector<uint16_t> want(n);
      for (int64_t i = 0; i < n; ++i) {
        const bool put = (i % 37) == static_cast<int64_t>(c % 37) || i == n - 1;
        const uint32_t u = put ? kCases[c].in : 0x40490fdbu;  // pi: 0x4049|0x0fdb -> 0x4049 (down)
        src[i] = from_bits(u);
        want[i] = put ? kCases[c].out : 0x4049;
      }
      std::vector<uint16_t> got(n, 0x1234);
      cpu::convert_fp32_to_bf16(got.data(), src.data(), n);
      for (int64_t i = 0; i < n; ++i) {
        if (got[i] != want[i]) {
          ADD_FAILURE() << std::hex << "n=" << std::dec << n << " i=" << i << std::hex << " in 0x" << bits(src[i])
                        << " got 0x" << got[i] << " want 0x" << want[i];
          return;
        }
      }
    }
  }
}

// bf16 -> fp32 is the bit pattern shifted up; fp32 -> bf16 -> fp32 -> bf16 returns every bf16
// except signalling NaNs, which come back quiet (exponent all ones, mantissa != 0: | 0x40).
TEST(ConvertBf16, AllBf16RoundTrip) {
  std::vector<uint16_t> h(65536);
  for (uint32_t i = 0; i < 65536; ++i) h[i] = static_cast<uint16_t>(i);
  std::vector<float> f(65536);
  cpu::convert_bf16_to_fp32(f.data(), h.data(), 65536);
  std::vector<uint16_t> back(65536);
  cpu::convert_fp32_to_bf16(back.data(), f.data(), 65536);
  for (uint32_t i = 0; i < 65536; ++i) {
    ASSERT_EQ(bits(f[i]), i << 16) << std::hex << i;
    const bool nan = (i & 0x7f80) == 0x7f80 && (i & 0x007f) != 0;
    ASSERT_EQ(back[i], nan ? (i | 0x40) : i) << std::hex << i;
  }
}

// The vector path matches core/dtype.h's scalar converter on random bit patterns (all classes).
TEST(ConvertBf16, MatchesScalarOnRandomBits) {
  Rng rng(4);
  const int64_t n = 1 << 20;
  std::vector<float> src(n);
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u = static_cast<uint32_t>(rng.next_u64());
    // Subnormals only in the second half, and sparsely: a vector block holding one takes another
    // path, so most blocks must hold none.
    if (i >= n / 2 && i % 331 == 0) u &= 0x807fffffu;
    if (i % 11 == 0) u |= 0x7f800000u;  // inf / NaN
    src[i] = from_bits(u);
  }
  std::vector<uint16_t> got(n);
  cpu::convert_fp32_to_bf16(got.data(), src.data(), n);
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(got[i], fp32_to_bf16(src[i])) << std::hex << bits(src[i]);
}

}  // namespace
