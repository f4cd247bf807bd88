// Pipeline schedules (parallel/pipeline_schedule.h) run through the simulator without MPI: no
// deadlock, forward before backward, sends matched, micro-batches in flight per rank and the
// bubble against the closed forms of the 1F1B / Megatron interleaving papers; and the simulator
// itself rejects broken lists (so a passing schedule test means something).
#include <gtest/gtest.h>

#include <algorithm>

#include "core/error.h"
#include "error_of.h"
#include "parallel/pipeline_schedule.h"

using namespace lathe::pipeline;

namespace {

using lathe::test::error_of;

Costs costs(double f, double b) {
  Costs c;
  c.forward = f;
  c.backward = b;
  return c;
}

int64_t compute_actions(const std::vector<Action>& l) {
  return std::count_if(l.begin(), l.end(), [](const Action& a) { return a.op == Op::Forward || a.op == Op::Backward; });
}

}  // namespace

TEST(PipelineSchedule, OneFOneBInFlightAndBubble) {
  for (int64_t p = 1; p <= 6; ++p)
    for (int64_t m : {p, p + 1, 2 * p, 3 * p + 1, int64_t{16}}) {
      if (m < p) continue;
      const Spec s{Kind::OneFOneB, p, m, 1};
      const auto lists = make_schedule(s);
      ASSERT_EQ(static_cast<int64_t>(lists.size()), p);
      for (const Costs& c : {costs(1, 2), costs(1, 1), costs(1.5, 3.25)}) {
        const SimResult r = simulate(s, lists, c);
        ASSERT_TRUE(r.ok) << "p " << p << " m " << m << ": " << r.error;
        for (int64_t st = 0; st < p; ++st) {
          // PipeDream-flush: p - s - 1 warm-up forwards + the one of the steady phase.
          EXPECT_EQ(r.max_in_flight[static_cast<size_t>(st)], std::min(p - st, m)) << "p " << p << " m " << m;
          EXPECT_EQ(compute_actions(lists[static_cast<size_t>(st)]), 2 * m);
          EXPECT_DOUBLE_EQ(r.busy[static_cast<size_t>(st)], static_cast<double>(m) * (c.forward + c.backward));
        }
        // Zero-cost messages: the step takes (m + p - 1)(f + b), the bubble (p-1)/(m+p-1) of it.
        EXPECT_NEAR(r.makespan, static_cast<double>(m + p - 1) * (c.forward + c.backward), 1e-9);
        EXPECT_NEAR(r.bubble, bubble_formula(p, m), 1e-12) << "p " << p << " m " << m;
      }
    }
}

TEST(PipelineSchedule, GPipeHoldsEveryMicroBatch) {
  for (int64_t p : {1, 2, 4})
    for (int64_t m : {4, 8}) {
      const Spec s{Kind::GPipe, p, m, 1};
      const SimResult r = simulate(s, make_schedule(s));
      ASSERT_TRUE(r.ok) << r.error;
      for (int64_t f : r.max_in_flight) EXPECT_EQ(f, m);
      EXPECT_NEAR(r.bubble, bubble_formula(p, m), 1e-12);
    }
}

TEST(PipelineSchedule, InterleavedMatchesMegatron) {
  for (int64_t p : {2, 3, 4})
    for (int64_t v : {2, 3})
      for (int64_t m : {p, 2 * p, 4 * p}) {
        const Spec s{Kind::Interleaved, p, m, v};
        const auto lists = make_schedule(s);
        // Chunk costs 1/v of a stage's (unit forward, backward twice as long).
        const Costs c = costs(1.0 / static_cast<double>(v), 2.0 / static_cast<double>(v));
        const SimResult r = simulate(s, lists, c);
        ASSERT_TRUE(r.ok) << "p " << p << " v " << v << " m " << m << ": " << r.error;
        for (int64_t st = 0; st < p; ++st) {
          EXPECT_EQ(compute_actions(lists[static_cast<size_t>(st)]), 2 * m * v);
          // Megatron's warm-up + 1: the chunk-forwards held by rank r.
          EXPECT_EQ(r.max_in_flight[static_cast<size_t>(st)], std::min((p - st - 1) * 2 + (v - 1) * p + 1, m * v))
              << "p " << p << " v " << v << " m " << m << " rank " << st;
        }
        // Narayanan et al. 2021: bubble (p-1)(f+b)/v over an ideal m(f+b).
        EXPECT_NEAR(r.bubble, bubble_formula(p, m, v), 1e-12) << "p " << p << " v " << v << " m " << m;
        // and smaller than 1F1B's for the same p and m.
        EXPECT_LT(r.bubble, bubble_formula(p, m));
      }
}

