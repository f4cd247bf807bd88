// lathe tokenizer train --input FILES... --vocab-size N --out DIR [--pretokenizer gpt2|llama3]
//                       [--special-tokens "<|endoftext|>,..."] [--min-frequency 2] [--threads 2]
// Byte-level BPE training equal to HF tokenizers' BpeTrainer (see src/tokenizer/bpe_trainer.h).
#include <fmt/format.h>

#include <CLI/CLI.hpp>

#include "cli/command.h"
#include "core/error.h"
#include "tokenizer/bpe_trainer.h"
#include "tokenizer/corpus.h"

namespace {

std::vector<std::string> split_commas(const std::string& s) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= s.size()) {
    size_t c = s.find(',', start);
    if (c == std::string::npos) c = s.size();
    if (c > start) out.push_back(s.substr(start, c - start));
    start = c + 1;
  }
  return out;
}

int run_tokenizer(int argc, char** argv) {
  using namespace lathe::tok;
  CLI::App app{"Tokenizer tools. Verbs: train (byte-level BPE, HF tokenizers compatible)", "lathe tokenizer"};
  app.require_subcommand(1);
  auto* train = app.add_subcommand("train", "train a byte-level BPE tokenizer; writes DIR/tokenizer.json");
  std::vector<std::string> inputs;
  std::string out, special = "", pretok = "gpt2", format = "auto", text_key = "text";
  std::string bos, eos, pad;
  int64_t vocab_size = 0;
  uint64_t min_freq = 2;
  int threads = 2;
  bool no_progress = false;
  train
      ->add_option("--input,-i", inputs,
                   "input files or globs: plain text (one sequence per line, like HF "
                   "train(files)) or JSONL, optionally .gz/.zst")
      ->required();
  train->add_option("--vocab-size", vocab_size, "target vocabulary size, special tokens included")->required();
  train->add_option("--out,-o", out, "output directory (tokenizer.json, tokenizer_config.json)")->required();
  train->add_option("--pretokenizer", pretok, "pre-tokenization regex: gpt2 or llama3")->capture_default_str();
  train->add_option("--special-tokens", special, "comma-separated special tokens, given the first ids");
  train->add_option("--min-frequency", min_freq, "stop when the best pair occurs fewer times")->capture_default_str();
  train->add_option("--threads", threads, "word-counting threads")->capture_default_str();
  train->add_option("--format", format, "auto (by suffix: .jsonl/.json = JSONL), text or jsonl")->capture_default_str();
  train->add_option("--text-key", text_key, "JSONL key holding the text")->capture_default_str();
  train->add_option("--bos-token", bos, "BOS token for tokenizer_config.json (default: guessed)");
  train->add_option("--eos-token", eos, "EOS token for tokenizer_config.json (default: guessed)");
  train->add_option("--pad-token", pad, "PAD token for tokenizer_config.json (default: guessed)");
  train->add_flag("--no-progress", no_progress, "no progress bar");
  LATHE_CLI_PARSE(app, argc, argv);

  BpeTrainerOptions opt;
  opt.vocab_size = vocab_size;
  opt.pretokenizer = pretok;
  (void)pretokenizer_pattern(pretok);  // validates the name before reading anything
  opt.special_tokens = split_commas(special);
  opt.min_frequency = min_freq;
  LATHE_CHECK(threads >= 1 && threads <= 256, "--threads {}: must be between 1 and 256", threads);
  opt.threads = threads;
  opt.progress = !no_progress;
  opt.format = parse_input_format(format);
  opt.text_key = text_key;
  opt.bos_token = bos;
  opt.eos_token = eos;
  opt.pad_token = pad;

  auto files = expand_input_patterns(inputs);
  WordCounts wc = count_words(files, opt);
  fmt::print(stderr, "counted {} words ({} distinct) in {:.1f} MB, {} sequences, {:.2f} s{}\n", wc.total_words,
             wc.words.size(), wc.bytes / 1e6, wc.sequences, wc.seconds,
             wc.skipped ? fmt::format(" ({} JSONL lines without a usable \"{}\" skipped)", wc.skipped, text_key) : "");
  BpeModel m = train_bpe(wc, opt);
  save_hf_tokenizer(m, out);
  fmt::print(stderr, "{} merges, vocabulary {} ({} special) in {:.2f} s; wrote {}/tokenizer.json\n", m.merges.size(),
             m.vocab.size(), m.special_tokens.size(), m.seconds, out);
  if (static_cast<int64_t>(m.vocab.size()) < vocab_size)
    fmt::print(stderr, "note: vocabulary stopped at {} < --vocab-size {}: no pair occurs --min-frequency {} times\n",
               m.vocab.size(), vocab_size, min_freq);
  return 0;
}

lathe::cli::Registrar reg("tokenizer", "tokenizer tools: 'tokenizer train' trains a byte-level BPE", run_tokenizer);

}  // namespace
