#include "train/consistency.h"

#include <fmt/format.h>

#include <algorithm>

#include "core/error.h"
#include "data/indexed_dataset.h"
#include "tokenizer/tokenizer.h"

namespace lathe {

ConsistencyReport check_consistency(const Recipe& r) {
  ConsistencyReport rep;
  const int64_t V = r.model.vocab_size;
  auto result = [&](bool ok, std::string line) { (ok ? rep.passed : rep.failures).push_back(std::move(line)); };

  if (!r.data.tokenizer.empty()) {
    auto tok = tok::load_tokenizer(r.data.tokenizer);
    const int64_t tv = tok->vocab_size();
    result(tv <= V, tv <= V ? fmt::format("tokenizer {} has {} tokens <= model.vocab_size {}", r.data.tokenizer, tv, V)
                            : fmt::format("tokenizer {} has {} tokens but model.vocab_size is {}: set model.vocab_size "
                                          ">= {} (a multiple of 64 is faster) or use the model's own tokenizer",
                                          r.data.tokenizer, tv, V, tv));
    struct Special {
      const char* key;
      int64_t model_id;
      std::optional<int32_t> tok_id;
    };
    for (const Special& s : {Special{"bos_token_id", r.model.bos_token_id, tok->bos_id()},
                             Special{"eos_token_id", r.model.eos_token_id, tok->eos_id()},
                             Special{"pad_token_id", r.model.pad_token_id, tok->pad_id()}}) {
      if (s.model_id >= 0)
        result(s.model_id < tv,
               s.model_id < tv ? fmt::format("model.{} {} exists in the tokenizer ({} tokens)", s.key, s.model_id, tv)
                               : fmt::format("model.{} is {} but the tokenizer {} has only {} tokens: set model.{} to "
                                             "the tokenizer's id{}",
                                             s.key, s.model_id, r.data.tokenizer, tv, s.key,
                                             s.tok_id ? fmt::format(" ({})", *s.tok_id) : std::string()));
      if (s.tok_id)
        result(*s.tok_id < V, *s.tok_id < V
                                  ? fmt::format("tokenizer {} id {} < model.vocab_size {}", s.key, *s.tok_id, V)
                                  : fmt::format("the tokenizer's {} is {} but model.vocab_size is {}: raise "
                                                "model.vocab_size to at least {}",
                                                s.key, *s.tok_id, V, *s.tok_id + 1));
    }
  }
  // Every dataset the run reads: data.train or each data.blend entry (named by its index), data.valid.
  std::vector<std::pair<std::string, std::string>> sets = {{"dataset " + r.data.train, r.data.train}};
  if (!r.data.blend.empty()) sets.clear();
  for (size_t i = 0; i < r.data.blend.size(); ++i)
    sets.push_back({fmt::format("data.blend[{}].prefix {}", i, r.data.blend[i].prefix), r.data.blend[i].prefix});
  sets.push_back({"dataset " + r.data.valid, r.data.valid});
  for (const auto& [name, prefix] : sets) {
    if (prefix.empty()) continue;
    data::IndexedDataset ds(prefix);
    const int32_t mx = ds.max_token_id();
    result(mx < V, mx < V ? fmt::format("{}: largest token id {} < model.vocab_size {} ({} tokens)", name, mx, V,
                                        ds.total_tokens())
                          : fmt::format("{}: contains token id {} but model.vocab_size is {}; use a model with "
                                        "vocab_size >= {} or re-tokenize the data with the model's tokenizer",
                                        name, mx, V, static_cast<int64_t>(mx) + 1));
  }
  // Document-aware samples (data.attention: document, reset_position_ids, mask_loss_after_eod) cut
  // documents at the EOD id: every training dataset (data.train or each blended prefix) must
  // contain it, or each sample would be one document. Probed from the sequences' last tokens
  // (`lathe tokenize --append-eos` ends every document with it), then the first 1M tokens.
  if (r.data.attention == "document" || r.data.reset_position_ids || r.data.mask_loss_after_eod) {
    int64_t eod = r.data.eod_token;
    if (eod < 0 && !r.data.tokenizer.empty()) {
      auto tok = tok::load_tokenizer(r.data.tokenizer);
      if (tok->eos_id()) eod = *tok->eos_id();
    }
    if (eod >= 0 && eod < V)                          // otherwise the recipe / trainer name the missing or bad id
      for (size_t k = 0; k + 1 < sets.size(); ++k) {  // the last entry is data.valid: not trained on
        const auto& [name, prefix] = sets[k];
        if (prefix.empty()) continue;
        data::IndexedDataset ds(prefix);
        auto [hits, checked] = data::sequences_ending_with(ds, static_cast<int32_t>(eod));
        int64_t inside = 0;
        if (hits == 0) {
          std::vector<int32_t> head(static_cast<size_t>(std::min<int64_t>(ds.total_tokens(), 1 << 20)));
          if (!head.empty()) ds.read_global(0, static_cast<int64_t>(head.size()), head.data());
          inside = std::count(head.begin(), head.end(), static_cast<int32_t>(eod));
        }
        result(hits > 0 || inside > 0,
               hits > 0 ? fmt::format("{}: {} of {} sequences checked end with the EOD id {}", name, hits, checked, eod)
               : inside > 0
                   ? fmt::format("{}: the EOD id {} occurs ({} times in the first 1M tokens)", name, eod, inside)
                   : fmt::format("{}: the EOD id {} occurs nowhere ({} sequences' last tokens and the first 1M tokens "
                                 "checked), so document attention would see each sample as one document; re-tokenize "
                                 "with `lathe tokenize --append-eos`, or set data.eod_token to the id that ends its "
                                 "documents",
                                 name, eod, checked));
      }
  }
  return rep;
}

void require_consistency(const Recipe& r) {
  ConsistencyReport rep = check_consistency(r);
  if (rep.failures.empty()) return;
  std::string msg = fmt::format("{}: model, tokenizer and data disagree:", r.source);
  for (auto& f : rep.failures) msg += "\n  - " + f;
  throw Error(msg);
}

}  // namespace lathe
