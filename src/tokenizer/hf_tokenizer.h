// HF tokenizer.json (BPE model) and the GPT-2 legacy file pairs, which are converted to the same
// in-memory configuration (as transformers' converters do).
#pragma once
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tokenizer/tokenizer.h"

namespace lathe::tok {

// `config`: the parsed tokenizer.json; `where`: its path for messages; `kind_override`: kind()
// to report ("" = derived from the model); `files`: source_files(); `dir`: directory searched for
// tokenizer_config.json (BOS/EOS/PAD names), "" for none.
std::unique_ptr<Tokenizer> make_hf_tokenizer(const nlohmann::json& config, const std::string& where,
                                             const std::string& kind_override, std::vector<std::string> files,
                                             const std::string& dir);

// encoder.json/vocab.json + vocab.bpe/merges.txt -> GPT-2 style byte-level BPE.
std::unique_ptr<Tokenizer> load_gpt2_legacy(const std::string& vocab_path, const std::string& merges_path);

}  // namespace lathe::tok
