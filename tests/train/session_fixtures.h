// What the in-process tests of the run's parts share (test_train_step.cpp, test_checkpointer.cpp):
// a scratch directory, a tiny Megatron dataset of random byte tokens, a recipe of a debug preset
// around it, and the steps of train()'s loop driven by hand on a TrainSession (train/session.h),
// each rank of a data-parallel group on a thread of dist::run_threads.
#pragma once

#include <stdlib.h>

#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "config/recipe.h"
#include "data/indexed_dataset.h"
#include "train/session.h"
#include "train/train_step.h"

namespace lathe::session_test {

namespace fs = std::filesystem;

struct TempDir {
  fs::path path;
  explicit TempDir(const std::string& tag) {
    std::string tmpl = (fs::temp_directory_path() / ("lathe_" + tag + "_XXXXXX")).string();
    path = ::mkdtemp(tmpl.data());
  }
  ~TempDir() { fs::remove_all(path); }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
};

// Documents of random byte tokens (vocab_size 256): DIR/data.bin, DIR/data.idx. Returns the prefix.
inline std::string make_data(const fs::path& dir) {
  const std::string prefix = (dir / "data").string();
  data::IndexedDatasetWriter w(prefix, DType::U16);
  std::mt19937 g(3);
  for (int d = 0; d < 120; ++d) {
    std::vector<int32_t> doc(60 + g() % 60);
    for (auto& t : doc) t = static_cast<int32_t>(g() % 256);
    w.add_document(doc);
  }
  w.finalize();
  return prefix;
}

struct RecipeSpec {
  std::string preset = "gpt2-debug";
  int64_t micro_batch = 2, accum = 1, steps = 3, seed = 7;
  int zero = 0;
  std::string bucket_mb = "25";  // parallel.bucket_mb
  int64_t checkpoint_every = 0, keep_last = 0;
  std::string extra;  // more YAML lines (top level)
};

// One OpenMP thread per rank: the sums do not depend on the machine's cores.
inline Recipe recipe(const std::string& data, const fs::path& out, const RecipeSpec& s) {
  const std::string text = "model: {preset: " + s.preset + ", vocab_size: 256}\n" + "data: {train: " + data +
                           "}\n"
                           "optimizer: {name: adamw, lr: 3.0e-3, grad_clip: 1.0}\n"
                           "schedule: {name: cosine, warmup_steps: 2, min_lr: 1.0e-4}\n"
                           "parallel: {zero: " +
                           std::to_string(s.zero) + ", bucket_mb: " + s.bucket_mb +
                           "}\n"
                           "training: {micro_batch_size: " +
                           std::to_string(s.micro_batch) + ", grad_accum_steps: " + std::to_string(s.accum) +
                           ", seq_len: 16, steps: " + std::to_string(s.steps) +
                           ", seed: " + std::to_string(s.seed) +
                           ", eval_interval: 0, peak_gflops: 100, threads: 1}\n"
                           "output: {dir: " +
                           out.string() + ", checkpoint_every: " + std::to_string(s.checkpoint_every) +
                           ", keep_last: " + std::to_string(s.keep_last) + "}\n" + s.extra;
  return parse_recipe(text, "session_fixtures");
}

inline TrainOptions quiet(dist::Communicator* world) {
  TrainOptions o;
  o.quiet = true;
  o.sample_at_end = false;
  o.world = world;
  return o;
}

// What one rank saw of steps [first, last) of train()'s loop.
struct Steps {
  std::vector<double> losses, norms;
  std::vector<StepStats> stats;
};

// train()'s loop body without evaluation, checkpoints or stops: step, record (the health a
// checkpoint records). No anomaly policy in these recipes.
inline Steps run_steps(TrainSession& s, int64_t first, int64_t last) {
  Steps out;
  StepStats prev;
  for (int64_t step = first; step < last; ++step) {
    const StepStats st = train_step(s.step_context(), step, prev);
    if (!st.skipped) prev = st;
    s.record(step, st);
    out.losses.push_back(st.loss);
    out.norms.push_back(st.norm);
    out.stats.push_back(st);
  }
  return out;
}

inline std::vector<float> weights_of(TrainSession& s) {
  Model& m = s.step_context().rm.model();
  return std::vector<float>(m.param_data(), m.param_data() + m.num_params());
}

}  // namespace lathe::session_test
