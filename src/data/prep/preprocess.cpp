#include "data/prep/preprocess.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <thread>

#include "core/error.h"
#include "core/timer.h"
#include "data/indexed_dataset.h"
#include "io/fs.h"

namespace lathe::tok {

std::atomic<bool>& preprocess_cancel_flag() {
  static std::atomic<bool> flag{false};
  return flag;
}

namespace {

// Chunks of input (whole-line blocks of ~batch_bytes, or whole files) numbered in input order.
struct InBatch {
  uint64_t seq = 0;
  std::vector<InputChunk> chunks;
  uint64_t raw_pos = 0;  // on-disk bytes consumed when the batch was complete (for the ETA)
};

struct Skip {
  uint32_t file_index;
  uint64_t line;
  SkipReason reason;
  std::string detail;
};

struct OutBatch {
  std::vector<int32_t> tokens;    // all kept documents back to back
  std::vector<uint32_t> lengths;  // tokens per kept document
  std::vector<Skip> skips;
  uint64_t text_bytes = 0, input_bytes = 0, records = 0, raw_pos = 0;
};

double thread_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}

bool file_exists(const std::string& p) {
  struct stat st;
  return ::stat(p.c_str(), &st) == 0;
}

std::string shard_name(const std::string& prefix, size_t k) { return fmt::format("{}_{:05d}", prefix, k); }

// Encodes one batch into `out` (runs on a worker thread). `out` is a recycled batch: its vectors
// are cleared, not freed.
void process_batch(const InBatch& in, const Tokenizer& tok, const PreprocessOptions& opt, std::optional<int32_t> eos,
                   bool check_utf8, OutBatch& out) {
  out.tokens.clear();
  out.lengths.clear();
  out.skips.clear();
  out.text_bytes = out.input_bytes = out.records = 0;
  out.raw_pos = in.raw_pos;
  std::string text, detail;
  auto record = [&](std::string_view data, bool is_json, uint32_t file_index, uint64_t line) {
    ++out.records;
    out.input_bytes += data.size();
    std::string_view t = data;
    if (is_json) {
      SkipReason why;
      detail.clear();
      if (data.find_first_not_of(" \t\r") == std::string_view::npos) {
        out.skips.push_back({file_index, line, SkipReason::Empty, "blank line"});
        return;
      }
      if (!extract_json_text(data, opt.text_key, text, why, detail)) {
        out.skips.push_back({file_index, line, why, detail});
        return;
      }
      t = text;
    }
    if (t.empty()) {
      out.skips.push_back({file_index, line, SkipReason::Empty, ""});
      return;
    }
    if (check_utf8 && !is_valid_utf8(t)) {
      size_t at = 0;
      while (at < t.size() && utf8_valid_at(t, at)) at += utf8_char_len(t, at);
      out.skips.push_back({file_index, line, SkipReason::InvalidUtf8,
                           tok.is_byte_level() ? fmt::format("byte {} of the record", at)
                                               : fmt::format("byte {} of the record; tokenizer is not byte-level ({})",
                                                             at, tok.kind())});
      return;
    }
    const size_t start = out.tokens.size();
    tok.encode_append(t, out.tokens, false);
    if (out.tokens.size() == start) {
      out.skips.push_back({file_index, line, SkipReason::Empty, "encodes to no tokens"});
      return;
    }
    out.text_bytes += t.size();
    if (eos) out.tokens.push_back(*eos);
    out.lengths.push_back(static_cast<uint32_t>(out.tokens.size() - start));
  };
  for (const InputChunk& c : in.chunks) {
    if (!c.lines) {
      record(c.data, c.is_json, c.file_index, 0);
      continue;
    }
    for_each_line(c, [&](std::string_view line, uint64_t no) { record(line, c.is_json, c.file_index, no); });
  }
}

// The options checked and the output place prepared, before any thread starts.
struct RunSetup {
  std::optional<int32_t> eos;  // appended to every document (--append-eos)
  bool check_utf8 = false;
  DType dtype = DType::U16;
};

RunSetup check_and_prepare(const Tokenizer& tok, const PreprocessOptions& opt) {
  LATHE_CHECK(!opt.output_prefix.empty(), "--output: empty prefix");
  LATHE_CHECK(opt.workers >= 1 && opt.workers <= 1024, "--workers {}: must be between 1 and 1024", opt.workers);
  LATHE_CHECK(opt.max_shard_bytes >= 1, "--max-shard-size must be at least 1 byte");
  RunSetup s;
  if (opt.append_eos) {
    s.eos = tok.eos_id();
    LATHE_CHECK(s.eos.has_value(),
                "--append-eos: tokenizer '{}' has no EOS token (declare eos_token in tokenizer_config.json, or drop "
                "--append-eos)",
                tok.kind());
  }
  // A byte-level tokenizer encodes any bytes, so invalid UTF-8 is only skipped for the others;
  // --strict promises that invalid UTF-8 is an error whatever the tokenizer.
  s.check_utf8 = !tok.is_byte_level() || opt.strict;
  s.dtype = data::optimal_token_dtype(tok.vocab_size());
  const std::string& prefix = opt.output_prefix;

  // Refuse to mix with an earlier run's outputs.
  std::vector<std::string> existing;
  for (const std::string& p : {prefix, shard_name(prefix, 0)})
    for (const char* ext : {".bin", ".idx"})
      if (file_exists(p + ext)) existing.push_back(p + ext);
  if (!existing.empty() && !opt.overwrite)
    throw_error("output '{}' already exists; pass --overwrite to replace it, or choose another --output",
                existing.front());
  std::string dir = std::filesystem::path(prefix).parent_path().string();
  if (!dir.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    LATHE_CHECK(!ec, "--output '{}': cannot create directory '{}': {}", prefix, dir, ec.message());
  }
  return s;
}

// The state the reader thread, the worker threads and the writer (the calling thread) share, and
// the reader's and workers' loops. One mutex: batches are ~1 MB so contention is negligible.
struct Pipeline {
  const PreprocessOptions& opt;
  const std::vector<std::string>& files;
  RecordReader& reader;

