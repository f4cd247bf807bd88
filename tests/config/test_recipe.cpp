// Recipe loading: a good recipe, each error class with the exact key path in the message,
// --set overrides, closest_match, to_yaml re-loading, and the shipped configs/*.yaml.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <regex>

#include "config/recipe.h"
#include "config/recipe_diff.h"
#include "core/error.h"
#include "io/fs.h"

using namespace lathe;
namespace fs = std::filesystem;

namespace {

const char* kGood = R"(
model:
  preset: gpt2-debug
  n_layer: 3
  vocab_size: 256
data:
  train: data/shakespeare_byte
  valid_fraction: 0.1
  tokenizer: byte
optimizer:
  name: adamw
  lr: 1.0e-3
  weight_decay: 0.1
  grad_clip: 1.0
schedule:
  name: cosine
  warmup_steps: 20
  min_lr: 1e-4
training:
  micro_batch_size: 16
  seq_len: 128
  steps: 600
  eval_interval: 100
output:
  dir: runs/test
)";

// Replace `old` with `repl` in kGood (must occur).
std::string edit(const std::string& old, const std::string& repl) {
  std::string s = kGood;
  auto p = s.find(old);
  EXPECT_NE(p, std::string::npos) << old;
  return s.replace(p, old.size(), repl);
}

void expect_error(const std::string& text, std::vector<std::string> subs, const std::vector<std::string>& ovs = {}) {
  try {
    parse_recipe(text, "recipe.yaml", ovs);
    FAIL() << "no error; expected: " << subs[0];
  } catch (const Error& e) {
    std::string m = e.what();
    EXPECT_EQ(m.rfind("recipe.yaml: ", 0), 0u) << m;
    for (auto& s : subs) EXPECT_NE(m.find(s), std::string::npos) << "message: " << m << "\nmissing: " << s;
  }
}

}  // namespace

TEST(Recipe, GoodRecipe) {
  Recipe r = parse_recipe(kGood, "recipe.yaml");
  EXPECT_EQ(r.source, "recipe.yaml");
  EXPECT_EQ(r.model.model_type, "gpt2");
  EXPECT_EQ(r.model.num_hidden_layers, 3);  // override of the preset
  EXPECT_EQ(r.model.hidden_size, 48);       // from the preset
  EXPECT_EQ(r.model.vocab_size, 256);
  EXPECT_EQ(r.data.train, "data/shakespeare_byte");
  EXPECT_DOUBLE_EQ(r.data.valid_fraction, 0.1);
  EXPECT_EQ(r.data.tokenizer, "byte");
  EXPECT_DOUBLE_EQ(r.optimizer.lr, 1e-3);
  EXPECT_DOUBLE_EQ(r.optimizer.beta2, 0.95);  // default
  EXPECT_EQ(r.schedule.warmup_steps, 20);
  EXPECT_DOUBLE_EQ(r.schedule.min_lr, 1e-4);
  EXPECT_EQ(r.training.micro_batch_size, 16);
  EXPECT_EQ(r.training.seq_len, 128);
  EXPECT_EQ(r.training.steps, 600);
  EXPECT_EQ(r.training.grad_accum_steps, 1);
  EXPECT_EQ(r.output.dir, "runs/test");
  EXPECT_TRUE(r.init_from.empty());
}

TEST(Recipe, ModelWithoutPreset) {
  Recipe r = parse_recipe(R"(
model: {model_type: llama, hidden_size: 64, num_hidden_layers: 2, num_attention_heads: 4,
        num_key_value_heads: 2, intermediate_size: 128, vocab_size: 100, max_position_embeddings: 64}
data: {train: x}
training: {seq_len: 64}
)",
                          "r.yaml");
  EXPECT_EQ(r.model.family, "llama");
  EXPECT_EQ(r.model.num_key_value_heads, 2);
  // Switching model_type within the llama family keeps the preset's sizes.
  Recipe q = parse_recipe("model: {preset: llama-debug, model_type: qwen2}\ndata: {train: x}\n", "r.yaml");
  EXPECT_EQ(q.model.model_type, "qwen2");
  EXPECT_TRUE(q.model.attention_bias);
  EXPECT_EQ(q.model.hidden_size, 48);
}

TEST(Recipe, UnknownKeys) {
  expect_error(edit("  lr: 1.0e-3", "  lrr: 1.0e-3"), {"unknown key 'optimizer.lrr'", "did you mean 'optimizer.lr'"});
  expect_error(edit("optimizer:", "optimiser:"), {"unknown section 'optimiser'", "did you mean 'optimizer'"});
  expect_error(edit("  n_layer: 3", "  n_layers: 3"), {"unknown key 'model.n_layers'", "did you mean 'model.n_layer'"});
  expect_error(edit("  seq_len: 128", "  seqlen: 128"), {"unknown key 'training.seqlen'", "'training.seq_len'"});
  expect_error(edit("  seq_len: 128", "  zzzzzzzzzzzz: 128"), {"unknown key 'training.zzzzzzzzzzzz'"});
  // A llama field on a gpt2 model is unknown for that model_type.
  expect_error(edit("  n_layer: 3", "  rms_norm_eps: 1e-5"), {"unknown key 'model.rms_norm_eps'"});
}

