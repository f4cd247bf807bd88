// lathe eval --model DIR [--data PREFIX] [--tasks FILE.jsonl] [--tokenizer T] [--seq-len S] [--batch B] [--json]
//            [--no-progress]
// Progress (src/core/progress.h) goes to stderr: a bar on a terminal, a line per 10% otherwise.
// --data: mean next-token loss and perplexity over every full sample of the dataset in file order:
// sample i covers tokens [i*S, i*S+S] of the concatenated sequences (Megatron's sample windows).
// --tasks: multiple-choice accuracy (HellaSwag-style JSONL, one item per line:
//   {"context": "...", "endings": ["...", ...], "label": 2}
// or already tokenized: {"context_ids": [...], "ending_ids": [[...], ...], "label": 2}).
// Each ending is scored by the log-likelihood of its tokens after the context (context and ending
// tokenized separately and concatenated, as lm-evaluation-harness does; the context is cut from the
// left to fit max_position_embeddings). acc picks the highest sum, acc_norm the highest mean per
// token (the length-normalised score).
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <charconv>
#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>

#include "cli/command.h"
#include "core/progress.h"
#include "core/timer.h"
#include "data/loader.h"
#include "eval/eval_tasks.h"
#include "interop/hf_weights.h"
#include "io/fs.h"
#include "io/json.h"
#include "tokenizer/tokenizer.h"
#include "train/trainer.h"

