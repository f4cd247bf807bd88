// BPE model (HF tokenizers `models::bpe` semantics): vocab + ranked merges, one pre-token at a time.
// Merging follows HF's Word::merge_all exactly: a priority queue over adjacent pairs, lowest rank
// first, ties to the leftmost pair, over a doubly-linked list of symbols.
//
// Two unit modes:
//  - byte units (byte-level tokenizers): pre-tokens are raw bytes; vocab strings are converted
//    from the GPT-2 byte->unicode spelling to raw bytes at load, so no per-encode mapping is needed.
//  - char units (SentencePiece-style): pre-tokens are UTF-8 strings split into chars, with
//    byte_fallback (<0xXX>) and unk handling.
// A bounded thread-local cache maps pre-token -> ids (results are identical with or without it).
#pragma once
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace lathe::tok {

namespace detail {
// The first min(n, 8) bytes at p, little-endian, zero padded; never reads past p + n. Built from
// whole loads in registers: memcpy with a variable length compiles to byte stores followed by an
// 8-byte load, a failed store-to-load forwarding that cost more than the rest of a cache lookup.
inline uint64_t load_u64(const char* p, size_t n) {
  uint64_t v;
  if (n >= 8) {
    std::memcpy(&v, p, 8);
    return v;
  }
  if (n >= 4) {
    uint32_t lo, hi;
    std::memcpy(&lo, p, 4);
    std::memcpy(&hi, p + n - 4, 4);  // bytes n-4 .. n-1; the top n-4 of them are bytes 4 .. n-1
    return lo | (static_cast<uint64_t>(hi) >> (8 * (8 - n)) << 32);
  }
  if (n == 0) return 0;
  const auto* u = reinterpret_cast<const unsigned char*>(p);
  return u[0] | static_cast<uint64_t>(u[n / 2]) << (8 * (n / 2)) | static_cast<uint64_t>(u[n - 1]) << (8 * (n - 1));
}
}  // namespace detail

// Token ids read from files lie in [0, token_id_limit(entries)), entries = the file's vocabulary
// entries + added tokens. Real tokenizers number their tokens densely (GPT-2 0..50256, Llama-3
// 0..128255, Qwen2 0..151664); the slack allows holes while keeping the id -> token table (sized
// max id + 1) proportional to the file, and ids + 1 never overflow int32.
constexpr int64_t kTokenIdSlack = int64_t{1} << 16;
inline int64_t token_id_limit(int64_t entries) {
  const int64_t lim = entries + kTokenIdSlack;
  return lim < INT32_MAX ? lim : INT32_MAX;
}

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const noexcept;
};
using StringIdMap = std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>>;

// Open-addressing map from a 64-bit pair key to (rank, new id).
class PairMap {
 public:
  void reserve(size_t n);
  void insert_or_assign(uint64_t key, int32_t rank, int32_t id);
  // nullptr when absent; else pointer to {rank, id}.
  const int32_t* find(uint64_t key) const {
    if (slots_.empty()) return nullptr;
    size_t i = mix(key) & mask_;
    while (true) {
      const Slot& s = slots_[i];
      if (s.key == key) return s.val;
      if (s.key == kEmpty) return nullptr;
      i = (i + 1) & mask_;
    }
  }
  static uint64_t key(int32_t a, int32_t b) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
  }

 private:
  static constexpr uint64_t kEmpty = ~0ull;
  struct Slot {
    uint64_t key = kEmpty;
    int32_t val[2] = {0, 0};
  };
  static size_t mix(uint64_t k) {
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdull;
    k ^= k >> 33;
    return static_cast<size_t>(k);
  }
  void grow();
  std::vector<Slot> slots_;
  size_t mask_ = 0, size_ = 0;
};

struct BpeOptions {
  bool byte_units = false;
  std::optional<std::string> unk_token;
  std::string continuing_subword_prefix;  // "" = none
  std::string end_of_word_suffix;         // "" = none
  bool fuse_unk = false;
  bool byte_fallback = false;
  bool ignore_merges = false;
};

// (Named BpeEncoder, not BpeModel: bpe_trainer.h's struct BpeModel is another type in this
// namespace, and two classes of one name are an ODR violation: the linker kept one implicit
// destructor for both, and HfTokenizer freed its model with the trainer's under clang -O2.)
class BpeEncoder {
 public:
  // vocab: token (as spelled in the file) -> id; merges: pairs of tokens, rank = index.
  // `where` names the source file for error messages.
  BpeEncoder(StringIdMap vocab, const std::vector<std::pair<std::string, std::string>>& merges, BpeOptions opt,
             const std::string& where);

  // Appends the ids of one pre-token (raw bytes in byte mode, UTF-8 in char mode).
  void encode_word(std::string_view word, std::vector<int32_t>& out) const;

  std::optional<int32_t> token_to_id(std::string_view tok) const;
  // Token string as spelled in the file; nullptr for an unknown id.
  const std::string* id_to_token(int32_t id) const;
  // Largest id + 1 of the model vocab.
  int64_t size() const { return static_cast<int64_t>(id_to_tok_.size()); }
  const BpeOptions& options() const { return opt_; }

 private:
  void merge_word(std::string_view word, std::vector<int32_t>& out) const;
  void add_unit(std::string_view key, std::string_view fallback_chars, std::vector<int32_t>& syms,
                std::optional<int32_t>& unk) const;

  BpeOptions opt_;
  StringIdMap vocab_;   // file spelling -> id
  StringIdMap lookup_;  // encode-space spelling (raw bytes in byte mode) -> id
  std::vector<std::string> id_to_tok_;
  std::vector<uint8_t> id_present_;
  PairMap merges_;
  int32_t byte_id_[256];  // byte mode: id of each single byte, -1 if absent
  int32_t unk_id_ = -1;
  std::string raw_prefix_, raw_suffix_;
  uint64_t instance_;  // key of this model's thread-local caches
};

}  // namespace lathe::tok