TEST(Recipe, WrongTypes) {
  expect_error(edit("seq_len: 128", "seq_len: abc"), {"training.seq_len: expected an integer, got 'abc'"});
  expect_error(edit("seq_len: 128", "seq_len: 12.5"), {"training.seq_len: expected an integer"});
  expect_error(edit("seq_len: 128", "seq_len: \"128\""), {"training.seq_len: expected an integer, got '128'"});
  expect_error(edit("lr: 1.0e-3", "lr: fast"), {"optimizer.lr: expected a number, got 'fast'"});
  expect_error(edit("n_layer: 3", "n_layer: three"), {"model.n_layer: expected an integer, got 'three'"});
  expect_error(edit("name: cosine", "name: [a, b]"), {"schedule.name: expected a string"});
  expect_error(edit("  dir: runs/test", "  dir: runs/test\n  save_every: {a: 1}"), {"output.save_every"});
}

TEST(Recipe, ImpossibleValues) {
  expect_error(edit("  n_layer: 3", "  n_head: 5"), {"model.n_embd = 48", "model.n_head = 5"});
  expect_error(edit("seq_len: 128", "seq_len: 129"), {"training.seq_len", "129", "128"});
  expect_error(edit("micro_batch_size: 16", "micro_batch_size: 0"), {"training.micro_batch_size", "0"});
  expect_error(edit("steps: 600", "steps: 600\n  grad_accum_steps: 0"), {"training.grad_accum_steps"});
  expect_error(edit("steps: 600", "steps: 0"), {"training.steps"});
  expect_error(edit("lr: 1.0e-3", "lr: 0"), {"optimizer.lr", "must be > 0"});
  expect_error(edit("lr: 1.0e-3", "lr: -1e-3"), {"optimizer.lr"});
  expect_error(edit("name: adamw", "name: adamw\n  beta1: 1.0"), {"optimizer.beta1", "[0, 1)"});
  expect_error(edit("name: adamw", "name: adamw\n  beta2: -0.1"), {"optimizer.beta2"});
  expect_error(edit("valid_fraction: 0.1", "valid_fraction: 1.0"), {"data.valid_fraction", "[0, 1)"});
  expect_error(edit("name: cosine", "name: cosin"), {"schedule.name", "'cosin'", "cosine"});
  expect_error(edit("name: cosine", "name: wsd\n  decay_shape: exp"), {"schedule.decay_shape", "'exp'"});
  expect_error(edit("warmup_steps: 20", "warmup_steps: 601"), {"schedule.warmup_steps", "601", "training.steps = 600"});
  expect_error(edit("min_lr: 1e-4", "min_lr: 1e-2"), {"schedule.min_lr", "optimizer.lr"});
  expect_error(edit("name: adamw", "name: sgd"), {"optimizer.name", "'sgd'"});
  expect_error(edit("  train: data/shakespeare_byte\n", ""), {"data.train", "missing"});
  expect_error(edit("  vocab_size: 256\n", ""), {"data.tokenizer", "vocab_size"});
  expect_error(edit("valid_fraction: 0.1", "valid_fraction: 0"), {"training.eval_interval", "validation"});
  expect_error(edit("  preset: gpt2-debug\n", "  preset: gpt2-debug\n  config: x.json\n"), {"only one of"});
  expect_error(edit("preset: gpt2-debug", "preset: gpt3"), {"model.preset", "gpt3"});
  expect_error(edit("  n_layer: 3", "  resid_pdrop: 0.1"), {"model.resid_pdrop", "dropout"});
  expect_error("model: {n_layer: 2}\ndata: {train: x}\n", {"model_type"});
  expect_error("model: {preset: gpt2-debug, model_type: llama}\ndata: {train: x}\n", {"model.model_type", "family"});
  expect_error("model: [1, 2]\n", {"model", "mapping"});
  expect_error("model: {preset: gpt2-debug\n", {"invalid YAML"});
}

// Sliding-window attention runs beyond the window (issue 25 item 5): seq_len is capped by
// max_position_embeddings only.
TEST(Recipe, SeqLenBeyondSlidingWindow) {
  const Recipe r = parse_recipe(
      "model: {preset: mistral-debug, sliding_window: 32}\ndata: {train: x}\n"
      "training: {seq_len: 128}\n",
      "recipe.yaml", {});
  EXPECT_EQ(r.model.sliding_window, 32);
  EXPECT_EQ(r.training.seq_len, 128);
  expect_error("model: {preset: mistral-debug, sliding_window: 32}\ndata: {train: x}\ntraining: {seq_len: 129}\n",
               {"training.seq_len", "max_position_embeddings"});
}

