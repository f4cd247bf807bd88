// The CUDA attention, fused lm-head loss, logits and optimizer kernels (kernels/cuda/attention.cu,
// lm_head_loss.cu, optimizer.cu) against the CPU reference (the CPU op tables and optim/), on a GPU.
// Built without CUDA, or run where no GPU is usable, every case is SKIPPED with the reason (never
// reported as passed); tests/cuda/run_on_gpu.sh runs them on a GPU machine.
//
// Tolerances, per element: |got - want| <= tol * (1 + max|want|) (as test_backend_ops.cpp):
//   fp32 5e-5: fp32 rounding of differently ordered sums (online softmax over 64-key tiles against
//        the CPU's two-pass softmax, cuBLASLt against OpenBLAS); bf16 3e-2: both sides round
//        outputs and intermediates to bf16 (2^-8 relative each), see test_backend_ops.cpp.
//   optimizers: 1e-6 relative + 1e-12 absolute on params and moments after 3 steps: the same float
//        formulas; only FMA contraction differs (an ulp, 6e-8, per operation).
// Determinism: every kernel called twice on the same inputs gives the same bits.
#include <gtest/gtest.h>

#include <barrier>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "kernels/backend.h"
#include "kernels/cpu/ops_bf16.h"
#include "optim/chunks.h"
#include "optim/clip.h"
#include "optim/optimizer.h"
#ifdef LATHE_HAVE_CUDA
#include "kernels/cuda/ops.h"
#endif

using namespace lathe;

