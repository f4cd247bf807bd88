#include "tokenizer/corpus.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <glob.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>
#include <zstd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/timer.h"
#include "io/fs.h"
#include "io/json.h"
#include "tokenizer/json_scan.h"

namespace lathe::tok {

using io::json_nesting_depth;

InputFormat parse_input_format(std::string_view name) {
  if (name == "auto") return InputFormat::Auto;
  if (name == "text" || name == "txt") return InputFormat::Text;
  if (name == "jsonl" || name == "json") return InputFormat::Jsonl;
  throw_error("--format '{}': unknown input format; use auto, text or jsonl", name);
}

static bool ends_with(std::string_view s, std::string_view suf) {
  return s.size() >= suf.size() && s.substr(s.size() - suf.size()) == suf;
}

static bool is_regular_file(const std::string& p, uint64_t* size = nullptr) {
  struct stat st;
  if (::stat(p.c_str(), &st) != 0) return false;
  if (size) *size = static_cast<uint64_t>(st.st_size);
  return S_ISREG(st.st_mode);
}

std::vector<std::string> expand_input_patterns(const std::vector<std::string>& patterns) {
  std::vector<std::string> out;
  for (const auto& pat : patterns) {
    bool has_glob = pat.find_first_of("*?[") != std::string::npos;
    if (!has_glob) {
      struct stat st;
      LATHE_CHECK(::stat(pat.c_str(), &st) == 0, "input '{}': {} (check the path)", pat, std::strerror(errno));
      if (S_ISDIR(st.st_mode)) throw_error("input '{}' is a directory (pass the files, e.g. '{}/*.jsonl')", pat, pat);
      LATHE_CHECK(S_ISREG(st.st_mode), "input '{}' is {}, not a regular file; pass regular files", pat,
                  io::file_kind(st.st_mode));
      out.push_back(pat);
      continue;
    }
    glob_t g{};
    int rc = ::glob(pat.c_str(), GLOB_ERR, nullptr, &g);
    if (rc == GLOB_NOMATCH) {
      ::globfree(&g);
      throw_error("input pattern '{}' matches no file", pat);
    }
    if (rc != 0) {
      ::globfree(&g);
      throw_error("input pattern '{}': glob failed (code {})", pat, rc);
    }
    std::vector<std::string> m;
    for (size_t i = 0; i < g.gl_pathc; ++i)
      if (is_regular_file(g.gl_pathv[i])) m.emplace_back(g.gl_pathv[i]);
    ::globfree(&g);
    LATHE_CHECK(!m.empty(), "input pattern '{}' matches no regular file", pat);
    std::sort(m.begin(), m.end());
    out.insert(out.end(), m.begin(), m.end());
  }
  return out;
}

static std::string read_magic(const std::string& path, size_t n) {
  std::string m(n, '\0');
  const int fd = io::open_input(path);  // regular files only: a FIFO would block here
  size_t got = 0;
  while (got < n) {
    const ssize_t r = ::read(fd, m.data() + got, n - got);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) break;
    got += static_cast<size_t>(r);
  }
  ::close(fd);
  m.resize(got);
  return m;
}

Compression detect_compression(const std::string& path) {
  if (ends_with(path, ".gz") || ends_with(path, ".gzip")) {
    std::string m = read_magic(path, 2);
    LATHE_CHECK(m.size() == 0 || m == "\x1f\x8b", "input '{}' is named .gz but is not gzip data (rename it)", path);
    return Compression::Gzip;
  }
  if (ends_with(path, ".zst") || ends_with(path, ".zstd")) {
    std::string m = read_magic(path, 4);
    LATHE_CHECK(m.size() == 0 || m == std::string("\x28\xb5\x2f\xfd", 4),
                "input '{}' is named .zst but is not zstd data (rename it)", path);
    return Compression::Zstd;
  }
  return Compression::None;
}

