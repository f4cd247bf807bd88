// lathe eval --model DIR [--data PREFIX] [--tasks FILE.jsonl] [--tokenizer T] [--seq-len S] [--batch B] [--json]
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
#include <nlohmann/json.hpp>
#include <optional>
#include <filesystem>
#include <sstream>

#include "cli/command.h"
#include "core/timer.h"
#include "data/loader.h"
#include "models/hf_weights.h"
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

// One multiple-choice item: token ids of the context and of each ending.
struct McItem {
  std::vector<int32_t> context;
  std::vector<std::vector<int32_t>> endings;
  int64_t label;
};

std::vector<int32_t> ids_of(const nlohmann::json& v, const std::string& where, int64_t vocab) {
  LATHE_CHECK(v.is_array(), "{} must be an array of token ids", where);
  std::vector<int32_t> out;
  for (const auto& x : v) {
    LATHE_CHECK(x.is_number_integer() && x.get<int64_t>() >= 0 && x.get<int64_t>() < vocab,
                "{}: {} is not a token id of this model (vocab_size {})", where, lathe::io::json_excerpt(x, 40), vocab);
    out.push_back(static_cast<int32_t>(x.get<int64_t>()));
  }
  return out;
}

std::vector<McItem> read_tasks(const std::string& path, const lathe::tok::Tokenizer* tok, int64_t vocab) {
  std::vector<McItem> items;
  std::istringstream lines(lathe::io::read_file(path));
  std::string line;
  int64_t n = 0;
  while (std::getline(lines, line)) {
    ++n;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = fmt::format("{} line {}", path, n);
    const nlohmann::json j = lathe::io::parse_json(line, where);
    LATHE_CHECK(j.is_object(), "{}: expected an object {{\"context\", \"endings\", \"label\"}}", where);
    McItem it;
    const bool text = j.contains("context");
    LATHE_CHECK(text || j.contains("context_ids"), "{}: needs \"context\" (text) or \"context_ids\" (token ids)",
                where);
    if (text) {
      LATHE_CHECK(tok != nullptr, "{}: text items need a tokenizer (pass --tokenizer)", where);
      LATHE_CHECK(j["context"].is_string() && j.contains("endings") && j["endings"].is_array(),
                  "{}: \"context\" must be a string and \"endings\" an array of strings", where);
      it.context = tok->encode(j["context"].get<std::string>());
      for (const auto& e : j["endings"]) {
        LATHE_CHECK(e.is_string(), "{}: every ending must be a string", where);
        it.endings.push_back(tok->encode(e.get<std::string>()));
      }
    } else {
      it.context = ids_of(j["context_ids"], where + " context_ids", vocab);
      LATHE_CHECK(j.contains("ending_ids") && j["ending_ids"].is_array(), "{}: \"ending_ids\" must be an array", where);
      for (size_t e = 0; e < j["ending_ids"].size(); ++e)
        it.endings.push_back(ids_of(j["ending_ids"][e], fmt::format("{} ending_ids[{}]", where, e), vocab));
    }
    for (auto& id : it.context)
      LATHE_CHECK(id < vocab, "{}: the context has token id {} >= vocab_size {}", where, id, vocab);
    LATHE_CHECK(it.endings.size() >= 2, "{}: {} ending(s); a multiple-choice item needs at least 2", where,
                it.endings.size());
    for (size_t e = 0; e < it.endings.size(); ++e)
      LATHE_CHECK(!it.endings[e].empty(), "{}: ending {} has no tokens", where, e);
    LATHE_CHECK(j.contains("label") && j["label"].is_number_integer() && j["label"].get<int64_t>() >= 0 &&
                    j["label"].get<int64_t>() < static_cast<int64_t>(it.endings.size()),
                "{}: \"label\" must be the index of the right ending (0..{})", where, it.endings.size() - 1);
    it.label = j["label"].get<int64_t>();
    LATHE_CHECK(!it.context.empty(), "{}: the context has no tokens (the first ending token needs one before it)",
                where);
    items.push_back(std::move(it));
  }
  LATHE_CHECK(!items.empty(), "{}: no items", path);
  return items;
}

