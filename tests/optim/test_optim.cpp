// Optimizers, LR schedules and gradient clipping. lathe runs here; its inputs and outputs go to a
// temp directory as raw little-endian float32 files plus manifest.json, and
// tests/optim/optim_oracle.py recomputes everything independently (torch.optim.AdamW,
// torch.nn.utils.clip_grad_norm_, LAMB and the schedules from their formulas) and fails on mismatch.
#include <gtest/gtest.h>
#include <omp.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "core/error.h"
#include "optim/clip.h"
#include "optim/optimizer.h"
#include "optim/schedule.h"

namespace fs = std::filesystem;
using json = nlohmann::json;
using namespace lathe::optim;

namespace {

struct TempDir {
  fs::path path;
  TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "lathe_optim_XXXXXX").string();
    path = ::mkdtemp(tmpl.data());
  }
  ~TempDir() { fs::remove_all(path); }
};

void write_floats(const fs::path& p, const float* data, size_t n) {
  std::ofstream f(p, std::ios::binary);
  f.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(n * sizeof(float)));
}
void write_floats(const fs::path& p, const std::vector<float>& v) { write_floats(p, v.data(), v.size()); }

std::vector<float> normal(std::mt19937& g, size_t n, float scale) {
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(g);
  return v;
}

// Parameter layout with a decay mask, a gap no range covers (must stay untouched), tensors of odd
// sizes and one larger than a chunk (8192) so chunked reductions span several chunks.
std::vector<ParamRange> layout(size_t& P) {
  std::vector<ParamRange> r = {
      {0, 1000, true}, {1000, 37, false}, {1042, 20000, true}, {21042, 1, false}, {21043, 300, true}};
  P = 21350;
  return r;
}

json ranges_json(const std::vector<ParamRange>& rs) {
  json a = json::array();
  for (auto& r : rs) a.push_back({r.offset, r.size, r.decay});
  return a;
}

// Runs `steps` updates of optimizer `name` from fixed random inputs; records everything.
json run_optimizer(const fs::path& dir, const std::string& name, bool zero_range) {
  std::mt19937 g(name == "adamw" ? 1 : 2);
  size_t P;
  auto ranges = layout(P);
  OptimConfig cfg;
  cfg.name = name;
  cfg.beta1 = 0.9;
  cfg.beta2 = 0.95;
  cfg.eps = 1e-8;
  cfg.weight_decay = 0.1;
  auto opt = make_optimizer(cfg, P);
  std::vector<float> params = normal(g, P, 1.0f);
  if (zero_range) std::fill(params.begin() + 21043, params.begin() + 21343, 0.0f);  // ||p|| = 0
  fs::create_directories(dir / name);
  write_floats(dir / name / "params0.f32", params);
  const std::vector<double> lrs = {1e-3, 2e-3, 3e-3, 2.5e-3, 1e-3, 5e-4};
  json steps = json::array();
  for (size_t k = 0; k < lrs.size(); ++k) {
    auto grads = normal(g, P, k == 2 ? 3.0f : 0.05f);
    const std::string gname = "grad" + std::to_string(k) + ".f32";
    write_floats(dir / name / gname, grads);
    opt->step(params.data(), grads.data(), ranges, lrs[k], static_cast<int64_t>(k + 1));
    steps.push_back({{"lr", lrs[k]}, {"grad", gname}});
  }
  write_floats(dir / name / "out_params.f32", params);
  json state = json::object();
  for (auto& [sname, buf] : opt->state_buffers()) {
    EXPECT_EQ(buf->size(), P);
    write_floats(dir / name / ("out_" + sname + ".f32"), buf->data(), buf->size());
    state[sname] = "out_" + sname + ".f32";
  }
  return {{"name", name},       {"dir", name},        {"P", P},         {"ranges", ranges_json(ranges)},
          {"beta1", cfg.beta1}, {"beta2", cfg.beta2}, {"eps", cfg.eps}, {"weight_decay", cfg.weight_decay},
          {"steps", steps},     {"state", state}};
}

