// train() takes the faults a test injects from TrainOptions::faults (train/fault_plan.h), never
// from the environment: `lathe train` reads the LATHE_TEST_* variables once (src/cli/cmd_train.cpp)
// and passes them in. In process, on a small gpt2-debug run: a planned non-finite step is skipped
// (as an fp16 overflow would be) and a planned loss spike multiplies that step's loss, while the
// environment variables alone change nothing.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "config/recipe.h"
#include "data/indexed_dataset.h"
#include "train/trainer.h"

namespace fs = std::filesystem;

namespace {

struct TempDir {
  fs::path path;
  TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "lathe_fault_plan_XXXXXX").string();
    path = ::mkdtemp(tmpl.data());
  }
  ~TempDir() { fs::remove_all(path); }
};

// Documents of random byte tokens (vocab_size 256).
std::string make_data(const fs::path& dir) {
  const std::string prefix = (dir / "data").string();
  lathe::data::IndexedDatasetWriter w(prefix, lathe::DType::U16);
  std::mt19937 g(3);
  for (int d = 0; d < 200; ++d) {
    std::vector<int32_t> doc(100 + g() % 100);
    for (auto& t : doc) t = static_cast<int32_t>(g() % 256);
    w.add_document(doc);
  }
  w.finalize();
  return prefix;
}

lathe::Recipe recipe(const std::string& data, const fs::path& out) {
  return lathe::parse_recipe(
      "model: {preset: gpt2-debug, vocab_size: 256}\n"
      "data: {train: " +
          data +
          ", valid_fraction: 0.1}\n"
          "optimizer: {name: adamw, lr: 3.0e-3, grad_clip: 1.0}\n"
          "schedule: {name: cosine, warmup_steps: 2, min_lr: 1.0e-4}\n"
          "training: {micro_batch_size: 2, seq_len: 16, steps: 4, seed: 7, eval_interval: 0, peak_gflops: 100, "
          "threads: 1}\n"
          "output: {dir: " +
          out.string() + "}\n",
      "test_fault_plan");
}

struct StepRecord {
  double loss;
  bool skipped;
};
std::vector<StepRecord> steps_of(const fs::path& out) {
  std::vector<StepRecord> v;
  std::ifstream f(out / "metrics.jsonl");
  for (std::string line; std::getline(f, line);) {
    const auto j = nlohmann::json::parse(line);
    if (j.contains("loss")) v.push_back({j["loss"].get<double>(), j["skipped"].get<bool>()});
  }
  return v;
}

lathe::TrainOptions quiet() {
  lathe::TrainOptions o;
  o.quiet = true;
  o.sample_at_end = false;
  return o;
}

TEST(FaultPlan, ComesFromTrainOptionsNotTheEnvironment) {
  TempDir tmp;
  const std::string data = make_data(tmp.path);
  ::setenv("LATHE_TEST_NONFINITE_STEPS", "2", 1);
  ::setenv("LATHE_TEST_LOSS_SPIKE_STEPS", "3", 1);
  const lathe::TrainResult clean = lathe::train(recipe(data, tmp.path / "clean"), quiet());
  ::unsetenv("LATHE_TEST_NONFINITE_STEPS");
  ::unsetenv("LATHE_TEST_LOSS_SPIKE_STEPS");
  const auto clean_steps = steps_of(tmp.path / "clean");
  ASSERT_EQ(clean_steps.size(), 4u);
  for (const StepRecord& s : clean_steps) EXPECT_FALSE(s.skipped) << "the environment must not inject faults";

  lathe::TrainOptions o = quiet();
  o.faults.nonfinite_steps = {2};
  o.faults.loss_spike_steps = {3};
  o.faults.loss_spike_factor = 1000;
  const lathe::TrainResult faulty = lathe::train(recipe(data, tmp.path / "faulty"), o);
  const auto faulty_steps = steps_of(tmp.path / "faulty");
  ASSERT_EQ(faulty_steps.size(), 4u);
  EXPECT_FALSE(faulty_steps[0].skipped);
  EXPECT_TRUE(faulty_steps[1].skipped) << "step 2's gradient was planned non-finite";
  // Step 1 is the same run's; step 3 trains from weights that skipped step 2's update.
  EXPECT_EQ(faulty.losses[0], clean.losses[0]);
  EXPECT_GT(faulty.losses[2], 100 * clean.losses[2]) << "step 3's loss was planned x1000";
}

}  // namespace
