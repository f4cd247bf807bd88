// Reading training / preprocessing corpora: plain text and JSONL files, optionally gzip (.gz,
// zlib) or zstd (.zst, libzstd) compressed, named directly or by glob patterns.
//
//   auto files = expand_input_patterns({"data/*.jsonl.zst", "extra.txt"});
//   RecordReader rr(files, {.format = InputFormat::Auto, .split_lines = false});
//   InputChunk c;
//   while (rr.next_chunk(c, 1 << 20)) { ... lines of a JSONL / text file, or a whole text file ... }
//
// Format rule (InputFormat::Auto): after removing a .gz/.zst suffix, names ending in .jsonl,
// .ndjson or .json are JSONL (one JSON object per line); everything else is plain text.
// JSON parsing is NOT done here: the record reader only splits bytes into records so that the
// (expensive) parsing runs on the worker threads of the preprocessing pipeline.
#pragma once
#include "core/progress.h"
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/utf8.h"  // is_valid_utf8

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

// Input for the preprocessing pipeline, in chunks that the worker threads split further:
//  - line-based files (JSONL, or plain text with split_lines): about `target` bytes of whole
//    lines (a line is never cut; a line longer than `target` makes a larger chunk). Records are
//    the lines of `data` (for_each_line); `first_line` is the 1-based number of the first one.
//  - plain text, one document per file: one whole file per chunk (`lines` false, first_line 0).
// Reading in large chunks keeps the reader thread at a few percent of one core: splitting lines
// and copying them one by one cost a tenth of the encoding work on one-line documents.
struct InputChunk {
  std::string data;
  uint32_t file_index = 0;
  uint64_t first_line = 0;
  bool lines = false;
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
  bool next_chunk(InputChunk& chunk, size_t target);
  const std::vector<std::string>& files() const { return files_; }
  uint64_t total_file_bytes() const { return total_bytes_; }
  // On-disk bytes consumed so far over all files.
  uint64_t raw_bytes_read() const;

 private:
  bool open_next_file();
  void close_file();
  std::vector<std::string> files_;
  Options opt_;
  uint64_t total_bytes_ = 0, done_bytes_ = 0;
  size_t next_file_ = 0;
  std::unique_ptr<ByteSource> src_;
  std::string carry_;  // start of a line whose end has not been read yet
  bool cur_json_ = false, whole_file_ = false;
  uint64_t next_line_ = 1;
  uint32_t cur_index_ = 0;
};

// The records of a line chunk: f(line, line_number) for each line, without its "\n" and then
// without one trailing "\r". An empty line is a record; the empty rest after a final "\n" is not.
template <typename F>
void for_each_line(const InputChunk& c, F&& f) {
  const char* p = c.data.data();
  const char* end = p + c.data.size();
  uint64_t line = c.first_line;
  while (p < end) {
    const char* nl = static_cast<const char*>(std::memchr(p, '\n', static_cast<size_t>(end - p)));
    const char* stop = nl ? nl : end;
    size_t len = static_cast<size_t>(stop - p);
    if (len && p[len - 1] == '\r') --len;
    f(std::string_view(p, len), line++);
    p = nl ? nl + 1 : end;
  }
}

// Why a document was not written. Order = column order in summaries.
enum class SkipReason : int { Empty = 0, InvalidJson, MissingKey, NotString, InvalidUtf8, Count };
const char* skip_reason_name(SkipReason r);

// Extracts obj[key] from one JSONL line. On failure returns false with `why` set and `detail`
// carrying the parser message (for InvalidJson). A line nesting deeper than kMaxJsonLineDepth is
// InvalidJson without being parsed (the fast scanner's own limit; no corpus line comes close).
constexpr int kMaxJsonLineDepth = 512;
bool extract_json_text(std::string_view line, const std::string& key, std::string& out, SkipReason& why,
                       std::string& detail);

// "512MB" (10^6), "512MiB" (2^20), "1G", "1GiB", "4096" (bytes), "64K". Throws naming `what`.
uint64_t parse_byte_size(std::string_view s, std::string_view what);

// Progress display and formatting: the shared utility (src/core/progress.h).
using ProgressLine = lathe::progress::Line;
using lathe::progress::format_count;
using lathe::progress::format_duration;

}  // namespace lathe::tok