json run_clip(const fs::path& dir) {
  std::mt19937 g(3);
  const std::vector<size_t> sizes = {50001, 7, 9000, 1};
  size_t n = 0;
  for (auto s : sizes) n += s;
  const auto grads = normal(g, n, 0.01f);
  fs::create_directories(dir / "clip");
  write_floats(dir / "clip" / "grads.f32", grads);
  const double norm = global_grad_norm(grads.data(), n);
  json cases = json::array();
  for (double max_norm : {0.5 * norm, 2.0 * norm, 0.0, 1e-3}) {
    auto g2 = grads;
    const double ret = clip_grad_norm(g2.data(), n, max_norm);
    EXPECT_EQ(ret, norm);
    const std::string out = "clipped" + std::to_string(cases.size()) + ".f32";
    write_floats(dir / "clip" / out, g2);
    cases.push_back({{"max_norm", max_norm}, {"norm", ret}, {"out", out}});
  }
  return {{"dir", "clip"}, {"sizes", sizes}, {"grads", "grads.f32"}, {"cases", cases}};
}

json run_schedules() {
  json out = json::array();
  auto add = [&](const char* name, double lr, double min_lr, int64_t warmup, int64_t total, double fraction,
                 const char* shape) {
    ScheduleConfig c;
    c.name = name;
    c.lr = lr;
    c.min_lr = min_lr;
    c.warmup_steps = warmup;
    c.total_steps = total;
    c.decay_fraction = fraction;
    c.decay_shape = shape;
    validate(c);
    std::vector<double> lrs;
    for (int64_t s = 0; s < c.total_steps + 3; ++s) lrs.push_back(lr_at(c, s));
    out.push_back({{"name", c.name},
                   {"lr", c.lr},
                   {"min_lr", c.min_lr},
                   {"warmup_steps", c.warmup_steps},
                   {"total_steps", c.total_steps},
                   {"decay_fraction", c.decay_fraction},
                   {"decay_shape", c.decay_shape},
                   {"lrs", lrs}});
  };
  add("constant", 1e-3, 0.0, 10, 50, 0.1, "linear");
  add("constant", 1e-3, 0.0, 0, 5, 0.1, "linear");
  add("linear", 6e-4, 6e-5, 7, 100, 0.1, "linear");
  add("linear", 6e-4, 0.0, 0, 1, 0.1, "linear");
  add("cosine", 3e-4, 3e-5, 20, 200, 0.1, "linear");
  add("cosine", 3e-4, 0.0, 0, 37, 0.1, "linear");
  add("cosine", 1e-3, 1e-4, 10, 10, 0.1, "linear");  // warmup only
  for (const char* shape : {"linear", "cosine", "1-sqrt"}) add("wsd", 2e-3, 2e-4, 10, 100, 0.2, shape);
  add("wsd", 2e-3, 0.0, 5, 33, 0.1, "1-sqrt");
  add("wsd", 2e-3, 0.0, 0, 20, 0.0, "linear");   // no decay phase
  add("wsd", 2e-3, 1e-5, 0, 20, 1.0, "cosine");  // all decay
  return out;
}

template <typename F>
void expect_error(F&& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "no error thrown, expected: " << needle;
  } catch (const lathe::Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

}  // namespace

TEST(Optim, MatchesPythonOracle) {
  TempDir tmp;
  json manifest;
  manifest["optimizers"] = {run_optimizer(tmp.path, "adamw", false), run_optimizer(tmp.path, "lamb", true)};
  manifest["clip"] = run_clip(tmp.path);
  manifest["schedules"] = run_schedules();
  std::ofstream(tmp.path / "manifest.json") << manifest.dump(1);
  const std::string cmd =
      std::string("/usr/bin/python3 ") + LATHE_SOURCE_DIR + "/tests/optim/optim_oracle.py " + tmp.path.string();
  EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
}

// Bit-identical results for any thread count (chunked reductions summed in chunk order).
TEST(Optim, DeterministicAcrossThreadCounts) {
  size_t P;
  auto ranges = layout(P);
  std::mt19937 g(9);
  const auto p0 = normal(g, P, 1.0f), grads = normal(g, P, 0.1f);
  const int saved = omp_get_max_threads();
  for (const char* name : {"adamw", "lamb"}) {
    std::vector<std::vector<float>> results;
    std::vector<double> norms;
    for (int threads : {1, 2, 3}) {
      omp_set_num_threads(threads);
      OptimConfig cfg;
      cfg.name = name;
      auto opt = make_optimizer(cfg, P);
      auto p = p0;
      for (int s = 1; s <= 3; ++s) opt->step(p.data(), grads.data(), ranges, 1e-3, s);
      results.push_back(p);
      norms.push_back(global_grad_norm(grads.data(), P));
    }
    EXPECT_EQ(results[0], results[1]) << name;
    EXPECT_EQ(results[0], results[2]) << name;
    EXPECT_EQ(norms[0], norms[1]);
    EXPECT_EQ(norms[0], norms[2]);
  }
  omp_set_num_threads(saved);
}