namespace {

#ifndef LATHE_HAVE_CUDA

TEST(CudaFusedOps, SkippedWithoutCuda) {
  GTEST_SKIP() << "built without CUDA (LATHE_CUDA=OFF): the CUDA attention, lm-head loss and optimizer kernels "
                  "are compared with the CPU in a CUDA build on a GPU (tests/cuda/run_on_gpu.sh)";
}

#else

#define REQUIRE_GPU()                                              \
  do {                                                             \
    const std::string why = cuda_backend().unavailable();          \
    if (!why.empty())                                              \
      GTEST_SKIP() << "no usable CUDA GPU here (" << why           \
                   << "): the kernels run in "                     \
                      "tests/cuda/run_on_gpu.sh on a GPU machine"; \
  } while (0)

// Device memory of the CUDA backend holding `bytes`, freed on scope exit.
struct Dev {
  explicit Dev(size_t bytes) : n(bytes) { p = cuda_backend().alloc(bytes == 0 ? 1 : bytes); }
  ~Dev() { cuda_backend().free(p); }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
  template <class T>
  void put(const std::vector<T>& v) {
    cuda_backend().copy(p, v.data(), v.size() * sizeof(T), CopyKind::HostToDevice);
  }
  template <class T>
  std::vector<T> get(size_t count) const {
    std::vector<T> v(count);
    cuda_backend().copy(v.data(), p, count * sizeof(T), CopyKind::DeviceToHost);
    return v;
  }
  template <class T>
  T* as() {
    return static_cast<T*>(p);
  }
  void* p = nullptr;
  size_t n = 0;
};

size_t elem_size(DType dt) { return dt == DType::F32 ? 4 : 2; }

// Host bytes of `x` in the element type of dt (fp32 or bf16 bits), and back to fp32.
std::vector<uint8_t> encode(const std::vector<float>& x, DType dt) {
  std::vector<uint8_t> b(x.size() * elem_size(dt));
  for (size_t i = 0; i < x.size(); ++i) {
    if (dt == DType::F32) {
      std::memcpy(b.data() + 4 * i, &x[i], 4);
    } else {
      const uint16_t h = fp32_to_bf16(x[i]);
      std::memcpy(b.data() + 2 * i, &h, 2);
    }
  }
  return b;
}
std::vector<float> decode(const std::vector<uint8_t>& b, DType dt) {
  const size_t n = b.size() / elem_size(dt);
  std::vector<float> x(n);
  for (size_t i = 0; i < n; ++i) {
    if (dt == DType::F32) {
      std::memcpy(&x[i], b.data() + 4 * i, 4);
    } else {
      uint16_t h;
      std::memcpy(&h, b.data() + 2 * i, 2);
      x[i] = bf16_to_fp32(h);
    }
  }
  return x;
}

std::vector<float> randn(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

double tolerance(DType dt) { return dt == DType::F32 ? 5e-5 : 3e-2; }

void expect_close(const std::vector<float>& got, const std::vector<float>& want, double tol, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double max_abs = 0.0;
  for (float w : want) max_abs = std::max(max_abs, std::fabs(static_cast<double>(w)));
  const double bound = tol * (1.0 + max_abs);
  size_t bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::fabs(static_cast<double>(got[i]) - want[i]);
    if (!(err <= bound)) {
      if (++bad <= 5) ADD_FAILURE() << what << "[" << i << "]: got " << got[i] << ", want " << want[i];
    }
  }
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << got.size() << " elements beyond " << bound;
}

// ---- attention -----------------------------------------------------------------------------------
struct AttnCase {
  int64_t B, T, H, KVH, D;
  double p_new_doc;      // < 0: no documents
  int64_t window = 0;    // sliding window (0: none)
  float softcap = 0.0f;  // attention logit soft cap (Gemma 2; 0: none)
  float scale = 0.0f;    // score scale (0: 1/sqrt(D))
};

std::vector<int32_t> make_docs(int64_t B, int64_t T, double p, uint32_t seed) {
  std::mt19937 rng(seed);
  std::bernoulli_distribution fresh(p);
  std::vector<int32_t> ds(static_cast<size_t>(B * T));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      ds[b * T + t] = (t == 0 || fresh(rng)) ? static_cast<int32_t>(t) : ds[b * T + t - 1];
  return ds;
}

void cuda_attention_forward(DType dt, void* out, float* lse, const void* qkv, const AttnCase& c, const int32_t* ds) {
  if (dt == DType::F32)
    cuda::attention_forward<DType::F32>(out, lse, qkv, c.B, c.T, c.H, c.KVH, c.D, nullptr, ds, c.window, c.scale,
                                        c.softcap);
  else
    cuda::attention_forward<DType::BF16>(out, lse, qkv, c.B, c.T, c.H, c.KVH, c.D, nullptr, ds, c.window, c.scale,
                                         c.softcap);
}
void cuda_attention_backward(DType dt, void* dqkv, const void* dout, const void* qkv, const void* out, const float* lse,
                             const AttnCase& c, const int32_t* ds) {
  if (dt == DType::F32)
    cuda::attention_backward<DType::F32>(dqkv, dout, qkv, out, lse, c.B, c.T, c.H, c.KVH, c.D, nullptr, ds, c.window,
                                         c.scale, c.softcap);
  else
    cuda::attention_backward<DType::BF16>(dqkv, dout, qkv, out, lse, c.B, c.T, c.H, c.KVH, c.D, nullptr, ds, c.window,
                                          c.scale, c.softcap);
}

TEST(CudaFusedOps, AttentionMatchesCpuForwardAndBackward) {
  REQUIRE_GPU();
  const AttnCase cases[] = {
      {2, 67, 4, 2, 64, -1.0},                    // GQA, odd T across two tiles
      {1, 130, 3, 1, 128, 0.03},                  // D = 128, documents, MQA
      {2, 1, 2, 2, 40, -1.0},                     // one token, D padded to 64
      {1, 200, 2, 2, 16, 0.2},                    // many short documents
      {1, 129, 6, 3, 80, 0.01},                   // D padded to 128, documents crossing tiles
      {2, 300, 4, 2, 64, -1.0, 70},               // sliding window across tiles (issue 25)
      {1, 259, 3, 1, 40, 0.02, 65},               // window with documents
      {1, 130, 2, 2, 16, -1.0, 1},                // window of one key: each token's own value
      {2, 131, 4, 2, 64, -1.0, 0, 0.7f, 0.2f},    // soft cap and score scale (Gemma 2), GQA
      {1, 259, 3, 1, 40, 0.02, 65, 0.5f, 0.15f},  // soft cap with documents and a window
  };
  for (DType dt : {DType::F32, DType::BF16}) {
    const Ops& cpu = ops_for(cpu_backend(), dt);
    for (const AttnCase& c : cases) {
      const std::string name = compute_dtype_name(dt) + " B=" + std::to_string(c.B) + " T=" + std::to_string(c.T) +
                               " H=" + std::to_string(c.H) + " KVH=" + std::to_string(c.KVH) +
                               " D=" + std::to_string(c.D) + (c.p_new_doc >= 0 ? " docs" : "") +
                               (c.window > 0 ? " window=" + std::to_string(c.window) : "") +
                               (c.softcap > 0 ? " softcap=" + std::to_string(c.softcap) : "");
      SCOPED_TRACE(name);
      const int64_t nqkv = c.B * c.T * (c.H + 2 * c.KVH) * c.D, nout = c.B * c.T * c.H * c.D, nlse = c.B * c.H * c.T;
      const std::vector<uint8_t> qkv = encode(randn(nqkv, 1), dt), dout = encode(randn(nout, 2), dt);
      std::vector<int32_t> ds;
      if (c.p_new_doc >= 0) ds = make_docs(c.B, c.T, c.p_new_doc, 3);
      const int32_t* ds_host = ds.empty() ? nullptr : ds.data();

      // CPU reference
      std::vector<uint8_t> out(nout * elem_size(dt)), dqkv(nqkv * elem_size(dt));
      std::vector<float> lse(nlse);
      std::vector<uint8_t> scratch(cpu.attention_scratch_bytes(c.T, c.D));
      cpu.attention_forward(out.data(), lse.data(), qkv.data(), c.B, c.T, c.H, c.KVH, c.D, scratch.data(), ds_host,
                            c.window, c.scale, c.softcap);
      cpu.attention_backward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), c.B, c.T, c.H, c.KVH, c.D,
                             scratch.data(), ds_host, c.window, c.scale, c.softcap);

      // GPU
      Dev d_qkv(qkv.size()), d_dout(dout.size()), d_out(out.size()), d_dqkv(dqkv.size()), d_lse(nlse * 4),
          d_ds(ds.size() * 4);
      d_qkv.put(qkv);
      d_dout.put(dout);
      if (!ds.empty()) d_ds.put(ds);
      const int32_t* ds_dev = ds.empty() ? nullptr : d_ds.as<int32_t>();
      cuda_attention_forward(dt, d_out.p, d_lse.as<float>(), d_qkv.p, c, ds_dev);
      // The backward reads the GPU's own out and lse (as in training).
      cuda_attention_backward(dt, d_dqkv.p, d_dout.p, d_qkv.p, d_out.p, d_lse.as<float>(), c, ds_dev);
      const std::vector<uint8_t> g_out = d_out.get<uint8_t>(out.size()), g_dqkv = d_dqkv.get<uint8_t>(dqkv.size());
      const std::vector<float> g_lse = d_lse.get<float>(nlse);
      expect_close(decode(g_out, dt), decode(out, dt), tolerance(dt), "out");
      expect_close(g_lse, lse, dt == DType::F32 ? 5e-5 : 1e-2, "lse");
      expect_close(decode(g_dqkv, dt), decode(dqkv, dt), tolerance(dt), "dqkv");

      // Bit-reproducible: a second forward and backward give the same bytes.
      cuda_attention_forward(dt, d_out.p, d_lse.as<float>(), d_qkv.p, c, ds_dev);
      cuda_attention_backward(dt, d_dqkv.p, d_dout.p, d_qkv.p, d_out.p, d_lse.as<float>(), c, ds_dev);
      EXPECT_TRUE(d_out.get<uint8_t>(out.size()) == g_out) << "forward not deterministic";
      EXPECT_TRUE(d_dqkv.get<uint8_t>(dqkv.size()) == g_dqkv) << "backward not deterministic";
    }
  }
}

