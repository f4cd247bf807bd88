// The training-step table of every backend (kernels/step_ops.h), as ggml's test_opt_step_adamw:
// the same guarded backend buffers as test_backend_ops.cpp (backend_buffers.h), double references.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "backend_buffers.h"
#include "core/rng.h"
#include "error_of.h"
#include "gradcheck_basic.h"
#include "kernels/backend.h"
#include "reference_ops.h"

using namespace lathe;
using namespace lathe::test;
using lathe::test::error_of;

namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// ================================ the step ops (kernels/step_ops.h) ==============================
// The training-step table of every backend (as ggml's test_opt_step_adamw): AdamW and LAMB over
// ranges of odd sizes that cross a chunk boundary and leave gaps, the gradient norm and its chunk
// sums, the non-finite check and the scale, against double references, in backend memory with
// guard bytes. fp32 state throughout: tolerance 1e-5 (a few fp32 roundings per element and step).

constexpr double kStepTol = 1e-5;

struct StepTarget {
  const Backend* backend;
  const StepOps* ops;
};

// Ranges over n = kStepChunk + 76 elements: [32, 40) and the last 3 belong to no range.
constexpr size_t kStepN = kStepChunk + 76;
std::vector<StepRange> step_ranges() { return {{0, 1, true, 0}, {1, 31, false, 1}, {40, kStepChunk + 33, true, 2}}; }

// m, v, p after `steps` updates in double: AdamW, or LAMB with per-range trust ratios.
struct StepRef {
  VecD p, m, v;
};
StepRef ref_step(bool lamb, StepRef s, const std::vector<VecF>& grads, const StepHyper& h,
                 const std::vector<double>& lrs, const std::vector<float>& scales) {
  const auto ranges = step_ranges();
  for (size_t k = 0; k < grads.size(); ++k) {
    const double t = static_cast<double>(k + 1), lr = lrs[k];
    const double bc1 = 1.0 - std::pow(h.beta1, t), bc2 = 1.0 - std::pow(h.beta2, t);
    for (const StepRange& r : ranges) {
      VecD u(r.size);
      double pn = 0, un = 0;
      for (size_t j = 0; j < r.size; ++j) {
        const size_t i = r.offset + j;
        const double g = static_cast<double>(grads[k][i]) * scales[k];
        s.m[i] = h.beta1 * s.m[i] + (1 - h.beta1) * g;
        s.v[i] = h.beta2 * s.v[i] + (1 - h.beta2) * g * g;
        if (!lamb) {
          if (r.decay) s.p[i] *= 1 - lr * h.weight_decay;
          s.p[i] -= lr / bc1 * s.m[i] / (std::sqrt(s.v[i]) / std::sqrt(bc2) + h.eps);
          continue;
        }
        u[j] = (s.m[i] / bc1) / (std::sqrt(s.v[i] / bc2) + h.eps) + (r.decay ? h.weight_decay * s.p[i] : 0.0);
        pn += s.p[i] * s.p[i];
        un += u[j] * u[j];
      }
      if (!lamb) continue;
      const double trust = pn > 0 && un > 0 ? std::sqrt(pn) / std::sqrt(un) : 1.0;
      for (size_t j = 0; j < r.size; ++j) s.p[r.offset + j] -= lr * trust * u[j];
    }
  }
  return s;
}

