// lathe encode / lathe decode: text <-> token ids through a tokenizer (src/tokenizer).
//   lathe encode --tokenizer PATH [--add-special-tokens] [--lines | --nul] [--bench]
//   lathe decode --tokenizer PATH [--skip-special-tokens] [--lines | --nul]
#include <fmt/format.h>

#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <iterator>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "cli/command.h"
#include "core/error.h"
#include "tokenizer/tokenizer.h"

namespace {

struct Opts {
  std::string tokenizer;
  bool special = false, lines = false, nul = false, bench = false;
};

const char* kEncodeHelp =
    "usage: lathe encode --tokenizer PATH [--add-special-tokens] [--lines | --nul] [--bench]\n"
    "Reads text on stdin, prints token ids separated by spaces.\n"
    "  --tokenizer PATH        'byte', a directory (tokenizer.json, encoder.json+vocab.bpe,\n"
    "                          vocab.json+merges.txt, tokenizer.model) or one of those files\n"
    "  --add-special-tokens    apply the post-processor template (BOS/EOS), as HF encode() does\n"
    "  --lines                 encode every input line (without its newline) separately; one line of ids each\n"
    "  --nul                   as --lines with NUL-separated inputs\n"
    "  --bench                 print only throughput (input encoded in ~64 KB chunks split at newlines)\n";
const char* kDecodeHelp =
    "usage: lathe decode --tokenizer PATH [--skip-special-tokens] [--lines | --nul]\n"
    "Reads token ids (whitespace separated) on stdin, writes the text.\n"
    "  --skip-special-tokens   drop special added tokens\n"
    "  --lines                 every input line is one sequence; each output text is followed by a newline\n"
    "  --nul                   as --lines, each output text is followed by a NUL byte\n";

// Usage errors (unknown or incomplete option, missing --tokenizer) print the usage and return 2,
// like the CLI11-parsed commands; --help returns 0. `rc` is set when the command must stop.
std::optional<Opts> parse(int argc, char** argv, bool encode, int& rc) {
  const char* help = encode ? kEncodeHelp : kDecodeHelp;
  const char* name = encode ? "lathe encode" : "lathe decode";
  auto usage_error = [&](const std::string& what) -> std::optional<Opts> {
    std::fprintf(stderr, "%s: usage error: %s\n%s", name, what.c_str(), help);
    rc = 2;
    return std::nullopt;
  };
  Opts o;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      fmt::print("{}", help);
      rc = 0;
      return std::nullopt;
    } else if (a == "--tokenizer" && i + 1 < argc) {
      o.tokenizer = argv[++i];
    } else if (a.rfind("--tokenizer=", 0) == 0) {
      o.tokenizer = a.substr(12);
    } else if (encode && a == "--add-special-tokens") {
      o.special = true;
    } else if (!encode && a == "--skip-special-tokens") {
      o.special = true;
    } else if (a == "--lines") {
      o.lines = true;
    } else if (a == "--nul") {
      o.nul = true;
    } else if (encode && a == "--bench") {
      o.bench = true;
    } else {
      return usage_error(fmt::format("unknown or incomplete argument '{}'", a));
    }
  }
  if (o.tokenizer.empty()) return usage_error("--tokenizer PATH is required");
  if (o.lines && o.nul) return usage_error("--lines and --nul are exclusive");
  return o;
}

std::string read_stdin() {
  std::string s;
  char buf[1 << 16];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), stdin)) > 0) s.append(buf, n);
  return s;
}

void append_ids(std::string& out, const std::vector<int32_t>& ids) {
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i) out += ' ';
    fmt::format_int f(ids[i]);
    out.append(f.data(), f.size());
  }
}

void flush(std::string& out, bool force) {
  if (out.size() > (1 << 20) || force) {
    std::fwrite(out.data(), 1, out.size(), stdout);
    out.clear();
  }
}

