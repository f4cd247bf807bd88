// Byte-level BPE training, merge-for-merge equal to HF `tokenizers`' BpeTrainer with a ByteLevel
// pre-tokenizer (GPT-2 regex) or Split(Llama-3 regex) + ByteLevel, and
// initial_alphabet = ByteLevel.alphabet() (all 256 byte symbols).
//
//   BpeTrainerOptions opt; opt.vocab_size = 32000; opt.special_tokens = {"<|endoftext|>"};
//   WordCounts wc = count_words(files, opt);       // PCRE2-JIT pre-tokenization, opt.threads threads
//   BpeModel m = train_bpe(wc, opt);                // merge loop
//   save_hf_tokenizer(m, "out_dir");                // tokenizer.json + tokenizer_config.json
//
// What "equal to HF" means, step by step (huggingface/tokenizers models/bpe/trainer.rs):
//  * Sequences: a plain-text file is read line by line with the '\n' kept (HF train(files) does
//    the same); a JSONL file gives one sequence per document (the text key's value).
//  * Ids: special tokens first (in the given order), then the 256 byte symbols sorted by the code
//    point of their GPT-2 byte->unicode character, then one id per merge in merge order.
//  * Merge choice: the pair with the highest count; ties go to the smallest (left id, right id).
//    Counts are updated incrementally from the changes of each merged word; a heap entry whose
//    count is stale is re-pushed with the current count (HF's lazy update). Training stops at
//    vocab_size, or when the best count is < max(1, min_frequency).
//  * One known place where HF itself is not deterministic: when a merge produces a string that
//    already is a token (two merge paths to the same bytes), HF may hold two heap entries for one
//    pair with different word sets and equal priority; which one Rust's BinaryHeap pops first is
//    an implementation detail. lathe pops them in insertion order.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tokenizer/corpus.h"

namespace lathe::tok {

struct BpeTrainerOptions {
  int64_t vocab_size = 32000;
  std::string pretokenizer = "gpt2";  // "gpt2" | "llama3"
  std::vector<std::string> special_tokens;
  uint64_t min_frequency = 2;
  int threads = 2;  // word counting threads
  bool progress = true;
  InputFormat format = InputFormat::Auto;
  std::string text_key = "text";  // JSONL inputs
  // tokenizer_config.json; empty = guessed from the special tokens (see save_hf_tokenizer)
  std::string bos_token, eos_token, pad_token;
};

// The pre-tokenization regexes (exact strings of GPT-2 and of Llama-3's tokenizer.json).
const std::string& pretokenizer_pattern(std::string_view name);

// GPT-2 byte -> unicode code point table (shared/reference/hf-tokenizer-json.md section 6).
uint32_t byte_to_unicode(uint8_t b);
// The UTF-8 spelling of a byte string in byte-level vocabularies ("Ġthe" for " the").
std::string bytes_to_token_string(std::string_view bytes);

// Distinct pre-tokens (raw bytes) with their counts. Order is unspecified.
struct WordCounts {
  std::vector<std::string> words;
  std::vector<uint64_t> counts;
  uint64_t total_words = 0;  // pre-tokens seen (with repetition)
  uint64_t bytes = 0;        // text bytes pre-tokenized
  uint64_t sequences = 0;    // lines / documents
  uint64_t skipped = 0;      // JSONL lines without a usable text value
  double seconds = 0;
};

// Pre-tokenizes `texts` (each one sequence) single-threaded; for tests and small inputs.
WordCounts count_words_in_texts(const std::vector<std::string>& texts, const BpeTrainerOptions& opt);
// Reads `files` (plain text / JSONL, .gz/.zst) with opt.threads pre-tokenizing threads.
WordCounts count_words(const std::vector<std::string>& files, const BpeTrainerOptions& opt);

struct BpeModel {
  std::string pretokenizer;
  std::vector<std::string> special_tokens;          // ids 0..special_tokens.size()-1
  std::vector<std::string> vocab;                   // id -> token: specials verbatim, others as raw bytes
  std::vector<std::pair<int32_t, int32_t>> merges;  // rank order; pair of ids
  std::string bos_token, eos_token, pad_token;
  double seconds = 0;
  // Token string as written in tokenizer.json (byte->unicode mapped, specials verbatim).
  std::string token_string(int32_t id) const;
};

BpeModel train_bpe(const WordCounts& wc, const BpeTrainerOptions& opt);

// tokenizer.json content (HF format, merges in the ["a","b"] form).
std::string hf_tokenizer_json(const BpeModel& m);
std::string hf_tokenizer_config_json(const BpeModel& m);
// Writes DIR/tokenizer.json and DIR/tokenizer_config.json (temp name, fsync, rename); creates DIR.
// BOS/EOS/PAD left empty in the model are guessed: eos = <|endoftext|>, </s>, <|end_of_text|> or
// <|eot_id|>; bos = <s> or <|begin_of_text|>, else the GPT-2 convention bos = <|endoftext|>;
// pad = <pad> or <|pad|>. Tokens given explicitly must be among the special tokens.
void save_hf_tokenizer(BpeModel& m, const std::string& dir);

}  // namespace lathe::tok
