// Unit tests of src/train/checkpoint: XXH64 against the reference library (when its header is
// installed) and published vectors, save/load round trip of weights + moments + state, atomic
// layout (tmp dirs, latest, keep_last), corruption of each file kind, shape mismatches, sharded
// slices, recipe diff classification.
#include <gtest/gtest.h>

#include <cmath>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <random>

#include "core/error.h"
#include "core/stop_signal.h"
#include "error_of.h"
#include "io/fs.h"
#include "io/safetensors.h"
#include "train/checkpoint.h"

#if __has_include(<xxhash.h>)
#define XXH_INLINE_ALL
#include <xxhash.h>
#define HAVE_REF_XXHASH 1
#endif

namespace fs = std::filesystem;
using namespace lathe;
using nlohmann::json;

namespace {

std::string tmpdir(const std::string& tag) {
  fs::path p = fs::temp_directory_path() / fmt::format("lathe_ckpt_{}_{}", tag, ::getpid());
  fs::remove_all(p);
  fs::create_directories(p);
  return p.string();
}

std::unique_ptr<Model> debug_model(uint64_t seed, int64_t n_embd = 48) {
  ModelConfig c = ModelConfig::preset("gpt2-debug");
  c.hidden_size = n_embd;
  auto m = build_model(c);
  m->init_weights(seed);
  return m;
}

std::unique_ptr<optim::Optimizer> random_adamw(size_t P, uint32_t seed) {
  optim::OptimConfig oc;
  auto opt = optim::make_optimizer(oc, P);
  std::mt19937 g(seed);
  std::normal_distribution<float> d;
  for (auto& [name, buf] : opt->state_buffers())  // second moments are >= 0 (load checks it)
    for (size_t i = 0; i < buf->size(); ++i) buf->data()[i] = name == "exp_avg_sq" ? std::fabs(d(g)) : d(g);
  return opt;
}

CheckpointState some_state(int64_t step) {
  CheckpointState st;
  st.step = step;
  st.consumed_samples = step * 8;
  st.loader = {2, 24};
  st.rng = {7, 0xfedcba9876543210ull};
  st.loss_scale = 65536.0;
  st.loss_scale_dynamic = true;
  st.loss_scale_good_steps = step / 2;
  st.skipped_steps = step / 3;
  st.consecutive_skipped_steps = step / 4;
  st.recipe = {{"model", ModelConfig::preset("gpt2-debug").to_hf_json()}, {"training", {{"steps", 100}}}};
  st.lathe_version = "test";
  st.lr = 1.5e-3;
  st.threads = 3;
  st.optimizer = "adamw";
  return st;
}

void flip_byte(const std::string& path, size_t at) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  ASSERT_TRUE(f.good()) << path;
  f.seekg(static_cast<std::streamoff>(at));
  char c;
  f.get(c);
  c = static_cast<char>(c ^ 0x10);
  f.seekp(static_cast<std::streamoff>(at));
  f.put(c);
}

using lathe::test::error_of;

}  // namespace

TEST(Xxh64, PublishedVectors) {
  // From the xxHash repository's sanity checks / spec.
  EXPECT_EQ(Xxh64::hash("", 0), 0xEF46DB3751D8E999ull);
  EXPECT_EQ(hex64(Xxh64::hash("", 0)), "ef46db3751d8e999");
}

#ifdef HAVE_REF_XXHASH
TEST(Xxh64, MatchesReferenceLibrary) {
  std::mt19937_64 g(1);
  std::vector<unsigned char> data(5000);
  for (auto& b : data) b = static_cast<unsigned char>(g());
  for (size_t n : {0, 1, 3, 4, 7, 8, 15, 31, 32, 33, 63, 64, 65, 100, 1000, 4999, 5000}) {
    for (uint64_t seed : {0ull, 1ull, 0x9E3779B185EBCA87ull}) {
      const uint64_t ref = XXH64(data.data(), n, seed);
      EXPECT_EQ(Xxh64::hash(data.data(), n, seed), ref) << "n=" << n << " seed=" << seed;
      // Streaming in uneven pieces gives the same digest.
      Xxh64 s(seed);
      size_t i = 0, piece = 1;
      while (i < n) {
        const size_t m = std::min(piece, n - i);
        s.update(data.data() + i, m);
        i += m;
        piece = piece * 3 % 41 + 1;
      }
      EXPECT_EQ(s.digest(), ref) << "streaming n=" << n;
    }
  }
}
#endif