InputFormat detect_format(const std::string& path, InputFormat requested) {
  if (requested != InputFormat::Auto) return requested;
  std::string_view p = path;
  for (std::string_view suf : {".gz", ".gzip", ".zst", ".zstd"})
    if (ends_with(p, suf)) {
      p.remove_suffix(suf.size());
      break;
    }
  if (ends_with(p, ".jsonl") || ends_with(p, ".ndjson") || ends_with(p, ".json")) return InputFormat::Jsonl;
  return InputFormat::Text;
}

namespace {

class PlainSource : public ByteSource {
 public:
  explicit PlainSource(const std::string& path) : path_(path) {
    fd_ = io::open_input(path);  // regular files only; FIFOs, directories, symlink loops named
#ifdef POSIX_FADV_SEQUENTIAL
    ::posix_fadvise(fd_, 0, 0, POSIX_FADV_SEQUENTIAL);
#endif
  }
  ~PlainSource() override { ::close(fd_); }
  size_t read(char* buf, size_t n) override {
    for (;;) {
      ssize_t r = ::read(fd_, buf, n);
      if (r >= 0) {
        pos_ += static_cast<uint64_t>(r);
        return static_cast<size_t>(r);
      }
      if (errno != EINTR) throw_error("input '{}': read failed: {}", path_, std::strerror(errno));
    }
  }
  uint64_t raw_position() const override { return pos_; }

 private:
  std::string path_;
  int fd_ = -1;
  uint64_t pos_ = 0;
};

// gzip through zlib's inflate rather than gzread: gzread reports a stream cut short only through
// gzerror() after returning end-of-file (a file cut in half "tokenized successfully" with part of
// its documents) and silently ignores bytes after the last member. Here a stream that ends inside
// a member, a corrupt member (bad CRC or length, invalid deflate data) and trailing bytes that are
// not another gzip member are all errors naming the file and the compressed byte offset.
// Concatenated members (gzip a b > c; pigz) are one stream, as gzip -d reads them.
class GzipSource : public ByteSource {
 public:
  explicit GzipSource(const std::string& path) : path_(path), file_(path) {
    std::memset(&zs_, 0, sizeof(zs_));
    LATHE_CHECK(::inflateInit2(&zs_, 15 + 16) == Z_OK, "input '{}': zlib inflateInit2 failed", path);  // 16: gzip
    in_buf_.resize(1 << 20);
  }
  ~GzipSource() override { ::inflateEnd(&zs_); }
  size_t read(char* buf, size_t n) override {
    zs_.next_out = reinterpret_cast<Bytef*>(buf);
    zs_.avail_out = static_cast<uInt>(std::min<size_t>(n, 1u << 30));
    const uInt want = zs_.avail_out;
    while (zs_.avail_out > 0) {
      if (zs_.avail_in == 0 && !eof_) {
        const size_t got = file_.read(in_buf_.data(), in_buf_.size());
        if (got == 0) eof_ = true;
        zs_.next_in = reinterpret_cast<Bytef*>(in_buf_.data());
        zs_.avail_in = static_cast<uInt>(got);
      }
      if (zs_.avail_in == 0) {  // end of the file
        if (in_member_)
          throw_error(
              "input '{}': truncated gzip stream: the file ends inside compressed member {} after {} bytes read "
              "({} bytes decompressed); the file was cut short: re-download or re-compress it",
              path_, members_, file_.raw_position(), decompressed_ + (want - zs_.avail_out));
        break;
      }
      if (!in_member_) {  // a new member starts here (the first, or one after a complete member)
        if (members_ > 0) LATHE_CHECK(::inflateReset(&zs_) == Z_OK, "input '{}': zlib inflateReset failed", path_);
        in_member_ = true;
        member_out_ = zs_.total_out;
        member_start_ = file_.raw_position() - zs_.avail_in;
        ++members_;
      }
      const int ret = ::inflate(&zs_, Z_NO_FLUSH);
      if (ret == Z_STREAM_END) {
        in_member_ = false;
      } else if (ret != Z_OK && ret != Z_BUF_ERROR) {
        const uint64_t at = file_.raw_position() - zs_.avail_in;
        if (members_ > 1 && zs_.total_out == member_out_ && ret == Z_DATA_ERROR)
          throw_error(
              "input '{}': the bytes after the end of the gzip stream (from byte {}) are not a gzip member: "
              "trailing garbage, the file is corrupt",
              path_, member_start_);
        throw_error("input '{}': gzip decompression failed near compressed byte {}: {} (the file is corrupt)", path_,
                    at, zs_.msg ? zs_.msg : (ret == Z_MEM_ERROR ? "out of memory" : "zlib error"));
      }
    }
    const size_t produced = want - zs_.avail_out;
    decompressed_ += produced;
    return produced;
  }
  uint64_t raw_position() const override { return file_.raw_position(); }

