// Reading training / preprocessing corpora: plain text and JSONL files, optionally gzip (.gz,
// zlib) or zstd (.zst, libzstd) compressed, named directly or by glob patterns.
//
//   auto files = expand_input_patterns({"data/*.jsonl.zst", "extra.txt"});
//   RecordReader rr(files, {.format = InputFormat::Auto, .split_lines = false});
//   RawRecord rec;
//   while (rr.next(rec)) { ... rec.data is a JSON line, a text line or a whole text file ... }
//
// Format rule (InputFormat::Auto): after removing a .gz/.zst suffix, names ending in .jsonl,
// .ndjson or .json are JSONL (one JSON object per line); everything else is plain text.
// JSON parsing is NOT done here: the record reader only splits bytes into records so that the
// (expensive) parsing runs on the worker threads of the preprocessing pipeline.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace lathe::tok {

enum class Compression { None, Gzip, Zstd };
enum class InputFormat { Auto, Text, Jsonl };

InputFormat parse_input_format(std::string_view name);  // "auto" | "text" | "jsonl"

// Each pattern is a file name or a glob(3) pattern (*, ?, [..]). A pattern matching nothing is an
// error naming it. Matches of one pattern are sorted; patterns keep their order. Directories
// are rejected (name the files inside them).
std::vector<std::string> expand_input_patterns(const std::vector<std::string>& patterns);

// By suffix (.gz / .zst); the file's magic bytes are checked so a mislabelled file fails clearly.
Compression detect_compression(const std::string& path);
// Resolves InputFormat::Auto by the suffix rule above.
InputFormat detect_format(const std::string& path, InputFormat requested);

// Decompressed bytes of one file.
class ByteSource {
 public:
  virtual ~ByteSource() = default;
  // Up to n bytes; 0 at end of file. Throws lathe::Error (naming the file) on I/O or format errors.
  virtual size_t read(char* buf, size_t n) = 0;
  // Bytes of the file on disk consumed so far (compressed bytes for .gz/.zst): drives ETAs.
  virtual uint64_t raw_position() const = 0;
};
std::unique_ptr<ByteSource> open_byte_source(const std::string& path);

// Lines of a ByteSource, each with its trailing '\n' (the last line may lack one).
class LineReader {
 public:
  explicit LineReader(std::unique_ptr<ByteSource> src);
  bool next(std::string& line);
  uint64_t raw_position() const { return src_->raw_position(); }

 private:
  std::unique_ptr<ByteSource> src_;
  std::string buf_;
  size_t pos_ = 0;
  bool eof_ = false;
};

// One unit of input before parsing: a JSONL line (without '\n'), a text line (--split-lines,
// without '\n' / "\r\n") or a whole text file. `line` is 1-based (0 for a whole file).
struct RawRecord {
  std::string data;
  uint32_t file_index = 0;
  uint64_t line = 0;
  bool is_json = false;
};

class RecordReader {
 public:
  struct Options {
    InputFormat format = InputFormat::Auto;
    bool split_lines = false;  // plain text: one document per line instead of per file
  };
  RecordReader(std::vector<std::string> files, Options opt);
  ~RecordReader();
  bool next(RawRecord& rec);
  const std::vector<std::string>& files() const { return files_; }
  uint64_t total_file_bytes() const { return total_bytes_; }
  // On-disk bytes consumed so far over all files.
  uint64_t raw_bytes_read() const;

 private:
  bool open_next_file();
  std::vector<std::string> files_;
  Options opt_;
  uint64_t total_bytes_ = 0, done_bytes_ = 0;
  size_t next_file_ = 0;
  std::unique_ptr<LineReader> lines_;
  bool cur_json_ = false, whole_file_ = false, file_done_ = false;
  uint64_t cur_line_ = 0;
  uint32_t cur_index_ = 0;
};

// Why a document was not written. Order = column order in summaries.
enum class SkipReason : int { Empty = 0, InvalidJson, MissingKey, NotString, InvalidUtf8, Count };
const char* skip_reason_name(SkipReason r);

// Extracts obj[key] from one JSONL line. On failure returns false with `why` set and `detail`
// carrying the parser message (for InvalidJson).
bool extract_json_text(std::string_view line, const std::string& key, std::string& out,
                       SkipReason& why, std::string& detail);

bool is_valid_utf8(std::string_view s);

// "512MB" (10^6), "512MiB" (2^20), "1G", "1GiB", "4096" (bytes), "64K". Throws naming `what`.
uint64_t parse_byte_size(std::string_view s, std::string_view what);

// A one-line progress display on stderr: redrawn in place on a terminal, else one line every
// `plain_interval` seconds so logs stay readable.
class ProgressLine {
 public:
  explicit ProgressLine(bool enabled, double plain_interval = 10.0);
  // Redraws if enough time passed (or force). `line` is the full text without '\n'.
  bool due(bool force = false);
  void show(const std::string& line);
  void finish();  // ends the in-place line with '\n' if something was drawn

 private:
  bool enabled_, tty_, drawn_ = false;
  double interval_, last_ = -1e30;
  size_t last_len_ = 0;
};

// "1:02:03" / "4:05"
std::string format_duration(double seconds);
// "12.3M" style counts
std::string format_count(double v);

}  // namespace lathe::tok