TEST(Checkpoint, RoundTripWeightsMomentsState) {
  const std::string run = tmpdir("rt");
  auto m = debug_model(1);
  auto opt = random_adamw(m->num_params(), 5);
  save_checkpoint(run, *m, opt.get(), some_state(12), 0);
  const std::string dir = run + "/checkpoints/step_00000012";
  ASSERT_TRUE(fs::is_directory(dir));
  for (const char* f : {"model.safetensors", "optimizer.safetensors", "recipe.yaml", "state.json"})
    EXPECT_TRUE(fs::exists(dir + "/" + f)) << f;
  EXPECT_EQ(io::read_file(run + "/checkpoints/latest"), "step_00000012\n");
  EXPECT_EQ(find_latest_checkpoint(run), dir);

  auto m2 = debug_model(99);  // different weights, overwritten by the load
  optim::OptimConfig oc;
  auto opt2 = optim::make_optimizer(oc, m2->num_params());
  CheckpointState st = load_checkpoint(dir, *m2, opt2.get());
  EXPECT_EQ(0, std::memcmp(m->param_data(), m2->param_data(), m->num_params() * 4));
  auto a = opt->state_buffers(), b = opt2->state_buffers();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i)
    EXPECT_EQ(0, std::memcmp(a[i].second->data(), b[i].second->data(), m->num_params() * 4)) << a[i].first;
  const CheckpointState want = some_state(12);
  EXPECT_EQ(st.step, 12);
  EXPECT_EQ(st.consumed_samples, want.consumed_samples);
  EXPECT_EQ(st.loader.epoch, 2);
  EXPECT_EQ(st.loader.position, 24);
  EXPECT_EQ(st.rng, want.rng);
  EXPECT_EQ(st.loss_scale, 65536.0);
  EXPECT_TRUE(st.loss_scale_dynamic);
  EXPECT_EQ(st.loss_scale_good_steps, 6);
  EXPECT_EQ(st.skipped_steps, 4);
  EXPECT_EQ(st.consecutive_skipped_steps, 3);
  EXPECT_EQ(st.recipe, want.recipe);
  EXPECT_EQ(st.lathe_version, "test");
  EXPECT_EQ(st.lr, 1.5e-3);
  EXPECT_EQ(st.threads, 3);
  EXPECT_EQ(st.optimizer, "adamw");
  ModelConfig mc = checkpoint_model_config(dir);
  EXPECT_EQ(mc.hidden_size, 48);
  EXPECT_EQ(mc.num_hidden_layers, m->config().num_hidden_layers);

  // Weights only (export path): no optimizer needed.
  auto m3 = debug_model(3);
  load_checkpoint(dir, *m3, nullptr);
  EXPECT_EQ(0, std::memcmp(m->param_data(), m3->param_data(), m->num_params() * 4));
  fs::remove_all(run);
}

// A model big enough (10 MB of weights) for the zero-copy O_DIRECT path, the staging buffers and
// the alignment pad inside optimizer.safetensors; also on /dev/shm (tmpfs refuses O_DIRECT, so
// the buffered fallback runs) when it exists.
TEST(Checkpoint, LargeTensorsDirectAndBufferedPaths) {
  ModelConfig c = ModelConfig::preset("gpt2-debug");
  c.hidden_size = 256;
  c.num_attention_heads = 4;
  c.intermediate_size = 1024;
  c.vocab_size = 4000;  // odd sizes: tensors end at unaligned offsets
  std::vector<std::string> roots = {tmpdir("large")};
  if (fs::is_directory("/dev/shm")) {
    roots.push_back(fmt::format("/dev/shm/lathe_ckpt_large_{}", ::getpid()));
    fs::remove_all(roots.back());
  }
  for (const std::string& run : roots) {
    auto m = build_model(c);
    m->init_weights(4);
    ASSERT_GT(m->num_params() * 4, 8u << 20);
    auto opt = random_adamw(m->num_params(), 6);
    save_checkpoint(run, *m, opt.get(), some_state(3), 0);
    const std::string dir = run + "/checkpoints/step_00000003";
    verify_checkpoint(dir);  // checksums recomputed from what is on disk
    auto m2 = build_model(c);
    optim::OptimConfig oc;
    auto opt2 = optim::make_optimizer(oc, m2->num_params());
    load_checkpoint(dir, *m2, opt2.get());
    EXPECT_EQ(0, std::memcmp(m->param_data(), m2->param_data(), m->num_params() * 4)) << run;
    auto a = opt->state_buffers(), b = opt2->state_buffers();
    for (size_t i = 0; i < a.size(); ++i)
      EXPECT_EQ(0, std::memcmp(a[i].second->data(), b[i].second->data(), m->num_params() * 4)) << a[i].first;
    // The file is plain safetensors: the lathe reader accepts it and sees the pad as U8.
    io::SafetensorsFile f(dir + "/optimizer.safetensors");
    // exp_avg run, then a pad unless exp_avg_sq's address already lines up, then exp_avg_sq run.
    const uintptr_t gap = reinterpret_cast<uintptr_t>(a[1].second->data()) -
                          reinterpret_cast<uintptr_t>(a[0].second->data()) - m->num_params() * 4;
    const size_t pads = gap % 4096 ? 1 : 0;
    EXPECT_EQ(f.tensors().size(), 2 * m->params().specs().size() + pads);
    fs::remove_all(run);
  }
}