int run_encode(int argc, char** argv) {
  int rc = 0;
  const auto parsed = parse(argc, argv, true, rc);
  if (!parsed) return rc;
  const Opts& o = *parsed;
  auto tok = lathe::tok::load_tokenizer(o.tokenizer);
  std::string text = read_stdin();
  std::string out;
  if (o.bench) {
    auto t0 = std::chrono::steady_clock::now();
    size_t tokens = 0, pos = 0;
    while (pos < text.size()) {
      size_t end = std::min(text.size(), pos + (1 << 16));
      size_t nl = text.find('\n', end);
      end = nl == std::string::npos ? text.size() : nl + 1;
      tokens += tok->encode(std::string_view(text).substr(pos, end - pos), o.special).size();
      pos = end;
    }
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    fmt::print("bytes {} tokens {} seconds {:.3f} MB/s {:.2f}\n", text.size(), tokens, s, text.size() / 1e6 / s);
    return 0;
  }
  if (o.lines || o.nul) {
    char sep = o.nul ? '\0' : '\n';
    size_t pos = 0;
    while (pos < text.size()) {
      size_t e = text.find(sep, pos);
      if (e == std::string::npos) e = text.size();
      append_ids(out, tok->encode(std::string_view(text).substr(pos, e - pos), o.special));
      out += '\n';
      flush(out, false);
      pos = e + 1;
    }
  } else {
    append_ids(out, tok->encode(text, o.special));
    out += '\n';
  }
  flush(out, true);
  return 0;
}

std::vector<int32_t> parse_ids(std::string_view s, size_t line) {
  std::vector<int32_t> ids;
  size_t i = 0;
  while (i < s.size()) {
    while (i < s.size() && std::isspace(static_cast<unsigned char>(s[i]))) ++i;
    if (i >= s.size()) break;
    size_t j = i;
    if (s[j] == '-') ++j;
    while (j < s.size() && std::isdigit(static_cast<unsigned char>(s[j]))) ++j;
    const std::string tok(s.substr(i, std::min<size_t>(j - i, 40)));
    LATHE_CHECK(j > i && (j == s.size() || std::isspace(static_cast<unsigned char>(s[j]))),
                "stdin line {}: '{}' is not a token id (expected integers separated by spaces)", line,
                std::string(s.substr(i, std::min<size_t>(20, s.size() - i))));
    // from_chars into int64 and an explicit range check: std::stol threw std::out_of_range for
    // 20 digits and the int32 cast wrapped 4294967296 to id 0 silently.
    int64_t v = 0;
    const auto [end, ec] = std::from_chars(s.data() + i, s.data() + j, v);
    LATHE_CHECK(ec == std::errc() && end == s.data() + j && v >= 0 && v <= std::numeric_limits<int32_t>::max(),
                "stdin line {}: token id '{}' is out of range (ids are 0 .. {})", line, tok,
                std::numeric_limits<int32_t>::max());
    ids.push_back(static_cast<int32_t>(v));
    i = j;
  }
  return ids;
}

int run_decode(int argc, char** argv) {
  int rc = 0;
  const auto parsed = parse(argc, argv, false, rc);
  if (!parsed) return rc;
  const Opts& o = *parsed;
  auto tok = lathe::tok::load_tokenizer(o.tokenizer);
  std::string text = read_stdin();
  std::string out;
  if (o.lines || o.nul) {
    size_t pos = 0, line = 1;
    while (pos < text.size()) {
      size_t e = text.find('\n', pos);
      if (e == std::string::npos) e = text.size();
      auto ids = parse_ids(std::string_view(text).substr(pos, e - pos), line++);
      out += tok->decode(ids, o.special);
      out += o.nul ? '\0' : '\n';
      flush(out, false);
      pos = e + 1;
    }
  } else {
    out = tok->decode(parse_ids(text, 1), o.special);
  }
  flush(out, true);
  return 0;
}

lathe::cli::Registrar reg_encode("encode", "text on stdin -> token ids", run_encode);
lathe::cli::Registrar reg_decode("decode", "token ids on stdin -> text", run_decode);

}  // namespace
