// src/data/prep/: making training data. This room owns `lathe tokenize`: corpus text in (read
// with tokenizer/corpus.h, also what the BPE trainer reads), Megatron .bin/.idx token shards out
// (data/indexed_dataset.h's format, which the rest of data/ reads back). It is the one part of
// data/ that uses tokenizer/; tokenizer/ does not depend on data/.
//
// Corpus preprocessing: text / JSONL (optionally .gz/.zst) -> Megatron .bin/.idx token shards.
//
// Pipeline (preprocess_corpus):
//   reader thread  : RecordReader -> batches of ~1 MB of whole lines (or whole files), numbered
//                    in input order
//   N worker threads: split lines, JSON parse, UTF-8 check, Tokenizer::encode (+EOS) -> token batches
//   calling thread : takes batches strictly in number order and writes them, so the output is
//                    byte-identical for any N; draws the progress line.
// Memory is bounded: at most 2N+4 batches are between the reader and the writer.
//
// Output naming rule: shards are written as PREFIX_00000, PREFIX_00001, ... (.bin/.idx). A new
// shard starts when adding the next document would push the current shard's .bin past
// max_shard_bytes (a single document larger than the limit gets a shard of its own). If the run
// produces exactly one shard it is named PREFIX.bin/PREFIX.idx instead.
// While the run is in progress shards live under "<name>.incomplete" (.bin/.idx, plus the
// writer's own .tmp names); they get their final names only after all input was processed, .bin
// before .idx. An interrupted or failed run removes what it wrote, and in any case never leaves a
// file under a final name. Existing outputs are an error unless `overwrite`.
#pragma once
#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "tokenizer/corpus.h"
#include "tokenizer/tokenizer.h"

namespace lathe::tok {

struct PreprocessOptions {
  std::vector<std::string> inputs;  // files or globs
  std::string output_prefix;
  int workers = 1;
  bool append_eos = false;
  std::string text_key = "text";
  bool split_lines = false;  // plain text: one document per line (else one per file)
  InputFormat format = InputFormat::Auto;
  uint64_t max_shard_bytes = 512ull * 1000 * 1000;
  bool strict = false;  // first bad record (invalid JSON, missing key, invalid UTF-8 for any tokenizer) is an
                        // error instead of a counted skip
  bool overwrite = false;
  bool progress = true;
  size_t batch_bytes = 1 << 20;
  size_t max_examples = 5;  // skipped records listed by file:line in the summary
};

struct SkipExample {
  std::string file;
  uint64_t line = 0;  // 0: whole file
  SkipReason reason = SkipReason::Empty;
  std::string detail;
};

struct PreprocessStats {
  uint64_t documents = 0;    // written
  uint64_t tokens = 0;       // written (EOS included)
  uint64_t text_bytes = 0;   // bytes of text encoded
  uint64_t input_bytes = 0;  // bytes of records read (decompressed)
  uint64_t records = 0;      // records read
  uint64_t skipped[static_cast<int>(SkipReason::Count)] = {};
  std::vector<SkipExample> examples;
  std::vector<std::string> outputs;  // final prefixes (without .bin/.idx)
  std::vector<uint64_t> output_documents;
  std::string dtype;
  int64_t vocab_size = 0;
  double seconds = 0;
  // CPU time per pipeline stage: with P cores and reader + writer running beside the workers,
  // the best wall time is about max(workers/min(N, P), (workers + reader + writer) / P).
  double reader_cpu_seconds = 0, workers_cpu_seconds = 0, writer_cpu_seconds = 0;
  // Work is shared by document: a plain-text file read as one document (no --split-lines) is
  // encoded by one worker. The largest such file, when it was big enough to matter (>= 8 batches
  // and more than one worker), so the summary can say why the workers idled.
  std::string largest_single_document;
  uint64_t largest_single_document_bytes = 0;
};

// Set from a signal handler to stop a run cleanly (outputs removed, lathe::Error thrown).
std::atomic<bool>& preprocess_cancel_flag();

PreprocessStats preprocess_corpus(const Tokenizer& tok, const PreprocessOptions& opt);

std::string format_preprocess_summary(const PreprocessStats& s);

}  // namespace lathe::tok