// Figures for the GPU run's log (tests/cuda/run_on_gpu.sh), not a pass criterion beyond finite
// results: GPT-2 124M's attention shape (B=8, T=1024, H=12, D=64) in bf16, forward and backward,
// milliseconds and TFLOP/s (causal: 2 x 2 x B x H x D x T^2 / 2 flops forward, 2.5x that backward).
TEST(CudaFusedOps, AttentionTimingGpt2Shape) {
  REQUIRE_GPU();
  const AttnCase c{8, 1024, 12, 12, 64, -1.0};
  const int64_t nqkv = c.B * c.T * (c.H + 2 * c.KVH) * c.D, nout = c.B * c.T * c.H * c.D;
  Dev d_qkv(nqkv * 2), d_dout(nout * 2), d_out(nout * 2), d_dqkv(nqkv * 2), d_lse(c.B * c.H * c.T * 4);
  d_qkv.put(encode(randn(nqkv, 71), DType::BF16));
  d_dout.put(encode(randn(nout, 72), DType::BF16));
  auto run = [&](bool backward) {
    if (backward)
      cuda_attention_backward(DType::BF16, d_dqkv.p, d_dout.p, d_qkv.p, d_out.p, d_lse.as<float>(), c, nullptr);
    else
      cuda_attention_forward(DType::BF16, d_out.p, d_lse.as<float>(), d_qkv.p, c, nullptr);
  };
  const double fwd_flops = 2.0 * 2.0 * c.B * c.H * c.D * static_cast<double>(c.T) * c.T / 2.0;
  for (bool backward : {false, true}) {
    run(backward);  // warm-up (first launch sets the shared-memory limit)
    cuda_backend().synchronize();
    const int reps = 5;
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < reps; ++i) run(backward);
    cuda_backend().synchronize();
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / reps;
    const double flops = backward ? 2.5 * fwd_flops : fwd_flops;
    std::printf("attention %s bf16 B=8 T=1024 H=12 D=64: %.3f ms, %.1f TFLOP/s\n", backward ? "backward" : "forward",
                ms, flops / (ms * 1e-3) / 1e12);
  }
  for (float v : d_lse.get<float>(c.B * c.H * c.T)) ASSERT_TRUE(std::isfinite(v));
}

