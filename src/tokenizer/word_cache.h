// Per-thread cache of BPE results: pre-token bytes -> token ids (used by BpeModel::encode_word).
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "tokenizer/bpe.h"

namespace lathe::tok {

// Bounded pre-token -> ids cache (per thread, per model). Cleared when full.
// Kept small on purpose: with several workers the shared L3 is the bottleneck, so every miss
// there costs parallel speedup. A slot is 16 bytes and holds the first 8 bytes of the word, so a
// word of at most 8 bytes that encodes to one token (most words of natural text: " the", "ing",
// "\n") is found, compared and answered from that one slot. Longer words and multi-token words
// keep their ids and the rest of their bytes in one contiguous arena entry. A typical corpus's
// cache (tens of thousands of words) fits in a core's L2.
// `hash` must be the function whose values callers pass to lookup/insert (grow() rehashes with it).
class WordCache {
 public:
  using HashFn = uint64_t (*)(std::string_view);
  static constexpr size_t kMaxSlots = 1 << 17;
  static constexpr size_t kMaxEntries = kMaxSlots / 2;
  static constexpr size_t kMaxWordBytes = 256;        // longer words are not cached (len is a uint8)
  static constexpr size_t kMaxArenaWords = 4u << 20;  // 16 MB of entries at most

  explicit WordCache(HashFn hash) : hash_(hash), slots_(kMinSlots) {}

  // Returns true and appends ids when `w` (1..kMaxWordBytes-1 bytes) is cached.
  bool lookup(std::string_view w, uint64_t h, std::vector<int32_t>& out) const {
    const uint16_t tag = static_cast<uint16_t>(h >> 48);
    const uint64_t head = load_head(w);
    const size_t mask = slots_.size() - 1;
    for (size_t i = h & mask;; i = (i + 1) & mask) {
      const Slot& s = slots_[i];
      if (s.len == 0) return false;
      if (s.tag != tag || s.len != w.size() || s.head != head) continue;
      if (s.len <= 8 && s.n_ids == 1) {
        out.push_back(static_cast<int32_t>(s.data));
        return true;
      }
      const uint32_t* e = arena_.data() + s.data;  // [ids x n_ids][bytes 8.. of the word]
      if (s.len > 8 && std::memcmp(e + s.n_ids, w.data() + 8, s.len - 8) != 0) continue;
      const int32_t* ids = reinterpret_cast<const int32_t*>(e);
      out.insert(out.end(), ids, ids + s.n_ids);
      return true;
    }
  }

  void insert(std::string_view w, uint64_t h, const int32_t* ids, size_t n) {
    if (w.empty() || w.size() >= kMaxWordBytes || n == 0 || n > 255) return;  // not cacheable
    const bool inline_entry = w.size() <= 8 && n == 1;
    const size_t words = inline_entry ? 0 : n + (w.size() > 8 ? (w.size() - 8 + 3) / 4 : 0);
    if (entries_ >= kMaxEntries || arena_.size() + words > kMaxArenaWords) clear();
    if ((entries_ + 1) * 2 > slots_.size()) grow();
    Slot s;
    s.head = load_head(w);
    s.len = static_cast<uint8_t>(w.size());
    s.n_ids = static_cast<uint8_t>(n);
    s.tag = static_cast<uint16_t>(h >> 48);
    if (inline_entry) {
      s.data = static_cast<uint32_t>(ids[0]);
    } else {
      s.data = static_cast<uint32_t>(arena_.size());
      arena_.resize(arena_.size() + words, 0);
      uint32_t* e = arena_.data() + s.data;
      std::memcpy(e, ids, n * sizeof(int32_t));
      if (w.size() > 8) std::memcpy(e + n, w.data() + 8, w.size() - 8);
    }
    place(h, s);
    ++entries_;
  }

 private:
  static constexpr size_t kMinSlots = 1 << 12;
  struct Slot {
    uint64_t head = 0;  // bytes 0..7 of the word, zero padded
    uint32_t data = 0;  // the id (inline entry) or the arena offset
    uint8_t len = 0;    // word bytes; 0 = empty slot
    uint8_t n_ids = 0;
    uint16_t tag = 0;  // top hash bits
  };
  static_assert(sizeof(Slot) == 16);

  static uint64_t load_head(std::string_view w) { return detail::load_u64(w.data(), w.size()); }
  void place(uint64_t h, const Slot& s) {
    const size_t mask = slots_.size() - 1;
    size_t i = h & mask;
    while (slots_[i].len != 0) i = (i + 1) & mask;
    slots_[i] = s;
  }
  void grow() {
    // Rehash every slot from its full word (head + arena tail).
    std::vector<Slot> old(std::min(slots_.size() * 2, kMaxSlots));
    old.swap(slots_);
    std::string word;
    for (const Slot& s : old) {
      if (s.len == 0) continue;
      word.assign(reinterpret_cast<const char*>(&s.head), std::min<size_t>(s.len, 8));
      if (s.len > 8) word.append(reinterpret_cast<const char*>(arena_.data() + s.data + s.n_ids), s.len - 8);
      place(hash_(word), s);
    }
  }
  void clear() {
    slots_.assign(kMinSlots, Slot{});
    arena_.clear();
    entries_ = 0;
  }
  HashFn hash_;
  std::vector<Slot> slots_;
  std::vector<uint32_t> arena_;
  size_t entries_ = 0;
};

}  // namespace lathe::tok