TEST(Recipe, Overrides) {
  Recipe r = parse_recipe(kGood, "recipe.yaml",
                          {"training.steps=10", "model.n_layer=2", "optimizer.lr=2e-3", "data.valid=data/v",
                           "schedule.warmup_steps=5", "model.n_embd=64", "output.dir=runs/x y"});
  EXPECT_EQ(r.training.steps, 10);
  EXPECT_EQ(r.model.num_hidden_layers, 2);
  EXPECT_EQ(r.model.hidden_size, 64);
  EXPECT_DOUBLE_EQ(r.optimizer.lr, 2e-3);
  EXPECT_EQ(r.data.valid, "data/v");
  EXPECT_EQ(r.output.dir, "runs/x y");
  // The alias replaces the preset's spelling instead of conflicting with it.
  Recipe a = parse_recipe(kGood, "recipe.yaml", {"model.hidden_size=96"});
  EXPECT_EQ(a.model.hidden_size, 96);
  // Creates a section that the file does not have.
  Recipe b = parse_recipe("model: {preset: llama-debug}\ndata: {train: x}\n", "r.yaml", {"output.save_every=7"});
  EXPECT_EQ(b.output.save_every, 7);
  // Nested key inside a model field (rope_parameters.rope_theta).
  Recipe c = parse_recipe("model: {preset: llama-debug}\ndata: {train: x}\n", "r.yaml",
                          {"model.rope_parameters.rope_theta=500000.0"});
  EXPECT_DOUBLE_EQ(c.model.rope_theta, 500000.0);
  // RoPE scaling and rope_theta set in the recipe (over a preset), and a nested override.
  Recipe rs = parse_recipe(
      "model: {preset: llama-debug, rope_theta: 500000.0, partial_rotary_factor: 0.5,\n"
      "        rope_scaling: {rope_type: yarn, factor: 4.0, beta_fast: 16.0}}\ndata: {train: x}\n",
      "r.yaml", {"model.rope_scaling.factor=8.0"});
  EXPECT_DOUBLE_EQ(rs.model.rope_theta, 500000.0);
  EXPECT_EQ(rs.model.rope_scaling.type, "yarn");
  EXPECT_DOUBLE_EQ(*rs.model.rope_scaling.factor, 8.0);
  EXPECT_DOUBLE_EQ(*rs.model.rope_scaling.beta_fast, 16.0);
  EXPECT_DOUBLE_EQ(rs.model.partial_rotary_factor, 0.5);
  expect_error("model: {preset: llama-debug, rope_scaling: {rope_type: yarn}}\ndata: {train: x}\n",
               {"model.rope_scaling.factor: missing"});
  // Dynamic NTK scaling may train past max_position_embeddings (128 in llama-debug); others may not.
  Recipe dy = parse_recipe("model: {preset: llama-debug, rope_scaling: {rope_type: dynamic, factor: 2.0}}\n"
                           "data: {train: x}\ntraining: {seq_len: 200}\n",
                           "r.yaml");
  EXPECT_EQ(dy.training.seq_len, 200);
  expect_error("model: {preset: llama-debug, rope_scaling: {rope_type: linear, factor: 2.0}}\n"
               "data: {train: x}\ntraining: {seq_len: 200}\n",
               {"training.seq_len", "exceeds the model's max_position_embeddings"});
  expect_error(kGood, {"--set training.stpes=10", "unknown key 'training.stpes'", "did you mean 'training.steps'"},
               {"training.stpes=10"});
  expect_error(kGood, {"--set trainig.steps=10", "unknown section 'trainig'", "'training'"}, {"trainig.steps=10"});
  expect_error(kGood, {"--set training.steps=abc", "training.steps: expected an integer, got 'abc'"},
               {"training.steps=abc"});
  expect_error(kGood, {"--set steps"}, {"steps"});
  expect_error(kGood, {"--set steps=3", "needs a section"}, {"steps=3"});
  expect_error(kGood, {"--set model.n_layr=3", "'model.n_layer'"}, {"model.n_layr=3"});
}

TEST(Recipe, ClosestMatch) {
  std::vector<std::string> c = {"optimizer.lr", "optimizer.eps", "training.steps", "training.seq_len"};
  EXPECT_EQ(closest_match("optimizer.lrr", c), "optimizer.lr");
  EXPECT_EQ(closest_match("training.step", c), "training.steps");
  EXPECT_EQ(closest_match("Training.Seq_Len", c), "training.seq_len");
  EXPECT_EQ(closest_match("completely.different", c), "");
  EXPECT_EQ(closest_match("x", {}), "");
  EXPECT_EQ(closest_match("n_embed", {"n_embd", "n_head", "n_layer"}), "n_embd");
}

