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

// ---- normalizers -------------------------------------------------------------------------
class Normalizer {
 public:
  virtual ~Normalizer() = default;
  virtual void apply(std::string& s) const = 0;
};
// `where` prefixes error messages (file and JSON path).
std::unique_ptr<Normalizer> make_normalizer(const nlohmann::json& j, const std::string& where);

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
std::unique_ptr<PreTokenizer> make_pre_tokenizer(const nlohmann::json& j, const std::string& where, bool* byte_level);

// ---- decoders ----------------------------------------------------------------------------
class Decoder {
 public:
  virtual ~Decoder() = default;
  virtual void apply(std::vector<std::string>& tokens) const = 0;
};
std::unique_ptr<Decoder> make_decoder(const nlohmann::json& j, const std::string& where);

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