 private:
  std::string path_;
  PlainSource file_;
  z_stream zs_;
  std::vector<char> in_buf_;
  bool eof_ = false, in_member_ = false;
  uint64_t members_ = 0, member_out_ = 0, member_start_ = 0, decompressed_ = 0;
};

class ZstdSource : public ByteSource {
 public:
  explicit ZstdSource(const std::string& path) : path_(path), file_(path) {
    dctx_ = ZSTD_createDCtx();
    LATHE_CHECK(dctx_, "input '{}': ZSTD_createDCtx failed", path);
    in_buf_.resize(ZSTD_DStreamInSize());
  }
  ~ZstdSource() override { ZSTD_freeDCtx(dctx_); }
  size_t read(char* buf, size_t n) override {
    if (n == 0) return 0;
    ZSTD_outBuffer out{buf, n, 0};
    while (out.pos == 0) {
      // When the last call filled the output, the decoder may still hold decoded bytes: call it
      // again before reading more input (or deciding that the stream ended).
      if (in_.pos == in_.size && !output_was_full_) {
        size_t got = file_.read(in_buf_.data(), in_buf_.size());
        if (got == 0) {
          LATHE_CHECK(last_ret_ == 0,
                      "input '{}': truncated zstd stream: the file ends inside a frame after {} bytes read ({} bytes "
                      "decompressed); the file was cut short: re-download or re-compress it",
                      path_, file_.raw_position(), decompressed_);
          return 0;
        }
        in_ = ZSTD_inBuffer{in_buf_.data(), got, 0};
      }
      size_t ret = ZSTD_decompressStream(dctx_, &out, &in_);
      LATHE_CHECK(!ZSTD_isError(ret),
                  "input '{}': zstd decompression failed near compressed byte {}: {} (the file is "
                  "corrupt)",
                  path_, file_.raw_position() - (in_.size - in_.pos), ZSTD_getErrorName(ret));
      last_ret_ = ret;
      output_was_full_ = out.pos == out.size;
    }
    decompressed_ += out.pos;
    return out.pos;
  }
  uint64_t raw_position() const override { return file_.raw_position(); }

 private:
  std::string path_;
  PlainSource file_;
  ZSTD_DCtx* dctx_ = nullptr;
  std::vector<char> in_buf_;
  ZSTD_inBuffer in_{nullptr, 0, 0};
  size_t last_ret_ = 0;
  bool output_was_full_ = false;
  uint64_t decompressed_ = 0;
};

}  // namespace

std::unique_ptr<ByteSource> open_byte_source(const std::string& path) {
  switch (detect_compression(path)) {
    case Compression::Gzip:
      return std::make_unique<GzipSource>(path);
    case Compression::Zstd:
      return std::make_unique<ZstdSource>(path);
    case Compression::None:
      break;
  }
  return std::make_unique<PlainSource>(path);
}

LineReader::LineReader(std::unique_ptr<ByteSource> src) : src_(std::move(src)) {}

