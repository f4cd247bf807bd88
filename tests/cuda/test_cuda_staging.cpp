// Staged (pinned, asynchronous) uploads of the token ids and targets of device-resident models
// (Backend::stage_upload / wait_staged, Model::stage_inputs; issue 12 "host staging ... copies
// overlapped with compute").
//
// Here, without a GPU: a "deferred" device backend in host memory whose staged copies land only when
// the model waits for them (wait_staged or synchronize), as a copy stream's would when the compute
// stream runs ahead. A model that read a slot without waiting, reused a slot a staged copy had
// overwritten, or took a stale copy of a refilled host array would compute with the wrong ids: the
// losses and gradients are compared with the same model on the CPU backend (same fp32 kernels, so
// bit-identical), and the number of uploads is checked (a staged micro-batch is uploaded once:
// tokens and targets, not again by its backward).
// On a GPU (tests/cuda/run_on_gpu.sh): the CUDA backend's staging against plain copies, and a
// model on CUDA trained with staged micro-batches against the same without staging (bit-identical).
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <map>
#include <vector>

#include "config/model_config.h"
#include "core/rng.h"
#include "kernels/backend.h"
#include "models/model.h"

using namespace lathe;

namespace {

// Host memory presented as a device; the CPU fp32 op table; staged copies deferred until waited for.
class DeferredDevice final : public Backend {
 public:
  std::string_view name() const override { return "deferred"; }
  DeviceKind device() const override { return DeviceKind::Cuda; }
  void* alloc(size_t bytes) const override { return std::aligned_alloc(64, (bytes + 63) / 64 * 64 + 64); }
  void free(void* p) const override { std::free(p); }
  void memset(void* dst, int value, size_t bytes) const override { std::memset(dst, value, bytes); }
  void copy(void* dst, const void* src, size_t bytes, CopyKind) const override {
    if (bytes) std::memcpy(dst, src, bytes);
  }
  void synchronize() const override { land_until(~uint64_t{0}); }
  std::vector<const Ops*> op_tables() const override { return {find_ops(cpu_backend(), DType::F32)}; }
  uint64_t stage_upload(void* dst, const void* src, size_t bytes) const override {
    const auto* s = static_cast<const std::byte*>(src);
    pending_[++ticket_] = Pending{dst, std::vector<std::byte>(s, s + bytes)};  // src reusable at once
    ++uploads_;
    return ticket_;
  }
  void wait_staged(uint64_t ticket) const override { land_until(ticket); }
  mutable int64_t uploads_ = 0;