TEST(Optim, Errors) {
  OptimConfig cfg;
  cfg.name = "sgd";
  expect_error([&] { make_optimizer(cfg, 10); }, "adamw, lamb");
  cfg.name = "adamw";
  cfg.beta2 = 1.0;
  expect_error([&] { make_optimizer(cfg, 10); }, "optim.beta2 (1)");
  cfg.beta2 = 0.95;
  cfg.eps = 0.0;
  expect_error([&] { make_optimizer(cfg, 10); }, "optim.eps");
  cfg.eps = 1e-8;
  auto opt = make_optimizer(cfg, 10);
  std::vector<float> p(10), gr(10);
  std::vector<ParamRange> bad = {{5, 6, true}};
  expect_error([&] { opt->step(p.data(), gr.data(), bad, 1e-3, 1); }, "exceeds the 10 parameters");
  std::vector<ParamRange> ok = {{0, 10, true}};
  expect_error([&] { opt->step(p.data(), gr.data(), ok, 1e-3, 0); }, "step must count from 1");
  auto names = opt->state_buffers();
  ASSERT_EQ(names.size(), 2u);
  EXPECT_EQ(names[0].first, "exp_avg");
  EXPECT_EQ(names[1].first, "exp_avg_sq");

  ScheduleConfig s;
  s.min_lr = 0.5;
  expect_error([&] { validate(s); }, "schedule.min_lr (0.5) must be <= schedule.lr (0.0003)");
  s = {};
  s.name = "exp";
  expect_error([&] { validate(s); }, "constant, linear, cosine, wsd");
  s = {};
  s.warmup_steps = 5;
  s.total_steps = 4;
  expect_error([&] { validate(s); }, "schedule.warmup_steps (5)");
  s = {};
  s.name = "wsd";
  s.total_steps = 100;
  s.warmup_steps = 95;
  expect_error([&] { validate(s); }, "schedule.decay_fraction");
  s.warmup_steps = 0;
  s.decay_shape = "exp";
  expect_error([&] { validate(s); }, "schedule.decay_shape 'exp'");
}

TEST(Optim, ClipNonFiniteLeavesGradients) {
  std::vector<float> g = {1.0f, NAN, 2.0f};
  const double n = clip_grad_norm(g.data(), g.size(), 1.0);
  EXPECT_TRUE(std::isnan(n));
  EXPECT_EQ(g[0], 1.0f);
  EXPECT_EQ(g[2], 2.0f);
}

// Clipping applied on the fly (Optimizer::step's grad_scale) must equal clipping the gradients
// first, bit for bit, for both optimizers.
TEST(Optim, FusedClipEqualsClipThenStep) {
  for (const char* name : {"adamw", "lamb"}) {
    const size_t n = 20001;
    std::mt19937 gen(5);
    std::normal_distribution<float> d(0.0f, 1.0f);
    std::vector<float> p0(n), g0(n);
    for (auto& x : p0) x = d(gen);
    for (auto& x : g0) x = d(gen);
    std::vector<ParamRange> ranges{{0, 12000, true}, {12000, n - 12000, false}};
    OptimConfig cfg;
    cfg.name = name;
    auto a = make_optimizer(cfg, n), b = make_optimizer(cfg, n);
    std::vector<float> pa = p0, pb = p0;
    for (int step = 1; step <= 3; ++step) {
      std::vector<float> ga = g0, gb = g0;
      for (size_t i = 0; i < n; ++i) ga[i] = gb[i] = g0[i] * static_cast<float>(step);
      const double norm = clip_grad_norm(ga.data(), n, 0.5);
      a->step(pa.data(), ga.data(), ranges, 1e-2, step);
      ASSERT_EQ(norm, global_grad_norm(gb.data(), n));
      const float scale = clip_coefficient(norm, 0.5);
      ASSERT_LT(scale, 1.0f);
      b->step(pb.data(), gb.data(), ranges, 1e-2, step, scale);
    }
    for (size_t i = 0; i < n; ++i) ASSERT_EQ(pa[i], pb[i]) << name << " element " << i;
  }
}
