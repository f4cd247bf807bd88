// A context-parallel model (parallel/context_parallel.h attach_context_parallel, issue 27) on the
// thread communicator: N ranks each holding chunks i and 2N-1-i of every sample (embedding, norms,
// MLP and loss on their rows, positions global, attention across the group) give, summed over the
// group, the loss and the gradients of one model over the whole sequence. GPT-2 (learned
// positions), Llama GQA (RoPE), Qwen3 (q/k norms) and Gemma 2 (score scale, soft caps); causal, documents (length-1
// ones, ones crossing chunks) and documents with positions restarting per document; ring and all-gather; context 2
// and 4. The attention weights are scaled up so that attention is far from uniform.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "dist/comm.h"
#include "models/documents.h"
#include "models/model.h"
#include "parallel/context_parallel.h"
#include "tp_fixtures.h"

namespace {

using namespace lathe;
using parallel::ContextImpl;

constexpr int64_t kB = 2, kT = 48;
constexpr int32_t kEod = 5;

enum class Docs { None, Document, DocumentResetPositions };

// q/k (and fused qkv) weights x 12: scores of order one instead of ~0 at the 0.02 init.
void sharpen_attention(Model& m) {
  for (const ParamSpec& s : m.params().specs()) {
    const std::string& n = s.name;
    if (n.find("c_attn.weight") == std::string::npos && n.find("q_proj.weight") == std::string::npos &&
        n.find("k_proj.weight") == std::string::npos)
      continue;
    for (int64_t i = 0; i < s.numel(); ++i) m.param_data()[s.offset + i] *= 12.0f;
  }
  m.refresh_compute_weights();
}

// Tokens with EODs at chosen places: two in a row (a length-1 document), documents crossing chunk
// boundaries (chunks of 12 at N = 2, 6 at N = 4).
tp_test::Batch batch(const ModelConfig& cfg) {
  tp_test::Batch b = tp_test::random_batch(cfg, 3, kB, kT);
  for (auto& t : b.tokens)
    if (t == kEod) t = kEod + 1;
  for (int64_t i : {4, 5, 17, 30, 47}) b.tokens[i] = kEod;
  for (int64_t i : {kT + 10, kT + 11, kT + 12, kT + 40}) b.tokens[i] = kEod;
  return b;
}

struct Docsets {
  std::vector<int32_t> doc_start, positions;  // [B, T]
};

Docsets docsets(const tp_test::Batch& b) {
  Docsets d;
  d.doc_start.resize(kB * kT);
  d.positions.resize(kB * kT);
  documents_from_eod(b.tokens.data(), kB, kT, kEod, d.doc_start.data(), d.positions.data());
  return d;
}

struct Result {
  double loss = 0;
  std::vector<float> grads;
};

Result one_rank(const Model& init, const tp_test::Batch& b, Docs docs) {
  auto m = build_model(init.config());
  std::copy(init.param_data(), init.param_data() + init.num_params(), m->param_data());
  m->refresh_compute_weights();
  m->allocate(kB, kT);
  const Docsets d = docsets(b);
  if (docs != Docs::None)
    m->set_documents(d.doc_start.data(), docs == Docs::DocumentResetPositions ? d.positions.data() : nullptr, kB, kT);
  m->zero_grad();
  Result r;
  r.loss = m->forward_backward(b.tokens.data(), b.targets.data(), kB, kT, 1.0f / (kB * kT), true);
  r.grads.assign(m->grad_data(), m->grad_data() + m->num_params());
  return r;
}

Result context(const Model& init, const tp_test::Batch& b, Docs docs, int N, ContextImpl impl) {
  Result out;
  dist::run_threads(N, [&](dist::Communicator& g) {
    auto m = build_model(init.config());
    std::copy(init.param_data(), init.param_data() + init.num_params(), m->param_data());
    m->refresh_compute_weights();
    parallel::attach_context_parallel(*m, g, impl, kB, kT);
    const int64_t Tl = kT / N;
    m->allocate(kB, Tl);
    const std::vector<int32_t> rows = parallel::context_rows(kT, N, g.rank());
    std::vector<int32_t> tokens(kB * Tl), targets(kB * Tl), ds(kB * Tl), pos(kB * Tl);
    parallel::context_batch(rows, kB, kT, b.tokens.data(), tokens.data());
    parallel::context_batch(rows, kB, kT, b.targets.data(), targets.data());
    const Docsets d = docsets(b);
    parallel::context_batch(rows, kB, kT, d.doc_start.data(), ds.data());
    parallel::context_positions(rows, kB, kT, docs == Docs::DocumentResetPositions ? d.positions.data() : nullptr,
                                pos.data());
    m->set_documents(docs == Docs::None ? nullptr : ds.data(), pos.data(), kB, Tl);
    m->zero_grad();
    // The loss is the mean over every target of the whole batch: 1 / (B T) on every rank's rows.
    double loss = m->forward_backward(tokens.data(), targets.data(), kB, Tl, 1.0f / (kB * kT), true);
    // Replicated weights: their gradients summed over the context group (as over data ranks).
    g.all_reduce(m->grad_data(), m->num_params(), DType::F32);
    g.all_reduce(&loss, 1, DType::F64);
    if (g.rank() == 0) {
      out.loss = loss;
      out.grads.assign(m->grad_data(), m->grad_data() + m->num_params());
    }
  });
  return out;
}

void check_family(const char* name, const ModelConfig& cfg) {
  auto init = build_model(cfg);
  tp_test::perturbed_init(*init);
  sharpen_attention(*init);
  const tp_test::Batch b = batch(cfg);
  for (Docs docs : {Docs::None, Docs::Document, Docs::DocumentResetPositions}) {
    const Result ref = one_rank(*init, b, docs);
    for (int N : {2, 4})
      for (ContextImpl impl : {ContextImpl::Ring, ContextImpl::AllGather}) {
        const Result got = context(*init, b, docs, N, impl);
        const std::string what = std::string(name) + " docs=" + std::to_string(static_cast<int>(docs)) +
                                 " N=" + std::to_string(N) + " " + parallel::context_impl_name(impl);
        EXPECT_NEAR(got.loss, ref.loss, 1e-5 * std::fabs(ref.loss)) << what;
        const double err = tp_test::rel_err(got.grads.data(), ref.grads.data(), static_cast<int64_t>(ref.grads.size()));
        EXPECT_LT(err, 1e-5) << what;
      }
  }
}

TEST(ContextParallelModel, Gpt2LearnedPositions) { check_family("gpt2", ModelConfig::preset("gpt2-debug")); }
TEST(ContextParallelModel, LlamaGqaRope) { check_family("llama_gqa", ModelConfig::preset("llama-debug")); }
TEST(ContextParallelModel, Qwen3QkNorm) { check_family("qwen3", ModelConfig::preset("qwen3-debug")); }
// Gemma 2: query_pre_attn_scalar's score scale and attn_logit_softcapping in the block kernel, the
// alternating sliding window, the embedding scale and the final logit soft cap on the rank's rows.
TEST(ContextParallelModel, Gemma2ScaleSoftcapWindow) { check_family("gemma2", ModelConfig::preset("gemma2-debug")); }
// Sliding window of 7 keys (Mistral's), shorter than a chunk at N = 2 and longer at N = 4.
TEST(ContextParallelModel, LlamaSlidingWindow) {
  ModelConfig c = ModelConfig::preset("llama-debug");
  c.sliding_window = 7;
  c.validate("LlamaSlidingWindow");
  check_family("llama_window7", c);
}

// Documents matter: the same model without them differs (the test is not blind to the masks).
TEST(ContextParallelModel, DocumentsChangeTheResult) {
  const ModelConfig cfg = ModelConfig::preset("llama-debug");
  auto init = build_model(cfg);
  tp_test::perturbed_init(*init);
  sharpen_attention(*init);
  const tp_test::Batch b = batch(cfg);
  const Result causal = context(*init, b, Docs::None, 2, ContextImpl::Ring);
  const Result docs = context(*init, b, Docs::Document, 2, ContextImpl::Ring);
  EXPECT_GT(std::fabs(causal.loss - docs.loss), 1e-4);
}

}  // namespace