TEST(Checkpoint, KeepLastTmpDirsAndReplace) {
  const std::string run = tmpdir("keep");
  auto m = debug_model(1);
  auto opt = random_adamw(m->num_params(), 5);
  // A leftover of a killed save is ignored by the search and removed by the next save.
  fs::create_directories(run + "/checkpoints/step_00000009.tmp");
  std::string log;
  EXPECT_EQ(find_latest_checkpoint(run, &log), "");
  EXPECT_NE(log.find("step_00000009.tmp"), std::string::npos) << log;
  for (int s = 1; s <= 5; ++s) save_checkpoint(run, *m, opt.get(), some_state(s), 2);
  auto all = list_checkpoints(run);
  ASSERT_EQ(all.size(), 2u);
  EXPECT_EQ(all[0].first, 4);
  EXPECT_EQ(all[1].first, 5);
  EXPECT_FALSE(fs::exists(run + "/checkpoints/step_00000009.tmp"));
  EXPECT_EQ(io::read_file(run + "/checkpoints/latest"), "step_00000005\n");
  // Saving a step that exists replaces it; the one found in place is moved aside, never deleted.
  const std::string old_state = io::read_file(run + "/checkpoints/step_00000005/state.json");
  m->param_data()[0] += 1.0f;
  CheckpointSaveInfo info;
  save_checkpoint(run, *m, opt.get(), some_state(5), 2, &info);
  auto m2 = debug_model(2);
  load_checkpoint(run + "/checkpoints/step_00000005", *m2, nullptr);
  EXPECT_EQ(m2->param_data()[0], m->param_data()[0]);
  EXPECT_EQ(list_checkpoints(run).size(), 2u);
  ASSERT_NE(info.moved_aside.find("step_00000005.abandoned-"), std::string::npos) << info.moved_aside;
  EXPECT_EQ(io::read_file(info.moved_aside + "/state.json"), old_state);
  fs::remove_all(run);
}

// Under a StopSignalGuard (lathe checkpoint reshard) a signal stops the data writer between its
// pieces: the save fails naming the signal and publishes no step directory.
TEST(Checkpoint, SignalUnderStopGuardStopsTheWriterAndLeavesNothing) {
  const std::string run = tmpdir("stopped");
  auto m = debug_model(1);
  {
    StopSignalGuard guard;
    ::raise(SIGINT);  // recorded by the guard's handler, not delivered as a kill
    ASSERT_EQ(stop_signal(), SIGINT);
    const std::string err = error_of([&] { save_checkpoint(run, *m, nullptr, some_state(1), 0); });
    EXPECT_NE(err.find("interrupted by SIGINT"), std::string::npos) << err;
    // At the first data file (weights are written first), not only at the small files after it.
    EXPECT_NE(err.find("model.safetensors: interrupted"), std::string::npos) << err;
  }
  EXPECT_FALSE(fs::exists(run + "/checkpoints/step_00000001")) << "a stopped save published its step";
  // Without a guard (lathe train's own handler) the writer never stops half-way; the stopped
  // save's step_X.tmp (reshard removes its own) is cleaned by the next save.
  save_checkpoint(run, *m, nullptr, some_state(1), 0);
  verify_checkpoint(run + "/checkpoints/step_00000001");
  for (const auto& e : fs::directory_iterator(run + "/checkpoints"))
    EXPECT_EQ(e.path().filename().string().find(".tmp"), std::string::npos) << "left behind: " << e.path();
  fs::remove_all(run);
}

