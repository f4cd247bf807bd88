// Per-rank checkpoint shards (train/checkpoint.h: save_checkpoint_sharded, load_checkpoint_moments):
// N ranks (threads of dist::run_threads) each write the moments of their ZeRO cut (FlatShards at
// optim::kChunk, which cut tensors anywhere); reading back any flat range, for any other number of
// ranks, must give exactly the saved values (bit-identical: it is a copy), and a damaged shard
// table must be an error naming the gap or overlap, never zeros.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>

#include "ckpt_fixtures.h"
#include "core/error.h"
#include "dist/comm.h"
#include "io/fs.h"
#include "io/json.h"
#include "optim/chunks.h"
#include "parallel/flat_shards.h"
#include "train/checkpoint.h"

namespace lathe {
namespace {
namespace fs = std::filesystem;
using ckpt_test::reseal;

std::string temp_dir(const std::string& tag) { return ckpt_test::fresh_temp_dir("lathe_ckpt_shards_", tag); }

// A model whose 3 layers of odd widths make tensors straddle every cut of a small chunk size.
std::unique_ptr<Model> small_model() {
  ModelConfig c = ModelConfig::preset("gpt2-debug");
  auto m = build_model(c);
  m->init_weights(3);
  return m;
}

std::unique_ptr<optim::Optimizer> random_moments(size_t P, uint32_t seed) {
  auto opt = optim::make_optimizer(optim::OptimConfig{}, P);
  std::mt19937 g(seed);
  std::normal_distribution<float> d;
  for (auto& [name, buf] : opt->state_buffers())
    for (size_t i = 0; i < buf->size(); ++i) buf->data()[i] = name == "exp_avg_sq" ? std::fabs(d(g)) : d(g);
  return opt;
}

CheckpointState state(int64_t step, int world) {
  CheckpointState st;
  st.step = step;
  st.consumed_samples = step * 4;
  st.loader = {0, step * 4};
  st.rng = {1};
  st.recipe = {{"model", ModelConfig::preset("gpt2-debug").to_hf_json()}};
  st.lathe_version = "test";
  st.optimizer = "adamw";
  st.threads = world;
  return st;
}

// Saves `full` moments as `world` ranks would (rank r writes FlatShards cut r, align elements).
std::string save_as_ranks(const std::string& run, const Model& model, optim::Optimizer& full, int world,
                          size_t align, int64_t step) {
  const parallel::FlatShards sh(model.num_params(), world, align);
  dist::run_threads(world, [&](dist::Communicator& c) {
    const int r = c.rank();
    save_checkpoint_sharded(run, model, moment_slice(full, 0, sh.begin(r), sh.end(r)), state(step, world), 0,
                            nullptr, c);
  });
  return (fs::path(run) / "checkpoints" / fmt::format("step_{:08d}", step)).string();
}

void expect_range_equal(optim::Optimizer& full, optim::Optimizer& part, size_t begin, size_t end,
                        const std::string& what) {
  auto a = full.state_buffers(), b = part.state_buffers();
  for (size_t i = 0; i < a.size(); ++i)
    for (size_t k = begin; k < end; ++k)
      ASSERT_EQ(std::memcmp(a[i].second->data() + k, b[i].second->data() + (k - begin), 4), 0)
          << what << ": " << a[i].first << " element " << k;
}

TEST(CheckpointShards, AnyLayoutReadsBackTheSavedMomentsExactly) {
  auto model = small_model();
  const size_t P = model->num_params();
  auto full = random_moments(P, 11);
  // 1000-element cuts split many tensors mid-row; optim::kChunk is what the trainer uses.
  for (int world : {2, 3}) {
    for (size_t align : {size_t{1000}, optim::kChunk}) {
      const std::string run = temp_dir(fmt::format("w{}a{}", world, align));
      const std::string dir = save_as_ranks(run, *model, *full, world, align, 7);
      verify_checkpoint(dir);
      const CheckpointState cs = read_checkpoint_state(dir);
      EXPECT_EQ(cs.world_size, world);
      int shard_files = 0;
      for (const auto& f : cs.files) shard_files += f.name.rfind("optimizer-rank", 0) == 0;
      EXPECT_EQ(shard_files, world);
      // Read back as 1..4 ranks of ZeRO cuts and as odd ranges.
      for (int readers = 1; readers <= 4; ++readers) {
        const parallel::FlatShards sh(P, readers, 777);
        for (int r = 0; r < readers; ++r) {
          auto part = optim::make_optimizer(optim::OptimConfig{}, sh.size(r));
          load_checkpoint_moments(dir, *model, moment_slice(*part, sh.begin(r), sh.begin(r), sh.end(r)));
          expect_range_equal(*full, *part, sh.begin(r), sh.end(r),
                             fmt::format("saved by {} ranks (cut {}), read as rank {} of {}", world, align, r, readers));
        }
      }
      // And the whole thing through the single-process loader (weights too).
      auto back = build_model(ModelConfig::preset("gpt2-debug"));
      auto whole = optim::make_optimizer(optim::OptimConfig{}, P);
      load_checkpoint(dir, *back, whole.get());
      expect_range_equal(*full, *whole, 0, P, "load_checkpoint");
      EXPECT_EQ(std::memcmp(back->param_data(), model->param_data(), P * 4), 0);
      fs::remove_all(run);
    }
  }
}

std::string load_error(const std::string& dir, const Model& model) {
  auto opt = optim::make_optimizer(optim::OptimConfig{}, model.num_params());
  try {
    load_checkpoint_moments(dir, model, moment_slice(*opt, 0, 0, model.num_params()));
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(CheckpointShards, GapsAndOverlapsInTheShardTablesAreNamed) {
  auto model = small_model();
  auto full = random_moments(model->num_params(), 5);
  const std::string run = temp_dir("bad");
  const std::string dir = save_as_ranks(run, *model, *full, 2, 1000, 3);
  const std::string shard1 = "optimizer-rank00001-of-00002.safetensors";
  // Find a piece in rank 1's table (a tensor cut by the boundary at element 1000 or later).
  nlohmann::json body = nlohmann::json::parse(io::read_file((fs::path(dir) / "state.json").string()))["body"];
  ASSERT_TRUE(body["tensors"].contains(shard1));
  std::string cut;
  for (const auto& t : body["tensors"][shard1])
    if (t.contains("flat")) cut = t["name"];
  ASSERT_FALSE(cut.empty()) << "no tensor cut by the shard boundary: the test needs one";
  {
    // Shrink a piece: its first element is then in no file.
    reseal(dir, [&](nlohmann::json& b) {
      for (auto& t : b["tensors"][shard1])
        if (t["name"] == cut) t["flat"][0] = t["flat"][0].get<int64_t>() + 1;
    });
    const std::string e = load_error(dir, *model);
    EXPECT_NE(e.find("in no optimizer file"), std::string::npos) << e;
    EXPECT_NE(e.find(cut), std::string::npos) << e;
  }
  reseal(dir, [&](nlohmann::json& b) {
    for (auto& t : b["tensors"][shard1])
      if (t["name"] == cut) t["flat"][0] = t["flat"][0].get<int64_t>() - 2;
  });
  const std::string e = load_error(dir, *model);
  EXPECT_NE(e.find("held by two optimizer files"), std::string::npos) << e;
  fs::remove_all(run);
}

}  // namespace
}  // namespace lathe
