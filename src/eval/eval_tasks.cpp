#include "eval/eval_tasks.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"
#include "io/fs.h"
#include "io/json.h"

namespace lathe {
namespace {

std::vector<int32_t> ids_of(const nlohmann::json& v, const std::string& where, int64_t vocab) {
  LATHE_CHECK(v.is_array(), "{} must be an array of token ids", where);
  std::vector<int32_t> out;
  for (const auto& x : v) {
    LATHE_CHECK(x.is_number_integer() && x.get<int64_t>() >= 0 && x.get<int64_t>() < vocab,
                "{}: {} is not a token id of this model (vocab_size {})", where, io::json_excerpt(x, 40), vocab);
    out.push_back(static_cast<int32_t>(x.get<int64_t>()));
  }
  return out;
}

}  // namespace

std::vector<McItem> read_mc_tasks(const std::string& path, const tok::Tokenizer* tok, int64_t vocab,
                                  const std::string& no_tokenizer_fix) {
  std::vector<McItem> items;
  std::istringstream lines(io::read_file(path));
  std::string line;
  int64_t n = 0;
  while (std::getline(lines, line)) {
    ++n;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = fmt::format("{} line {}", path, n);
    const nlohmann::json j = io::parse_json(line, where);
    LATHE_CHECK(j.is_object(), "{}: expected an object {{\"context\", \"endings\", \"label\"}}", where);
    McItem it;
    it.line = n;
    const bool text = j.contains("context");
    LATHE_CHECK(text || j.contains("context_ids"), "{}: needs \"context\" (text) or \"context_ids\" (token ids)",
                where);
    if (text) {
      LATHE_CHECK(tok != nullptr, "{}: text items need a tokenizer ({})", where, no_tokenizer_fix);
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
    for (const auto& e : it.endings)
      for (auto id : e) LATHE_CHECK(id < vocab, "{}: an ending has token id {} >= vocab_size {}", where, id, vocab);
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

int64_t check_mc_items_fit(const std::vector<McItem>& items, int64_t max_t, const std::string& path,
                           const std::string& max_t_what) {
  int64_t longest = 0;
  for (const McItem& it : items)
    for (size_t e = 0; e < it.endings.size(); ++e) {
      const int64_t len = static_cast<int64_t>(it.endings[e].size());
      LATHE_CHECK(len < max_t,
                  "{} line {}: ending {} has {} tokens, which do not fit the {} positions scored ({}) with one context "
                  "token before it; shorten the ending or raise {}",
                  path, it.line, e, len, max_t, max_t_what, max_t_what);
      longest = std::max(longest, len);
    }
  return longest;
}

std::string model_dir_tokenizer(const std::string& model_dir) {
  if (std::filesystem::exists(model_dir + "/tokenizer.json")) return model_dir;
  const std::string lj = model_dir + "/lathe.json";
  if (std::filesystem::exists(lj)) {
    const auto j = io::read_json_file(lj);
    if (j.contains("tokenizer") && j["tokenizer"].is_string()) return j["tokenizer"].get<std::string>();
  }
  return "";
}

McScores score_mc_items(Model& model, const std::vector<McItem>& items, int64_t max_t, const std::string& path,
                        size_t first, size_t stride, progress::Bar* bar, const LogitsFn& logits_fn) {
  LATHE_CHECK(stride >= 1 && max_t >= 2 && max_t <= model.max_seq() && model.max_batch() >= 1,
              "score_mc_items: the model is allocated for {}x{} tokens, {} positions asked", model.max_batch(),
              model.max_seq(), max_t);
  // Each ending is one sequence: plain causal attention and positions 0..T-1, whatever documents
  // a training step left set (the trainer sets them again for every micro-batch).
  model.set_documents(nullptr, nullptr, 0, 0);
  const int64_t V = model.global_vocab();  // a tensor-parallel shard's forward_logits gathers every column
  std::vector<float> logits;
  McScores out;
  for (size_t i = first; i < items.size(); i += stride) {
    const McItem& it = items[i];
    McItemScore sc;
    sc.label = it.label;
    double best = -1e300, best_norm = -1e300;
    for (size_t e = 0; e < it.endings.size(); ++e) {
      const auto& end = it.endings[e];
      LATHE_CHECK(static_cast<int64_t>(end.size()) < max_t,
                  "{} line {}: ending {} has {} tokens, which do not fit the {} positions evaluated (it needs one "
                  "context token before it)",
                  path, it.line, e, end.size(), max_t);
      // The context cut from the left so that context + ending fit max_t positions.
      const size_t keep = std::min(it.context.size(), static_cast<size_t>(max_t) - end.size());
      std::vector<int32_t> seq(it.context.end() - static_cast<std::ptrdiff_t>(keep), it.context.end());
      seq.insert(seq.end(), end.begin(), end.end());
      const int64_t T = static_cast<int64_t>(seq.size());
      logits.resize(static_cast<size_t>(T * V));
      if (logits_fn)
        logits_fn(seq.data(), T, logits.data());
      else
        model.forward_logits(seq.data(), 1, T, logits.data());  // [1, T, V]
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
      sc.loglik.push_back(ll);
      if (ll > best) best = ll, sc.pick = static_cast<int64_t>(e);
      if (norm > best_norm) best_norm = norm, sc.pick_norm = static_cast<int64_t>(e);
    }
    ++out.items;
    out.right += sc.pick == it.label;
    out.right_norm += sc.pick_norm == it.label;
    out.per_item.push_back(std::move(sc));
    if (bar) bar->add(1);
  }
  return out;
}

}  // namespace lathe
