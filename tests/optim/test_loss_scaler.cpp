// The loss scaler's state machine against sequences derived by hand from the rules in
// optim/loss_scaler.h (PyTorch GradScaler: halve on overflow and restart the clean-step count,
// double after growth_interval clean steps in a row).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core/error.h"
#include "optim/loss_scaler.h"

using namespace lathe::optim;
using V = LossScaler::Verdict;

namespace {

LossScaleConfig fp16(double initial = 65536, int64_t interval = 3, int64_t max_skipped = 0) {
  LossScaleConfig c;
  c.enabled = true;
  c.initial = initial;
  c.growth_interval = interval;
  c.max_skipped_steps = max_skipped;
  return c;
}

struct Expect {
  bool overflow;
  V verdict;
  double scale_after;
  int64_t good_after;
};

void run(LossScaler& s, const std::vector<Expect>& seq, int64_t first_step = 1) {
  int64_t step = first_step;
  for (const Expect& e : seq) {
    SCOPED_TRACE("step " + std::to_string(step));
    EXPECT_EQ(s.update(e.overflow, step), e.verdict);
    EXPECT_EQ(s.scale(), e.scale_after);
    EXPECT_EQ(s.state().good_steps, e.good_after);
    ++step;
  }
}

}  // namespace

TEST(LossScaler, DefaultsArePyTorchAndMegatron) {
  LossScaleConfig c;
  EXPECT_EQ(c.initial, 65536.0);
  EXPECT_EQ(c.growth_interval, 2000);
  EXPECT_EQ(c.backoff, 0.5);
  EXPECT_EQ(c.growth, 2.0);
  EXPECT_EQ(c.min, 1.0);
  EXPECT_FALSE(c.enabled);
  c.enabled = true;
  EXPECT_EQ(LossScaler(c).scale(), 65536.0);
}

TEST(LossScaler, HalvesOnOverflowAndGrowsAfterInterval) {
  LossScaler s(fp16(1024, 3));
  // clean, clean, overflow (halve, count restarts), clean x3 (grow on the third), clean, overflow.
  run(s, {{false, V::Apply, 1024, 1},
          {false, V::Apply, 1024, 2},
          {true, V::Skip, 512, 0},
          {false, V::Apply, 512, 1},
          {false, V::Apply, 512, 2},
          {false, V::Apply, 1024, 0},
          {false, V::Apply, 1024, 1},
          {true, V::Skip, 512, 0},
          {true, V::Skip, 256, 0},
          {false, V::Apply, 256, 1}});
  EXPECT_EQ(s.state().skipped_steps, 3);
  EXPECT_EQ(s.state().consecutive_skipped, 0);
}

TEST(LossScaler, GrowthIntervalOneGrowsEveryCleanStep) {
  LossScaler s(fp16(8, 1));
  run(s, {{false, V::Apply, 16, 0}, {false, V::Apply, 32, 0}, {true, V::Skip, 16, 0}, {false, V::Apply, 32, 0}});
}

TEST(LossScaler, CustomBackoffAndGrowth) {
  LossScaleConfig c = fp16(1000, 2);
  c.backoff = 0.25;
  c.growth = 3;
  c.min = 100;
  LossScaler s(c);
  // 1000 -> 250 -> clamped at min 100 -> grows x3 after 2 clean steps.
  run(s, {{true, V::Skip, 250, 0},
          {true, V::Skip, 100, 0},
          {false, V::Apply, 100, 1},
          {false, V::Apply, 300, 0},
          {false, V::Apply, 300, 1}});
}

TEST(LossScaler, OverflowAtMinimumStopsNamingStepAndScale) {
  LossScaleConfig c = fp16(4, 1000);
  c.min = 1;
  LossScaler s(c);
  run(s, {{true, V::Skip, 2, 0}, {true, V::Skip, 1, 0}}, 7);
  EXPECT_EQ(s.update(true, 9), V::Stop);
  const std::string& why = s.stop_reason();
  EXPECT_NE(why.find("step 9"), std::string::npos) << why;
  EXPECT_NE(why.find("minimum loss scale 1"), std::string::npos) << why;
  EXPECT_NE(why.find("precision.loss_scale.min"), std::string::npos) << why;
}

TEST(LossScaler, ConsecutiveSkipsStopNamingTheSteps) {
  LossScaler s(fp16(65536, 2000, 3));
  run(s, {{true, V::Skip, 32768, 0}, {false, V::Apply, 32768, 1}, {true, V::Skip, 16384, 0}, {true, V::Skip, 8192, 0}},
      10);
  EXPECT_EQ(s.update(true, 14), V::Stop);
  const std::string& why = s.stop_reason();
  EXPECT_NE(why.find("steps 12-14"), std::string::npos) << why;
  EXPECT_NE(why.find("3 consecutive"), std::string::npos) << why;
  EXPECT_NE(why.find("training.max_skipped_steps = 3"), std::string::npos) << why;
}