namespace {

// CLI11 validator: a positive integer. A value that is not an integer at all is left to CLI11's
// conversion ("Could not convert"); 0 and negative values used to fall back silently to a default.
const CLI::Validator kPositive(
    [](std::string& s) -> std::string {
      int64_t v = 0;
      const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
      if (ec == std::errc() && end == s.data() + s.size() && v <= 0)
        return fmt::format("must be a positive integer, got {}", s);
      return "";
    },
    "POSITIVE");

nlohmann::json eval_tasks(lathe::Model& model, const std::string& model_dir, const std::string& path,
                          std::string tokenizer_path, bool show_progress) {
  const auto& cfg = model.config();
  // The model directory's own tokenizer, as lathe.json records it.
  if (tokenizer_path.empty()) tokenizer_path = lathe::model_dir_tokenizer(model_dir);
  std::unique_ptr<lathe::tok::Tokenizer> tok;
  if (!tokenizer_path.empty()) tok = lathe::tok::load_tokenizer(tokenizer_path);
  const std::vector<lathe::McItem> items = lathe::read_mc_tasks(path, tok.get(), cfg.vocab_size);
  const int64_t max_t = cfg.max_position_embeddings;
  model.allocate(1, max_t);
  const double t0 = lathe::now_seconds();
  lathe::progress::Bar bar("eval tasks", static_cast<int64_t>(items.size()), "items", show_progress);
  const lathe::McScores sc = lathe::score_mc_items(model, items, max_t, path, 0, 1, &bar);
  bar.finish();
  nlohmann::json per_item = nlohmann::json::array();
  for (const auto& it : sc.per_item)
    per_item.push_back({{"loglik", it.loglik}, {"pick", it.pick}, {"pick_norm", it.pick_norm}, {"label", it.label}});
  return {{"tasks", path},
          {"items", sc.items},
          {"acc", sc.acc()},
          {"acc_norm", sc.acc_norm()},
          {"tasks_seconds", lathe::now_seconds() - t0},
          {"per_item", per_item}};
}

void print_mc(const nlohmann::json& mc) {
  fmt::print("multiple choice {}: acc {:.4f} | acc_norm {:.4f} (length-normalised) | {} items | {:.1f} s\n",
             mc["tasks"].get<std::string>(), mc["acc"].get<double>(), mc["acc_norm"].get<double>(),
             mc["items"].get<int64_t>(), mc["tasks_seconds"].get<double>());
}

int run_eval(int argc, char** argv) {
  CLI::App app{"Mean next-token loss of a model on a tokenized dataset", "lathe eval"};
  std::string model_dir, prefix;
  std::optional<int64_t> seq_len_opt;
  int64_t batch = 8;
  bool json = false;
  app.add_option("--model", model_dir, "Hugging Face model directory")->required();
  std::string tasks, tokenizer_path;
  app.add_option("--data", prefix, "Megatron dataset prefix (PREFIX.bin + PREFIX.idx): loss and perplexity");
  app.add_option("--tasks", tasks, "multiple-choice items (JSONL: context, endings, label): accuracy");
  app.add_option("--tokenizer", tokenizer_path,
                 "tokenizer for --tasks text (default: the model directory's, as lathe.json records it)");
  app.add_option("--seq-len", seq_len_opt, "tokens per sample (default: min(1024, max_position_embeddings))")
      ->check(kPositive);
  app.add_option("--batch", batch, "samples per forward pass")->check(kPositive);
  app.add_flag("--json", json, "print one JSON object");
  bool no_progress = false;
  app.add_flag("--no-progress", no_progress, "no progress bar / lines on stderr");
  LATHE_CLI_PARSE(app, argc, argv);
  if (prefix.empty() && tasks.empty()) {
    fmt::print(stderr,
               "lathe eval: usage error: give --data PREFIX (loss, perplexity) and/or --tasks FILE.jsonl "
               "(multiple-choice accuracy)\n");
    return 2;
  }
  std::string report;
  auto model = lathe::load_hf_model(model_dir, &report);
  const auto& cfg = model->config();
  nlohmann::json mc;
  if (!tasks.empty()) mc = eval_tasks(*model, model_dir, tasks, tokenizer_path, !no_progress);
  if (prefix.empty()) {
    if (json) {
      mc["model"] = model_dir;
      fmt::print("{}\n", mc.dump());
    } else {
      fmt::print("{}\n", report);
      print_mc(mc);
    }
    return 0;
  }
  const int64_t seq_len = seq_len_opt ? *seq_len_opt : std::min<int64_t>(1024, cfg.max_position_embeddings);
  LATHE_CHECK(seq_len <= cfg.max_position_embeddings || cfg.rope_scaling.type == "dynamic",
              "--seq-len {} exceeds the model's max_position_embeddings {}", seq_len, cfg.max_position_embeddings);
  lathe::data::IndexedDataset ds(prefix);
  const int32_t mx = ds.max_token_id();
  LATHE_CHECK(mx < cfg.vocab_size, "{}: the dataset contains token id {} but the model's vocab_size is {}", prefix, mx,
              cfg.vocab_size);
  auto samples = lathe::data::all_samples(lathe::data::num_samples(ds.total_tokens(), seq_len));
  LATHE_CHECK(!samples.empty(), "{}: {} tokens are fewer than one sample of --seq-len {} (+1)", prefix,
              ds.total_tokens(), seq_len);
  batch = std::min<int64_t>(batch, static_cast<int64_t>(samples.size()));  // a batch never exceeds the data
  model->allocate(batch, seq_len);
  const double t0 = lathe::now_seconds();
  // Batch by batch so that the progress line advances; sum of token losses and tokens combine
  // exactly as one evaluate_samples call over all samples would (same batches, same order).
  double loss_sum = 0;
  int64_t tokens = 0;
  {
    lathe::progress::Bar bar("eval data", static_cast<int64_t>(samples.size()), "samples", !no_progress);
    const size_t step = static_cast<size_t>(batch);  // one batch per call: the line advances per batch
    for (size_t i = 0; i < samples.size(); i += step) {
      const std::vector<int64_t> part(
          samples.begin() + static_cast<std::ptrdiff_t>(i),
          samples.begin() + static_cast<std::ptrdiff_t>(std::min(samples.size(), i + step)));
      auto [l, t] = lathe::evaluate_samples(*model, ds, part, batch, seq_len);
      loss_sum += l * static_cast<double>(t);
      tokens += t;
      bar.add(static_cast<int64_t>(part.size()));
    }
    bar.finish();
  }
  const double loss = tokens ? loss_sum / static_cast<double>(tokens) : 0.0;
  const double dt = lathe::now_seconds() - t0;
  if (json) {
    nlohmann::json j = {{"loss", loss},
                        {"tokens", tokens},
                        {"samples", samples.size()},
                        {"seq_len", seq_len},
                        {"perplexity", std::exp(loss)},
                        {"seconds", dt},
                        {"model", model_dir},
                        {"data", prefix}};
    if (!mc.is_null()) j["tasks"] = mc;
    fmt::print("{}\n", j.dump());
  } else {
    fmt::print("{}\n", report);
    fmt::print("loss {:.6f} | perplexity {:.3f} | {} tokens in {} samples of {} | {:.1f} s\n", loss, std::exp(loss),
               tokens, samples.size(), seq_len, dt);
    if (!mc.is_null()) print_mc(mc);
  }
  return 0;
}

lathe::cli::Registrar reg("eval", "mean next-token loss of a model on a dataset", run_eval);

}  // namespace
