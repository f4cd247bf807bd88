// lathe tokenize --tokenizer PATH --input FILES/GLOBS... --output PREFIX [--workers N] [--append-eos]
//                [--text-key text] [--split-lines] [--max-shard-size 512MB] [--strict] [--overwrite]
// Corpus -> Megatron .bin/.idx shards; pipeline and naming rules in src/data/prep/preprocess.h.
#include <fmt/format.h>
#include <glob.h>

#include <CLI/CLI.hpp>
#include <csignal>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>

#include "cli/command.h"
#include "core/error.h"
#include "data/prep/preprocess.h"
#include "io/fs.h"
#include "tokenizer/tokenizer.h"

namespace {

extern "C" void on_interrupt(int) { lathe::tok::preprocess_cancel_flag().store(true); }

// Value errors of --max-shard-size are usage errors (exit 2) like the other options' (CLI11 checks).
CLI::Validator byte_size_validator() {
  return CLI::Validator(
      [](std::string& s) -> std::string {
        try {
          lathe::tok::parse_byte_size(s, "size");
          return "";
        } catch (const lathe::Error& e) {
          return e.what();
        }
      },
      "SIZE");
}

// No output (PREFIX.bin/.idx, the first shard's PREFIX_00000.bin/.idx, --stats-json) may be an
// input file (after glob expansion) or the tokenizer, nor two outputs one path.
void check_tokenize_paths(const lathe::tok::PreprocessOptions& opt, const std::string& stats_json,
                          const std::string& tokenizer) {
  std::vector<lathe::io::PathUse> in;
  if (tokenizer != "byte") in.push_back({tokenizer, "--tokenizer"});
  for (const std::string& pattern : opt.inputs) {
    glob_t g{};
    if (::glob(pattern.c_str(), 0, nullptr, &g) == 0)
      for (size_t i = 0; i < g.gl_pathc; ++i) in.push_back({g.gl_pathv[i], "--input"});
    else
      in.push_back({pattern, "--input"});
    ::globfree(&g);
  }
  const std::string& p = opt.output_prefix;
  std::vector<lathe::io::PathUse> out{{p + ".bin", "--output's .bin"},
                                      {p + ".idx", "--output's .idx"},
                                      {p + "_00000.bin", "--output's first shard"},
                                      {p + "_00000.idx", "--output's first shard index"}};
  if (!stats_json.empty()) out.push_back({stats_json, "--stats-json"});
  lathe::io::check_output_paths(in, out);
}

int run_tokenize(int argc, char** argv) {
  using namespace lathe::tok;
  CLI::App app{"Tokenize a corpus into Megatron .bin/.idx shards (uint16 ids when the vocabulary fits, else int32)",
               "lathe tokenize"};
  PreprocessOptions opt;
  std::string tokenizer, max_shard = "512MB", format = "auto", stats_json;
  bool no_progress = false;
  app.add_option("--tokenizer,-t", tokenizer, "tokenizer directory or file, or 'byte'")->required();
  app.add_option("--input,-i", opt.inputs,
                 "input files or globs: plain text, JSONL (.jsonl/.ndjson/.json), "
                 "optionally .gz/.zst")
      ->required();
  app.add_option("--output,-o", opt.output_prefix,
                 "output prefix: PREFIX.bin/.idx, or PREFIX_00000.bin/.idx, ... "
                 "when more than one shard is needed")
      ->required();
  app.add_option("--workers,-j", opt.workers, "encoding threads (output is identical for any value)")
      ->capture_default_str()
      ->check(CLI::Range(1, 1024));
  app.add_flag("--append-eos", opt.append_eos, "append the tokenizer's EOS id to every document");
  app.add_option("--text-key", opt.text_key, "JSONL key holding the document text")->capture_default_str();
  app.add_flag("--split-lines", opt.split_lines, "plain text: one document per line (default: one per file)");
  app.add_option("--max-shard-size", max_shard, "start a new shard before a .bin would exceed this (512MB, 1GiB, ...)")
      ->capture_default_str()
      ->check(byte_size_validator());
  app.add_option("--format", format, "auto (by file suffix), text or jsonl")
      ->capture_default_str()
      ->check(CLI::IsMember({"auto", "text", "txt", "jsonl", "json"}));
  app.add_flag("--strict", opt.strict,
               "a bad record (invalid JSON, missing key, invalid UTF-8) is an error, not a skip");
  app.add_flag("--overwrite", opt.overwrite, "replace outputs of an earlier run");
  app.add_flag("--no-progress", no_progress, "no progress line on stderr");
  app.add_option("--batch-bytes", opt.batch_bytes, "input bytes per work batch (tuning; tests use small values)")
      ->capture_default_str()
      ->check(CLI::Range(size_t{1}, size_t{1} << 40));
  app.add_option("--stats-json", stats_json, "also write the summary as JSON to this file");
  LATHE_CLI_PARSE(app, argc, argv);
  opt.max_shard_bytes = parse_byte_size(max_shard, "--max-shard-size");
  opt.format = parse_input_format(format);
  opt.progress = !no_progress;
  LATHE_CHECK(opt.batch_bytes >= 1, "--batch-bytes must be at least 1");

  check_tokenize_paths(opt, stats_json, tokenizer);
  auto tok = load_tokenizer(tokenizer);
  preprocess_cancel_flag().store(false);
  std::signal(SIGINT, on_interrupt);
  std::signal(SIGTERM, on_interrupt);
  PreprocessStats st = preprocess_corpus(*tok, opt);
  std::signal(SIGINT, SIG_DFL);
  std::signal(SIGTERM, SIG_DFL);
  std::fputs(format_preprocess_summary(st).c_str(), stdout);
  std::fflush(stdout);

  if (!stats_json.empty()) {
    nlohmann::ordered_json j;
    j["outputs"] = st.outputs;
    j["output_documents"] = st.output_documents;
    j["dtype"] = st.dtype;
    j["vocab_size"] = st.vocab_size;
    j["documents"] = st.documents;
    j["tokens"] = st.tokens;
    j["records"] = st.records;
    j["input_bytes"] = st.input_bytes;
    j["text_bytes"] = st.text_bytes;
    j["seconds"] = st.seconds;
    j["cpu_seconds"] = {
        {"reader", st.reader_cpu_seconds}, {"workers", st.workers_cpu_seconds}, {"writer", st.writer_cpu_seconds}};
    nlohmann::ordered_json sk = nlohmann::ordered_json::object();
    for (int r = 0; r < static_cast<int>(SkipReason::Count); ++r) sk[skip_reason_name(SkipReason(r))] = st.skipped[r];
    j["skipped"] = sk;
    nlohmann::ordered_json ex = nlohmann::ordered_json::array();
    for (const auto& e : st.examples)
      ex.push_back({{"file", e.file}, {"line", e.line}, {"reason", skip_reason_name(e.reason)}, {"detail", e.detail}});
    j["examples"] = ex;
    j["largest_single_document"] = st.largest_single_document;
    j["largest_single_document_bytes"] = st.largest_single_document_bytes;
    std::ofstream f(stats_json);
    LATHE_CHECK(f.good(), "--stats-json '{}': cannot open for writing", stats_json);
    f << j.dump(2) << "\n";
    LATHE_CHECK(f.good(), "--stats-json '{}': write failed", stats_json);
  }
  return 0;
}

lathe::cli::Registrar reg("tokenize", "corpus (text/JSONL, .gz/.zst) -> Megatron .bin/.idx token shards", run_tokenize);

}  // namespace