TEST(Recipe, ToYamlReloads) {
  const std::string llama = "model: {preset: llama-debug}\ndata: {train: x}\n";
  std::vector<std::pair<std::string, std::vector<std::string>>> cases = {
      {kGood, {}},
      {kGood, {"model.n_inner=100", "optimizer.eps=1e-10", "training.peak_gflops=12.5", "output.dir=a \"b\""}},
      {llama, {"model.model_type=qwen2", "training.seq_len=64", "model.eos_token_id=5"}},
      {llama,
       {"model.preset=mistral-debug", "data.tokenizer=tok.model", "schedule.name=wsd", "schedule.decay_shape=1-sqrt",
        "training.seq_len=100", "model.sliding_window=100"}},
      {kGood,
       {"precision.compute=fp16", "precision.loss_scale.initial=1024", "precision.loss_scale.growth=4",
        "training.max_skipped_steps=0"}},
      {kGood, {"precision.compute=bf16", "precision.loss_scale.enabled=true", "precision.loss_scale.min=0.25"}}};
  for (auto& [text, ovs] : cases) {
    Recipe r = parse_recipe(text, "recipe.yaml", ovs);
    std::string y = r.to_yaml();
    Recipe back = parse_recipe(y, "resolved.yaml");
    EXPECT_EQ(back.to_json(), r.to_json()) << y;
    EXPECT_EQ(back.model, r.model);
  }
}

TEST(Recipe, ConfigAndInitFromFiles) {
  std::string dir = (fs::temp_directory_path() / ("lathe_recipe_" + std::to_string(::getpid()))).string();
  fs::create_directories(dir + "/hf");
  io::atomic_write_file(dir + "/hf/config.json", ModelConfig::preset("llama-debug").to_hf_json().dump(2));
  Recipe r = parse_recipe("model: {init_from: " + dir + "/hf, num_hidden_layers: 3}\ndata: {train: x}\n", "r.yaml");
  EXPECT_EQ(r.init_from, dir + "/hf");
  EXPECT_EQ(r.model.num_hidden_layers, 3);
  EXPECT_EQ(r.model.hidden_size, 48);
  Recipe back = parse_recipe(r.to_yaml(), "resolved.yaml");
  EXPECT_EQ(back.to_json(), r.to_json());
  Recipe c = parse_recipe("model: {config: " + dir + "/hf/config.json}\ndata: {train: x}\n", "r.yaml");
  EXPECT_EQ(c.model, ModelConfig::preset("llama-debug"));
  EXPECT_TRUE(c.init_from.empty());
  expect_error("model: {init_from: " + dir + "/nope}\ndata: {train: x}\n", {"model.init_from", "nope/config.json"});
  // An invalid config.json is reported against that file.
  io::atomic_write_file(dir + "/bad.json", R"({"model_type": "llama", "mlp_bias": true})");
  try {
    parse_recipe("model: {config: " + dir + "/bad.json}\ndata: {train: x}\n", "r.yaml");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("bad.json: mlp_bias"), std::string::npos) << e.what();
  }
  fs::remove_all(dir);
}

// model.head_dim: explicit in a recipe; a base's derived head_dim (= its hidden / heads, written into
// every llama-family config.json) follows an overridden width or head count.
TEST(Recipe, HeadDim) {
  const std::string base = "model: {preset: llama-debug, ";
  const std::string rest = "}\ndata: {train: x}\n";
  Recipe a = parse_recipe(base + "hidden_size: 96" + rest, "r.yaml");
  EXPECT_EQ(a.model.head_dim(), 24);
  EXPECT_EQ(a.model.attention_width(), 96);
  Recipe b = parse_recipe(base + "num_attention_heads: 2, num_key_value_heads: 2" + rest, "r.yaml");
  EXPECT_EQ(b.model.head_dim(), 24);
  Recipe c = parse_recipe(base + "hidden_size: 96, head_dim: 32" + rest, "r.yaml");
  EXPECT_EQ(c.model.head_dim(), 32);
  EXPECT_EQ(c.model.attention_width(), 128);
  EXPECT_EQ(parse_recipe(c.to_yaml(), "x").model, c.model);  // recipe.yaml round trip
  EXPECT_EQ(parse_recipe(base + "head_dim: 12" + rest, "r.yaml").model, ModelConfig::preset("llama-debug"));
  try {
    parse_recipe(base + "head_dim: 7" + rest, "r.yaml");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("model.head_dim = 7"), std::string::npos) << e.what();
  }
}

