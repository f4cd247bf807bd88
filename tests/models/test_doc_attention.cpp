// Document-aware samples (issue 11) through the whole model, against PyTorch running each document
// separately. For GPT-2 (learned positions) and Llama / Qwen2 (RoPE, GQA) this test builds a debug
// model, packs documents into two samples (an EOD followed by an EOD: a document of length 1; a
// document cut by the end of the sample; a sample without any EOD: a document spanning the sample
// boundary), sets them on the model (models/documents.h), masks the targets after EOD, and writes
// logits, the loss and every gradient. torch_reference_docs.py splits each sample at its EODs,
// runs every piece as a batch of its own through the float64 reference model of
// torch_reference.py (positions 0.. per piece with reset_position_ids, else the piece's offsets),
// and compares to 1e-5 relative. Without the python oracle: recompute and the bf16 model give the
// same documents' results, and a model whose documents are cleared is plain causal again.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>

#include "config/model_config.h"
#include "core/rng.h"
#include "interop/hf_weights.h"
#include "io/safetensors.h"
#include "model_fixtures.h"
#include "models/documents.h"

namespace fs = std::filesystem;
using namespace lathe;
using namespace lathe::model_test;

namespace {

constexpr int64_t kB = 2, kT = 13;
constexpr int32_t kEod = 7;

// Row 0: documents [0..3] (EOD at 3), [4] (an EOD alone: length 1), [5..9] (EOD at 9), [10..12]
// (cut by the sample end). Row 1: no EOD (one document spanning the sample).
std::vector<int32_t> make_tokens(int64_t V) {
  Rng rng(11);
  std::vector<int32_t> toks(kB * kT);
  for (auto& t : toks) {
    t = static_cast<int32_t>(rng.below(V));
    if (t == kEod) t = kEod + 1;
  }
  toks[3] = toks[4] = toks[9] = kEod;
  return toks;
}

struct Outputs {
  std::vector<float> logits, grads;
  double loss = 0;
};

struct Mode {
  bool attention = true, reset = true, mask = true;
};

// Biases and norm weights start at 0 / 1; perturbed so their use is exercised.
std::unique_ptr<Model> make_model(const ModelConfig& cfg, DType dt = DType::F32) { return perturbed_model(cfg, dt); }

Outputs run(Model& model, const std::vector<int32_t>& toks, std::vector<int32_t>& tgts, const Mode& m,
            Recompute rc = Recompute::None) {
  model.allocate(kB, kT, 0, rc);
  DocumentOptions o;
  o.document_attention = m.attention;
  o.reset_positions = m.reset;
  o.mask_loss = m.mask;
  o.eod = kEod;
  std::vector<int32_t> ds, pos;
  set_batch_documents(model, o, toks.data(), kB, kT, ds, pos);
  const int64_t V = model.config().vocab_size;
  int64_t kept = kB * kT;
  if (m.mask) kept = mask_loss_after_eod(toks.data(), tgts.data(), kB * kT, kEod);
  Outputs out;
  out.logits.resize(kB * kT * V);
  model.forward_logits(toks.data(), kB, kT, out.logits.data());
  model.zero_grad();
  out.loss = model.forward_backward(toks.data(), tgts.data(), kB, kT, 1.0f / static_cast<float>(kept), true) /
             static_cast<double>(kept);
  out.grads.assign(model.grad_data(), model.grad_data() + model.num_params());
  return out;
}

std::vector<int32_t> make_targets(int64_t V) { return random_tokens(kB * kT, V, 13); }

void check_with_torch(const std::string& name, const ModelConfig& cfg, const Mode& m) {
  const fs::path dir = fs::temp_directory_path() / fmt::format("lathe_docattn_{}_{}", name, getpid());
  fresh_dir(dir);
  auto model = make_model(cfg);
  model->allocate(kB, kT);
  save_hf_model(*model, (dir / "model").string());
  const int64_t V = cfg.vocab_size;
  const auto toks = make_tokens(V);
  auto tgts = make_targets(V);
  const Outputs o = run(*model, toks, tgts, m);
  const float loss = static_cast<float>(o.loss);
  const int32_t flags[4] = {m.attention, m.reset, m.mask, kEod};
  io::write_safetensors((dir / "docs.safetensors").string(), {{"tokens", DType::I32, Shape{kB, kT}, toks.data()},
                                                              {"targets", DType::I32, Shape{kB, kT}, tgts.data()},
                                                              {"flags", DType::I32, Shape{4}, flags},
                                                              {"logits", DType::F32, Shape{kB, kT, V}, o.logits.data()},
                                                              {"loss", DType::F32, Shape{}, &loss}});
  save_hf_tensors(*model, model->grad_data(), (dir / "grads.safetensors").string());
  const std::string cmd =
      fmt::format("/usr/bin/python3 {}/tests/models/torch_reference_docs.py {} 2>&1", LATHE_SOURCE_DIR, dir.string());
  int rc;
  std::string out;
  ASSERT_NO_FATAL_FAILURE(run_oracle(cmd, rc, out));
  EXPECT_EQ(rc, 0) << "torch_reference_docs.py reported a mismatch for " << name << ":\n" << out;
  if (rc == 0) fs::remove_all(dir);
}

ModelConfig preset(const char* n) { return ModelConfig::preset(n); }

}  // namespace

