// Pipeline stages of an HF tokenizer.json (normalizers, pre-tokenizers, decoders, added-token
// matcher), each built from its JSON object. Semantics follow huggingface/tokenizers 0.20
// (see shared/reference/hf-tokenizer-json.md); unsupported component types fail at load with the
// type name, never silently.
#pragma once
#include <cstdint>
#include <deque>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "tokenizer/regex.h"

namespace lathe::tok {

// ---- typed access to untrusted JSON ------------------------------------------------------
// tokenizer.json is untrusted input: every field is read through these, so a wrong type is a
// lathe::Error naming the file and the JSON path of the field ("tokenizer.json: model.vocab["x"]
// must be an integer, got a string"), never an nlohmann type_error; quoted values are bounded
// excerpts. `file` is the path for messages, `path` the JSON path of the field ("" = top level).
namespace json_field {
// path + "." + key (just key at the top level).
std::string join(const std::string& path, std::string_view key);
// path + "[i]".
std::string index(const std::string& path, size_t i);
// path + "[\"key\"]" with the key quoted as a bounded JSON excerpt.
std::string member(const std::string& path, std::string_view key);
// The field, or nullptr when `obj` has no such key or it is null.
const nlohmann::json* find(const nlohmann::json& obj, std::string_view key);
// Throws "FILE: PATH must be WHAT, got TYPE (EXCERPT)".
[[noreturn]] void type_error(const std::string& file, const std::string& path, const char* what,
                             const nlohmann::json& got);
void require_object(const nlohmann::json& v, const std::string& file, const std::string& path);
const nlohmann::json& object(const nlohmann::json& obj, std::string_view key, const std::string& file,
                             const std::string& path);
const nlohmann::json& array(const nlohmann::json& obj, std::string_view key, const std::string& file,
                            const std::string& path);
std::string string(const nlohmann::json& obj, std::string_view key, const std::string& file, const std::string& path);
std::optional<std::string> opt_string(const nlohmann::json& obj, std::string_view key, const std::string& file,
                                      const std::string& path);
bool opt_bool(const nlohmann::json& obj, std::string_view key, bool dflt, const std::string& file,
              const std::string& path);
// An integer in [lo, hi]; absent or null -> dflt.
int64_t opt_int(const nlohmann::json& obj, std::string_view key, int64_t dflt, int64_t lo, int64_t hi,
                const std::string& file, const std::string& path);
// `v` (at `path`) as an integer in [0, limit): the rule for every token id read from a file.
int32_t token_id(const nlohmann::json& v, int64_t limit, const std::string& file, const std::string& path);
// A string quoted for a message, cut to a bounded excerpt.
std::string quote(std::string_view s);
}  // namespace json_field

// ---- growth budget -----------------------------------------------------------------------
// Normalizers and decoders that insert text (Replace, Prepend) can be chained so that the text
// grows geometrically (30 Replace "a" -> "aa" would need 2^30 times the input). Rule: the output
// of a normalizer chain (or a decoder chain) may be at most kMaxGrowth times its input plus
// kGrowthSlack bytes; every stage that can grow the text computes its output size first and
// throws (naming the stage) instead of allocating more. Real tokenizers stay far below it
// (Llama's Replace " " -> "\u2581" triples a text of spaces at most).
struct GrowthBudget {
  static constexpr size_t kMaxGrowth = 64;
  static constexpr size_t kGrowthSlack = 1 << 20;
  size_t input = 0, limit = 0;
  explicit GrowthBudget(size_t input_bytes);
  // Throws "WHERE: ... would grow the text to N bytes ..." when n > limit.
  void check(size_t n, const std::string& where, const char* kind) const;
};

// ---- normalizers -------------------------------------------------------------------------
class Normalizer {
 public:
  virtual ~Normalizer() = default;
  // Normalizes s; throws lathe::Error when the chain would exceed its GrowthBudget.
  void apply(std::string& s) const {
    GrowthBudget b(s.size());
    run(s, b);
  }
  virtual void run(std::string& s, const GrowthBudget& budget) const = 0;
};
// `file` names the tokenizer file in messages, `path` the JSON path of this component.
std::unique_ptr<Normalizer> make_normalizer(const nlohmann::json& j, const std::string& file,
                                            const std::string& path = "normalizer");

// ---- pre-tokenizers ----------------------------------------------------------------------
// A piece of (normalized) text; `origin` is true when it starts at offset 0 of the input
// (Metaspace prepend_scheme "first").
struct Piece {
  std::string_view s;
  bool origin;
};
struct PieceBuf {
  std::vector<Piece> pieces, tmp;
  std::deque<std::string> owned;  // storage for modified pieces (deque: stable references)
  std::vector<std::pair<size_t, size_t>> matches;
  void clear() {
    pieces.clear();
    owned.clear();
  }
};

class PreTokenizer {
 public:
  virtual ~PreTokenizer() = default;
  // Rewrites buf.pieces in place.
  virtual void apply(PieceBuf& buf) const = 0;
  // True for ByteLevel: pieces are raw bytes for a byte-level model (must be the last stage).
  virtual bool is_byte_level() const { return false; }
  // Long text in bounded windows: sets buf.pieces to the pieces of s[pos, end) exactly as
  // applying this pre-tokenizer to all of s (one piece, `origin` as given) would produce them,
  // and returns end, a cut no piece crosses and nothing merges across, with
  // end >= min(pos + min_len, s.size()). pos is 0 or an end returned before. Returns 0 when this
  // pre-tokenizer cannot cut (the caller applies it to the whole text instead).
  virtual size_t apply_window(std::string_view s, size_t pos, size_t min_len, bool origin, PieceBuf& buf) const {
    (void)s, (void)pos, (void)min_len, (void)origin, (void)buf;
    return 0;
  }
};
std::unique_ptr<PreTokenizer> make_pre_tokenizer(const nlohmann::json& j, const std::string& file, bool* byte_level,
                                                 const std::string& path = "pre_tokenizer");

// ---- decoders ----------------------------------------------------------------------------
class Decoder {
 public:
  virtual ~Decoder() = default;
  // Decodes tokens in place; throws lathe::Error when the chain would exceed its GrowthBudget.
  void apply(std::vector<std::string>& tokens) const {
    size_t n = 0;
    for (const std::string& t : tokens) n += t.size();
    GrowthBudget b(n);
    run(tokens, b);
  }
  virtual void run(std::vector<std::string>& tokens, const GrowthBudget& budget) const = 0;
};
std::unique_ptr<Decoder> make_decoder(const nlohmann::json& j, const std::string& file,
                                      const std::string& path = "decoder");

// ---- added tokens ------------------------------------------------------------------------
struct AddedToken {
  int32_t id;
  std::string content;
  bool special = false, lstrip = false, rstrip = false, normalized = false, single_word = false;
};

// Leftmost-longest matcher over a set of added tokens (a byte trie; HF uses Aho-Corasick with
// the same leftmost-longest semantics), applying lstrip/rstrip/single_word.
class AddedTokenMatcher {
 public:
  void add(const std::string& pattern, const AddedToken* tok);
  bool empty() const { return nodes_.size() <= 1; }
  struct Match {
    size_t start, end;
    const AddedToken* tok;
  };
  void find(std::string_view text, std::vector<Match>& out) const;

 private:
  struct Node {
    std::vector<std::pair<uint8_t, int32_t>> next;
    const AddedToken* tok = nullptr;
  };
  std::vector<Node> nodes_{Node{}};
  bool first_byte_[256] = {};
};

}  // namespace lathe::tok
