// The pipeline executor (parallel/pipeline_executor.h) against the whole model in one process (the
// oracle): the same global weights, cut into stage models on the in-process thread communicator,
// one step of m micro-batches through the 1F1B or interleaved schedule must give the same loss sum
// and, gathered back from the stages, the same gradients as forward_backward over the m
// micro-batches; forward_loss the same validation loss. GPT-2 (tied wte: the first and last stage
// sum its gradient) and untied Llama; even and uneven stage_layers. Tolerance: 1e-5 relative on
// the loss, gradients within 1e-5 of the largest gradient (only the tied wte's gradient is summed
// in another order: head part + embedding part instead of per micro-batch).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <mutex>

#include "core/rng.h"
#include "dist/comm.h"
#include "models/model.h"
#include "parallel/pipeline_executor.h"
#include "parallel/pipeline_stage.h"

using namespace lathe;
using namespace lathe::parallel;

namespace {

struct Case {
  const char* name;
  const char* preset;
  int64_t layers, p, v, m;
  std::vector<int64_t> stage_layers;
  std::vector<uint8_t> sliding = {};  // per-layer sliding-window flags (window 5 < T = 16), empty = none
};

void run_case(const Case& c) {
  SCOPED_TRACE(c.name);
  ModelConfig cfg = ModelConfig::preset(c.preset);
  cfg.num_hidden_layers = c.layers;
  if (std::string(c.preset) == "llama-debug") cfg.tie_word_embeddings = false;
  if (!c.sliding.empty()) {
    cfg.sliding_window = 5;
    cfg.sliding_layers = c.sliding;
  }
  const int64_t B = 2, T = 16, N = B * T;
  auto whole = build_model(cfg);
  whole->init_weights(11);
  whole->allocate(B, T);
  Rng rng(3);
  std::vector<int32_t> tokens(static_cast<size_t>(c.m * N)), targets(tokens.size());
  for (auto& t : tokens) t = static_cast<int32_t>(rng.next_u64() % static_cast<uint64_t>(cfg.vocab_size));
  for (auto& t : targets) t = static_cast<int32_t>(rng.next_u64() % static_cast<uint64_t>(cfg.vocab_size));
  const float scale = 1.0f / static_cast<float>(c.m * N);
  whole->zero_grad();
  double want = 0;
  for (int64_t i = 0; i < c.m; ++i)
    want += whole->forward_backward(tokens.data() + i * N, targets.data() + i * N, B, T, scale, true);
  const double want_eval = whole->forward_backward(tokens.data(), targets.data(), B, T, 0.0f, false);
  const size_t P = whole->num_params();
  std::vector<float> want_grad(whole->grad_data(), whole->grad_data() + P);
  float gmax = 0;
  for (float g : want_grad) gmax = std::max(gmax, std::fabs(g));

  Recipe r;
  r.source = "test";
  r.parallel.pipeline = c.p;
  r.parallel.virtual_stages = c.v;
  r.parallel.stage_layers = c.stage_layers;
  r.training.grad_accum_steps = c.m;
  std::mutex mu;
  std::vector<float> got_grad(P);
  double got = 0, got_eval = 0;
  dist::run_threads(static_cast<int>(c.p), [&](dist::Communicator& pp) {
    const PipelineLayout l = pipeline_layout(r, c.layers, whole->arch().tied_lm_head, pp.rank());
    auto stage = build_stage_model(*whole, l);
    scatter_stage(whole->params(), whole->param_data(), stage->params(), stage->param_data());
    stage->refresh_compute_weights();
    PipelineExecutor ex(*stage, l, pp, B, T, 0, Recompute::None);
    stage->zero_grad();
    const double loss = ex.step(tokens.data(), targets.data(), scale, nullptr);
    const double eval = ex.forward_loss(tokens.data(), targets.data(), B, nullptr);
    std::vector<float> g(P);
    gather_stages(pp, l, whole->params(), stage->params(), stage->grad_data(), g.data());
    std::lock_guard<std::mutex> lk(mu);
    if (pp.rank() == 0) got_grad = g, got = loss, got_eval = eval;
    // Every rank reports the replica's loss.
    EXPECT_NEAR(loss, want, 1e-5 * std::fabs(want)) << "rank " << pp.rank();
  });
  EXPECT_NEAR(got, want, 1e-5 * std::fabs(want));
  EXPECT_NEAR(got_eval, want_eval, 1e-5 * std::fabs(want_eval));
  double worst = 0;
  size_t at = 0;
  for (size_t i = 0; i < P; ++i)
    if (std::fabs(got_grad[i] - want_grad[i]) > worst) worst = std::fabs(got_grad[i] - want_grad[i]), at = i;
  EXPECT_LE(worst, 1e-5 * gmax) << "gradient element " << at << ": " << got_grad[at] << " vs " << want_grad[at];
}

TEST(PipelineExecutor, Gpt2OneFOneBTwoStages) { run_case({"gpt2 p2", "gpt2-debug", 4, 2, 1, 4, {}}); }
TEST(PipelineExecutor, Gpt2UnevenThreeStages) { run_case({"gpt2 p3 uneven", "gpt2-debug", 4, 3, 1, 5, {1, 2, 1}}); }
TEST(PipelineExecutor, Gpt2Interleaved) { run_case({"gpt2 p2 v2", "gpt2-debug", 4, 2, 2, 4, {}}); }
TEST(PipelineExecutor, LlamaUntiedInterleavedThreeStages) { run_case({"llama p3 v2", "llama-debug", 6, 3, 2, 3, {}}); }

// Layers that mix sliding and full attention keep their own windows in every stage (the flags are
// not symmetric across stages, so a stage reading the whole model's first entries would differ).
TEST(PipelineExecutor, MixedSlidingLayersTwoStages) {
  run_case({"qwen2 mixed windows p2", "qwen2-debug", 4, 2, 1, 4, {}, {1, 1, 0, 1}});
}
TEST(PipelineExecutor, MixedSlidingLayersInterleaved) {
  run_case({"qwen2 mixed windows p2 v2", "qwen2-debug", 4, 2, 2, 4, {}, {1, 0, 0, 1}});
}
TEST(PipelineExecutor, Qwen3TwoStages) { run_case({"qwen3 p2", "qwen3-debug", 4, 2, 1, 4, {}}); }
// gemma2: the embedding scale on the first stage, sandwich and 1 + w norms, GeGLU, the soft-capped
// head on the last (tied to the first stage's embedding), even layers sliding.
TEST(PipelineExecutor, Gemma2TwoStages) { run_case({"gemma2 p2", "gemma2-debug", 4, 2, 1, 4, {}, {1, 0, 1, 0}}); }
TEST(PipelineExecutor, Gemma2InterleavedThreeStages) {
  run_case({"gemma2 p3 v2", "gemma2-debug", 6, 3, 2, 3, {}, {1, 0, 1, 0, 1, 0}});
}
// olmo2: post norms only and whole-projection q/k norms in every stage, the untied head on the last.
TEST(PipelineExecutor, Olmo2TwoStages) { run_case({"olmo2 p2", "olmo2-debug", 4, 2, 1, 4, {}}); }
TEST(PipelineExecutor, Olmo2InterleavedThreeStages) { run_case({"olmo2 p3 v2", "olmo2-debug", 6, 3, 2, 3, {}}); }

TEST(PipelineStage, StageTablesSliceTheWholeTable) {
  // Every tensor of the whole model is held by its owner (a tied wte also by the last stage), and
  // the stage tables hold nothing else.
  ModelConfig cfg = ModelConfig::preset("gpt2-debug");
  cfg.num_hidden_layers = 5;
  auto whole = build_model(cfg);
  Recipe r;
  r.parallel.pipeline = 3;
  r.parallel.stage_layers = {1, 3, 1};
  r.training.grad_accum_steps = 3;
  size_t held = 0;
  for (int rank = 0; rank < 3; ++rank) {
    const PipelineLayout l = pipeline_layout(r, 5, true, rank);
    auto stage = build_stage_model(*whole, l);
    EXPECT_EQ(stage->config().num_hidden_layers, r.parallel.stage_layers[static_cast<size_t>(rank)]);
    for (const ParamSpec& s : stage->params().specs()) EXPECT_TRUE(l.holds(whole->params().at(s.name), rank));
    held += stage->num_params();
  }
  const int64_t wte = cfg.vocab_size * cfg.hidden_size;
  EXPECT_EQ(held, whole->num_params() + static_cast<size_t>(wte));  // wte twice
}

}  // namespace