bool LineReader::next(std::string& line) {
  constexpr size_t kChunk = 1 << 20;
  line.clear();
  for (;;) {
    size_t nl = buf_.find('\n', pos_);
    if (nl != std::string::npos) {
      line.append(buf_, pos_, nl + 1 - pos_);
      pos_ = nl + 1;
      return true;
    }
    line.append(buf_, pos_, std::string::npos);
    buf_.clear();
    pos_ = 0;
    if (eof_) return !line.empty();
    buf_.resize(kChunk);
    size_t got = src_->read(buf_.data(), kChunk);
    buf_.resize(got);
    if (got == 0) eof_ = true;
  }
}

RecordReader::RecordReader(std::vector<std::string> files, Options opt) : files_(std::move(files)), opt_(opt) {
  for (auto& f : files_) {
    uint64_t sz = 0;
    LATHE_CHECK(is_regular_file(f, &sz), "input '{}' is not a readable regular file", f);
    total_bytes_ += sz;
  }
}

RecordReader::~RecordReader() = default;

uint64_t RecordReader::raw_bytes_read() const { return done_bytes_ + (src_ ? src_->raw_position() : 0); }

void RecordReader::close_file() {
  if (!src_) return;
  uint64_t sz = 0;
  is_regular_file(files_[cur_index_], &sz);
  done_bytes_ += sz;
  src_.reset();
}

bool RecordReader::open_next_file() {
  close_file();
  if (next_file_ >= files_.size()) return false;
  cur_index_ = static_cast<uint32_t>(next_file_++);
  const std::string& path = files_[cur_index_];
  cur_json_ = detect_format(path, opt_.format) == InputFormat::Jsonl;
  whole_file_ = !cur_json_ && !opt_.split_lines;
  next_line_ = 1;
  carry_.clear();
  src_ = open_byte_source(path);
  return true;
}

bool RecordReader::next_chunk(InputChunk& c, size_t target) {
  target = std::max<size_t>(target, 1);
  const size_t block = std::clamp<size_t>(target, 4096, 1 << 20);  // read() size
  for (;;) {
    if (!src_ && !open_next_file()) return false;
    c.file_index = cur_index_;
    c.is_json = cur_json_;
    c.lines = !whole_file_;
    c.first_line = whole_file_ ? 0 : next_line_;
    c.data.assign(carry_);  // keeps the capacity of a recycled c.data
    carry_.clear();
    bool eof = false;
    size_t scanned = 0;  // bytes of c.data already known to hold no '\n'
    size_t cut = std::string::npos;
    for (;;) {
      if (!whole_file_ && c.data.size() >= target) {
        // Only the bytes read since the last look (a very long line must not be rescanned).
        const void* nl = ::memrchr(c.data.data() + scanned, '\n', c.data.size() - scanned);
        if (nl) {
          cut = static_cast<size_t>(static_cast<const char*>(nl) - c.data.data()) + 1;
          break;
        }
        scanned = c.data.size();
      }
      const size_t have = c.data.size();
      c.data.resize(have + block);
      const size_t got = src_->read(c.data.data() + have, block);
      c.data.resize(have + got);
      if (got == 0) {
        eof = true;
        break;
      }
    }
    if (cut != std::string::npos) {
      carry_.assign(c.data, cut, std::string::npos);
      c.data.resize(cut);
    }
    if (eof) close_file();
    if (c.data.empty() && whole_file_) return true;  // an empty file is an (empty) document
    if (c.data.empty()) continue;
    if (!whole_file_) next_line_ += static_cast<uint64_t>(std::count(c.data.begin(), c.data.end(), '\n'));
    return true;
  }
}

const char* skip_reason_name(SkipReason r) {
  switch (r) {
    case SkipReason::Empty:
      return "empty";
    case SkipReason::InvalidJson:
      return "invalid JSON";
    case SkipReason::MissingKey:
      return "missing text key";
    case SkipReason::NotString:
      return "text value is not a string";
    case SkipReason::InvalidUtf8:
      return "invalid UTF-8";
    case SkipReason::Count:
      break;
  }
  return "?";
}

