// parallel/model_parallel.h: the rank layout (tensor fastest, then data, then pipeline), the
// process groups split from it, and RankShare's scatter / gather / owned ranges for tensor-only,
// pipeline-only and tensor x pipeline layouts, on the in-process thread communicator.
// Oracles: the layout formula written out; each group's members checked through a sum of world
// ranks; scatter then gather must give the whole model's weights back bit for bit; the owned
// ranges must count every element of the whole model exactly once over a replica (the sum of
// squares of the owned weights equals the whole model's, and the element counts add up).
// Also parallel::parallelize (parallel/parallelize.h), the last test.
#include <gtest/gtest.h>

#include <cmath>
#include <mutex>

#include "dist/comm.h"
#include "models/model.h"
#include "parallel/model_parallel.h"
#include "parallel/parallelize.h"
#include "parallel/pipeline_stage.h"

using namespace lathe;
using namespace lathe::parallel;

TEST(ModelParallel, RankLayoutIsTensorFastestThenDataThenPipeline) {
  for (auto [world, tp, pp] : {std::tuple{8, 2, 2}, {12, 3, 2}, {6, 1, 3}, {4, 4, 1}, {1, 1, 1}}) {
    const int dp = world / (tp * pp);
    for (int r = 0; r < world; ++r) {
      const RankLayout l = RankLayout::of(r, world, tp, pp);
      EXPECT_EQ(l.dp, dp);
      EXPECT_EQ((l.pp_rank * dp + l.dp_rank) * tp + l.tp_rank, r) << world << " " << tp << " " << pp;
      EXPECT_TRUE(l.tp_rank < tp && l.dp_rank < dp && l.pp_rank < pp);
    }
  }
  EXPECT_THROW(RankLayout::of(0, 6, 4, 1), Error);  // 4 does not divide 6
}

TEST(ModelParallel, GroupsHoldTheRanksThatShareTheOtherCoordinates) {
  const int world = 8, tp = 2, pp = 2;
  dist::run_threads(world, [&](dist::Communicator& w) {
    const RankLayout l = RankLayout::of(w.rank(), world, tp, pp);
    ProcessGroups g = make_process_groups(w, l);
    ASSERT_TRUE(g.tp && g.pp && g.dp && g.replica);
    EXPECT_EQ(g.model_group(), g.replica.get());
    // The sum of the members' world ranks, against the formula's members.
    auto sum_of = [&](dist::Communicator& c) {
      int64_t x = w.rank();
      c.all_reduce(&x, 1, DType::I64);
      return x;
    };
    auto rank_of = [&](int t, int d, int p) { return (p * l.dp + d) * tp + t; };
    int64_t want_tp = 0, want_pp = 0, want_dp = 0, want_rep = 0;
    for (int t = 0; t < tp; ++t) want_tp += rank_of(t, l.dp_rank, l.pp_rank);
    for (int p = 0; p < pp; ++p) want_pp += rank_of(l.tp_rank, l.dp_rank, p);
    for (int d = 0; d < l.dp; ++d) want_dp += rank_of(l.tp_rank, d, l.pp_rank);
    for (int p = 0; p < pp; ++p)
      for (int t = 0; t < tp; ++t) want_rep += rank_of(t, l.dp_rank, p);
    EXPECT_EQ(sum_of(*g.tp), want_tp);
    EXPECT_EQ(sum_of(*g.pp), want_pp);
    EXPECT_EQ(sum_of(*g.dp), want_dp);
    EXPECT_EQ(sum_of(*g.replica), want_rep);
    EXPECT_EQ(g.tp->rank(), l.tp_rank);
    EXPECT_EQ(g.pp->rank(), l.pp_rank);
    EXPECT_EQ(g.dp->rank(), l.dp_rank);
    // Checkpoint writers: tensor rank 0 of pipeline rank 0, one per data rank, ordered by it.
    EXPECT_EQ(g.ckpt_writers != nullptr, l.tp_rank == 0 && l.pp_rank == 0);
    if (g.ckpt_writers) {
      EXPECT_EQ(g.ckpt_writers->rank(), l.dp_rank);
    }
  });
}