TEST(PipelineSchedule, MessagesGoToNeighbours) {
  const Spec s{Kind::Interleaved, 3, 6, 2};
  const auto lists = make_schedule(s);
  // Rank 2 chunk 0 (virtual stage 2) sends its output to rank 0 chunk 1 (virtual stage 3).
  const auto& l2 = lists[2];
  EXPECT_NE(std::find(l2.begin(), l2.end(), Action{Op::SendAct, 0, 0, 0}), l2.end());
  EXPECT_NE(std::find(lists[0].begin(), lists[0].end(), Action{Op::RecvAct, 0, 1, 2}), lists[0].end());
  const SimResult r = simulate(s, lists);
  ASSERT_TRUE(r.ok) << r.error;
  // Every boundary but the last carries one activation and one gradient per micro-batch.
  int64_t sent = 0;
  for (int64_t n : r.messages) sent += n;
  EXPECT_EQ(sent, 2 * 6 * (3 * 2 - 1));
}

TEST(PipelineSchedule, SimulatorRejectsBrokenLists) {
  const Spec s{Kind::OneFOneB, 3, 4, 1};
  const auto good = make_schedule(s);
  ASSERT_TRUE(simulate(s, good).ok);

  // Stage 1 waits for the gradient of micro-batch 0 before its forwards: stage 2 never gets input.
  auto dead = good;
  auto& l1 = dead[1];
  auto it = std::find(l1.begin(), l1.end(), Action{Op::RecvGrad, 0, 0, 2});
  ASSERT_NE(it, l1.end());
  Action rg = *it;
  l1.erase(it);
  l1.insert(l1.begin(), rg);
  SimResult r = simulate(s, dead);
  EXPECT_FALSE(r.ok);
  EXPECT_NE(r.error.find("deadlock"), std::string::npos) << r.error;
  EXPECT_NE(r.error.find("rank 1"), std::string::npos) << r.error;

  // A missing send: the receiver blocks forever.
  auto lost = good;
  lost[0].erase(std::find(lost[0].begin(), lost[0].end(), Action{Op::SendAct, 2, 0, 1}));
  r = simulate(s, lost);
  EXPECT_FALSE(r.ok);
  EXPECT_NE(r.error.find("RecvAct2.0<0"), std::string::npos) << r.error;

  // Backward before forward on the last stage.
  auto swapped = good;
  auto& l2 = swapped[2];
  auto f = std::find(l2.begin(), l2.end(), Action{Op::Forward, 0, 0});
  auto b = std::find(l2.begin(), l2.end(), Action{Op::Backward, 0, 0});
  std::iter_swap(f, b);
  r = simulate(s, swapped);
  EXPECT_FALSE(r.ok);
  EXPECT_NE(r.error.find("backward before its forward"), std::string::npos) << r.error;

  // A message addressed to the wrong rank.
  auto wrong = good;
  std::find(wrong[0].begin(), wrong[0].end(), Action{Op::SendAct, 1, 0, 1})->peer = 2;
  r = simulate(s, wrong);
  EXPECT_FALSE(r.ok);
  EXPECT_NE(r.error.find("next stage is on rank 1"), std::string::npos) << r.error;

  // A micro-batch dropped from every rank is noticed even though nothing blocks.
  auto dropped = good;
  for (auto& l : dropped)
    l.erase(std::remove_if(l.begin(), l.end(), [](const Action& a) { return a.mb == 3; }), l.end());
  r = simulate(s, dropped);
  EXPECT_FALSE(r.ok);
  EXPECT_NE(r.error.find("micro-batch 3"), std::string::npos) << r.error;
}