  std::mutex mu;
  std::condition_variable cv;  // any state change
  std::deque<InBatch> work;
  std::map<uint64_t, OutBatch> done;
  uint64_t batches_read = 0, next_write = 0;
  bool reader_finished = false;
  bool stop = false;
  std::exception_ptr error;
  // Buffers go round instead of being freed: a fresh megabyte-sized block is an mmap, page faults
  // on first touch and an munmap (a TLB shootdown across the cores running the other threads)
  // when freed. That cost parallel speedup; recycled buffers stay mapped and warm. At most
  // max_inflight batches exist, so the pools stay small.
  std::vector<std::string> spare_text;  // chunk buffers, back from the workers to the reader
  std::vector<OutBatch> spare_out;      // token batches, back from the writer to the workers
  const uint64_t max_inflight;

  double reader_cpu = 0, workers_cpu = 0;
  std::string largest_doc;  // see PreprocessStats::largest_single_document (reader thread only)
  uint64_t largest_doc_bytes = 0;

  Pipeline(const PreprocessOptions& o, const std::vector<std::string>& f, RecordReader& r)
      : opt(o), files(f), reader(r), max_inflight(static_cast<uint64_t>(o.workers) * 2 + 4) {}

  void fail(std::exception_ptr e) {
    std::lock_guard<std::mutex> lk(mu);
    if (!error) error = e;
    stop = true;
    cv.notify_all();
  }

  // The reader thread: input chunks grouped into numbered batches, at most max_inflight ahead of
  // the writer.
  void read_all() {
    try {
      InBatch b;
      size_t bytes = 0;
      auto flush = [&]() -> bool {
        std::unique_lock<std::mutex> lk(mu);
        cv.wait(lk, [&] { return stop || batches_read - next_write < max_inflight; });
        if (stop) return false;
        b.seq = batches_read++;
        b.raw_pos = reader.raw_bytes_read();
        work.push_back(std::move(b));
        cv.notify_all();
        b = InBatch{};
        bytes = 0;
        return true;
      };
      InputChunk chunk;
      auto fresh_chunk = [&] {
        chunk = InputChunk{};
        std::lock_guard<std::mutex> lk(mu);
        if (!spare_text.empty()) {
          chunk.data = std::move(spare_text.back());
          spare_text.pop_back();
        }
      };
      // Smaller chunks towards the end of the input, so that the workers finish together instead of
      // one of them encoding the last full batch alone (the output does not depend on batching).
      const uint64_t total_bytes = reader.total_file_bytes();
      auto chunk_target = [&]() -> size_t {
        const uint64_t pos = reader.raw_bytes_read();
        const uint64_t left = total_bytes > pos ? total_bytes - pos : 0;
        const uint64_t share = left / (4 * static_cast<uint64_t>(opt.workers));
        return static_cast<size_t>(std::min<uint64_t>(opt.batch_bytes, std::max<uint64_t>(share, 64 << 10)));
      };
      while (reader.next_chunk(chunk, chunk_target())) {
        if (preprocess_cancel_flag().load(std::memory_order_relaxed)) break;
        bytes += chunk.data.size() + 64;
        if (!chunk.lines && opt.workers > 1 && chunk.data.size() >= 8 * opt.batch_bytes &&
            chunk.data.size() > largest_doc_bytes) {
          largest_doc_bytes = chunk.data.size();
          largest_doc = files[chunk.file_index];
        }
        b.chunks.push_back(std::move(chunk));
        // A block of lines is a batch of its own (sized by chunk_target); whole files are
        // grouped up to batch_bytes.
        if ((b.chunks.back().lines || bytes >= opt.batch_bytes) && !flush()) return;
        fresh_chunk();
      }
      if (!b.chunks.empty() && !flush()) return;
      std::lock_guard<std::mutex> lk(mu);
      reader_cpu = thread_cpu_seconds();
      reader_finished = true;
      cv.notify_all();
    } catch (...) {
      fail(std::current_exception());
    }
  }