TEST(Recipe, ShippedConfigsLoad) {
  for (const char* name : {"quickstart.yaml", "gpt2-124m.yaml", "llama-debug.yaml", "llama-debug-longctx.yaml",
                           "plan/llama3.2-1b-8k.yaml"}) {
    std::string path = std::string(LATHE_SOURCE_DIR) + "/configs/" + name;
    Recipe r = load_recipe(path);
    EXPECT_EQ(r.source, path);
    EXPECT_EQ(parse_recipe(r.to_yaml(), "x").to_json(), r.to_json()) << name;
  }
  Recipe q = load_recipe(std::string(LATHE_SOURCE_DIR) + "/configs/quickstart.yaml");
  EXPECT_EQ(q.model.model_type, "gpt2");
  EXPECT_EQ(q.model.vocab_size, 256);
  EXPECT_EQ(q.model.max_position_embeddings, 256);
  EXPECT_EQ(q.model.hidden_size, 128);
  EXPECT_EQ(q.model.num_hidden_layers, 4);
  EXPECT_EQ(q.model.num_attention_heads, 4);
  EXPECT_EQ(q.data.train, "data/shakespeare_byte");
  EXPECT_EQ(q.data.tokenizer, "byte");
  EXPECT_EQ(q.training.steps, 600);
  EXPECT_EQ(q.output.dir, "runs/quickstart");
  // The long-context continuation keeps llama-debug.yaml's shape and optimizer, changes the RoPE.
  Recipe s = load_recipe(std::string(LATHE_SOURCE_DIR) + "/configs/llama-debug.yaml");
  Recipe l = load_recipe(std::string(LATHE_SOURCE_DIR) + "/configs/llama-debug-longctx.yaml");
  EXPECT_EQ(l.model.rope_scaling.type, "llama3");
  EXPECT_EQ(l.training.seq_len, 4 * s.training.seq_len);
  EXPECT_EQ(l.output.dir, s.output.dir);
  for (const auto& c : diff_recipes(s.to_json(), l.to_json()))
    EXPECT_FALSE(c.shape || c.key.rfind("optimizer.", 0) == 0 || c.key.rfind("schedule.", 0) == 0) << c.key;
}

TEST(Recipe, CheckpointKeys) {
  Recipe d = parse_recipe(kGood, "recipe.yaml");
  EXPECT_EQ(d.output.checkpoint_every, 0);
  EXPECT_EQ(d.output.keep_last, 0);
  EXPECT_EQ(d.training.resume, "");
  Recipe r =
      parse_recipe(kGood, "recipe.yaml", {"output.checkpoint_every=25", "output.keep_last=3", "training.resume=auto"});
  EXPECT_EQ(r.output.checkpoint_every, 25);
  EXPECT_EQ(r.output.keep_last, 3);
  EXPECT_EQ(r.training.resume, "auto");
  // The resolved recipe carries them and re-loads to the same values.
  Recipe again = parse_recipe(r.to_yaml(), "resolved.yaml");
  EXPECT_EQ(again.output.checkpoint_every, 25);
  EXPECT_EQ(again.output.keep_last, 3);
  EXPECT_EQ(again.training.resume, "auto");
  expect_error(kGood, {"output.checkpoint_every", "-1", ">= 0"}, {"output.checkpoint_every=-1"});
  expect_error(kGood, {"output.keep_last", "-2"}, {"output.keep_last=-2"});
  expect_error(kGood, {"output.keep_last: expected an integer"}, {"output.keep_last=many"});
  expect_error(kGood, {"unknown key 'output.checkpoint_evry'", "did you mean 'output.checkpoint_every'"},
               {"output.checkpoint_evry=5"});
}

// ------------------------------------------------------------------- hostile YAML (issue 14)

// The hand-written scanner accepts exactly the language of the regexes it replaced (std::regex
// overflowed the stack on a 100,000-digit scalar): every string of length <= 5 over the
// characters that matter, through --set (a plain YAML scalar).
TEST(RecipeHostile, ScalarScannerMatchesTheOldRegexes) {
  const std::regex int_re("[-+]?[0-9]+");
  const std::regex float_re(R"([-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?)");
  const std::string alphabet = "01.e+-";
  const std::string base = "model: {preset: gpt2-debug}\ndata: {train: x}\n";
  std::vector<std::string> all = {""};
  for (size_t len = 1, begin = 0; len <= 5; ++len) {
    const size_t end = all.size();
    for (size_t i = begin; i < end; ++i)
      for (char c : alphabet) all.push_back(all[i] + c);
    begin = end;
  }
  int numbers = 0;
  for (const std::string& s : all) {
    if (s.empty() || s[0] == '-' || s[0] == '.') continue;  // YAML indicators: a list, not a scalar
    const bool number = std::regex_match(s, int_re) || std::regex_match(s, float_re);
    std::string err;
    try {
      parse_recipe(base, "r.yaml", {"training.peak_gflops=" + s});
    } catch (const Error& e) {
      err = e.what();
    }
    const bool typed =
        err.find("expected a number") == std::string::npos && err.find("invalid YAML") == std::string::npos;
    EXPECT_EQ(typed, number) << "'" << s << "': " << err;
    numbers += number;
  }
  EXPECT_GT(numbers, 100);
}

