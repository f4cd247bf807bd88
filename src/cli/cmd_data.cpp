// lathe data inspect PREFIX [--tokenizer T] [--eod ID] [--samples N] [--json]
// What a tokenized dataset (Megatron PREFIX.bin + PREFIX.idx) holds, before anyone trains on it:
// dtype and sizes, sequence-length statistics and a log2 histogram, vocabulary use (distinct ids,
// largest id, the most frequent ids, decoded with --tokenizer), how many sequences end with the EOD
// token (--eod, or the tokenizer's), and the start of the first sequences decoded.
// One pass over the tokens (OpenMP, per-thread counts merged in thread order).
//
// lathe data blend-plan RECIPE [--set k=v ...] [--world N] [--json]
// The recipe's data.blend planned for the whole run (training.steps x global batch samples): per
// dataset its weight, the share asked and observed, samples available and taken, epochs (passes)
// and the cap. Reads the plan from OUTPUT/data_cache when the run has built it (else plans in
// memory); writes nothing.
#include <fmt/format.h>
#include <omp.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <numeric>
#include <optional>
#include <unordered_map>
#include <vector>

#include "cli/command.h"
#include "config/recipe.h"
#include "core/checked.h"
#include "core/error.h"
#include "data/blend_cache.h"
#include "data/indexed_dataset.h"
#include "tokenizer/tokenizer.h"
#include "train/preflight.h"

namespace {

using json = nlohmann::json;

struct TokenCounts {
  std::vector<int64_t> dense;  // id -> count, when the largest id is small enough
  std::unordered_map<int32_t, int64_t> sparse;
  int64_t count(int32_t id) const {
    if (!dense.empty()) return id < static_cast<int32_t>(dense.size()) ? dense[static_cast<size_t>(id)] : 0;
    auto it = sparse.find(id);
    return it == sparse.end() ? 0 : it->second;
  }
};

TokenCounts count_tokens(const lathe::data::IndexedDataset& ds, int32_t max_id) {
  TokenCounts tc;
  const int64_t N = ds.total_tokens();
  constexpr int64_t kBlock = 1 << 20;
  const int64_t blocks = (N + kBlock - 1) / kBlock;
  const bool dense = max_id < (1 << 24);
  const int nt = omp_get_max_threads();
  std::vector<std::vector<int64_t>> dense_t(static_cast<size_t>(nt));
  std::vector<std::unordered_map<int32_t, int64_t>> sparse_t(static_cast<size_t>(nt));
#pragma omp parallel
  {
    const int t = omp_get_thread_num();
    std::vector<int32_t> buf(static_cast<size_t>(kBlock));
    auto& d = dense_t[static_cast<size_t>(t)];
    auto& s = sparse_t[static_cast<size_t>(t)];
    if (dense) d.assign(static_cast<size_t>(max_id) + 1, 0);
#pragma omp for schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t start = b * kBlock, n = std::min(kBlock, N - start);
      ds.read_global(start, n, buf.data());
      for (int64_t i = 0; i < n; ++i) {
        if (dense)
          ++d[static_cast<size_t>(buf[static_cast<size_t>(i)])];
        else
          ++s[buf[static_cast<size_t>(i)]];
      }
    }
  }
  if (dense) {
    tc.dense.assign(static_cast<size_t>(std::max(max_id, 0)) + 1, 0);
    for (const auto& d : dense_t)
      for (size_t i = 0; i < d.size(); ++i) tc.dense[i] += d[i];
  } else {
    for (const auto& s : sparse_t)
      for (const auto& [k, v] : s) tc.sparse[k] += v;
  }
  return tc;
}