TEST(CudaFusedOps, AttentionRefusesHeadDimAbove128) {
  REQUIRE_GPU();
  try {
    cuda::attention_forward<DType::F32>(nullptr, nullptr, nullptr, 1, 4, 2, 2, 160, nullptr, nullptr, 0, 0.0f, 0.0f);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("head dim 160"), std::string::npos) << e.what();
  }
}

// ---- lm head loss and logits -----------------------------------------------------------------------
double cuda_lm_head(DType dt, float* losses, void* dx, float* dw, const void* x, const void* w, const int32_t* t,
                    int64_t N, int64_t C, int64_t V, float gs, bool backward, void* scratch, int64_t R,
                    float cap = 0.0f) {
  return dt == DType::F32
             ? cuda::lm_head_loss<DType::F32>(losses, dx, dw, x, w, t, N, C, V, gs, backward, scratch, R, nullptr, cap)
             : cuda::lm_head_loss<DType::BF16>(losses, dx, dw, x, w, t, N, C, V, gs, backward, scratch, R, nullptr,
                                               cap);
}
size_t cuda_lm_scratch(DType dt, int64_t R, int64_t V) {
  return dt == DType::F32 ? cuda::lm_head_loss_scratch_bytes<DType::F32>(R, V)
                          : cuda::lm_head_loss_scratch_bytes<DType::BF16>(R, V);
}