TEST(Checkpoint, NoValidCheckpointIsAnErrorNamingEach) {
  const std::string run = tmpdir("none_valid");
  auto m = debug_model(1);
  save_checkpoint(run, *m, nullptr, some_state(1), 0);
  save_checkpoint(run, *m, nullptr, some_state(2), 0);
  for (const char* s : {"/checkpoints/step_00000001/model.safetensors", "/checkpoints/step_00000002/recipe.yaml"})
    flip_byte(run + s, 10);
  std::string log;
  const std::string err = error_of([&] { find_latest_checkpoint(run, &log); });
  EXPECT_NE(err.find("none of the 2 checkpoints can be resumed"), std::string::npos) << err;
  EXPECT_NE(err.find(run + "/checkpoints/step_00000001/model.safetensors"), std::string::npos) << err;
  EXPECT_NE(err.find(run + "/checkpoints/step_00000002/recipe.yaml"), std::string::npos) << err;
  fs::remove_all(run);
}

TEST(Checkpoint, CorruptionOfEachFileIsNamedAndSkipped) {
  for (const std::string f : {"model.safetensors", "optimizer.safetensors", "recipe.yaml", "state.json"}) {
    for (double where : {0.02, 0.5, 0.97}) {
      const std::string run = tmpdir("corrupt");
      auto m = debug_model(1);
      auto opt = random_adamw(m->num_params(), 5);
      save_checkpoint(run, *m, opt.get(), some_state(1), 0);
      save_checkpoint(run, *m, opt.get(), some_state(2), 0);
      const std::string dir = run + "/checkpoints/step_00000002", path = dir + "/" + f;
      flip_byte(path, static_cast<size_t>(where * static_cast<double>(fs::file_size(path))));
      auto m2 = debug_model(2);
      optim::OptimConfig oc;
      auto opt2 = optim::make_optimizer(oc, m2->num_params());
      const std::string err = error_of([&] { load_checkpoint(dir, *m2, opt2.get()); });
      EXPECT_NE(err.find(path), std::string::npos) << f << " at " << where << ": " << err;
      EXPECT_NE(err.find("corrupt"), std::string::npos) << err;
      std::string log;
      EXPECT_EQ(find_latest_checkpoint(run, &log), run + "/checkpoints/step_00000001") << f;
      EXPECT_NE(log.find(path), std::string::npos) << log;
      fs::remove_all(run);
    }
  }
}

TEST(Checkpoint, MissingAndTruncatedFiles) {
  const std::string run = tmpdir("missing");
  auto m = debug_model(1);
  auto opt = random_adamw(m->num_params(), 5);
  save_checkpoint(run, *m, opt.get(), some_state(1), 0);
  const std::string dir = run + "/checkpoints/step_00000001";
  fs::resize_file(dir + "/optimizer.safetensors", 1000);
  std::string err = error_of([&] { verify_checkpoint(dir); });
  EXPECT_NE(err.find("optimizer.safetensors"), std::string::npos) << err;
  EXPECT_NE(err.find("truncated"), std::string::npos) << err;
  fs::remove(dir + "/optimizer.safetensors");
  err = error_of([&] { verify_checkpoint(dir); });
  EXPECT_NE(err.find("optimizer.safetensors: missing"), std::string::npos) << err;
  fs::remove(dir + "/state.json");
  err = error_of([&] { verify_checkpoint(dir); });
  EXPECT_NE(err.find("state.json: missing"), std::string::npos) << err;
  fs::remove_all(run);
}