TEST(LossScaler, WithoutDynamicScalingOnlyCountsSkips) {
  LossScaleConfig c;  // fp32 / bf16
  c.max_skipped_steps = 2;
  LossScaler s(c);
  run(s, {{false, V::Apply, 1, 0}, {true, V::Skip, 1, 0}, {false, V::Apply, 1, 0}, {true, V::Skip, 1, 0}});
  EXPECT_EQ(s.state().skipped_steps, 2);
  EXPECT_EQ(s.update(true, 5), V::Stop);
  EXPECT_NE(s.stop_reason().find("steps 4-5"), std::string::npos) << s.stop_reason();
  // 0 = never stop.
  c.max_skipped_steps = 0;
  LossScaler never(c);
  for (int i = 1; i <= 1000; ++i) ASSERT_EQ(never.update(true, i), V::Skip);
}

TEST(LossScaler, RestoreContinuesExactly) {
  // An uninterrupted sequence against one cut after every step and restored into a new scaler.
  const std::vector<bool> overflow = {false, true, false, false, false, true, true, false, false, false, false};
  LossScaler whole(fp16(256, 3, 5));
  std::vector<LossScalerState> want;
  for (size_t i = 0; i < overflow.size(); ++i) {
    whole.update(overflow[i], static_cast<int64_t>(i) + 1);
    want.push_back(whole.state());
  }
  for (size_t cut = 0; cut < overflow.size(); ++cut) {
    LossScaler a(fp16(256, 3, 5));
    for (size_t i = 0; i <= cut; ++i) a.update(overflow[i], static_cast<int64_t>(i) + 1);
    LossScaler b(fp16(256, 3, 5));
    b.restore(a.state(), "test");
    for (size_t i = cut + 1; i < overflow.size(); ++i) {
      b.update(overflow[i], static_cast<int64_t>(i) + 1);
      EXPECT_EQ(b.state().scale, want[i].scale) << "cut " << cut << " step " << i + 1;
      EXPECT_EQ(b.state().good_steps, want[i].good_steps);
      EXPECT_EQ(b.state().skipped_steps, want[i].skipped_steps);
      EXPECT_EQ(b.state().consecutive_skipped, want[i].consecutive_skipped);
    }
  }
}

TEST(LossScaler, RestoreNamesTheStepsOfARunOfSkipsBeforeTheCut) {
  LossScaler a(fp16(256, 3, 3));
  a.update(true, 1);
  a.update(true, 2);
  LossScaler b(fp16(256, 3, 3));
  b.restore(a.state(), "test");
  EXPECT_EQ(b.update(true, 3), V::Stop);
  EXPECT_NE(b.stop_reason().find("steps 1-3"), std::string::npos) << b.stop_reason();
}

TEST(LossScaler, RestoreRefusesImpossibleStates) {
  LossScaler s(fp16());
  auto bad = [&](LossScalerState st, const char* what) {
    try {
      s.restore(st, "ckpt/state.json");
      ADD_FAILURE() << "accepted " << what;
    } catch (const lathe::Error& e) {
      EXPECT_NE(std::string(e.what()).find("ckpt/state.json"), std::string::npos) << e.what();
    }
  };
  bad({0.0, 0, 0, 0}, "scale 0");
  bad({-2.0, 0, 0, 0}, "negative scale");
  bad({1.0 / 0.0, 0, 0, 0}, "infinite scale");
  bad({2.0, -1, 0, 0}, "negative good steps");
  bad({2.0, 0, 1, 2}, "more consecutive than total skips");
}

TEST(LossScaler, ValidateNamesTheField) {
  auto expect = [](LossScaleConfig c, const char* field) {
    try {
      validate(c);
      ADD_FAILURE() << "accepted a bad " << field;
    } catch (const lathe::Error& e) {
      EXPECT_NE(std::string(e.what()).find(field), std::string::npos) << e.what();
    }
  };
  LossScaleConfig c;
  c.initial = 0;
  expect(c, "precision.loss_scale.initial");
  c = {};
  c.growth_interval = 0;
  expect(c, "precision.loss_scale.growth_interval");
  c = {};
  c.backoff = 1;
  expect(c, "precision.loss_scale.backoff");
  c = {};
  c.growth = 1;
  expect(c, "precision.loss_scale.growth");
  c = {};
  c.min = 2 * c.initial;
  expect(c, "precision.loss_scale.min");
  // Below 2^-100 the unscaling factor 1 / scale is no finite float (issue 23 S1: NaN weights).
  c = {};
  c.initial = 1e-39;
  c.min = 1e-40;
  expect(c, "precision.loss_scale.initial");
  c = {};
  c.min = 1e-40;
  expect(c, "precision.loss_scale.min");
  c = {};
  c.max_skipped_steps = -1;
  expect(c, "training.max_skipped_steps");
}