TEST(DocAttention, Gpt2AgainstTorchPerDocument) { check_with_torch("gpt2", preset("gpt2-debug"), {}); }
TEST(DocAttention, LlamaGqaAgainstTorchPerDocument) { check_with_torch("llama", preset("llama-debug"), {}); }
TEST(DocAttention, Qwen2AgainstTorchPerDocument) { check_with_torch("qwen2", preset("qwen2-debug"), {}); }
// Document attention with positions continuing through the sample, and restarted positions with
// attention across the whole sample: each option alone.
TEST(DocAttention, AttentionOnlyAgainstTorch) {
  check_with_torch("gpt2_att", preset("gpt2-debug"), {true, false, false});
  check_with_torch("llama_att", preset("llama-debug"), {true, false, true});
}
TEST(DocAttention, PositionsOnlyAgainstTorch) {
  check_with_torch("gpt2_pos", preset("gpt2-debug"), {false, true, false});
  check_with_torch("llama_pos", preset("llama-debug"), {false, true, false});
}

// Recompute re-runs attention with the same documents: bit-identical to keeping the activations.
TEST(DocAttention, RecomputeIsBitIdentical) {
  for (const char* name : {"gpt2-debug", "llama-debug"}) {
    const ModelConfig cfg = preset(name);
    auto model = make_model(cfg);
    const auto toks = make_tokens(cfg.vocab_size);
    auto t1 = make_targets(cfg.vocab_size), t2 = t1;
    const Outputs a = run(*model, toks, t1, {}, Recompute::None);
    const Outputs b = run(*model, toks, t2, {}, Recompute::Full);
    EXPECT_EQ(a.loss, b.loss) << name;
    EXPECT_EQ(0, std::memcmp(a.grads.data(), b.grads.data(), a.grads.size() * sizeof(float))) << name;
  }
}

// The bf16 model takes the same documents (its own tables): the loss is within bf16 rounding of
// the fp32 model's with documents, and further from the fp32 causal loss than that.
TEST(DocAttention, Bf16FollowsDocuments) {
  const ModelConfig cfg = preset("llama-debug");
  auto f32 = make_model(cfg), b16 = make_model(cfg, DType::BF16);
  const auto toks = make_tokens(cfg.vocab_size);
  auto t1 = make_targets(cfg.vocab_size), t2 = t1, t3 = t1;
  const Outputs a = run(*f32, toks, t1, {});
  const Outputs b = run(*b16, toks, t2, {});
  f32->set_documents(nullptr, nullptr, 0, 0);
  const Outputs c = run(*f32, toks, t3, {false, false, true});
  EXPECT_NEAR(a.loss, b.loss, 2e-2 * a.loss);
  EXPECT_GT(std::fabs(a.loss - c.loss), 4 * std::fabs(a.loss - b.loss));
}

// Clearing the documents returns to plain causal attention, bit for bit; a pass of another shape
// while documents are set is refused.
TEST(DocAttention, ClearedDocumentsAreCausalAndShapeIsChecked) {
  const ModelConfig cfg = preset("gpt2-debug");
  auto model = make_model(cfg);
  const auto toks = make_tokens(cfg.vocab_size);
  auto t1 = make_targets(cfg.vocab_size), t2 = t1;
  const Outputs causal = run(*model, toks, t1, {false, false, false});
  std::vector<int32_t> ds(kB * kT), pos(kB * kT);
  documents_from_eod(toks.data(), kB, kT, kEod, ds.data(), pos.data());
  model->set_documents(ds.data(), pos.data(), kB, kT);
  std::vector<float> logits(kT * cfg.vocab_size);
  EXPECT_THROW(model->forward_logits(toks.data(), 1, kT, logits.data()), Error);
  model->set_documents(nullptr, nullptr, 0, 0);
  const Outputs again = run(*model, toks, t2, {false, false, false});
  EXPECT_EQ(causal.loss, again.loss);
  EXPECT_EQ(0, std::memcmp(causal.grads.data(), again.grads.data(), causal.grads.size() * sizeof(float)));
  pos[1] = 5;  // beyond its token index
  EXPECT_THROW(model->set_documents(ds.data(), pos.data(), kB, kT), Error);
}

TEST(DocAttention, SegmentsFromEod) {
  // A document ends AT its EOD; the next token starts one. Targets at EOD tokens are masked.
  const std::vector<int32_t> toks = {5, 7, 7, 1, 2, 7, 3, 4};
  std::vector<int32_t> ds(8), pos(8), tg = {1, 2, 3, 4, 5, 6, 7, 8};
  documents_from_eod(toks.data(), 2, 4, 7, ds.data(), pos.data());
  EXPECT_EQ(ds, (std::vector<int32_t>{0, 0, 2, 3, 0, 0, 2, 2}));
  EXPECT_EQ(pos, (std::vector<int32_t>{0, 1, 0, 0, 0, 1, 0, 1}));
  EXPECT_EQ(mask_loss_after_eod(toks.data(), tg.data(), 8, 7), 5);
  EXPECT_EQ(tg, (std::vector<int32_t>{1, -1, -1, 4, 5, -1, 7, 8}));
  EXPECT_EQ(parse_attention_mode("document"), AttentionMode::Document);
  EXPECT_THROW(parse_attention_mode("documents"), Error);
}