nlohmann::json eval_tasks(lathe::Model& model, const std::string& model_dir, const std::string& path,
                          std::string tokenizer_path) {
  const auto& cfg = model.config();
  if (tokenizer_path.empty()) {  // the model directory's own tokenizer, as lathe.json records it
    const std::string lj = model_dir + "/lathe.json";
    if (std::filesystem::exists(model_dir + "/tokenizer.json"))
      tokenizer_path = model_dir;
    else if (std::filesystem::exists(lj)) {
      const auto j = lathe::io::read_json_file(lj);
      if (j.contains("tokenizer") && j["tokenizer"].is_string()) tokenizer_path = j["tokenizer"].get<std::string>();
    }
  }
  std::unique_ptr<lathe::tok::Tokenizer> tok;
  if (!tokenizer_path.empty()) tok = lathe::tok::load_tokenizer(tokenizer_path);
  const std::vector<McItem> items = read_tasks(path, tok.get(), cfg.vocab_size);
  const int64_t max_t = cfg.max_position_embeddings;
  model.allocate(1, max_t);
  std::vector<float> logits;
  int64_t right = 0, right_norm = 0;
  nlohmann::json per_item = nlohmann::json::array();
  const double t0 = lathe::now_seconds();
  for (const McItem& it : items) {
    std::vector<double> lls;
    double best = -1e300, best_norm = -1e300;
    int64_t pick = -1, pick_norm = -1;
    for (size_t e = 0; e < it.endings.size(); ++e) {
      const auto& end = it.endings[e];
      LATHE_CHECK(static_cast<int64_t>(end.size()) < max_t, "{}: an ending of {} tokens does not fit the model's {} positions",
                  path, end.size(), max_t);
      // The context cut from the left so that context + ending fit max_position_embeddings.
      const size_t keep = std::min(it.context.size(), static_cast<size_t>(max_t) - end.size());
      std::vector<int32_t> seq(it.context.end() - static_cast<std::ptrdiff_t>(keep), it.context.end());
      seq.insert(seq.end(), end.begin(), end.end());
      const int64_t T = static_cast<int64_t>(seq.size()), V = cfg.vocab_size;
      logits.resize(static_cast<size_t>(T * V));
      model.forward_logits(seq.data(), 1, T, logits.data());
      double ll = 0;
      for (size_t k = 0; k < end.size(); ++k) {
        const int64_t pos = static_cast<int64_t>(keep + k) - 1;  // the logits that predict end[k]
        const float* row = logits.data() + pos * V;
        double mx = row[0];
        for (int64_t v = 1; v < V; ++v) mx = std::max(mx, double(row[v]));
        double sum = 0;
        for (int64_t v = 0; v < V; ++v) sum += std::exp(double(row[v]) - mx);
        ll += double(row[end[k]]) - mx - std::log(sum);
      }
      const double norm = ll / static_cast<double>(end.size());
      lls.push_back(ll);
      if (ll > best) best = ll, pick = static_cast<int64_t>(e);
      if (norm > best_norm) best_norm = norm, pick_norm = static_cast<int64_t>(e);
    }
    right += pick == it.label;
    right_norm += pick_norm == it.label;
    per_item.push_back({{"loglik", lls}, {"pick", pick}, {"pick_norm", pick_norm}, {"label", it.label}});
  }
  const double n = static_cast<double>(items.size());
  return {{"tasks", path},
          {"items", items.size()},
          {"acc", right / n},
          {"acc_norm", right_norm / n},
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
  LATHE_CLI_PARSE(app, argc, argv);
  if (prefix.empty() && tasks.empty()) {
    fmt::print(stderr, "lathe eval: usage error: give --data PREFIX (loss, perplexity) and/or --tasks FILE.jsonl "
                       "(multiple-choice accuracy)\n");
    return 2;
  }
  std::string report;
  auto model = lathe::load_hf_model(model_dir, &report);
  const auto& cfg = model->config();
  nlohmann::json mc;
  if (!tasks.empty()) mc = eval_tasks(*model, model_dir, tasks, tokenizer_path);
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