TEST(CudaFusedOps, LmHeadLossMatchesCpu) {
  REQUIRE_GPU();
  const int64_t N = 37, C = 48, V = 301, R = 8;
  const float grad_scale = 1.0f / 30.0f;
  std::vector<int32_t> targets(N);
  std::mt19937 rng(5);
  for (int64_t n = 0; n < N; ++n) targets[n] = (n % 7 == 3) ? -1 : static_cast<int32_t>(rng() % V);
  // cap 2: final logit soft-capping (Gemma 2) with logits of size ~ sqrt(C) * 0.3, well past the cap
  for (const float cap : {0.0f, 2.0f})
    for (DType dt : {DType::F32, DType::BF16}) {
      SCOPED_TRACE(compute_dtype_name(dt) + " softcap " + std::to_string(cap));
      if (dt == DType::BF16 && !cpu::bf16_matmul_available()) {
        ADD_FAILURE() << "the CPU bf16 reference needs oneDNN (libdnnl-dev)";
        continue;
      }
      const Ops& cpu = ops_for(cpu_backend(), dt);
      const std::vector<uint8_t> x = encode(randn(N * C, 11), dt), w = encode(randn(V * C, 12, 0.3f), dt);
      const std::vector<float> dw0 = randn(V * C, 13, 0.01f);  // dw accumulates (+=)

      std::vector<float> losses(N), dw = dw0;
      std::vector<uint8_t> dx(N * C * elem_size(dt));
      std::vector<uint8_t> scratch(cpu.lm_head_loss_scratch_bytes(R, V));
      const double want = cpu.lm_head_loss(losses.data(), dx.data(), dw.data(), x.data(), w.data(), targets.data(), N,
                                           C, V, grad_scale, true, scratch.data(), R, nullptr, cap);

      Dev d_x(x.size()), d_w(w.size()), d_t(N * 4), d_losses(N * 4), d_dx(dx.size()), d_dw(dw0.size() * 4),
          d_scratch(cuda_lm_scratch(dt, R, V));
      d_x.put(x);
      d_w.put(w);
      d_t.put(targets);
      d_dw.put(dw0);
      const double got = cuda_lm_head(dt, d_losses.as<float>(), d_dx.p, d_dw.as<float>(), d_x.p, d_w.p,
                                      d_t.as<int32_t>(), N, C, V, grad_scale, true, d_scratch.p, R, cap);
      EXPECT_NEAR(got, want, (dt == DType::F32 ? 1e-5 : 1e-2) * std::fabs(want)) << "loss sum";
      const std::vector<float> g_losses = d_losses.get<float>(N);
      expect_close(g_losses, losses, tolerance(dt), "losses");
      for (int64_t n = 0; n < N; ++n) {
        if (targets[n] < 0) {
          EXPECT_EQ(g_losses[n], 0.0f) << "ignored row " << n;
        }
      }
      const std::vector<uint8_t> g_dx = d_dx.get<uint8_t>(dx.size());
      const std::vector<float> g_dw = d_dw.get<float>(dw0.size());
      expect_close(decode(g_dx, dt), decode(dx, dt), tolerance(dt), "dx");
      expect_close(g_dw, dw, tolerance(dt), "dw");

      // Deterministic: the same call again (dw restarted) gives the same bits.
      d_dw.put(dw0);
      const double again = cuda_lm_head(dt, d_losses.as<float>(), d_dx.p, d_dw.as<float>(), d_x.p, d_w.p,
                                        d_t.as<int32_t>(), N, C, V, grad_scale, true, d_scratch.p, R, cap);
      EXPECT_EQ(again, got);
      EXPECT_TRUE(d_dx.get<uint8_t>(dx.size()) == g_dx);
      EXPECT_TRUE(d_dw.get<float>(dw0.size()) == g_dw);

      // Forward only: the same losses, dx and dw untouched.
      d_dw.put(dw0);
      const double fwd = cuda_lm_head(dt, d_losses.as<float>(), nullptr, nullptr, d_x.p, d_w.p, d_t.as<int32_t>(), N, C,
                                      V, grad_scale, false, d_scratch.p, R, cap);
      EXPECT_EQ(fwd, got);

      // logits_forward against the CPU table's.
      std::vector<float> logits(N * V);
      cpu.logits_forward(logits.data(), x.data(), w.data(), N, C, V);
      Dev d_logits(logits.size() * 4);
      if (dt == DType::F32)
        cuda::logits_forward<DType::F32>(d_logits.as<float>(), d_x.p, d_w.p, N, C, V);
      else
        cuda::logits_forward<DType::BF16>(d_logits.as<float>(), d_x.p, d_w.p, N, C, V);
      expect_close(d_logits.get<float>(logits.size()), logits, dt == DType::F32 ? 5e-5 : 1e-3, "logits");
    }
}

TEST(CudaFusedOps, LmHeadLossRefusesOutOfRangeTargetBeforeWriting) {
  REQUIRE_GPU();
  const int64_t N = 9, C = 8, V = 17, R = 4;
  std::vector<int32_t> targets(N, 1);
  targets[6] = static_cast<int32_t>(V);  // one past the vocabulary
  const std::vector<float> dw0 = randn(V * C, 3);
  Dev d_x(N * C * 4), d_w(V * C * 4), d_t(N * 4), d_losses(N * 4), d_dx(N * C * 4), d_dw(V * C * 4),
      d_scratch(cuda_lm_scratch(DType::F32, R, V));
  d_x.put(randn(N * C, 1));
  d_w.put(randn(V * C, 2));
  d_t.put(targets);
  d_dw.put(dw0);
  try {
    cuda_lm_head(DType::F32, d_losses.as<float>(), d_dx.p, d_dw.as<float>(), d_x.p, d_w.p, d_t.as<int32_t>(), N, C, V,
                 0.1f, true, d_scratch.p, R);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("target 17 at row 6"), std::string::npos) << msg;
    EXPECT_NE(msg.find("model.vocab_size"), std::string::npos) << msg;
  }
  EXPECT_TRUE(d_dw.get<float>(dw0.size()) == dw0) << "dw was written before the check";
}