void step_case_update(const StepTarget& t, bool lamb) {
  const std::string tag = std::string(t.ops->backend) + (lamb ? " lamb" : " adamw");
  Rng rng(lamb ? 91 : 90);
  const StepHyper h{0.9, 0.95, 1e-8, 0.1};
  const VecF p0 = randn(kStepN, rng, 0.5f);
  VecF v0 = randn(kStepN, rng, 0.1f), m0 = randn(kStepN, rng, 0.1f);  // moments from earlier steps
  for (float& x : v0) x = x * x;
  std::vector<VecF> grads;
  for (int k = 0; k < 3; ++k) grads.push_back(randn(kStepN, rng));
  const std::vector<double> lrs = {1e-3, 2e-3, 3e-3};
  const std::vector<float> scales = {1.0f, 0.5f, 1.0f};
  Dev p(*t.backend, p0, DType::F32, tag + " params"), m(*t.backend, m0, DType::F32, tag + " m"),
      v(*t.backend, v0, DType::F32, tag + " v");
  const auto ranges = step_ranges();
  for (size_t k = 0; k < grads.size(); ++k) {
    Dev g(*t.backend, grads[k], DType::F32, tag + " grads");
    const int64_t step = static_cast<int64_t>(k) + 1;
    if (lamb)
      t.ops->lamb_step(p.f(), g.f(), m.f(), v.f(), ranges, h, lrs[k], step, scales[k], {});
    else
      t.ops->adamw_step(p.f(), g.f(), m.f(), v.f(), ranges, h, lrs[k], step, scales[k]);
  }
  // Steps 1..3 from moments m0, v0: the bias corrections count the steps of this run.
  const StepRef want = ref_step(lamb, {to_double(p0), to_double(m0), to_double(v0)}, grads, h, lrs, scales);
  const VecF gp = p.down(), gm = m.down(), gv = v.down();
  expect_close(gp, want.p, kStepTol * (1.0 + max_abs(want.p)), kStepTol, tag + " params");
  expect_close(gm, want.m, kStepTol * (1.0 + max_abs(want.m)), kStepTol, tag + " exp_avg");
  expect_close(gv, want.v, kStepTol * (1.0 + max_abs(want.v)), kStepTol, tag + " exp_avg_sq");
  for (size_t i : {size_t{32}, size_t{39}, kStepN - 3, kStepN - 1}) {
    EXPECT_EQ(gp[i], p0[i]) << tag << ": param " << i << " outside every range changed";
    EXPECT_EQ(gm[i], m0[i]) << tag << ": exp_avg " << i << " outside every range changed";
  }
  if (!lamb) return;
  // The chunk-sums gather: one rank's identity gather sees every chunk and changes no bit; a range
  // without a tensor id is refused under a gather.
  std::vector<VecF> results;
  size_t gathered = 0;
  for (bool with_gather : {false, true}) {
    Dev q(*t.backend, p0, DType::F32, tag + " params"), mm(*t.backend, m0, DType::F32, tag + " m"),
        vv(*t.backend, v0, DType::F32, tag + " v"), g(*t.backend, grads[0], DType::F32, tag + " grads");
    StepChunkSumsGather gather;
    if (with_gather)
      gather = [&](const std::vector<StepChunkSums>& local) {
        gathered = local.size();
        return local;
      };
    t.ops->lamb_step(q.f(), g.f(), mm.f(), vv.f(), ranges, h, 1e-2, 1, 1.0f, gather);
    results.push_back(q.down());
  }
  EXPECT_EQ(gathered, make_step_chunks(ranges).size()) << tag;
  EXPECT_TRUE(bit_equal(results[0], results[1])) << tag << ": an identity gather changed the update";
  std::vector<StepRange> no_id = ranges;
  no_id[1].tensor = -1;
  Dev q(*t.backend, p0, DType::F32, tag + " params"), g(*t.backend, grads[0], DType::F32, tag + " grads");
  const std::string e = error_of([&] {
    t.ops->lamb_step(q.f(), g.f(), m.f(), v.f(), no_id, h, 1e-2, 1, 1.0f,
                     [](const std::vector<StepChunkSums>& l) { return l; });
  });
  EXPECT_NE(e.find("lamb: range 1 has no tensor id"), std::string::npos) << tag << ": " << e;
}

void step_case_norm(const StepTarget& t) {
  Rng rng(92);
  for (size_t n : {size_t{1}, size_t{33}, kStepChunk, 2 * kStepChunk + 77}) {
    const std::string tag = std::string(t.ops->backend) + " n=" + std::to_string(n);
    const VecF x = randn(n, rng, 3.0f);
    Dev d(*t.backend, x, DType::F32, tag + " grads");
    const size_t nchunks = (n + kStepChunk - 1) / kStepChunk;
    VecD want(nchunks, 0.0), got(nchunks, kNaN);
    for (size_t i = 0; i < n; ++i) want[i / kStepChunk] += static_cast<double>(x[i]) * x[i];
    t.ops->grad_sq_chunk_sums(d.f(), n, got.data());
    expect_close_d(got, want, 0.0, 1e-12, tag + " chunk sums");
    double total = 0;
    for (double s : want) total += s;
    EXPECT_NEAR(t.ops->global_grad_norm(d.f(), n), std::sqrt(total), 1e-12 * std::sqrt(total)) << tag;
  }
  for (float bad : {kNaN, std::numeric_limits<float>::infinity()}) {
    VecF x = randn(kStepChunk + 5, rng);
    x[kStepChunk + 2] = bad;
    Dev d(*t.backend, x, DType::F32, "grads");
    EXPECT_FALSE(std::isfinite(t.ops->global_grad_norm(d.f(), x.size()))) << t.ops->backend << " " << bad;
  }
}