  // A worker thread: encodes batches until the input is exhausted or the run stops.
  void encode_all(const Tokenizer& tok, const RunSetup& setup) {
    try {
      for (;;) {
        InBatch b;
        OutBatch o;
        {
          std::unique_lock<std::mutex> lk(mu);
          cv.wait(lk, [&] { return stop || !work.empty() || reader_finished; });
          if (stop || work.empty()) {
            workers_cpu += thread_cpu_seconds();
            return;
          }
          b = std::move(work.front());
          work.pop_front();
          if (!spare_out.empty()) {
            o = std::move(spare_out.back());
            spare_out.pop_back();
          }
        }
        process_batch(b, tok, opt, setup.eos, setup.check_utf8, o);
        std::lock_guard<std::mutex> lk(mu);
        for (InputChunk& c : b.chunks) spare_text.push_back(std::move(c.data));
        done.emplace(b.seq, std::move(o));
        cv.notify_all();
      }
    } catch (...) {
      fail(std::current_exception());
    }
  }

  // The writer's side: hands back the batch written last (`o`, recycled) and takes the next batch
  // in input order into `o`. False when all batches were written or the run stopped on an error;
  // throws when interrupted.
  bool take_next(OutBatch& o) {
    for (;;) {
      std::unique_lock<std::mutex> lk(mu);
      if (o.tokens.capacity() > 0) spare_out.push_back(std::move(o));  // the batch written last round
      o = OutBatch{};
      cv.wait_for(lk, std::chrono::milliseconds(200),
                  [&] { return stop || done.count(next_write) || (reader_finished && next_write == batches_read); });
      if (preprocess_cancel_flag().load()) throw_error("interrupted; partial outputs removed");
      if (stop) return false;
      auto it = done.find(next_write);
      if (it == done.end()) {
        if (reader_finished && next_write == batches_read) return false;
        continue;
      }
      o = std::move(it->second);
      done.erase(it);
      ++next_write;
      cv.notify_all();
      return true;
    }
  }
};

// The shards of one run: written under "<name>.incomplete", published under their final names
// only at the end (see preprocess.h).
class ShardSet {
 public:
  ShardSet(std::string prefix, DType dtype) : prefix_(std::move(prefix)), dtype_(dtype) {}

  void open_shard() {
    incomplete_.push_back(shard_name(prefix_, incomplete_.size()) + ".incomplete");
    writer_ = std::make_unique<data::IndexedDatasetWriter>(incomplete_.back(), dtype_);
  }

  // Documents go to the current shard in blocks; a new shard starts when the next document
  // would push the .bin past the limit (a document larger than the limit gets its own).
  void add(const OutBatch& o, uint64_t max_shard_bytes, PreprocessStats& st) {
    const size_t itemsize = dtype_size(dtype_);
    const size_t n_docs = o.lengths.size();
    size_t i = 0, off = 0;
    while (i < n_docs) {
      uint64_t bin = writer_->bin_bytes();
      size_t j = i, end = off;
      while (j < n_docs) {
        const uint64_t bytes = uint64_t(o.lengths[j]) * itemsize;
        if ((writer_->num_documents() > 0 || j > i) && bin + bytes > max_shard_bytes) break;
        bin += bytes;
        end += o.lengths[j];
        ++j;
      }
      if (j == i) {
        writer_->finalize();
        st.output_documents.push_back(writer_->num_documents());
        open_shard();
        continue;
      }
      writer_->add_documents(std::span<const int32_t>(o.tokens.data() + off, end - off),
                             std::span<const uint32_t>(o.lengths.data() + i, j - i));
      st.documents += j - i;
      st.tokens += end - off;
      i = j;
      off = end;
    }
  }

