// Checkpoints read at another layout and rewritten offline (train/reshard.h).
// Oracles: the saved buffers themselves (a load is a copy, so bit-identical) and
// parallel::scatter_shard (an independent path from global to a tensor-parallel rank's buffer).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include "ckpt_fixtures.h"
#include "core/error.h"
#include "dist/comm.h"
#include "io/fs.h"
#include "io/safetensors.h"
#include "optim/chunks.h"
#include "parallel/flat_shards.h"
#include "parallel/tensor_parallel.h"
#include "train/checkpoint.h"
#include "train/reshard.h"

namespace lathe {
namespace {
namespace fs = std::filesystem;
using ckpt_test::reseal;

std::string temp_dir(const std::string& tag) { return ckpt_test::fresh_temp_dir("lathe_reshard_", tag); }

// The global state of a gpt2-debug model: weights and two moments, random (second moments >= 0).
struct Global {
  std::unique_ptr<Model> model;
  std::vector<float> m, v;
  explicit Global(const ModelConfig& cfg = ModelConfig::preset("gpt2-debug")) {
    model = build_model(cfg);
    model->init_weights(3);
    std::mt19937 g(11);
    std::normal_distribution<float> d;
    m.resize(model->num_params());
    v.resize(model->num_params());
    for (size_t i = 0; i < m.size(); ++i) {
      m[i] = d(g);
      v[i] = std::fabs(d(g));
    }
  }
  MomentSlice slice(size_t b, size_t e) {
    MomentSlice s;
    s.begin = b;
    s.end = e;
    s.buffers = {{"exp_avg", m.data() + b}, {"exp_avg_sq", v.data() + b}};
    return s;
  }
};

CheckpointState state(int64_t step, const ModelConfig& cfg = ModelConfig::preset("gpt2-debug")) {
  CheckpointState st;
  st.step = step;
  st.consumed_samples = step * 4;
  st.loader = {0, step * 4};
  st.rng = {1};
  st.recipe = {{"model", cfg.to_hf_json()},
               {"optimizer", {{"name", "adamw"}}},
               {"parallel", {{"tensor", 2}, {"pipeline", 1}, {"data", 2}, {"zero", 1}}}};
  st.lathe_version = "test";
  st.optimizer = "adamw";
  st.threads = 1;
  return st;
}

// The checkpoint a TP=2 x DP=2 run writes: whole weights, moments cut evenly over 2 writers.
std::string save_tp_layout(const std::string& run, Global& g, int64_t step) {
  const size_t P = g.model->num_params();
  const std::vector<size_t> cut = dist::even_counts(P, 2);
  OfflineCheckpoint parts;
  parts.shard_files = true;
  parts.parts = {g.slice(0, cut[0]), g.slice(cut[0], P)};
  save_checkpoint_offline(run, *g.model, parts, state(step, g.model->config()));
  return (fs::path(run) / "checkpoints" / fmt::format("step_{:08d}", step)).string();
}

// Also with a vocabulary the degree does not divide (97 rows: 49 + 48 at tp=2, 25 + 3 x 24 at tp=4):
// each rank's uneven wte rows are read from the whole-model pieces.
TEST(Reshard, TensorParallelRankReadsOnlyItsShard) {
  ModelConfig odd = ModelConfig::preset("gpt2-debug");
  odd.vocab_size = 97;
  for (const ModelConfig& cfg : {ModelConfig::preset("gpt2-debug"), odd}) {
    Global g(cfg);
    const std::string run = temp_dir("tp");
    const std::string dir = save_tp_layout(run, g, 5);
    verify_checkpoint(dir);
    for (int tp : {1, 2, 4}) {
      for (int rank = 0; rank < tp; ++rank) {
        auto local = build_model(parallel::shard_config(cfg, tp, rank));
        const size_t L = local->num_params();
        // Oracle: the whole moments scattered to this rank (tensor_parallel.cpp), then its ZeRO cut.
        std::vector<float> want_m(L), want_v(L);
        parallel::scatter_shard(g.model->params(), g.m.data(), local->params(), want_m.data(), rank, tp);
        parallel::scatter_shard(g.model->params(), g.v.data(), local->params(), want_v.data(), rank, tp);
        const parallel::FlatShards zero(L, 3, optim::kChunk / 8);
        for (int z = 0; z < zero.ranks(); ++z) {
          const size_t b = zero.begin(z), e = zero.end(z);
          std::vector<float> m(e - b, -1), v(e - b, -1);
          MomentSlice s;
          s.begin = b;
          s.end = e;
          s.buffers = {{"exp_avg", m.data()}, {"exp_avg_sq", v.data()}};
          const CheckpointPieces ck(dir);
          load_moments_sharded(ck, g.model->params(), local->params(), rank, tp, s);
          const std::string what = fmt::format("vocab {} tp {} rank {} zero shard {}", cfg.vocab_size, tp, rank, z);
          ASSERT_EQ(std::memcmp(m.data(), want_m.data() + b, (e - b) * 4), 0) << what;
          ASSERT_EQ(std::memcmp(v.data(), want_v.data() + b, (e - b) * 4), 0) << what;
          // Exactly its share was copied out of the files: two moments of e - b floats.
          EXPECT_EQ(ck.bytes_read(), static_cast<int64_t>(2 * (e - b) * 4)) << what;
        }
      }
    }
    fs::remove_all(run);
  }
}

// Replaces the two optimizer shard files by files of boxes: file 0 holds the first half of every
// moment's last dimension, file 1 the rest (a layout no writer uses yet: Row-parallel pieces).
// `overlap`: file 1 takes one column more (shared with file 0); `drop`: file 1 omits its piece of
// the first tensor.
void rewrite_as_boxes(const std::string& dir, Global& g, bool overlap, bool drop) {
  std::vector<std::vector<float>> store;
  store.reserve(2 * 2 * g.model->params().specs().size());
  nlohmann::json tables[2] = {nlohmann::json::array(), nlohmann::json::array()};
  std::vector<io::StWriteF32> files[2];
  for (const auto& [moment, buf] : {std::pair<std::string, const float*>{"exp_avg", g.m.data()},
                                    std::pair<std::string, const float*>{"exp_avg_sq", g.v.data()}})
    for (const ParamSpec& s : g.model->params().specs()) {
      const int64_t cols = s.shape.back(), rows = s.numel() / cols, h = cols / 2;
      for (int f = 0; f < 2; ++f) {
        if (drop && f == 1 && &s == &g.model->params().specs()[0]) continue;
        const int64_t a = f == 0 ? 0 : h - (overlap ? 1 : 0), b = f == 0 ? h : cols;
        store.emplace_back();
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t c = a; c < b; ++c) store.back().push_back(buf[s.offset + static_cast<size_t>(r * cols + c)]);
        Shape box = s.shape;
        box.back() = b - a;
        nlohmann::json slice = nlohmann::json::array();
        for (size_t d = 0; d + 1 < s.shape.size(); ++d) slice.push_back({0, s.shape[d]});
        slice.push_back({a, b});
        const std::string name = moment + "/" + s.name;
        files[f].push_back({name, box, store.back().data()});
        tables[f].push_back({{"name", name}, {"dtype", "F32"}, {"global_shape", s.shape}, {"slice", slice}});
      }
    }
  nlohmann::json entries[2];
  for (int f = 0; f < 2; ++f) {
    const std::string file = fmt::format("optimizer-rank{:05d}-of-00002.safetensors", f);
    const std::string path = (fs::path(dir) / file).string();
    fs::remove(path);
    io::write_safetensors_f32(path, files[f]);
    const std::string bytes = io::read_file(path);
    entries[f] = {{"bytes", bytes.size()}, {"xxh64", hex64(Xxh64::hash(bytes.data(), bytes.size()))}};
  }
  reseal(dir, [&](nlohmann::json& b) {
    for (int f = 0; f < 2; ++f) {
      const std::string file = fmt::format("optimizer-rank{:05d}-of-00002.safetensors", f);
      b["files"][file] = entries[f];
      b["tensors"][file] = tables[f];
    }
  });
}

std::string load_error(const std::string& dir, Global& g) {
  std::vector<float> m(g.m.size()), v(g.v.size());
  MomentSlice s;
  s.begin = 0;
  s.end = m.size();
  s.buffers = {{"exp_avg", m.data()}, {"exp_avg_sq", v.data()}};
  try {
    const CheckpointPieces ck(dir);
    load_moments_sharded(ck, g.model->params(), g.model->params(), 0, 1, s);
  } catch (const Error& e) {
    return e.what();
  }
  EXPECT_EQ(std::memcmp(m.data(), g.m.data(), m.size() * 4), 0);
  EXPECT_EQ(std::memcmp(v.data(), g.v.data(), v.size() * 4), 0);
  return "";
}

TEST(Reshard, BoxPiecesAreReassembledAndBadTablesNamed) {
  Global g;
  const std::string run = temp_dir("box");
  const std::string dir = save_tp_layout(run, g, 5);
  rewrite_as_boxes(dir, g, false, false);
  verify_checkpoint(dir);
  EXPECT_EQ(load_error(dir, g), "");  // reassembled from boxes: bit-identical
  // The offline reshard reads boxes too and writes the run layout's flat pieces.
  const std::string out = temp_dir("box_out");
  reshard_checkpoint(dir, out, {1, 1, 3, 0});
  EXPECT_EQ(load_error((fs::path(out) / "checkpoints" / "step_00000005").string(), g), "");

  const std::string first = "exp_avg/" + g.model->params().specs()[0].name;
  rewrite_as_boxes(dir, g, true, false);
  std::string e = load_error(dir, g);
  EXPECT_NE(e.find("the pieces overlap"), std::string::npos) << e;
  EXPECT_NE(e.find(first), std::string::npos) << e;
  rewrite_as_boxes(dir, g, false, true);
  e = load_error(dir, g);
  EXPECT_NE(e.find("a piece is missing"), std::string::npos) << e;
  EXPECT_NE(e.find(first), std::string::npos) << e;
  fs::remove_all(run);
  fs::remove_all(out);
}

std::string file_bytes(const std::string& dir, const std::string& name) {
  return io::read_file((fs::path(dir) / name).string());
}

TEST(Reshard, RoundTripIsByteIdenticalAndKeepsEveryGlobalTensor) {
  Global g;
  const std::string run = temp_dir("rt");
  const std::string src = save_tp_layout(run, g, 7);
  const std::string a = temp_dir("rt_a"), b = temp_dir("rt_b"), a2 = temp_dir("rt_a2");
  const CheckpointLayout A{2, 1, 2, 1}, B{1, 1, 3, 2};
  const ReshardResult ra = reshard_checkpoint(src, a, A);
  const ReshardResult rb = reshard_checkpoint(ra.dir, b, B);
  const ReshardResult ra2 = reshard_checkpoint(rb.dir, a2, A);
  EXPECT_EQ(rb.files.size(), 5u);  // model, 3 optimizer shards, recipe
  ASSERT_EQ(ra.files, ra2.files);
  for (const std::string& f : ra.files) EXPECT_EQ(file_bytes(ra.dir, f), file_bytes(ra2.dir, f)) << f;
  EXPECT_EQ(file_bytes(ra.dir, "state.json"), file_bytes(ra2.dir, "state.json"));
  // Every global tensor of every checkpoint equals the source's, bit for bit.
  for (const std::string& dir : {ra.dir, rb.dir, ra2.dir}) {
    const CheckpointPieces ck(dir);
    for (const ParamSpec& s : g.model->params().specs()) {
      std::vector<float> w(static_cast<size_t>(s.numel()));
      ck.check(s.name, s.shape);
      ck.read(s.name, 0, s.numel(), w.data());
      EXPECT_EQ(std::memcmp(w.data(), g.model->param_data() + s.offset, w.size() * 4), 0) << dir << " " << s.name;
    }
    EXPECT_EQ(load_error(dir, g), "") << dir;
    EXPECT_EQ(checkpoint_layout(ck.state()).data, dir == rb.dir ? 3 : 2);
  }
  fs::remove_all(run);
  for (const std::string& d : {a, b, a2}) fs::remove_all(d);
}

TEST(Reshard, LayoutsTheModelCannotTakeAreRefusedNamingTheValue) {
  Global g;
  const std::string run = temp_dir("bad");
  const std::string src = save_tp_layout(run, g, 3);
  const std::string out = temp_dir("bad_out");
  auto err = [&](CheckpointLayout l) -> std::string {
    try {
      reshard_checkpoint(src, out, l);
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  };
  std::string e = err({3, 1, 1, 0});  // gpt2-debug: 4 heads
  EXPECT_NE(e.find("--tensor 3"), std::string::npos) << e;
  EXPECT_NE(e.find("num_attention_heads = 4"), std::string::npos) << e;
  e = err({1, 9, 1, 0});  // 2 layers
  EXPECT_NE(e.find("--pipeline 9"), std::string::npos) << e;
  e = err({1, 1, 0, 0});
  EXPECT_NE(e.find("--data 0"), std::string::npos) << e;
  e = err({1, 1, 1, 4});
  EXPECT_NE(e.find("--zero 4"), std::string::npos) << e;
  e = err({1, 1, 1, 0, 0});
  EXPECT_NE(e.find("--context 0"), std::string::npos) << e;
  e = err({1, 1, 1, 3, 2});  // a run refuses ZeRO 3 with context parallelism
  EXPECT_NE(e.find("--zero 3 with --context 2"), std::string::npos) << e;
  EXPECT_FALSE(fs::exists(fs::path(out) / "checkpoints" / "step_00000003"));  // nothing half-written
  EXPECT_EQ(err({1, 1, 1, 0}), "");
  e = err({1, 1, 1, 0});  // never overwrites
  EXPECT_NE(e.find("already exists"), std::string::npos) << e;
  fs::remove_all(run);
  fs::remove_all(out);
}

}  // namespace
}  // namespace lathe