TEST(RecipeHostile, LongScalars) {
  const std::string digits(100000, '7');
  expect_error(edit("seq_len: 128", "seq_len: " + digits),
               {"training.seq_len", "does not fit a 64-bit integer", "(100000 characters)"});
  expect_error(kGood, {"--set training.steps=", "does not fit"}, {"training.steps=" + digits});
  // A long float is a float (strtod copes); a long word is a string, quoted bounded in errors.
  Recipe r = parse_recipe(kGood, "recipe.yaml", {"training.peak_gflops=1." + digits});
  EXPECT_DOUBLE_EQ(r.training.peak_gflops, 1.7777777777777777);
  expect_error(kGood, {"optimizer.lr: expected a number", "(100000 characters)"},
               {"optimizer.lr=" + std::string(100000, 'x')});
}

TEST(RecipeHostile, AliasesCyclesAndDepth) {
  expect_error("x: &a [*a]\n", {"line 1", "cycle"});
  expect_error("x: &a {k: *a}\n", {"cycle"});
  expect_error(kGood, {"--set model.n_layer", "cycle"}, {"model.n_layer=&a [*a]"});
  std::string laughs = "a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n";
  for (int i = 1; i < 10; ++i) {
    laughs += fmt::format("a{}: &a{} [", i, i);
    for (int k = 0; k < 10; ++k) laughs += fmt::format("{}*a{}", k ? ", " : "", i - 1);
    laughs += "]\n";
  }
  expect_error(laughs, {"more than 100000 values"});
  expect_error("model: " + std::string(40, '[') + std::string(40, ']') + "\n", {"nests deeper than 32"});
  expect_error("model: " + std::string(100000, '[') + std::string(100000, ']') + "\n", {"nests too deeply", "line 1"});
  // Aliases that expand a little still work.
  Recipe r = parse_recipe(edit("  lr: 1.0e-3", "  lr: &lr 1.0e-3") + "", "recipe.yaml");
  Recipe a = parse_recipe(
      "model: {preset: gpt2-debug}\ndata: {train: x}\noptimizer: {lr: &lr 2.0e-3}\n"
      "schedule: {min_lr: *lr}\n",
      "recipe.yaml");
  EXPECT_DOUBLE_EQ(a.schedule.min_lr, 2e-3);
  EXPECT_DOUBLE_EQ(r.optimizer.lr, 1e-3);
}

TEST(RecipeHostile, DuplicatesDocumentsTags) {
  expect_error(std::string(kGood) + "training: {steps: 5}\n", {"duplicate section 'training'", "lines 19 and 26"});
  expect_error(edit("  steps: 600", "  steps: 600\n  steps: 700"), {"duplicate key 'training.steps'"});
  expect_error("model: {preset: gpt2-debug, preset: llama-debug}\ndata: {train: x}\n",
               {"duplicate key 'model.preset'"});
  expect_error(std::string(kGood) + "---\nmodel: {preset: llama-debug}\n", {"more than one YAML document", "line 26"});
  expect_error(kGood, {"--set training.steps", "more than one YAML document"}, {"training.steps=1\n---\n2"});
  // yaml-cpp's LoadAll returns empty documents forever on a stray top-level ',' (a hang found by
  // fuzz_recipe); it is an error at its position.
  expect_error(",", {"invalid YAML at line 1, column 1", "stray ','"});
  expect_error(kGood, {"--set training.steps", "stray ','"}, {"training.steps=,"});
  expect_error(edit("seq_len: 128", "seq_len: !!str 128"), {"explicit YAML tag", "training.seq_len"});
  expect_error(edit("seq_len: 128", "seq_len: !!python/object/apply:os.system [ls]"), {"explicit YAML tag"});
  expect_error(edit("seq_len: 128", "seq_len: !!int 128"), {"explicit YAML tag"});
  expect_error(std::string(kGood) + "? [a, b]\n: 1\n", {"keys must be plain names"});
  // Quoted scalars are strings; "---" as a leading document marker and "..." are fine.
  Recipe r = parse_recipe("---\n" + edit("dir: runs/test", "dir: \"2024\"") + "...\n", "recipe.yaml");
  EXPECT_EQ(r.output.dir, "2024");
  expect_error(edit("seq_len: 128", "seq_len: '128'"), {"expected an integer, got '128'"});
  // Strings go into JSON (recipe.yaml, checkpoint state), which needs UTF-8: refused here, not by
  // a JSON type error when the trainer writes the resolved recipe.
  expect_error(edit("dir: runs/test", "dir: runs/\xff\xfe"), {"output.dir", "not valid UTF-8"});
  expect_error(std::string(kGood) + "bad\xc3: 1\n", {"key", "not valid UTF-8"});
  EXPECT_EQ(parse_recipe(edit("dir: runs/test", "dir: runs/t\xc3\xa9st"), "r.yaml").output.dir, "runs/t\xc3\xa9st");
}