namespace {
// nlohmann's messages quote the whole last token ("last read: ..."), which can be the whole line.
std::string bounded_detail(std::string m) {
  if (m.size() > 300) m = m.substr(0, 200) + " ... " + m.substr(m.size() - 80);
  return m;
}
}  // namespace

bool extract_json_text(std::string_view line, const std::string& key, std::string& out, SkipReason& why,
                       std::string& detail) {
  if (fast_extract_json_string(line, key, out)) return true;
  // The fast scanner gives up beyond kMaxJsonLineDepth levels; nlohmann would build the whole DOM
  // of a line of megabytes of '[' (1.5 GB for 20 MB, per worker) before failing, so such a line is
  // refused by the depth scan first.
  if (json_nesting_depth(line, kMaxJsonLineDepth) > kMaxJsonLineDepth) {
    why = SkipReason::InvalidJson;
    detail = fmt::format("JSON nests deeper than {} levels", kMaxJsonLineDepth);
    return false;
  }
  nlohmann::json j = nlohmann::json::parse(line.begin(), line.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) {
    why = SkipReason::InvalidJson;
    // Re-parse with exceptions only on the (rare) failure path to get the parser's message.
    try {
      auto again = nlohmann::json::parse(line.begin(), line.end());
      (void)again;
    } catch (const std::exception& e) {
      detail = bounded_detail(e.what());
    }
    return false;
  }
  if (!j.is_object()) {
    why = SkipReason::InvalidJson;
    detail = fmt::format("line is a JSON {}, expected an object", j.type_name());
    return false;
  }
  auto it = j.find(key);
  if (it == j.end()) {
    why = SkipReason::MissingKey;
    detail = fmt::format("no key \"{}\" (set --text-key)", key);
    return false;
  }
  if (!it->is_string()) {
    why = SkipReason::NotString;
    detail = fmt::format("\"{}\" is a JSON {}", key, it->type_name());
    return false;
  }
  out = std::move(it->get_ref<std::string&>());
  return true;
}

uint64_t parse_byte_size(std::string_view s, std::string_view what) {
  size_t i = 0;
  while (i < s.size() && (std::isdigit(static_cast<unsigned char>(s[i])) || s[i] == '.')) ++i;
  // strtod must consume the whole number: "1.2.3MB" or "." are errors, not 1.2 or an exception
  // escaping from std::stod.
  const std::string num(s.substr(0, i));
  char* num_end = nullptr;
  const double v = i > 0 ? std::strtod(num.c_str(), &num_end) : 0.0;
  LATHE_CHECK(i > 0 && num_end == num.c_str() + num.size(), "{} '{}': expected a size like 512MB, 1GiB or 4096", what,
              s);
  std::string unit(s.substr(i));
  for (auto& c : unit) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  double mult;
  if (unit.empty() || unit == "B")
    mult = 1;
  else if (unit == "K" || unit == "KB")
    mult = 1e3;
  else if (unit == "KIB")
    mult = 1024.0;
  else if (unit == "M" || unit == "MB")
    mult = 1e6;
  else if (unit == "MIB")
    mult = 1024.0 * 1024;
  else if (unit == "G" || unit == "GB")
    mult = 1e9;
  else if (unit == "GIB")
    mult = 1024.0 * 1024 * 1024;
  else if (unit == "T" || unit == "TB")
    mult = 1e12;
  else if (unit == "TIB")
    mult = 1024.0 * 1024 * 1024 * 1024;
  else
    throw_error("{} '{}': unknown unit '{}' (use B, KB, MB, GB, KiB, MiB, GiB)", what, s, s.substr(i));
  double bytes = v * mult;
  LATHE_CHECK(bytes >= 1, "{} '{}' must be at least 1 byte", what, s);
  // Converting a double beyond 2^64 to uint64_t is undefined; 1 PB is far beyond any shard.
  LATHE_CHECK(bytes <= 1e15, "{} '{}' is larger than 1 PB", what, s);
  return static_cast<uint64_t>(bytes);
}

}  // namespace lathe::tok