TEST(PipelineSchedule, GivenCostsAndLatency) {
  // A slow last stage (the head) stretches every rank's step: (m - 1) * its cost + the rest.
  const Spec s{Kind::OneFOneB, 2, 4, 1};
  Costs c;
  c.forward_per_stage = {1, 2};
  c.backward_per_stage = {2, 4};
  const SimResult r = simulate(s, make_schedule(s), c);
  ASSERT_TRUE(r.ok) << r.error;
  EXPECT_DOUBLE_EQ(r.busy[0], 12);
  EXPECT_DOUBLE_EQ(r.busy[1], 24);
  EXPECT_DOUBLE_EQ(r.makespan, 1 + 24 + 2);  // stage 0's first forward, stage 1 busy, stage 0's last backward
  // Message latency adds to the critical path: one activation down and one gradient up per hop.
  Costs lat;
  lat.p2p = 0.5;
  const SimResult r2 = simulate(s, make_schedule(s), lat);
  ASSERT_TRUE(r2.ok);
  EXPECT_GT(r2.makespan, simulate(s, make_schedule(s)).makespan);
}

TEST(PipelineSchedule, BadSpecsNameTheValues) {
  std::string e = error_of([] { make_schedule({Kind::OneFOneB, 4, 3, 1}); });
  EXPECT_NE(e.find("3 micro-batches"), std::string::npos) << e;
  EXPECT_NE(e.find("4 pipeline stages"), std::string::npos) << e;
  e = error_of([] { make_schedule({Kind::Interleaved, 4, 6, 2}); });
  EXPECT_NE(e.find("multiple of 4"), std::string::npos) << e;
  EXPECT_NE(e.find("6"), std::string::npos) << e;
  e = error_of([] { make_schedule({Kind::OneFOneB, 2, 4, 2}); });
  EXPECT_NE(e.find("virtual_stages 2"), std::string::npos) << e;
  e = error_of([] { parse_kind("zb", "recipe.yaml: parallel.schedule"); });
  EXPECT_NE(e.find("'zb'"), std::string::npos) << e;
  EXPECT_EQ(parse_kind("interleaved", "x"), Kind::Interleaved);
}

TEST(PipelineSchedule, StageLayers) {
  EXPECT_EQ(assign_layers(12, 4, 1, {}), (std::vector<int64_t>{3, 3, 3, 3}));
  // Remainder to the middle stages first; first and last stay light.
  EXPECT_EQ(assign_layers(10, 4, 1, {}), (std::vector<int64_t>{2, 3, 3, 2}));
  EXPECT_EQ(assign_layers(7, 2, 1, {}), (std::vector<int64_t>{3, 4}));
  EXPECT_EQ(assign_layers(8, 2, 2, {}), (std::vector<int64_t>{2, 2, 2, 2}));
  EXPECT_EQ(assign_layers(12, 2, 1, {5, 7}), (std::vector<int64_t>{5, 7}));

  std::string e = error_of([] { assign_layers(12, 2, 1, {5, 6}, "r.yaml"); });
  EXPECT_NE(e.find("r.yaml: parallel.stage_layers [5, 6] sums to 11"), std::string::npos) << e;
  EXPECT_NE(e.find("12 layers"), std::string::npos) << e;
  e = error_of([] { assign_layers(12, 3, 1, {6, 0, 6}); });
  EXPECT_NE(e.find("stage 1 has 0 layers"), std::string::npos) << e;
  e = error_of([] { assign_layers(12, 2, 2, {6, 6}); });
  EXPECT_NE(e.find("2 entries but there are 4 stages"), std::string::npos) << e;
  e = error_of([] { assign_layers(3, 2, 2, {}); });
  EXPECT_NE(e.find("3 layers cannot be split"), std::string::npos) << e;
}