TEST(RecipeHostile, FloatsMustBeFinite) {
  for (const char* k : {"optimizer.lr", "optimizer.eps", "optimizer.weight_decay", "optimizer.grad_clip",
                        "optimizer.beta1", "schedule.min_lr", "schedule.decay_fraction", "data.valid_fraction",
                        "training.peak_gflops", "model.layer_norm_epsilon", "model.initializer_range"})
    for (const char* v : {"1e999", "-1e999"})
      expect_error(kGood, {k, "is not a finite number"}, {fmt::format("{}={}", k, v)});
  const std::string llama = "model: {preset: llama-debug}\ndata: {train: x}\n";
  for (const char* k : {"model.rms_norm_eps", "model.rope_theta", "model.rope_parameters.rope_theta"}) {
    try {
      parse_recipe(llama, "r.yaml", {fmt::format("{}=1e999", k)});
      ADD_FAILURE() << k;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("finite"), std::string::npos) << e.what();
    }
  }
}

TEST(RecipeHostile, IntegerBounds) {
  struct B {
    const char* key;
    int64_t max;
  };
  for (const B& b :
       {B{"training.micro_batch_size", kMaxMicroBatch}, B{"training.grad_accum_steps", kMaxGradAccum},
        B{"training.steps", kMaxSteps}, B{"training.eval_batches", kMaxEvalBatches}, B{"training.threads", kMaxThreads},
        B{"data.prefetch", kMaxPrefetch}, B{"output.save_every", kMaxSteps}, B{"output.checkpoint_every", kMaxSteps},
        B{"output.keep_last", kMaxKeepLast}, B{"training.log_interval", kMaxSteps}}) {
    std::vector<std::string> ok = {fmt::format("{}={}", b.key, b.max)};
    if (std::string(b.key) != "training.steps") ok.push_back("training.steps=100");  // keep the product small
    try {
      parse_recipe(kGood, "recipe.yaml", ok);
    } catch (const Error& e) {
      ADD_FAILURE() << b.key << ": " << e.what();
    }
    expect_error(kGood, {b.key, "exceeds the maximum"}, {fmt::format("{}={}", b.key, b.max + 1)});
  }
  expect_error(kGood, {"training.steps x micro_batch_size x grad_accum_steps x seq_len", "overflows"},
               {"training.steps=1000000000000", "training.micro_batch_size=65536", "training.grad_accum_steps=65536"});
  // training.seed takes any 64-bit value.
  EXPECT_EQ(parse_recipe(kGood, "r.yaml", {"training.seed=-9223372036854775808"}).training.seed, INT64_MIN);
  expect_error(edit("  n_layer: 3", "  n_layer: 2147483648"), {"model.n_layer", "exceeds lathe's maximum 65536"});
  expect_error(edit("  vocab_size: 256", "  vocab_size: 4611686018427387904"), {"model.vocab_size", "exceeds"});
  expect_error(edit("  n_layer: 3", "  n_layer: 3\n  n_embd: 2147483648\n  n_head: 1"), {"model.n_embd", "exceeds"});
}

TEST(RecipeHostile, BaseConfigFileIsDepthChecked) {
  std::string dir = (fs::temp_directory_path() / ("lathe_recipe_deep_" + std::to_string(::getpid()))).string();
  fs::create_directories(dir);
  io::atomic_write_file(dir + "/deep.json", "{\"model_type\": \"gpt2\", \"n_layer\": " + std::string(100000, '[') +
                                                std::string(100000, ']') + "}");
  expect_error("model: {config: " + dir + "/deep.json}\ndata: {train: x}\n",
               {"model.config", "deep.json", "nests deeper"});
  fs::remove_all(dir);
}