 private:
  struct Pending {
    void* dst;
    std::vector<std::byte> data;
  };
  // Copies land in issue order (one copy stream).
  void land_until(uint64_t ticket) const {
    while (!pending_.empty() && pending_.begin()->first <= ticket) {
      const Pending& p = pending_.begin()->second;
      std::memcpy(p.dst, p.data.data(), p.data.size());
      pending_.erase(pending_.begin());
    }
  }
  mutable std::map<uint64_t, Pending> pending_;
  mutable uint64_t ticket_ = 0;
};

std::vector<int32_t> random_ids(int64_t n, int64_t V, uint64_t seed) {
  Rng rng(seed);
  std::vector<int32_t> v(static_cast<size_t>(n));
  for (auto& x : v) x = static_cast<int32_t>(rng.next_u64() % static_cast<uint64_t>(V));
  return v;
}

struct PassResults {
  std::vector<double> losses;
  std::vector<float> grads;
};

// `accum` micro-batches per step, 2 steps; the inputs of each step refilled into the same arrays (as
// the trainer's loader does). staged: micro-batch m+1 staged before m runs (the trainer's order).
// Then two evaluation passes that refill one array without staging (a stale copy would repeat).
PassResults train(Model& m, int64_t B, int64_t T, int64_t accum, bool staged, bool documents = false) {
  const int64_t V = m.config().vocab_size, n = B * T;
  std::vector<int32_t> doc(static_cast<size_t>(n)), pos(doc.size());
  std::vector<int32_t> in(static_cast<size_t>(accum * n)), tg(in.size());
  PassResults r;
  m.zero_grad();
  for (int64_t step = 0; step < 2; ++step) {
    in = random_ids(accum * n, V, 100 + step);
    tg = random_ids(accum * n, V, 200 + step);
    for (int64_t k = 0; k < accum; ++k) {
      for (int64_t s = k == 0 ? 0 : k + 1; staged && s <= k + 1 && s < accum; ++s)
        m.stage_inputs(in.data() + s * n, tg.data() + s * n, n);
      if (documents) {  // documents of a length that changes with each pass (staged copies too)
        const int64_t len = 3 + (step * accum + k) % 5;
        for (int64_t i = 0; i < n; ++i) {
          const int64_t t = i % T;
          doc[static_cast<size_t>(i)] = static_cast<int32_t>(t / len * len);
          pos[static_cast<size_t>(i)] = static_cast<int32_t>(t % len);
        }
        m.set_documents(doc.data(), pos.data(), B, T);
      }
      r.losses.push_back(m.forward_backward(in.data() + k * n, tg.data() + k * n, B, T, 0.01f, true));
    }
    m.drop_staged_inputs();
  }
  if (documents) m.set_documents(nullptr, nullptr, 0, 0);
  std::vector<int32_t> ev(static_cast<size_t>(n)), evt(ev.size());
  for (int64_t k = 0; k < 2; ++k) {
    ev = random_ids(n, V, 300 + k);
    evt = random_ids(n, V, 400 + k);
    r.losses.push_back(m.forward_backward(ev.data(), evt.data(), B, T, 0.0f, false));
  }
  m.download_grads();
  r.grads.assign(m.grad_data(), m.grad_data() + m.num_params());
  return r;
}

TEST(StagedInputs, DeferredCopiesGiveTheCpuResultsAndUploadEachIdOnce) {
  const ModelConfig cfg = ModelConfig::preset("gpt2-debug");
  const int64_t B = 2, T = 16, accum = 3;
  auto host = build_model(cfg);
  host->init_weights(7);
  host->allocate(B, T);
  const PassResults want = train(*host, B, T, accum, false);

  for (bool staged : {true, false}) {
    SCOPED_TRACE(staged ? "staged" : "not staged");
    DeferredDevice dev;
    auto m = build_model(cfg, ComputeSpec{&dev, DType::F32});
    ASSERT_TRUE(m->on_device());
    m->init_weights(7);
    m->allocate(B, T);
    dev.uploads_ = 0;
    const PassResults got = train(*m, B, T, accum, staged);
    ASSERT_EQ(got.losses.size(), want.losses.size());
    for (size_t i = 0; i < want.losses.size(); ++i) EXPECT_EQ(got.losses[i], want.losses[i]) << "pass " << i;
    ASSERT_EQ(got.grads.size(), want.grads.size());
    EXPECT_EQ(std::memcmp(got.grads.data(), want.grads.data(), want.grads.size() * sizeof(float)), 0);
    // 6 training passes and 2 evaluation passes, tokens + targets uploaded once each (staged or
    // by the pass itself): the backward reuses its forward's copy of the tokens.
    EXPECT_EQ(dev.uploads_, 2 * (6 + 2));
  }
}

// Documents (set_documents before each pass, as the trainer does) go through the same staging.
TEST(StagedInputs, DeferredCopiesOfDocumentsGiveTheCpuResults) {
  const ModelConfig cfg = ModelConfig::preset("gpt2-debug");
  const int64_t B = 2, T = 16, accum = 3;
  auto host = build_model(cfg);
  host->init_weights(7);
  host->allocate(B, T);
  const PassResults want = train(*host, B, T, accum, true, true);
  DeferredDevice dev;
  auto m = build_model(cfg, ComputeSpec{&dev, DType::F32});
  m->init_weights(7);
  m->allocate(B, T);
  const PassResults got = train(*m, B, T, accum, true, true);
  EXPECT_EQ(got.losses, want.losses);
  ASSERT_EQ(got.grads.size(), want.grads.size());
  EXPECT_EQ(std::memcmp(got.grads.data(), want.grads.data(), want.grads.size() * sizeof(float)), 0);
}

TEST(StagedInputs, HostModelsIgnoreStaging) {
  auto m = build_model(ModelConfig::preset("gpt2-debug"));
  m->init_weights(1);
  m->allocate(1, 8);
  std::vector<int32_t> a(8, 3), b(8, 4);
  m->stage_inputs(a.data(), b.data(), 8);  // nothing to stage: host memory is the backend's
  a.assign(8, 5);
  auto m2 = build_model(ModelConfig::preset("gpt2-debug"));
  m2->init_weights(1);
  m2->allocate(1, 8);
  EXPECT_EQ(m->forward_backward(a.data(), b.data(), 1, 8, 0.0f, false),
            m2->forward_backward(a.data(), b.data(), 1, 8, 0.0f, false));
}

// The CUDA backend's staged copies: values land where a plain copy puts them, a slot refilled while
// earlier work still reads it keeps that work's values (ordered after the issued work).
TEST(StagedInputs, CudaStagedCopiesMatchPlainCopies) {
  const Backend& cuda = cuda_backend();
  if (const std::string why = cuda.unavailable(); !why.empty()) GTEST_SKIP() << "no usable GPU: " << why;
  const size_t n = 1 << 20;
  DeviceBuffer d(cuda, 2 * n, DType::I32);
  std::vector<int32_t> h(n), back(n);
  for (int round = 0; round < 20; ++round) {  // more rounds than pinned ring buffers
    for (size_t i = 0; i < n; ++i) h[i] = static_cast<int32_t>(i * 7 + static_cast<size_t>(round));
    const uint64_t t = cuda.stage_upload(static_cast<int32_t*>(d.data()) + (round % 2) * n, h.data(), n * 4);
    h.assign(n, -1);  // reusable at once
    cuda.wait_staged(t);
    cuda.copy(back.data(), static_cast<int32_t*>(d.data()) + (round % 2) * n, n * 4, CopyKind::DeviceToHost);
    for (size_t i = 0; i < n; i += 4099)
      ASSERT_EQ(back[i], static_cast<int32_t>(i * 7 + static_cast<size_t>(round))) << "round " << round;
  }
}

TEST(StagedInputs, CudaModelStagedEqualsUnstaged) {
  const Backend& cuda = cuda_backend();
  if (const std::string why = cuda.unavailable(); !why.empty()) GTEST_SKIP() << "no usable GPU: " << why;
  const ModelConfig cfg = ModelConfig::preset("gpt2-debug");
  PassResults runs[2];
  for (int staged = 0; staged < 2; ++staged) {
    auto m = build_model(cfg, ComputeSpec{&cuda, DType::F32});
    m->init_weights(7);
    m->allocate(4, 64);
    runs[staged] = train(*m, 4, 64, 4, staged == 1);
  }
  EXPECT_EQ(runs[0].losses, runs[1].losses);
  EXPECT_EQ(std::memcmp(runs[0].grads.data(), runs[1].grads.data(), runs[0].grads.size() * sizeof(float)), 0);
}

}  // namespace
