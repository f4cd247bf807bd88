// The Checkpointer (train/checkpointer.h) in process, driven through a TrainSession as train()'s
// loop drives it: a checkpoint saved after step 2 restores, in a new session, the weights, this
// rank's moments, the step, the data position and the seed the data order derives from, and the
// resumed steps are the uninterrupted run's bit for bit -- in one process and on two data ranks
// with ZeRO 1 (each rank writing and reading its shard of the moments). A session that does not
// resume starts elsewhere (so the comparisons can fail). due() follows output.checkpoint_every
// (and the final step), and output.keep_last keeps the newest checkpoints only.
#include <gtest/gtest.h>

#include <string>
#include <tuple>
#include <vector>

#include "dist/comm.h"
#include "session_fixtures.h"
#include "train/checkpoint.h"

namespace {

using namespace lathe;
using namespace lathe::session_test;

std::vector<std::vector<float>> moments_of(TrainSession& s) {
  std::vector<std::vector<float>> out;
  for (auto& [name, buf] : s.step_context().opt.local().state_buffers())
    out.emplace_back(buf->data(), buf->data() + buf->size());
  return out;
}

struct Snapshot {
  int64_t step = 0;
  std::vector<float> weights;
  std::vector<std::vector<float>> moments;
  data::LoaderState loader;
  optim::LossScalerState scaler;
};

Snapshot snapshot(TrainSession& s, int64_t step) {
  StepContext& c = s.step_context();
  return {step, weights_of(s), moments_of(s), c.loader.state(), c.scaler.state()};
}

void expect_same(const Snapshot& got, const Snapshot& want) {
  EXPECT_EQ(got.step, want.step);
  EXPECT_TRUE(got.weights == want.weights) << "weights";
  ASSERT_EQ(got.moments.size(), want.moments.size());
  for (size_t i = 0; i < got.moments.size(); ++i) EXPECT_TRUE(got.moments[i] == want.moments[i]) << "moment " << i;
  EXPECT_EQ(got.loader.epoch, want.loader.epoch);
  EXPECT_EQ(got.loader.position, want.loader.position);
  EXPECT_EQ(got.scaler.scale, want.scaler.scale);
  EXPECT_EQ(got.scaler.good_steps, want.scaler.good_steps);
  EXPECT_EQ(got.scaler.skipped_steps, want.scaler.skipped_steps);
}

struct RankResult {
  Snapshot saved, resumed, fresh;
  std::string ckpt;
  Steps tail, resumed_tail;  // steps 3..4 of the uninterrupted run and of the resumed one
  std::vector<float> end_weights, resumed_end_weights;
};

class CheckpointerRoundTrip : public ::testing::TestWithParam<std::tuple<int, int>> {};

TEST_P(CheckpointerRoundTrip, SaveThenRestoreContinuesTheRun) {
  const auto [world, zero] = GetParam();
  TempDir tmp("checkpointer");
  const std::string data = make_data(tmp.path);
  RecipeSpec spec;
  spec.steps = 4;
  spec.zero = zero;
  const fs::path out = tmp.path / "run";
  std::vector<RankResult> res(static_cast<size_t>(world));
  dist::run_threads(world, [&](dist::Communicator& comm) {
    RankResult& me = res[static_cast<size_t>(comm.rank())];
    const Recipe r = recipe(data, out, spec);
    {  // the uninterrupted run, with a checkpoint after step 2
      TrainSession s(r, quiet(&comm));
      const Steps head = run_steps(s, 0, 2);
      s.save_checkpoint(2, head.stats.back().lr);
      me.ckpt = s.ckpt().last_saved();
      me.saved = snapshot(s, 2);
      me.tail = run_steps(s, 2, 4);
      me.end_weights = weights_of(s);
    }
    {  // a new session resuming from it
      TrainOptions o = quiet(&comm);
      o.resume = me.ckpt;
      TrainSession s(r, o);
      me.resumed = snapshot(s, s.start_step());
      me.resumed_tail = run_steps(s, s.start_step(), s.steps());
      me.resumed_end_weights = weights_of(s);
    }
    {  // a session that does not resume (another directory: output.dir holds the run above)
      TrainSession s(recipe(data, tmp.path / "fresh", spec), quiet(&comm));
      me.fresh = snapshot(s, s.start_step());
    }
  });
  for (int rank = 0; rank < world; ++rank) {
    SCOPED_TRACE("rank " + std::to_string(rank));
    const RankResult& me = res[static_cast<size_t>(rank)];
    EXPECT_EQ(me.ckpt, (out / "checkpoints" / "step_00000002").string());
    // What state.json records: the step, samples consumed, data position and the seed.
    const CheckpointState cs = read_checkpoint_state(me.ckpt);
    EXPECT_EQ(cs.step, 2);
    EXPECT_EQ(cs.consumed_samples, 2 * 2 * world);  // 2 steps x global batch (micro-batch 2 x ranks)
    EXPECT_EQ(cs.loader.position, me.saved.loader.position);
    EXPECT_EQ(cs.loader.epoch, me.saved.loader.epoch);
    ASSERT_EQ(cs.rng.size(), 1u);
    EXPECT_EQ(cs.rng[0], 7u) << "training.seed";
    EXPECT_GT(me.saved.loader.position, 0);
    // The round trip.
    expect_same(me.resumed, me.saved);
    EXPECT_EQ(me.resumed_tail.losses, me.tail.losses) << "the resumed steps are the uninterrupted run's";
    EXPECT_EQ(me.resumed_tail.norms, me.tail.norms);
    EXPECT_TRUE(me.resumed_end_weights == me.end_weights);
    // The comparison can fail: a fresh session starts at step 0 from other weights, no moments, no data taken.
    EXPECT_EQ(me.fresh.step, 0);
    EXPECT_FALSE(me.fresh.weights == me.saved.weights);
    ASSERT_FALSE(me.saved.moments.empty());
    EXPECT_FALSE(me.fresh.moments[0] == me.saved.moments[0]) << "the moments after 2 steps are not the fresh zeros";
    EXPECT_EQ(me.fresh.loader.position, 0);
  }
  if (world == 2 && zero == 1) {
    EXPECT_FALSE(res[0].saved.moments[0] == res[1].saved.moments[0]) << "ZeRO 1: each rank holds its own shard";
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, CheckpointerRoundTrip,
                         ::testing::Values(std::make_tuple(1, 0), std::make_tuple(2, 0), std::make_tuple(2, 1)),
                         [](const auto& info) {
                           return "dp" + std::to_string(std::get<0>(info.param)) + "_zero" +
                                  std::to_string(std::get<1>(info.param));
                         });

// train()'s checkpoint schedule: due() every output.checkpoint_every steps and at the final one;
// keep_last N leaves the newest N once the background cleanup is done; checkpoint_every 0 never.
TEST(Checkpointer, DueAndKeepLast) {
  TempDir tmp("checkpointer_due");
  const std::string data = make_data(tmp.path);
  for (int keep : {2, 0}) {
    SCOPED_TRACE("keep_last " + std::to_string(keep));
    RecipeSpec spec;
    spec.steps = 7;
    spec.checkpoint_every = 2;
    spec.keep_last = keep;
    const fs::path out = tmp.path / ("keep" + std::to_string(keep));
    std::vector<int64_t> due;
    {
      TrainSession s(recipe(data, out, spec), quiet(nullptr));
      for (int64_t step = 0; step < s.steps(); ++step) {
        const StepStats st = run_steps(s, step, step + 1).stats.back();
        const int64_t done = step + 1;
        const bool last = done == s.steps();
        if (s.ckpt().due(done, last)) {
          due.push_back(done);
          s.save_checkpoint(done, st.lr);
        }
      }
    }  // the session joins the background removal of old checkpoints
    EXPECT_EQ(due, (std::vector<int64_t>{2, 4, 6, 7}));
    std::vector<int64_t> kept;
    for (const auto& [step, dir] : list_checkpoints(out.string())) kept.push_back(step);
    EXPECT_EQ(kept, keep == 2 ? (std::vector<int64_t>{6, 7}) : (std::vector<int64_t>{2, 4, 6, 7}));
  }
  RecipeSpec never;
  never.steps = 2;
  TrainSession s(recipe(data, tmp.path / "never", never), quiet(nullptr));
  for (int64_t done = 1; done <= 4; ++done) EXPECT_FALSE(s.ckpt().due(done, done == 4)) << done;
}

}  // namespace