int run_inspect(int argc, char** argv) {
  CLI::App app{"What a tokenized dataset holds: sizes, lengths, vocabulary use, EOD, a decoded sample",
               "lathe data inspect"};
  std::string prefix, tokenizer_path;
  std::optional<int64_t> eod;
  int64_t samples = 2;
  bool as_json = false;
  app.add_option("prefix", prefix, "dataset prefix (PREFIX.bin + PREFIX.idx)")->required();
  app.add_option("--tokenizer", tokenizer_path, "decode ids with this tokenizer (dir, file or 'byte')");
  app.add_option("--eod", eod, "end-of-document token id (default: the tokenizer's EOS, if any)")
      ->check(CLI::Range(int64_t{0}, int64_t{std::numeric_limits<int32_t>::max()}));  // ids are int32 (C2)
  app.add_option("--samples", samples, "sequences to decode at the end")->check(CLI::Range(int64_t{0}, int64_t{100}));
  app.add_flag("--json", as_json, "print one JSON object");
  LATHE_CLI_PARSE(app, argc, argv);

  lathe::data::IndexedDataset ds(prefix);
  std::unique_ptr<lathe::tok::Tokenizer> tok;
  if (!tokenizer_path.empty()) tok = lathe::tok::load_tokenizer(tokenizer_path);
  if (!eod && tok && tok->eos_id()) eod = *tok->eos_id();

  const size_t S = ds.num_sequences();
  std::vector<int64_t> lens(S);
  for (size_t i = 0; i < S; ++i) lens[i] = ds.sequence_length(i);
  std::vector<int64_t> sorted = lens;
  std::sort(sorted.begin(), sorted.end());
  auto pct = [&](double p) {
    return sorted.empty() ? int64_t{0} : sorted[std::min(sorted.size() - 1, static_cast<size_t>(p * sorted.size()))];
  };
  // log2 buckets: [1], [2,3], [4,7], ... (0-length sequences in bucket "0").
  std::map<int, int64_t> hist;
  for (int64_t l : lens) hist[l == 0 ? -1 : 63 - __builtin_clzll(static_cast<unsigned long long>(l))]++;

  const int32_t max_id = ds.max_token_id();
  const TokenCounts tc = count_tokens(ds, max_id);
  std::vector<std::pair<int64_t, int32_t>> freq;
  if (!tc.dense.empty()) {
    for (size_t i = 0; i < tc.dense.size(); ++i)
      if (tc.dense[i]) freq.push_back({tc.dense[i], static_cast<int32_t>(i)});
  } else {
    for (const auto& [k, v] : tc.sparse) freq.push_back({v, k});
  }
  std::sort(freq.begin(), freq.end(), [](auto& a, auto& b) { return a.first != b.first ? a.first > b.first : a.second < b.second; });
  const int64_t distinct = static_cast<int64_t>(freq.size());
  int64_t ends_with_eod = 0;
  if (eod) {
    std::vector<int32_t> last(1);
    for (size_t i = 0; i < S; ++i)
      if (lens[i] > 0) {
        ds.read_global(ds.sequence_offset(i) + lens[i] - 1, 1, last.data());
        ends_with_eod += last[0] == *eod;
      }
  }
  auto decode = [&](int32_t id) { return tok ? tok->decode(std::vector<int32_t>{id}) : std::string(); };

  json j;
  j["prefix"] = prefix;
  j["dtype"] = std::string(lathe::dtype_name(ds.dtype()));
  j["sequences"] = S;
  j["documents"] = ds.num_documents();
  j["tokens"] = ds.total_tokens();
  j["length"] = {{"min", sorted.empty() ? 0 : sorted.front()},
                 {"max", sorted.empty() ? 0 : sorted.back()},
                 {"mean", S ? static_cast<double>(ds.total_tokens()) / static_cast<double>(S) : 0.0},
                 {"median", pct(0.5)},
                 {"p90", pct(0.9)},
                 {"p99", pct(0.99)}};
  json hj = json::array();
  for (auto& [b, n] : hist)
    hj.push_back({{"from", b < 0 ? 0 : int64_t{1} << b}, {"to", b < 0 ? 0 : (int64_t{1} << (b + 1)) - 1}, {"sequences", n}});
  j["length_histogram"] = hj;
  j["vocabulary"] = {{"max_id", max_id}, {"distinct_ids", distinct}};
  json top = json::array();
  for (size_t i = 0; i < std::min<size_t>(10, freq.size()); ++i) {
    json e = {{"id", freq[i].second}, {"count", freq[i].first}};
    if (tok) e["text"] = decode(freq[i].second);
    top.push_back(e);
  }
  j["top_ids"] = top;
  if (eod) j["eod"] = {{"id", *eod}, {"count", tc.count(static_cast<int32_t>(*eod))}, {"sequences_ending_with_it", ends_with_eod}};
  json dec = json::array();
  for (size_t i = 0; i < std::min<size_t>(static_cast<size_t>(samples), S); ++i) {
    const int64_t n = std::min<int64_t>(lens[i], 64);
    std::vector<int32_t> ids(static_cast<size_t>(n));
    if (n) ds.read_global(ds.sequence_offset(i), n, ids.data());
    json e = {{"sequence", i}, {"first_ids", ids}};
    if (tok) e["text"] = tok->decode(ids);
    dec.push_back(e);
  }
  j["samples"] = dec;
  if (as_json) {
    fmt::print("{}\n", j.dump());
    return 0;
  }
  fmt::print("{}: {} tokens ({}) in {} sequences, {} documents\n", prefix, ds.total_tokens(), j["dtype"].get<std::string>(),
             S, ds.num_documents());
  fmt::print("sequence length: min {} | median {} | mean {:.1f} | p90 {} | p99 {} | max {}\n", j["length"]["min"].get<int64_t>(),
             pct(0.5), j["length"]["mean"].get<double>(), pct(0.9), pct(0.99), j["length"]["max"].get<int64_t>());
  int64_t most = 1;
  for (auto& [b, n] : hist) most = std::max(most, n);
  for (auto& [b, n] : hist)
    fmt::print("  {:>21} {:>10} {}\n",
               b < 0 ? std::string("0") : fmt::format("{}-{}", int64_t{1} << b, (int64_t{1} << (b + 1)) - 1), n,
               std::string(static_cast<size_t>(std::ceil(40.0 * static_cast<double>(n) / static_cast<double>(most))), '#'));
  fmt::print("vocabulary: {} distinct ids, largest id {}\n", distinct, max_id);
  fmt::print("most frequent ids:");
  for (const auto& e : top)
    fmt::print(" {}{} x{}", e["id"].get<int32_t>(), tok ? " " + json(e["text"]).dump() : std::string(),
               e["count"].get<int64_t>());
  fmt::print("\n");
  if (eod)
    fmt::print("EOD id {}: {} occurrences; {} of {} sequences end with it\n", *eod, j["eod"]["count"].get<int64_t>(),
               ends_with_eod, S);
  else
    fmt::print("EOD: not checked (pass --eod ID or a --tokenizer with an EOS token)\n");
  for (const auto& e : dec)
    fmt::print("sequence {}: {}\n", e["sequence"].get<size_t>(),
               tok ? json(e["text"]).dump() : e["first_ids"].dump());
  return 0;
}