TEST(Checkpoint, ShapeMismatchNamesTensor) {
  const std::string run = tmpdir("shape");
  auto m = debug_model(1);
  save_checkpoint(run, *m, nullptr, some_state(1), 0);
  auto other = debug_model(1, 64);
  const std::string err = error_of([&] { load_checkpoint(run + "/checkpoints/step_00000001", *other, nullptr); });
  EXPECT_NE(err.find("transformer.wte.weight"), std::string::npos) << err;
  EXPECT_NE(err.find("[96, 48]"), std::string::npos) << err;
  // No optimizer state saved -> resuming with an optimizer is refused.
  auto opt = random_adamw(m->num_params(), 1);
  const std::string err2 = error_of([&] { load_checkpoint(run + "/checkpoints/step_00000001", *m, opt.get()); });
  EXPECT_NE(err2.find("no optimizer state"), std::string::npos) << err2;
  fs::remove_all(run);
}

TEST(Checkpoint, ShardedSliceIsRefusedClearly) {
  const std::string run = tmpdir("slice");
  auto m = debug_model(1);
  save_checkpoint(run, *m, nullptr, some_state(1), 0);
  const std::string sp = run + "/checkpoints/step_00000001/state.json";
  json doc = json::parse(io::read_file(sp));
  doc["body"]["tensors"]["model.safetensors"][0]["slice"][0] = {0, 48};  // "this file holds half of dim 0"
  const std::string text = doc["body"].dump();
  doc["body_xxh64"] = hex64(Xxh64::hash(text.data(), text.size()));
  io::atomic_write_file(sp, doc.dump());
  const std::string err = error_of([&] { load_checkpoint(run + "/checkpoints/step_00000001", *m, nullptr); });
  EXPECT_NE(err.find("sharded"), std::string::npos) << err;
  fs::remove_all(run);
}

TEST(Checkpoint, RecipeDiffClassification) {
  json a = {{"model", {{"n_embd", 48}, {"init_from", "x"}}},
            {"training", {{"steps", 10}, {"seq_len", 32}, {"log_interval", 1}, {"threads", 0}}},
            {"optimizer", {{"lr", 1e-3}}},
            {"output", {{"dir", "a"}}}};
  json b = a;
  EXPECT_TRUE(diff_recipes(a, b).empty());
  b["training"]["steps"] = 20;
  b["training"]["log_interval"] = 5;
  b["output"]["dir"] = "b";
  b["model"]["init_from"] = "y";
  for (auto& c : diff_recipes(a, b)) EXPECT_FALSE(c.breaks_exactness) << c.key;
  EXPECT_EQ(diff_recipes(a, b).size(), 4u);
  b["training"]["seq_len"] = 64;
  b["optimizer"]["lr"] = 2e-3;
  b["model"]["n_embd"] = 64;
  b["data"] = {{"train", "x"}};  // a key the checkpoint did not have
  std::map<std::string, bool> got;
  for (auto& c : diff_recipes(a, b)) got[c.key] = c.breaks_exactness;
  EXPECT_TRUE(got.at("training.seq_len"));
  EXPECT_TRUE(got.at("optimizer.lr"));
  EXPECT_TRUE(got.at("model.n_embd"));
  EXPECT_TRUE(got.at("data.train"));
  EXPECT_FALSE(got.at("training.steps"));
  for (auto& c : diff_recipes(a, b))
    if (c.key == "training.seq_len") {
      EXPECT_EQ(c.before, "32");
      EXPECT_EQ(c.after, "64");
    }
}

