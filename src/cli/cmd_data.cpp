// lathe data inspect PREFIX [--tokenizer T] [--eod ID] [--samples N] [--json]
// What a tokenized dataset (Megatron PREFIX.bin + PREFIX.idx) holds, before anyone trains on it:
// dtype and sizes, sequence-length statistics and a log2 histogram, vocabulary use (distinct ids,
// largest id, the most frequent ids, decoded with --tokenizer), how many sequences end with the EOD
// token (--eod, or the tokenizer's), and the start of the first sequences decoded.
// One pass over the tokens (OpenMP, per-thread counts merged in thread order).
#include <fmt/format.h>
#include <omp.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <numeric>
#include <map>
#include <optional>
#include <unordered_map>
#include <vector>

#include "cli/command.h"
#include "core/error.h"
#include "data/indexed_dataset.h"
#include "tokenizer/tokenizer.h"

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
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 31));
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

int run_data(int argc, char** argv) {
  if (argc >= 2 && std::string(argv[1]) == "inspect") return run_inspect(argc - 1, argv + 1);
  fmt::print(stderr, "lathe data: usage error: expected a subcommand: inspect PREFIX (blend-plan is not implemented "
                     "yet)\n");
  return 2;
}

lathe::cli::Registrar reg("data", "dataset tools: 'data inspect PREFIX' shows sizes, lengths, vocabulary use, EOD",
                          run_data);

}  // namespace