int run_blend_plan(int argc, char** argv) {
  CLI::App app{"The recipe's data.blend planned for the whole run: samples and epochs per dataset",
               "lathe data blend-plan"};
  std::string path;
  std::vector<std::string> sets;
  int64_t world = 1;
  bool as_json = false;
  app.add_option("recipe", path, "recipe file (YAML) with data.blend")->required();
  app.add_option("--set", sets, "override a recipe value (repeatable)");
  app.add_option("--world", world, "plan for a job of this many processes (the global batch grows with parallel.data)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  app.add_flag("--json", as_json, "one JSON object instead of the table");
  LATHE_CLI_PARSE(app, argc, argv);
  lathe::Recipe r = lathe::load_recipe(path, sets);
  lathe::resolve_layout(r, world);
  LATHE_CHECK(!r.data.blend.empty(), "{}: no data.blend (the run trains on data.train {}); nothing to plan", path,
              r.data.train);
  const int64_t T = r.training.seq_len, G = lathe::global_batch_samples(r);
  const int64_t total = lathe::blend_plan_samples(r);
  std::vector<lathe::data::BlendEntryInput> in;
  for (const auto& e : r.data.blend) in.push_back({e.prefix, e.weight, e.epochs});
  const lathe::data::OpenedBlend ob = lathe::data::open_blend(in, T);
  const std::string cache = (std::filesystem::path(r.output.dir.empty() ? "." : r.output.dir) / "data_cache").string();
  const lathe::data::CachedPlan c = lathe::data::cached_blend_plan(
      ob.sources, T, static_cast<uint64_t>(r.training.seed), total, cache, /*write=*/false);
  const std::vector<double> shares = lathe::data::blend_shares(ob.sources);  // no overflow for huge weights
  json j = {{"recipe", path},   {"steps", r.training.steps}, {"global_batch", G},
            {"seq_len", T},     {"seed", r.training.seed},   {"samples", total},
            {"plan", c.status}, {"plan_seconds", c.seconds}, {"cache", c.path}};
  json ds = json::array();
  for (size_t i = 0; i < ob.sources.size(); ++i) {
    const auto& s = ob.sources[i];
    ds.push_back({{"index", i},
                  {"prefix", s.name},
                  {"weight", s.weight},
                  {"share_asked", shares[i]},
                  {"share_observed", total ? static_cast<double>(c.plan->taken[i]) / static_cast<double>(total) : 0.0},
                  {"samples_available", s.samples},
                  {"samples_taken", c.plan->taken[i]},
                  {"epochs", c.plan->epochs[i]},
                  {"epochs_cap", s.max_epochs}});
  }
  j["datasets"] = ds;
  if (as_json) {
    fmt::print("{}\n", j.dump());
    return 0;
  }
  fmt::print(
      "{}: blend of {} datasets for {} steps x global batch {} = {} samples of seq_len {} (seed {}); plan: {} "
      "({:.3f} s){}\n",
      path, ob.sources.size(), r.training.steps, G, total, T, r.training.seed, c.status, c.seconds,
      c.status == "reused" ? " from " + c.path : std::string());
  size_t w = 6;
  for (const auto& s : ob.sources) w = std::max(w, s.name.size());
  fmt::print("{:>4}  {:<{}}  {:>10}  {:>8}  {:>10}  {:>12}  {:>12}  {:>9}  {}\n", "#", "prefix", w, "weight", "asked",
             "observed", "available", "taken", "epochs", "cap");
  for (const auto& e : ds)
    fmt::print("{:>4}  {:<{}}  {:>10.4g}  {:>7.2f}%  {:>9.3f}%  {:>12}  {:>12}  {:>9.3f}  {}\n",
               e["index"].get<size_t>(), e["prefix"].get<std::string>(), w, e["weight"].get<double>(),
               100 * e["share_asked"].get<double>(), 100 * e["share_observed"].get<double>(),
               e["samples_available"].get<int64_t>(), e["samples_taken"].get<int64_t>(), e["epochs"].get<double>(),
               e["epochs_cap"].get<double>() > 0 ? fmt::format("{}", e["epochs_cap"].get<double>()) : std::string("-"));
  return 0;
}

int run_data(int argc, char** argv) {
  if (argc >= 2 && std::string(argv[1]) == "inspect") return run_inspect(argc - 1, argv + 1);
  if (argc >= 2 && std::string(argv[1]) == "blend-plan") return run_blend_plan(argc - 1, argv + 1);
  fmt::print(stderr, "lathe data: usage error: expected a subcommand: inspect PREFIX | blend-plan RECIPE\n");
  return 2;
}

lathe::cli::Registrar reg("data",
                          "dataset tools: 'data inspect PREFIX' shows sizes, lengths, vocabulary use, EOD; 'data "
                          "blend-plan RECIPE' the samples and epochs per dataset of a blend",
                          run_data);

}  // namespace