  // Removes everything written (the writer's temporaries and the finished incomplete shards).
  void remove_incomplete() {
    writer_.reset();  // removes its temp files
    for (const auto& p : incomplete_)
      for (const char* ext : {".bin", ".idx"}) ::unlink((p + ext).c_str());
  }

  // Finishes the last shard and gives every shard its final name (.bin before .idx, so that a
  // visible .idx always has its complete .bin); with `overwrite`, outputs of an earlier run that
  // this run did not replace are removed.
  void publish(bool overwrite, PreprocessStats& st) {
    try {
      writer_->finalize();
      st.output_documents.push_back(writer_->num_documents());
      writer_.reset();
    } catch (...) {
      remove_incomplete();
      throw;
    }
    const size_t n = incomplete_.size();
    for (size_t k = 0; k < n; ++k) st.outputs.push_back(n == 1 ? prefix_ : shard_name(prefix_, k));
    for (size_t k = 0; k < n; ++k)
      for (const char* ext : {".bin", ".idx"}) {
        std::string from = incomplete_[k] + ext, to = st.outputs[k] + ext;
        if (::rename(from.c_str(), to.c_str()) != 0)
          throw_error("renaming '{}' to '{}' failed: {}", from, to, std::strerror(errno));
      }
    if (overwrite) {
      if (n > 1)
        for (const char* ext : {".bin", ".idx"}) ::unlink((prefix_ + ext).c_str());
      for (size_t k = (n == 1 ? 0 : n);; ++k) {
        bool any = false;
        for (const char* ext : {".bin", ".idx"}) any |= ::unlink((shard_name(prefix_, k) + ext).c_str()) == 0;
        if (!any) break;
      }
    }
    io::fsync_dir(io::parent_dir(prefix_));
  }

 private:
  std::string prefix_;
  DType dtype_;
  std::vector<std::string> incomplete_;  // finalized shards under temporary names
  std::unique_ptr<data::IndexedDatasetWriter> writer_;
};

// Counts a batch's skipped records and keeps the first examples; the first bad one is an error
// under --strict.
void record_skips(const OutBatch& o, const std::vector<std::string>& files, const PreprocessOptions& opt,
                  PreprocessStats& st) {
  for (const Skip& s : o.skips) {
    if (opt.strict && s.reason != SkipReason::Empty)
      throw_error("{}{}: {}{}{} (--strict; drop it to skip such records)", files[s.file_index],
                  s.line ? fmt::format(":{}", s.line) : std::string(), skip_reason_name(s.reason),
                  s.detail.empty() ? "" : ": ", s.detail);
    ++st.skipped[static_cast<int>(s.reason)];
    if (st.examples.size() < opt.max_examples && s.reason != SkipReason::Empty)
      st.examples.push_back({files[s.file_index], s.line, s.reason, s.detail});
  }
}

// The error of a run that read records but kept none, with the skip counts.
[[noreturn]] void throw_no_documents(const PreprocessStats& st) {
  std::string why;
  for (int r = 0; r < static_cast<int>(SkipReason::Count); ++r)
    if (st.skipped[r])
      why += fmt::format("{}{} {}", why.empty() ? "" : ", ", st.skipped[r], skip_reason_name(SkipReason(r)));
  throw_error("no document was written from {} records{}{}; check --text-key / --split-lines / the inputs",
              st.records, why.empty() ? "" : ": ", why);
}

}  // namespace