TEST(Recipe, PrecisionDefaultsAndValues) {
  Recipe r = parse_recipe(kGood, "recipe.yaml");
  EXPECT_EQ(r.precision.compute, "fp32");
  EXPECT_FALSE(r.precision.loss_scale.enabled);
  EXPECT_EQ(r.precision.loss_scale.initial, 65536.0);
  EXPECT_EQ(r.precision.loss_scale.growth_interval, 2000);
  EXPECT_EQ(r.precision.loss_scale.backoff, 0.5);
  EXPECT_EQ(r.precision.loss_scale.growth, 2.0);
  EXPECT_EQ(r.precision.loss_scale.min, 1.0);
  EXPECT_EQ(r.training.max_skipped_steps, 20);
  EXPECT_TRUE(r.notes.empty());
  // fp16 turns dynamic loss scaling on; the keys take values.
  Recipe h = parse_recipe(kGood + std::string("precision: {compute: fp16, loss_scale: {initial: 1024, "
                                              "growth_interval: 10, backoff: 0.25, growth: 4, min: 2}}\n"),
                          "recipe.yaml");
  EXPECT_EQ(h.precision.compute, "fp16");
  EXPECT_TRUE(h.precision.loss_scale.enabled);
  EXPECT_EQ(h.precision.loss_scale.initial, 1024.0);
  EXPECT_EQ(h.precision.loss_scale.growth_interval, 10);
  EXPECT_EQ(h.precision.loss_scale.backoff, 0.25);
  EXPECT_EQ(h.precision.loss_scale.growth, 4.0);
  EXPECT_EQ(h.precision.loss_scale.min, 2.0);
  EXPECT_TRUE(h.notes.empty());
  // bf16 with loss_scale keys: accepted and ignored, with a note (not an error).
  Recipe b = parse_recipe(kGood, "recipe.yaml", {"precision.compute=bf16", "precision.loss_scale.initial=8"});
  EXPECT_EQ(b.precision.compute, "bf16");
  EXPECT_FALSE(b.precision.loss_scale.enabled);
  ASSERT_EQ(b.notes.size(), 1u);
  EXPECT_NE(b.notes[0].find("precision.loss_scale is ignored"), std::string::npos) << b.notes[0];
  EXPECT_NE(b.notes[0].find("bf16"), std::string::npos) << b.notes[0];
  // ... unless scaling is asked for explicitly (any precision).
  Recipe e = parse_recipe(kGood, "recipe.yaml", {"precision.loss_scale.enabled=true"});
  EXPECT_TRUE(e.precision.loss_scale.enabled);
  EXPECT_TRUE(e.notes.empty());
  Recipe off = parse_recipe(kGood, "recipe.yaml", {"precision.compute=fp16", "precision.loss_scale.enabled=false"});
  EXPECT_FALSE(off.precision.loss_scale.enabled);
  EXPECT_EQ(off.notes.size(), 1u);
  EXPECT_EQ(parse_recipe(kGood, "r.yaml", {"training.max_skipped_steps=0"}).training.max_skipped_steps, 0);
}

TEST(Recipe, PrecisionErrorsNameKeyAndValue) {
  expect_error(kGood + std::string("precision: {compute: fp8}\n"),
               {"precision.compute", "'fp8' is not supported", "fp32, bf16, fp16"});
  expect_error(kGood, {"precision.compute", "'float16'", "fp32, bf16, fp16"}, {"precision.compute=float16"});
  expect_error(kGood + std::string("precision: {compue: bf16}\n"),
               {"unknown key 'precision.compue'", "did you mean 'precision.compute'"});
  expect_error(kGood + std::string("precision: {compute: fp16, loss_scale: {intial: 2}}\n"),
               {"unknown key 'precision.loss_scale.intial'", "did you mean 'precision.loss_scale.initial'"});
  expect_error(kGood + std::string("precision: {loss_scale: 1024}\n"), {"precision.loss_scale", "expected a mapping"});
  expect_error(kGood + std::string("precision: bf16\n"), {"precision", "expected a mapping"});
  expect_error(kGood, {"precision.loss_scale.enabled", "expected true or false", "yes please"},
               {"precision.loss_scale.enabled=yes please"});
  expect_error(kGood, {"precision.loss_scale.initial", "0", "must be in [2^-100, 2^100]"},
               {"precision.loss_scale.initial=0"});
  expect_error(kGood, {"precision.loss_scale.initial", "1e+200"}, {"precision.loss_scale.initial=1e200"});
  expect_error(kGood, {"precision.loss_scale.initial", "not a finite"}, {"precision.loss_scale.initial=1e999"});
  expect_error(kGood, {"precision.loss_scale.growth_interval", "0"}, {"precision.loss_scale.growth_interval=0"});
  expect_error(kGood, {"precision.loss_scale.growth_interval", "expected an integer"},
               {"precision.loss_scale.growth_interval=1.5"});
  expect_error(kGood, {"precision.loss_scale.backoff", "1", "(0, 1)"}, {"precision.loss_scale.backoff=1"});
  expect_error(kGood, {"precision.loss_scale.growth", "0.5", "(1, 65536]"}, {"precision.loss_scale.growth=0.5"});
  expect_error(kGood, {"precision.loss_scale.min", "100000", "65536"}, {"precision.loss_scale.min=100000"});
  expect_error(kGood, {"precision.loss_scale.min", "-1"}, {"precision.loss_scale.min=-1"});
  expect_error(kGood, {"training.max_skipped_steps", "-1", ">= 0"}, {"training.max_skipped_steps=-1"});
  expect_error(kGood, {"unknown key 'training.max_skiped_steps'", "did you mean 'training.max_skipped_steps'"},
               {"training.max_skiped_steps=3"});
}
