// lathe generate --model DIR --prompt TEXT [--tokenizer PATH] [--max-new-tokens N]
//                [--temperature T] [--top-k K] [--top-p P] [--seed S] [--no-kv-cache]
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "cli/command.h"
#include "cli/validators.h"
#include "core/blas_env.h"
#include "core/dtype.h"
#include "core/parallel.h"
#include "eval/generate.h"
#include "interop/hf_weights.h"
#include "io/fs.h"
#include "io/json.h"
#include "models/kv_cache.h"
#include "tokenizer/tokenizer.h"

namespace {

namespace fs = std::filesystem;

// The tokenizer a model directory was trained with: tokenizer files in the directory, else the
// one named in lathe.json (written by `lathe train`).
std::string default_tokenizer(const std::string& dir) {
  std::error_code ec;  // non-throwing probes: the tokenizer loader names an unreadable file
  for (const char* f : {"tokenizer.json", "tokenizer.model", "vocab.json", "encoder.json"})
    if (fs::exists(fs::path(dir) / f, ec)) return dir;
  const fs::path meta = fs::path(dir) / "lathe.json";
  if (fs::exists(meta, ec)) {
    const nlohmann::json j = lathe::io::read_json_file(meta.string());  // depth-checked, errors name it
    if (j.is_object() && j.contains("tokenizer")) {
      LATHE_CHECK(j["tokenizer"].is_string(), "{}: field 'tokenizer' must be a string, got {}", meta.string(),
                  lathe::io::json_type_name(j["tokenizer"]));
      if (!j["tokenizer"].get<std::string>().empty()) return j["tokenizer"].get<std::string>();
    }
  }
  lathe::throw_error("{}: no tokenizer files and no tokenizer recorded in lathe.json; pass --tokenizer PATH", dir);
}

// --seed as text: CLI11 reads "-1" for an unsigned option as an option-looking second value and
// says "At Most 1 required but received 2"; this names the rule instead.
CLI::Validator seed_validator() {
  return CLI::Validator(
      [](std::string& s) -> std::string {
        const std::string rule = "the seed must be a non-negative integer below 2^64";
        if (s.empty() || s.size() > 20 || s.find_first_not_of("0123456789") != std::string::npos)
          return fmt::format("{}, got '{}'", rule, s);
        errno = 0;
        (void)std::strtoull(s.c_str(), nullptr, 10);
        if (errno == ERANGE) return fmt::format("{}, got {}", rule, s);
        return "";
      },
      "SEED");
}

int run_generate(int argc, char** argv) {
  CLI::App app{"Sample text from a model", "lathe generate"};
  std::string model_dir, prompt, tok_path;
  lathe::SamplingOptions so;
  so.max_new_tokens = 100;
  so.temperature = 0.8f;
  so.top_k = 50;
  so.top_p = 0.95f;
  app.add_option("--model", model_dir, "Hugging Face model directory")->required();
  app.add_option("--prompt", prompt, "prompt text")->required();
  app.add_option("--tokenizer", tok_path, "tokenizer (default: the model directory's)");
  // Out-of-range values are usage errors (exit 2), NaN and infinities included.
  app.add_option("--max-new-tokens", so.max_new_tokens, "tokens to generate (1 to 2^24)")
      ->check(lathe::cli::int_range(1, int64_t{1} << 24));
  app.add_option("--temperature", so.temperature, "softmax temperature, finite, in [0, 100] (0 = greedy)")
      ->check(lathe::cli::real_range(0, 100));
  app.add_option("--top-k", so.top_k, "keep the k most likely tokens (0 = all)")->check(lathe::cli::int_range(0));
  app.add_option("--top-p", so.top_p, "nucleus sampling mass in (0, 1] (1 = off)")
      ->check(lathe::cli::real_range(0, 1, /*lo_open=*/true));
  std::string seed_s = "0";
  app.add_option("--seed", seed_s, "random seed: an integer in [0, 2^64)")->check(seed_validator());
  bool no_kv_cache = false;
  app.add_flag("--no-kv-cache", no_kv_cache,
               "recompute the whole context for every new token (the reference path; same output, slower)");
  LATHE_CLI_PARSE(app, argc, argv);
  so.seed = std::stoull(seed_s);  // checked by seed_validator
  auto model = lathe::load_hf_model(model_dir);
  auto tokenizer = lathe::tok::load_tokenizer(tok_path.empty() ? default_tokenizer(model_dir) : tok_path);
  LATHE_CHECK(tokenizer->vocab_size() <= model->config().vocab_size,
              "tokenizer has {} tokens but the model's vocab_size is {}", tokenizer->vocab_size(),
              model->config().vocab_size);
  so.vocab_limit = tokenizer->vocab_size();
  auto ids = tokenizer->encode(prompt);
  LATHE_CHECK(!ids.empty(), "--prompt encodes to no tokens; give a non-empty prompt");
  model->allocate(1, std::min<int64_t>(model->config().max_position_embeddings, 1024));
  so.kv_cache = !no_kv_cache;
  if (so.kv_cache) {
    const std::string why = lathe::kv_cache_unsupported_reason(*model);
    if (!why.empty()) fmt::print(stderr, "lathe generate: note: {}; recomputing the context for every token\n", why);
  }
  fmt::print("{}", prompt);
  std::fflush(stdout);
  // Byte-level tokens may split UTF-8 characters: decode the whole continuation each time and
  // print what is new.
  std::vector<int32_t> out;
  std::string printed;
  // Load that arrives mid-run: fewer threads (core/blas_env.h; fp32 only, where the thread count
  // does not change the arithmetic).
  lathe::LoadFollower follow(model->compute_dtype() == lathe::DType::F32 ? lathe::max_threads() : 1);
  lathe::generate(*model, ids, so, [&](int32_t t) {
    if (const std::string note = follow.poll(); !note.empty()) fmt::print(stderr, "{}", note);
    out.push_back(t);
    std::string text = tokenizer->decode(out);
    if (text.size() > printed.size() && text.compare(0, printed.size(), printed) == 0) {
      fmt::print("{}", text.substr(printed.size()));
      std::fflush(stdout);
      printed = text;
    }
  });
  fmt::print("\n");
  return 0;
}

lathe::cli::Registrar reg("generate", "sample text from a model", run_generate);

}  // namespace