PreprocessStats preprocess_corpus(const Tokenizer& tok, const PreprocessOptions& opt) {
  const double t0 = now_seconds();
  const RunSetup setup = check_and_prepare(tok, opt);
  const std::vector<std::string> files = expand_input_patterns(opt.inputs);
  RecordReader reader(files, RecordReader::Options{opt.format, opt.split_lines});

  Pipeline pipe(opt, files, reader);
  std::thread reader_thread([&] { pipe.read_all(); });
  std::vector<std::thread> workers;
  for (int w = 0; w < opt.workers; ++w) workers.emplace_back([&] { pipe.encode_all(tok, setup); });

  // ---- writer (this thread): batches in input order into the shards
  PreprocessStats st;
  st.vocab_size = tok.vocab_size();
  st.dtype = std::string(dtype_name(setup.dtype));
  ShardSet shards(opt.output_prefix, setup.dtype);
  const double writer_cpu0 = thread_cpu_seconds();
  ProgressLine bar(opt.progress);
  const uint64_t total_file_bytes = std::max<uint64_t>(1, reader.total_file_bytes());
  auto draw = [&](uint64_t raw_pos, bool force) {
    const double frac = std::min(1.0, double(raw_pos) / double(total_file_bytes));
    if (!bar.due(force, frac)) return;
    const double el = std::max(now_seconds() - t0, 1e-9);
    bar.show(fmt::format("tokenize {} {:5.1f}%  {:.1f} MB/s  {} docs  {} tokens  ETA {}", progress::bar_cells(frac),
                         100 * frac, st.input_bytes / 1e6 / el, format_count(double(st.documents)),
                         format_count(double(st.tokens)), format_duration(progress::eta_seconds(frac, 1.0, el))));
  };
  try {
    shards.open_shard();
    OutBatch o;
    while (pipe.take_next(o)) {
      record_skips(o, files, opt, st);
      shards.add(o, opt.max_shard_bytes, st);
      st.text_bytes += o.text_bytes;
      st.input_bytes += o.input_bytes;
      st.records += o.records;
      draw(o.raw_pos, false);
    }
  } catch (...) {
    pipe.fail(std::current_exception());
  }
  reader_thread.join();
  for (auto& t : workers) t.join();
  st.reader_cpu_seconds = pipe.reader_cpu;
  st.largest_single_document = pipe.largest_doc;
  st.largest_single_document_bytes = pipe.largest_doc_bytes;
  st.workers_cpu_seconds = pipe.workers_cpu;
  st.writer_cpu_seconds = thread_cpu_seconds() - writer_cpu0;
  if (pipe.error || preprocess_cancel_flag().load()) {
    bar.finish();
    shards.remove_incomplete();
    if (pipe.error) std::rethrow_exception(pipe.error);
    throw_error("interrupted; partial outputs removed");
  }
  draw(reader.total_file_bytes(), true);
  bar.finish();

  if (st.documents == 0) {
    shards.remove_incomplete();
    throw_no_documents(st);
  }
  shards.publish(opt.overwrite, st);
  st.seconds = now_seconds() - t0;
  return st;
}

std::string format_preprocess_summary(const PreprocessStats& s) {
  std::string o;
  if (s.outputs.size() == 1) {
    o += fmt::format("wrote {}.bin/.idx ({}, vocabulary {})\n", s.outputs[0], s.dtype, s.vocab_size);
  } else {
    o += fmt::format("wrote {} shards ({}, vocabulary {}):\n", s.outputs.size(), s.dtype, s.vocab_size);
    for (size_t k = 0; k < s.outputs.size(); ++k)
      o += fmt::format("  {}.bin/.idx  {} documents\n", s.outputs[k], s.output_documents[k]);
  }
  uint64_t skipped = 0;
  for (uint64_t c : s.skipped) skipped += c;
  o += fmt::format("documents : {} written, {} records read, {} skipped\n", s.documents, s.records, skipped);
  o += fmt::format("tokens    : {}\n", s.tokens);
  double el = std::max(s.seconds, 1e-9);
  o += fmt::format("input     : {:.2f} MB in {:.2f} s ({:.2f} MB/s); {:.3f} bytes per token\n", s.input_bytes / 1e6,
                   s.seconds, s.input_bytes / 1e6 / el, s.tokens ? double(s.text_bytes) / double(s.tokens) : 0.0);
  if (!s.largest_single_document.empty())
    o += fmt::format(
        "note      : '{}' is one document of {:.1f} MB (plain text is one document per file), encoded by "
        "one worker while the others idled; pass --split-lines for one document per line, or split the file\n",
        s.largest_single_document, s.largest_single_document_bytes / 1e6);
  if (skipped) {
    std::string parts;
    for (int r = 0; r < static_cast<int>(SkipReason::Count); ++r)
      if (s.skipped[r])
        parts += fmt::format("{}{} {}", parts.empty() ? "" : ", ", s.skipped[r], skip_reason_name(SkipReason(r)));
    o += fmt::format("skipped   : {}\n", parts);
    for (const auto& e : s.examples)
      o += fmt::format("  {}:{}: {}{}{}\n", e.file, e.line, skip_reason_name(e.reason), e.detail.empty() ? "" : ": ",
                       e.detail);
  }
  return o;
}

}  // namespace lathe::tok