// ---- vocab-parallel lm head (tensor parallelism) ---------------------------------------------------
// Two "ranks" as two threads on the one GPU, each with half of the vocabulary; the all-reduce
// callback goes through the host (copy out, combine in rank order, copy back) behind a barrier.
struct TwoRankGroup {
  std::barrier<> sync{2};
  std::vector<double> bufs[2];
};
struct RankCtx {
  TwoRankGroup* group;
  int rank;
};
void host_all_reduce(void* ctx, double* buf, int64_t count, bool max) {
  auto* rc = static_cast<RankCtx*>(ctx);
  TwoRankGroup& g = *rc->group;
  std::vector<double>& mine = g.bufs[rc->rank];
  mine.resize(static_cast<size_t>(count));
  cuda_backend().copy(mine.data(), buf, count * sizeof(double), CopyKind::DeviceToHost);
  g.sync.arrive_and_wait();
  std::vector<double> out(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) out[i] = max ? std::max(g.bufs[0][i], g.bufs[1][i]) : g.bufs[0][i] + g.bufs[1][i];
  g.sync.arrive_and_wait();  // both have read both buffers
  cuda_backend().copy(buf, out.data(), count * sizeof(double), CopyKind::HostToDevice);
}

TEST(CudaFusedOps, LmHeadLossVocabParallelMatchesTheWholeVocabulary) {
  REQUIRE_GPU();
  // 302 rows: two shards of 151; 301: uneven shards of 151 + 150 rows (parallel::vocab_shard's rule,
  // a vocabulary the tensor degree does not divide).
  for (const int64_t V : {int64_t{302}, int64_t{301}}) {
    SCOPED_TRACE(V);
    const int64_t N = 29, C = 32, R = 8;
    const int64_t rows[2] = {(V + 1) / 2, V / 2}, begin[2] = {0, (V + 1) / 2};
    const float grad_scale = 1.0f / 25.0f;
    std::vector<int32_t> targets(N);
    std::mt19937 rng(9);
    for (int64_t n = 0; n < N; ++n) targets[n] = (n % 5 == 2) ? -1 : static_cast<int32_t>(rng() % V);
    const std::vector<float> x = randn(N * C, 61), w = randn(V * C, 62, 0.3f), dw0 = randn(V * C, 63, 0.01f);
    Dev d_x(x.size() * 4), d_t(N * 4);
    d_x.put(x);
    d_t.put(targets);

    // The whole vocabulary on one "rank" (and, as a first check, through the vocab-parallel path with
    // one shard and an identity all-reduce: the same bits).
    std::vector<float> whole_losses, whole_dx, whole_dw;
    double whole = 0.0;
    for (bool one_shard : {false, true}) {
      Dev d_w(w.size() * 4), d_losses(N * 4), d_dx(N * C * 4), d_dw(dw0.size() * 4),
          d_scratch(cuda::lm_head_loss_scratch_bytes<DType::F32>(R, V));
      d_w.put(w);
      d_dw.put(dw0);
      VocabParallel vp;
      vp.vocab_begin = 0;
      vp.global_V = V;
      const double got = cuda::lm_head_loss<DType::F32>(d_losses.as<float>(), d_dx.p, d_dw.as<float>(), d_x.p, d_w.p,
                                                        d_t.as<int32_t>(), N, C, V, grad_scale, true, d_scratch.p, R,
                                                        one_shard ? &vp : nullptr, 0.0f);
      if (!one_shard) {
        whole = got;
        whole_losses = d_losses.get<float>(N);
        whole_dx = d_dx.get<float>(N * C);
        whole_dw = d_dw.get<float>(dw0.size());
      } else {
        EXPECT_EQ(got, whole);
        EXPECT_TRUE(d_losses.get<float>(N) == whole_losses);
        EXPECT_TRUE(d_dx.get<float>(N * C) == whole_dx);
        EXPECT_TRUE(d_dw.get<float>(dw0.size()) == whole_dw);
      }
    }

    // Two shards of rows[r] rows at begin[r], in two threads.
    TwoRankGroup group;
    double sums[2] = {0.0, 0.0};
    std::vector<float> losses[2], dx[2], dw[2];
    std::string errors[2];
    auto rank_main = [&](int r) {
      try {
        RankCtx ctx{&group, r};
        VocabParallel vp;
        vp.vocab_begin = begin[r];
        vp.global_V = V;
        vp.all_reduce = host_all_reduce;
        vp.ctx = &ctx;
        const std::vector<float> w_r(w.begin() + begin[r] * C, w.begin() + (begin[r] + rows[r]) * C);
        const std::vector<float> dw_r(dw0.begin() + begin[r] * C, dw0.begin() + (begin[r] + rows[r]) * C);
        Dev d_w(w_r.size() * 4), d_losses(N * 4), d_dx(N * C * 4), d_dw(dw_r.size() * 4),
            d_scratch(cuda::lm_head_loss_scratch_bytes<DType::F32>(R, rows[r]));
        d_w.put(w_r);
        d_dw.put(dw_r);
        sums[r] = cuda::lm_head_loss<DType::F32>(d_losses.as<float>(), d_dx.p, d_dw.as<float>(), d_x.p, d_w.p,
                                                 d_t.as<int32_t>(), N, C, rows[r], grad_scale, true, d_scratch.p, R,
                                                 &vp, 0.0f);
        losses[r] = d_losses.get<float>(N);
        dx[r] = d_dx.get<float>(N * C);
        dw[r] = d_dw.get<float>(dw_r.size());
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    };
    std::thread t1(rank_main, 1);
    rank_main(0);
    t1.join();
    ASSERT_EQ(errors[0], "");
    ASSERT_EQ(errors[1], "");
    // Losses: the whole row's statistics on every rank; only the exp sum's order differs.
    EXPECT_EQ(sums[0], sums[1]);
    EXPECT_NEAR(sums[0], whole, 1e-5 * std::fabs(whole));
    expect_close(losses[0], whole_losses, 5e-5, "rank 0 losses");
    EXPECT_TRUE(losses[0] == losses[1]);
    // dx: the shards' partial products add up to the whole; dw: each shard's rows.
    std::vector<float> dx_sum(N * C);
    for (int64_t i = 0; i < N * C; ++i) dx_sum[i] = dx[0][i] + dx[1][i];
    expect_close(dx_sum, whole_dx, 5e-5, "dx summed over the shards");
    std::vector<float> dw_cat = dw[0];
    dw_cat.insert(dw_cat.end(), dw[1].begin(), dw[1].end());
    expect_close(dw_cat, whole_dw, 5e-5, "dw of the shards");
  }
}

// ---- optimizers and gradient norm: the CUDA backend's step ops (kernels/step_ops.h) ---------------
const StepOps& cuda_step() { return *cuda_backend().step_ops(); }
constexpr size_t kP = 3 * optim::kChunk + 123;
std::vector<optim::ParamRange> test_ranges() {
  const size_t K = optim::kChunk;
  // decayed matrix, a range crossing chunk boundaries without decay, a decayed tail; the last 5
  // elements and [1000, 1010) belong to no range and must stay untouched.
  return {{0, 1000, true, 0}, {1010, 2 * K, false, 1}, {1010 + 2 * K, kP - 5 - (1010 + 2 * K), true, 2}};
}

void optimizer_case(const std::string& name) {
  optim::OptimConfig cfg;
  cfg.name = name;
  cfg.weight_decay = 0.1;
  const std::vector<optim::ParamRange> ranges = test_ranges();
  std::vector<float> p_cpu = randn(kP, 21, 0.5f);
  auto opt = optim::make_optimizer(cfg, kP);
  Dev d_p(kP * 4), d_g(kP * 4), d_m(kP * 4), d_v(kP * 4);
  d_p.put(p_cpu);
  d_m.put(std::vector<float>(kP, 0.0f));
  d_v.put(std::vector<float>(kP, 0.0f));
  const std::vector<float> p0 = p_cpu;
  for (int64_t step = 1; step <= 3; ++step) {
    const std::vector<float> g = randn(kP, 30 + static_cast<uint32_t>(step));
    const double lr = 1e-3 * static_cast<double>(step);
    const float grad_scale = step == 2 ? 0.5f : 1.0f;
    opt->step(p_cpu.data(), g.data(), ranges, lr, step, grad_scale);
    d_g.put(g);
    if (name == "adamw")
      cuda_step().adamw_step(d_p.as<float>(), d_g.as<float>(), d_m.as<float>(), d_v.as<float>(), ranges,
                             optim::step_hyper(cfg), lr, step, grad_scale);
    else
      cuda_step().lamb_step(d_p.as<float>(), d_g.as<float>(), d_m.as<float>(), d_v.as<float>(), ranges,
                            optim::step_hyper(cfg), lr, step, grad_scale, {});
  }
  const std::vector<float> p_gpu = d_p.get<float>(kP);
  const auto state = opt->state_buffers();
  const std::vector<float> m_gpu = d_m.get<float>(kP), v_gpu = d_v.get<float>(kP);
  auto close = [](const std::vector<float>& got, const float* want, const std::string& what) {
    size_t bad = 0;
    for (size_t i = 0; i < kP; ++i)
      if (!(std::fabs(static_cast<double>(got[i]) - want[i]) <= 1e-6 * std::fabs(want[i]) + 1e-12) && ++bad <= 5)
        ADD_FAILURE() << what << "[" << i << "]: got " << got[i] << ", want " << want[i];
    EXPECT_EQ(bad, 0u) << what;
  };
  close(p_gpu, p_cpu.data(), name + " params");
  close(m_gpu, state[0].second->data(), name + " exp_avg");
  close(v_gpu, state[1].second->data(), name + " exp_avg_sq");
  for (size_t i : {size_t{1000}, size_t{1009}, kP - 5, kP - 1})
    EXPECT_EQ(p_gpu[i], p0[i]) << "element outside every range";
}

TEST(CudaFusedOps, AdamWMatchesCpu) {
  REQUIRE_GPU();
  optimizer_case("adamw");
}

TEST(CudaFusedOps, LambMatchesCpu) {
  REQUIRE_GPU();
  optimizer_case("lamb");
}

TEST(CudaFusedOps, LambGatherSeesEveryChunkAndKeepsTheResult) {
  REQUIRE_GPU();
  optim::OptimConfig cfg;
  cfg.name = "lamb";
  const std::vector<optim::ParamRange> ranges = test_ranges();
  const std::vector<float> p0 = randn(kP, 41), g = randn(kP, 42);
  std::vector<std::vector<float> > results;
  size_t gathered = 0;
  for (bool with_gather : {false, true}) {
    Dev d_p(kP * 4), d_g(kP * 4), d_m(kP * 4), d_v(kP * 4);
    d_p.put(p0);
    d_g.put(g);
    d_m.put(std::vector<float>(kP, 0.0f));
    d_v.put(std::vector<float>(kP, 0.0f));
    optim::ChunkSumsGather gather;
    if (with_gather)  // one rank: the gather returns the local chunk sums
      gather = [&](const std::vector<optim::ChunkSums>& local) {
        gathered = local.size();
        return local;
      };
    cuda_step().lamb_step(d_p.as<float>(), d_g.as<float>(), d_m.as<float>(), d_v.as<float>(), ranges,
                          optim::step_hyper(cfg), 1e-2, 1, 1.0f, gather);
    results.push_back(d_p.get<float>(kP));
  }
  EXPECT_EQ(gathered, optim::make_chunks(ranges).size());
  EXPECT_TRUE(results[0] == results[1]);
}

TEST(CudaFusedOps, GradNormNonFiniteAndScale) {
  REQUIRE_GPU();
  const size_t n = 2 * optim::kChunk + 77;
  std::vector<float> g = randn(n, 51);
  Dev d(n * 4);
  d.put(g);
  const size_t nchunks = (n + optim::kChunk - 1) / optim::kChunk;
  std::vector<double> want(nchunks), got(nchunks);
  optim::grad_sq_chunk_sums(g.data(), n, want.data());
  cuda_step().grad_sq_chunk_sums(d.as<float>(), n, got.data());
  for (size_t c = 0; c < nchunks; ++c) EXPECT_NEAR(got[c], want[c], 1e-12 * want[c]) << "chunk " << c;
  const double norm = cuda_step().global_grad_norm(d.as<float>(), n);
  EXPECT_NEAR(norm, optim::global_grad_norm(g.data(), n), 1e-12 * norm);
  EXPECT_EQ(cuda_step().global_grad_norm(d.as<float>(), n), norm) << "deterministic";

  EXPECT_FALSE(cuda_step().has_non_finite(d.as<float>(), n));
  cuda_step().scale_inplace(d.as<float>(), n, 0.25f);
  const std::vector<float> scaled = d.get<float>(n);
  for (size_t i = 0; i < n; ++i) ASSERT_EQ(scaled[i], g[i] * 0.25f) << i;
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity()}) {
    std::vector<float> h = g;
    h[n - 1] = bad;
    d.put(h);
    EXPECT_TRUE(cuda_step().has_non_finite(d.as<float>(), n)) << bad;
    EXPECT_FALSE(cuda_step().has_non_finite(d.as<float>(), n - 1)) << "only the first n - 1 elements";
  }
}

#endif  // LATHE_HAVE_CUDA

}  // namespace