// A long-context continuation: the position encoding changes the math (allowed with
// --force-resume-changes), a shape key never loads (config/model_keys.h); rope_scaling is one value.
TEST(Checkpoint, RecipeDiffModelKeys) {
  const json a = {{"model", {{"hidden_size", 48}, {"rope_theta", 1e4}, {"max_position_embeddings", 128},
                             {"rope_scaling", nullptr}, {"n_positions", 128}}}};
  json b = a;
  b["model"]["rope_theta"] = 5e5;
  b["model"]["max_position_embeddings"] = 512;
  b["model"]["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 4.0}};
  auto d = diff_recipes(a, b);
  ASSERT_EQ(d.size(), 3u);
  for (auto& c : d) {
    EXPECT_TRUE(c.breaks_exactness) << c.key;
    EXPECT_FALSE(c.shape) << c.key;
  }
  EXPECT_EQ(d[1].key, "model.rope_scaling");
  EXPECT_EQ(d[1].before, "null");
  EXPECT_EQ(d[1].after, R"({"factor":4.0,"rope_type":"llama3"})");
  b = a;
  b["model"]["hidden_size"] = 64;
  b["model"]["n_positions"] = 256;  // GPT-2's learned position table
  d = diff_recipes(a, b);
  ASSERT_EQ(d.size(), 2u);
  for (auto& c : d) EXPECT_TRUE(c.shape && c.breaks_exactness) << c.key;
}

TEST(Checkpoint, RecipeDiffPrecision) {
  const json fp32 = {{"training", {{"steps", 10}}}};  // a checkpoint from before the precision section
  json same = fp32;
  same["precision"] = {{"compute", "fp32"},
                       {"loss_scale",
                        {{"enabled", false},
                         {"initial", 65536.0},
                         {"growth_interval", 2000},
                         {"backoff", 0.5},
                         {"growth", 2.0},
                         {"min", 1.0}}}};
  same["training"]["max_skipped_steps"] = 20;
  EXPECT_TRUE(diff_recipes(fp32, same).empty()) << diff_recipes(fp32, same)[0].key;
  // The compute dtype breaks exactness, from an old checkpoint too.
  json bf16 = same;
  bf16["precision"]["compute"] = "bf16";
  for (const json* before : {&fp32, static_cast<const json*>(&same)}) {
    auto d = diff_recipes(*before, bf16);
    ASSERT_EQ(d.size(), 1u);
    EXPECT_EQ(d[0].key, "precision.compute");
    EXPECT_TRUE(d[0].breaks_exactness);
  }
  // Loss-scale settings are ignored (harmless) while scaling is off in both recipes...
  json ignored = bf16;
  ignored["precision"]["loss_scale"]["initial"] = 8.0;
  auto d = diff_recipes(bf16, ignored);
  ASSERT_EQ(d.size(), 1u);
  EXPECT_FALSE(d[0].breaks_exactness);
  // ...and break exactness when it is on in either.
  json on = bf16, on2 = bf16;
  on["precision"]["loss_scale"]["enabled"] = true;
  on2["precision"]["loss_scale"]["enabled"] = true;
  on2["precision"]["loss_scale"]["growth_interval"] = 100;
  d = diff_recipes(on, on2);
  ASSERT_EQ(d.size(), 1u);
  EXPECT_TRUE(d[0].breaks_exactness);
  d = diff_recipes(bf16, on);
  ASSERT_EQ(d.size(), 1u);
  EXPECT_EQ(d[0].key, "precision.loss_scale.enabled");
  EXPECT_TRUE(d[0].breaks_exactness);
  // max_skipped_steps only decides when to stop: harmless.
  json more = same;
  more["training"]["max_skipped_steps"] = 0;
  d = diff_recipes(same, more);
  ASSERT_EQ(d.size(), 1u);
  EXPECT_FALSE(d[0].breaks_exactness);
}

// ---- issue 14: state.json is untrusted input ----

TEST(CheckpointState, ParsesWhatSaveWrites) {
  const std::string run = tmpdir("parse");
  auto m = debug_model(1);
  auto opt = random_adamw(m->num_params(), 5);
  save_checkpoint(run, *m, opt.get(), some_state(3), 0);
  const std::string sp = run + "/checkpoints/step_00000003/state.json";
  const CheckpointState st = parse_checkpoint_state(io::read_file(sp), sp);
  EXPECT_EQ(st.step, 3);
  EXPECT_EQ(st.rng, some_state(3).rng);
  EXPECT_EQ(st.world_size, 1);
  EXPECT_EQ(st.files.size(), 3u);
  ASSERT_EQ(st.tensors.at("model.safetensors").size(), m->params().specs().size());
  EXPECT_EQ(st.tensors.at("optimizer.safetensors").size(), 2 * m->params().specs().size());
  const CheckpointTensor& t = st.tensors.at("model.safetensors")[0];
  EXPECT_EQ(t.name, m->params().specs()[0].name);
  EXPECT_EQ(t.global_shape, m->params().specs()[0].shape);
  EXPECT_EQ(t.dtype, "F32");
  fs::remove_all(run);
}

TEST(CheckpointState, DeepNestingIsRefusedBeforeTheChecksum) {
  // 60,000 levels overflowed the stack in body.dump() (the checksum) before the depth check.
  std::string text = R"({"body":{"x":)" + std::string(60000, '[') + std::string(60000, ']') + R"(},"body_xxh64":"0"})";
  const std::string err = error_of([&] { parse_checkpoint_state(text, "ck/state.json"); });
  EXPECT_NE(err.find("ck/state.json"), std::string::npos) << err;
  EXPECT_NE(err.find("nests deeper"), std::string::npos) << err;
}

TEST(CheckpointState, FieldsAreNamed) {
  const std::string run = tmpdir("fields");
  auto m = debug_model(1);
  save_checkpoint(run, *m, nullptr, some_state(1), 0);
  const std::string sp = run + "/checkpoints/step_00000001/state.json";
  const json doc = json::parse(io::read_file(sp));
  auto reseal = [&](const std::function<void(json&)>& edit) {
    json d = doc;
    edit(d["body"]);
    const std::string text = d["body"].dump();
    d["body_xxh64"] = hex64(Xxh64::hash(text.data(), text.size()));
    return error_of([&] { parse_checkpoint_state(d.dump(), sp); });
  };
  EXPECT_NE(reseal([](json& b) {
              b["tensors"]["model.safetensors"][0]["slice"] = 5;
            }).find("'tensors.model.safetensors[0].slice' must be an array"),
            std::string::npos);
  EXPECT_NE(reseal([](json& b) {
              b["tensors"]["model.safetensors"][1]["name"] = 3;
            }).find("'tensors.model.safetensors[1].name' must be a string"),
            std::string::npos);
  EXPECT_NE(reseal([](json& b) { b["rng"] = json::array(); }).find("'rng' is empty"), std::string::npos);
  EXPECT_NE(reseal([](json& b) { b["world"]["world_size"] = 0; }).find("'world.world_size'"), std::string::npos);
  // A world of 2 must list both ranks' moment shards.
  EXPECT_NE(reseal([](json& b) {
              b["world"]["world_size"] = 2;
              b["files"]["optimizer-rank00000-of-00002.safetensors"] = b["files"]["recipe.yaml"];
            }).find("optimizer-rank00001-of-00002.safetensors is missing"),
            std::string::npos);
  EXPECT_NE(reseal([](json& b) { b["files"]["../x"] = b["files"]["recipe.yaml"]; }).find("'files.../x'"),
            std::string::npos);
  EXPECT_NE(reseal([](json& b) { b["step"] = -1; }).find("'step' is -1"), std::string::npos);
  // The loss scaler's fields: optional (older checkpoints), checked when present.
  EXPECT_EQ(reseal([](json& b) {
              for (const char* k :
                   {"loss_scale_dynamic", "loss_scale_good_steps", "skipped_steps", "consecutive_skipped_steps"})
                b.erase(k);
            }),
            "");
  EXPECT_NE(reseal([](json& b) { b["loss_scale_dynamic"] = 1; }).find("'loss_scale_dynamic' must be true or false"),
            std::string::npos);
  EXPECT_NE(reseal([](json& b) { b["loss_scale_good_steps"] = -2; }).find("'loss_scale_good_steps' is -2"),
            std::string::npos);
  std::string err = reseal([](json& b) { b["skipped_steps"] = 2; });
  EXPECT_NE(err.find("'skipped_steps' is 2, above the largest allowed 1"), std::string::npos) << err;
  err = reseal([](json& b) {
    b["skipped_steps"] = 1;
    b["consecutive_skipped_steps"] = 2;
  });
  EXPECT_NE(err.find("'consecutive_skipped_steps' is 2, above the largest allowed 1"), std::string::npos) << err;
  EXPECT_EQ(reseal([](json&) {}), "");  // the unedited body passes
  fs::remove_all(run);
}

TEST(Checkpoint, LatestIsAHintNeverAPath) {
  const std::string run = tmpdir("latest");
  auto m = debug_model(1);
  save_checkpoint(run, *m, nullptr, some_state(1), 0);
  for (const char* bad : {"../..\n", "/etc\n", "garbage", "step_00000007\n"}) {
    io::atomic_write_file(run + "/checkpoints/latest", bad);
    std::string log;
    EXPECT_EQ(find_latest_checkpoint(run, &log), run + "/checkpoints/step_00000001");
    EXPECT_NE(log.find("ignored"), std::string::npos) << bad << ": " << log;
  }
  io::atomic_write_file(run + "/checkpoints/latest", "step_00000001\n");
  std::string log;
  EXPECT_EQ(find_latest_checkpoint(run, &log), run + "/checkpoints/step_00000001");
  EXPECT_EQ(log, "");
  fs::remove_all(run);
}