namespace {

struct ShareCase {
  const char* name;
  const char* preset;
  int64_t layers, vocab;  // vocab 97: not divisible by 2 (uneven vocabulary shards)
  bool tied;
  int tp, pp;
};

void check_share(const ShareCase& c) {
  SCOPED_TRACE(c.name);
  ModelConfig cfg = ModelConfig::preset(c.preset);
  cfg.num_hidden_layers = c.layers;
  cfg.vocab_size = c.vocab;
  cfg.tie_word_embeddings = c.tied;
  auto whole = build_model(cfg, ComputeSpec{nullptr, DType::F32, false});
  whole->init_weights(7);
  const size_t P = whole->num_params();
  double want_sq = 0;
  for (size_t i = 0; i < P; ++i) want_sq += double(whole->param_data()[i]) * whole->param_data()[i];
  Recipe r;
  r.source = "test";
  r.parallel.pipeline = c.pp;
  r.training.grad_accum_steps = c.pp;
  std::mutex mu;
  dist::run_threads(c.tp * c.pp, [&](dist::Communicator& w) {
    const RankLayout l = RankLayout::of(w.rank(), w.size(), c.tp, c.pp);
    ProcessGroups g = make_process_groups(w, l);
    PipelineLayout pl;
    if (c.pp > 1) pl = pipeline_layout(r, c.layers, whole->arch().tied_lm_head, l.pp_rank);
    auto local = build_rank_model(*whole, c.tp, l.tp_rank, false, c.pp > 1 ? &pl : nullptr);
    RankShare share(whole->params(), local->params(), c.pp > 1 ? &pl : nullptr, l.tp_rank, c.tp, g.tp.get(),
                    g.pp.get());
    share.scatter(whole->param_data(), local->param_data());
    std::vector<float> back(P, NAN);
    share.gather(local->param_data(), back.data());
    size_t differ = 0;
    for (size_t i = 0; i < P; ++i) differ += back[i] != whole->param_data()[i];
    // Every element counted once over the replica.
    double sums[2] = {0, 0};  // elements, sum of squares
    for (auto [b, e] : share.owned_ranges()) {
      sums[0] += static_cast<double>(e - b);
      for (size_t i = b; i < e; ++i) sums[1] += double(local->param_data()[i]) * local->param_data()[i];
    }
    w.all_reduce(sums, 2, DType::F64);
    std::lock_guard<std::mutex> lk(mu);
    EXPECT_EQ(differ, 0u) << "rank " << w.rank() << ": gather(scatter(whole)) differs in " << differ << " values";
    EXPECT_EQ(static_cast<size_t>(sums[0]), P) << "rank " << w.rank();
    EXPECT_NEAR(sums[1], want_sq, 1e-9 * want_sq) << "rank " << w.rank();
    EXPECT_LT(local->num_params(), P);
  });
}

}  // namespace

TEST(ModelParallel, ShareRoundTripsAndCountsEachElementOnce) {
  for (const ShareCase& c : {ShareCase{"gpt2 tied, tp2 x pp2, V 97", "gpt2-debug", 4, 97, true, 2, 2},
                             ShareCase{"llama untied GQA, tp2 x pp2", "llama-debug", 4, 96, false, 2, 2},
                             ShareCase{"gpt2 tied, pp3", "gpt2-debug", 3, 96, true, 1, 3},
                             ShareCase{"llama tp2", "llama-debug", 2, 97, false, 2, 1}})
    check_share(c);
}

// parallel/parallelize.h: the rank's model from the whole model (with its weights: each rank takes
// its share; a table only: init_shard draws the same values), its stage, hooks and executor.
// Oracles: current_whole() (gather over the replica) gives the whole model's weights back bit for
// bit; a table-only fresh start gives every rank the same weights as the whole model's init_weights
// with the same seed, scattered.
TEST(ModelParallel, ParallelizeGivesEachRankItsShareOfTheWholeModel) {
  for (auto [tp, pp] : {std::pair{2, 2}, std::pair{2, 1}, std::pair{1, 2}}) {
    SCOPED_TRACE(testing::Message() << "tp " << tp << " pp " << pp);
    ModelConfig cfg = ModelConfig::preset("gpt2-debug");
    cfg.num_hidden_layers = 4;
    cfg.vocab_size = 97;
    const uint64_t seed = 11;
    auto ref = build_model(cfg, ComputeSpec{nullptr, DType::F32, false});
    ref->init_weights(seed);
    const size_t P = ref->num_params();
    Recipe r;
    r.source = "test";
    r.parallel.tensor = tp;
    r.parallel.pipeline = pp;
    r.training.grad_accum_steps = 2;
    const ParallelConfig pc = ParallelConfig::of(r);
    std::mutex mu;
    dist::run_threads(tp * pp, [&](dist::Communicator& w) {
      Topology topo(w, r.parallel);
      // From the whole model's weights (fresh: init_weights(seed) on it first).
      InitialWeights from_whole;
      from_whole.fresh = true;
      from_whole.seed = seed;
      auto a = parallelize(build_model(cfg, ComputeSpec{nullptr, DType::F32, false}), topo, pc, from_whole, 1, 8);
      // From the whole model's table only: init_shard.
      ComputeSpec table{nullptr, DType::F32, false};
      table.parameters = false;
      InitialWeights from_table = from_whole;
      from_table.whole_has_weights = false;
      auto b = parallelize(build_model(cfg, table), topo, pc, from_table, 1, 8);
      const size_t n = a->model().num_params();
      size_t differ = 0;
      for (size_t i = 0; i < n; ++i) differ += a->model().param_data()[i] != b->model().param_data()[i];
      Model& whole = a->current_whole();
      size_t differ_whole = 0;
      for (size_t i = 0; i < P; ++i) differ_whole += whole.param_data()[i] != ref->param_data()[i];
      a->release_whole();
      std::lock_guard<std::mutex> lk(mu);
      EXPECT_TRUE(a->sharded());
      EXPECT_EQ(a->whole_params(), P);
      EXPECT_EQ(a->pipe() != nullptr, pp > 1);
      EXPECT_EQ(a->tp(), tp);
      EXPECT_EQ(a->tp_rank(), topo.lay.tp_rank);
      EXPECT_EQ(b->model().num_params(), n);
      EXPECT_LT(n, P);
      EXPECT_EQ(differ, 0u) << "rank " << w.rank() << ": init_shard differs from the whole model's init, scattered";
      EXPECT_EQ(differ_whole, 0u) << "rank " << w.rank() << ": current_whole differs from the whole model";
    });
  }
}
