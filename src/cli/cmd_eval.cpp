// lathe eval --model DIR --data PREFIX [--seq-len S] [--batch B] [--json]
// Mean next-token loss over every full sample of the dataset in file order: sample i covers
// tokens [i*S, i*S+S] of the concatenated sequences (Megatron's sample windows), no shuffling.
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <charconv>
#include <cmath>
#include <nlohmann/json.hpp>
#include <optional>

#include "cli/command.h"
#include "core/timer.h"
#include "data/loader.h"
#include "models/hf_weights.h"
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

int run_eval(int argc, char** argv) {
  CLI::App app{"Mean next-token loss of a model on a tokenized dataset", "lathe eval"};
  std::string model_dir, prefix;
  std::optional<int64_t> seq_len_opt;
  int64_t batch = 8;
  bool json = false;
  app.add_option("--model", model_dir, "Hugging Face model directory")->required();
  app.add_option("--data", prefix, "Megatron dataset prefix (PREFIX.bin + PREFIX.idx)")->required();
  app.add_option("--seq-len", seq_len_opt, "tokens per sample (default: min(1024, max_position_embeddings))")
      ->check(kPositive);
  app.add_option("--batch", batch, "samples per forward pass")->check(kPositive);
  app.add_flag("--json", json, "print one JSON object");
  LATHE_CLI_PARSE(app, argc, argv);
  std::string report;
  auto model = lathe::load_hf_model(model_dir, &report);
  const auto& cfg = model->config();
  const int64_t seq_len = seq_len_opt ? *seq_len_opt : std::min<int64_t>(1024, cfg.max_position_embeddings);
  LATHE_CHECK(seq_len <= cfg.max_position_embeddings, "--seq-len {} exceeds the model's max_position_embeddings {}",
              seq_len, cfg.max_position_embeddings);
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
  auto [loss, tokens] = lathe::evaluate_samples(*model, ds, samples, batch, seq_len);
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
    fmt::print("{}\n", j.dump());
  } else {
    fmt::print("{}\n", report);
    fmt::print("loss {:.6f} | perplexity {:.3f} | {} tokens in {} samples of {} | {:.1f} s\n", loss, std::exp(loss),
               tokens, samples.size(), seq_len, dt);
  }
  return 0;
}

lathe::cli::Registrar reg("eval", "mean next-token loss of a model on a dataset", run_eval);

}  // namespace