void step_case_non_finite(const StepTarget& t) {
  Rng rng(93);
  const size_t n = kStepChunk + 33;
  VecF x = randn(n, rng);
  x[7] = std::numeric_limits<float>::max();  // large, but finite
  x[8] = -std::numeric_limits<float>::denorm_min();
  {
    Dev d(*t.backend, x, DType::F32, "x");
    EXPECT_FALSE(t.ops->has_non_finite(d.f(), n)) << t.ops->backend;
    EXPECT_FALSE(t.ops->has_non_finite(d.f(), 0)) << t.ops->backend;
  }
  for (float bad : {kNaN, std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity()})
    for (size_t at : {size_t{0}, size_t{4097}, n - 1}) {
      VecF y = x;
      y[at] = bad;
      Dev d(*t.backend, y, DType::F32, "x");
      EXPECT_TRUE(t.ops->has_non_finite(d.f(), n)) << t.ops->backend << " " << bad << " at " << at;
      if (at == n - 1) {
        EXPECT_FALSE(t.ops->has_non_finite(d.f(), n - 1)) << "only the first n - 1 elements";
      }
    }
}

void step_case_scale(const StepTarget& t) {
  Rng rng(94);
  for (size_t n : {size_t{1}, size_t{31}, size_t{67}, kStepChunk + 5}) {
    const VecF x = randn(n, rng);
    Dev d(*t.backend, x, DType::F32, std::string(t.ops->backend) + " scale");
    t.ops->scale_inplace(d.f(), n, 0.37f);
    const VecF got = d.down();
    for (size_t i = 0; i < n; ++i) ASSERT_EQ(got[i], x[i] * 0.37f) << t.ops->backend << " n=" << n << " i=" << i;
  }
}

struct StepCase {
  const char* op;
  std::vector<const char*> slots;
  std::function<void(const StepTarget&)> run;
};

const std::vector<StepCase>& step_cases() {
  static const std::vector<StepCase> all = {
      {"adamw", {"adamw_step"}, [](const StepTarget& t) { step_case_update(t, false); }},
      {"lamb", {"lamb_step"}, [](const StepTarget& t) { step_case_update(t, true); }},
      {"grad_norm", {"grad_sq_chunk_sums", "global_grad_norm"}, step_case_norm},
      {"non_finite", {"has_non_finite"}, step_case_non_finite},
      {"scale", {"scale_inplace"}, step_case_scale},
      {"device_index",
       {"device_index"},
       [](const StepTarget& t) {
         EXPECT_EQ(t.ops->device_index() < 0, t.backend->device() == DeviceKind::Host) << t.ops->backend;
       }},
  };
  return all;
}

struct StepParam {
  StepTarget target;
  const StepCase* c;
};
std::vector<StepParam> all_step_params() {
  std::vector<StepParam> v;
  for (const Backend* b : backends())
    if (const StepOps* s = b->step_ops())
      for (const StepCase& c : step_cases()) v.push_back({{b, s}, &c});
  return v;
}
void PrintTo(const StepParam& p, std::ostream* os) { *os << p.target.backend->name() << " " << p.c->op; }

class BackendOpsStep : public ::testing::TestWithParam<StepParam> {};

TEST_P(BackendOpsStep, MatchesDoubleReference) {
  const StepParam& p = GetParam();
  if (const std::string why = p.target.backend->unavailable(); !why.empty())
    GTEST_SKIP() << p.target.backend->name() << " cannot run here: " << why;
  for (const char* slot : p.c->slots) {
    bool implemented = false, known = false;
    for_each_step_op(*p.target.ops, [&](const char* name, bool has) {
      if (std::string_view(name) == slot) known = true, implemented = has;
    });
    ASSERT_TRUE(known) << "step case " << p.c->op << " names an unknown slot " << slot;
    if (!implemented) GTEST_SKIP() << "not supported: " << slot << " on " << p.target.backend->name();
  }
  p.c->run(p.target);
}

INSTANTIATE_TEST_SUITE_P(Registry, BackendOpsStep, ::testing::ValuesIn(all_step_params()),
                         [](const ::testing::TestParamInfo<StepParam>& i) {
                           return std::string(i.param.target.backend->name()) + "_" + i.param.c->op;
                         });

// Every slot of StepOps has a case, and the backends that must have a table do: the CPU (optim/'s
// own kernels) and the CUDA backend of a CUDA build; the no-CUDA stand-in has none.
TEST(BackendOpsStep, EverySlotHasACaseAndTheTablesAreRegistered) {
  for_each_step_op(StepOps{}, [&](const char* name, bool) {
    bool covered = false;
    for (const StepCase& c : step_cases())
      for (const char* s : c.slots) covered = covered || std::string_view(s) == name;
    EXPECT_TRUE(covered) << "no step case in test_backend_ops.cpp calls " << name;
  });
  ASSERT_NE(cpu_backend().step_ops(), nullptr);
  EXPECT_EQ(std::string(cpu_backend().step_ops()->backend), "cpu");
  EXPECT_EQ(no_cuda_backend().step_ops(), nullptr);
  if (&cuda_backend() != &no_cuda_backend()) {
    EXPECT_NE(cuda_backend().step_ops(), nullptr);
  }
}

// ================================ registry and dispatch errors =================================

}  // namespace
