#include "tokenizer/bpe.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <queue>

#include "core/error.h"
#include "core/utf8.h"
#include "tokenizer/byte_level.h"
#include "tokenizer/word_cache.h"

namespace lathe::tok {

namespace {

inline uint64_t hash_bytes(std::string_view s) {
  // 8 bytes per step multiply-xorshift; good enough for a hash table of words.
  uint64_t h = 0x9E3779B97F4A7C15ull ^ (s.size() * 0xC2B2AE3D27D4EB4Full);
  const char* p = s.data();
  size_t n = s.size();
  while (n >= 8) {
    h = (h ^ detail::load_u64(p, 8)) * 0x100000001B3ull;
    h ^= h >> 29;
    p += 8;
    n -= 8;
  }
  if (n) {
    h = (h ^ detail::load_u64(p, n)) * 0x100000001B3ull;
    h ^= h >> 29;
  }
  h *= 0xff51afd7ed558ccdull;
  h ^= h >> 32;
  return h;
}

std::atomic<uint64_t> g_next_instance{1};

WordCache& thread_cache(uint64_t instance) {
  // A few models may be used by one thread; the instance counter (never a
  // pointer) keys them, so a new model at a freed model's address cannot see
  // stale entries.
  struct Entry {
    uint64_t instance;
    std::unique_ptr<WordCache> cache;
  };
  thread_local std::vector<Entry> caches;
  thread_local size_t last = 0;
  if (last < caches.size() && caches[last].instance == instance) return *caches[last].cache;
  for (size_t i = 0; i < caches.size(); ++i)
    if (caches[i].instance == instance) {
      last = i;
      return *caches[i].cache;
    }
  if (caches.size() >= 4) caches.erase(caches.begin());
  caches.push_back({instance, std::make_unique<WordCache>(&hash_bytes)});
  last = caches.size() - 1;
  return *caches.back().cache;
}

}  // namespace

size_t StringHash::operator()(std::string_view s) const noexcept { return hash_bytes(s); }

void PairMap::reserve(size_t n) {
  size_t cap = 16;
  while (cap < n * 2) cap <<= 1;
  slots_.assign(cap, Slot{});
  mask_ = cap - 1;
  size_ = 0;
}

void PairMap::grow() {
  std::vector<Slot> old = std::move(slots_);
  reserve(old.size());  // doubles: reserve(n) allocates >= 2n
  for (const Slot& s : old)
    if (s.key != kEmpty) insert_or_assign(s.key, s.val[0], s.val[1]);
}

void PairMap::insert_or_assign(uint64_t key, int32_t rank, int32_t id) {
  if (slots_.empty() || (size_ + 1) * 2 > slots_.size()) grow();
  size_t i = mix(key) & mask_;
  while (slots_[i].key != kEmpty && slots_[i].key != key) i = (i + 1) & mask_;
  if (slots_[i].key == kEmpty) ++size_;
  slots_[i].key = key;
  slots_[i].val[0] = rank;
  slots_[i].val[1] = id;
}

BpeEncoder::BpeEncoder(StringIdMap vocab, const std::vector<std::pair<std::string, std::string>>& merges,
                       BpeOptions opt, const std::string& where)
    : opt_(std::move(opt)), vocab_(std::move(vocab)), instance_(g_next_instance.fetch_add(1)) {
  // Callers bound ids by the size of their file (token_id_limit); this only keeps max_id + 1
  // from overflowing.
  int64_t max_id = -1;
  for (auto& [t, id] : vocab_) {
    LATHE_CHECK(id >= 0 && id < INT32_MAX, "{}: vocab token '{}' has id {}, outside [0, 2^31 - 1)", where,
                t.substr(0, 80), id);
    max_id = std::max<int64_t>(max_id, id);
  }
  id_to_tok_.assign(static_cast<size_t>(max_id + 1), std::string());
  id_present_.assign(static_cast<size_t>(max_id + 1), 0);
  for (auto& [t, id] : vocab_) {
    id_to_tok_[id] = t;
    id_present_[id] = 1;
  }
  if (opt_.byte_units) {
    for (auto& [t, id] : vocab_) {
      std::string raw;
      if (bytelevel_to_bytes(t, raw)) lookup_.emplace(std::move(raw), id);
    }
    std::string tmp;
    if (!opt_.continuing_subword_prefix.empty()) {
      LATHE_CHECK(bytelevel_to_bytes(opt_.continuing_subword_prefix, raw_prefix_),
                  "{}: continuing_subword_prefix '{}' is not byte-level text", where, opt_.continuing_subword_prefix);
    }
    if (!opt_.end_of_word_suffix.empty()) {
      LATHE_CHECK(bytelevel_to_bytes(opt_.end_of_word_suffix, raw_suffix_),
                  "{}: end_of_word_suffix '{}' is not byte-level text", where, opt_.end_of_word_suffix);
    }
  } else {
    lookup_ = vocab_;
    raw_prefix_ = opt_.continuing_subword_prefix;
    raw_suffix_ = opt_.end_of_word_suffix;
  }
  for (int b = 0; b < 256; ++b) {
    auto it = lookup_.find(std::string_view(reinterpret_cast<const char*>(&b), 1));
    byte_id_[b] = it == lookup_.end() ? -1 : it->second;
  }
  if (opt_.unk_token) {
    auto it = vocab_.find(*opt_.unk_token);
    LATHE_CHECK(it != vocab_.end(), "{}: unk_token '{}' is not in the vocab", where, *opt_.unk_token);
    unk_id_ = it->second;
  }
  merges_.reserve(merges.size() + 16);
  const std::string& pfx = opt_.continuing_subword_prefix;
  for (size_t r = 0; r < merges.size(); ++r) {
    const auto& [a, b] = merges[r];
    auto ia = vocab_.find(a);
    auto ib = vocab_.find(b);
    auto cut = [](const std::string& t) { return t.size() <= 80 ? t : t.substr(0, 80) + "..."; };  // messages
    LATHE_CHECK(ia != vocab_.end(), "{}: merge {} ('{}' '{}'): '{}' is not in the vocab", where, r, cut(a), cut(b),
                cut(a));
    LATHE_CHECK(ib != vocab_.end(), "{}: merge {} ('{}' '{}'): '{}' is not in the vocab", where, r, cut(a), cut(b),
                cut(b));
    std::string merged = a;
    if (!pfx.empty() && b.compare(0, pfx.size(), pfx) == 0)
      merged += b.substr(pfx.size());
    else
      merged += b;
    auto im = vocab_.find(merged);
    LATHE_CHECK(im != vocab_.end(), "{}: merge {} ('{}' '{}'): the merged token '{}' is not in the vocab", where, r,
                cut(a), cut(b), cut(merged));
    // HF collects merges into a HashMap: a repeated pair keeps its last rank.
    merges_.insert_or_assign(PairMap::key(ia->second, ib->second), static_cast<int32_t>(r), im->second);
  }
}

std::optional<int32_t> BpeEncoder::token_to_id(std::string_view tok) const {
  auto it = vocab_.find(tok);
  if (it == vocab_.end()) return std::nullopt;
  return it->second;
}

const std::string* BpeEncoder::id_to_token(int32_t id) const {
  if (id < 0 || static_cast<size_t>(id) >= id_to_tok_.size() || !id_present_[id]) return nullptr;
  return &id_to_tok_[id];
}

void BpeEncoder::encode_word(std::string_view word, std::vector<int32_t>& out) const {
  if (word.empty()) return;
  if (word.size() >= WordCache::kMaxWordBytes) {
    merge_word(word, out);
    return;
  }
  WordCache& cache = thread_cache(instance_);
  uint64_t h = hash_bytes(word);
  if (cache.lookup(word, h, out)) return;
  size_t start = out.size();
  merge_word(word, out);
  cache.insert(word, h, out.data() + start, out.size() - start);
}

// One unit (char, or byte in byte mode) -> symbols, following HF
// BPE::merge_word.
void BpeEncoder::add_unit(std::string_view key, std::string_view fallback_chars, std::vector<int32_t>& syms,
                          std::optional<int32_t>& unk) const {
  auto it = lookup_.find(key);
  if (it != lookup_.end()) {
    if (unk) {
      syms.push_back(*unk);
      unk.reset();
    }
    syms.push_back(it->second);
    return;
  }
  if (opt_.byte_fallback) {
    // HF looks up "<0xXX>" for every UTF-8 byte of the (vocab-space) string;
    // all must exist.
    int32_t ids[64];
    size_t n = 0;
    bool ok = fallback_chars.size() <= 64;
    for (size_t i = 0; ok && i < fallback_chars.size(); ++i) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "<0x%02X>", static_cast<unsigned char>(fallback_chars[i]));
      auto bt = vocab_.find(std::string_view(buf, 6));
      if (bt == vocab_.end())
        ok = false;
      else
        ids[n++] = bt->second;
    }
    if (ok) {
      // HF does not flush a pending unk here; it stays pending and is emitted
      // later, after these byte tokens (mirrors tokenizers' BPE::merge_word).
      syms.insert(syms.end(), ids, ids + n);
      return;
    }
  }
  if (unk_id_ >= 0) {
    if (unk && opt_.fuse_unk) return;  // fused into the pending unk
    if (unk) syms.push_back(*unk);
    unk = unk_id_;
  }
  // No unk token: HF silently drops the unit.
}

void BpeEncoder::merge_word(std::string_view word, std::vector<int32_t>& out) const {
  if (opt_.ignore_merges) {
    auto it = lookup_.find(word);
    if (it != lookup_.end()) {
      out.push_back(it->second);
      return;
    }
  }
  thread_local std::vector<int32_t> syms;
  syms.clear();
  std::optional<int32_t> unk;
  bool plain = raw_prefix_.empty() && raw_suffix_.empty();
  if (opt_.byte_units && plain) {
    for (size_t i = 0; i < word.size(); ++i) {
      int32_t id = byte_id_[static_cast<unsigned char>(word[i])];
      if (id >= 0 && !unk) {
        syms.push_back(id);
      } else {
        std::string mapped = bytes_to_bytelevel(word.substr(i, 1));
        add_unit(word.substr(i, 1), mapped, syms, unk);
      }
    }
  } else {
    std::string key;
    for (size_t i = 0; i < word.size();) {
      size_t len = opt_.byte_units ? 1 : utf8_char_len(word, i);
      std::string_view unit = word.substr(i, len);
      bool first = i == 0, last = i + len == word.size();
      key.clear();
      if (!first) key += raw_prefix_;
      key += unit;
      if (last) key += raw_suffix_;
      std::string fb = opt_.byte_units ? bytes_to_bytelevel(key) : key;
      add_unit(key, fb, syms, unk);
      i += len;
    }
  }
  if (unk) syms.push_back(*unk);

  size_t n = syms.size();
  if (n <= 1) {
    out.insert(out.end(), syms.begin(), syms.end());
    return;
  }
  // Doubly-linked list over symbol positions; removed symbols get alive=0.
  thread_local std::vector<int32_t> prev, next;
  thread_local std::vector<uint8_t> alive;
  prev.resize(n);
  next.resize(n);
  alive.assign(n, 1);
  for (size_t i = 0; i < n; ++i) {
    prev[i] = static_cast<int32_t>(i) - 1;
    next[i] = i + 1 < n ? static_cast<int32_t>(i + 1) : -1;
  }
  struct Cand {
    int32_t rank, pos, new_id;
    bool operator<(const Cand& o) const {  // max-heap on "priority": lowest rank, then lowest pos
      return rank != o.rank ? rank > o.rank : pos > o.pos;
    }
  };
  thread_local std::vector<Cand> heap;
  heap.clear();
  for (size_t i = 0; i + 1 < n; ++i)
    if (const int32_t* m = merges_.find(PairMap::key(syms[i], syms[i + 1])))
      heap.push_back({m[0], static_cast<int32_t>(i), m[1]});
  std::make_heap(heap.begin(), heap.end());
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end());
    Cand top = heap.back();
    heap.pop_back();
    int32_t p = top.pos;
    if (!alive[p] || next[p] < 0) continue;
    int32_t q = next[p];
    const int32_t* cur = merges_.find(PairMap::key(syms[p], syms[q]));
    if (!cur || cur[1] != top.new_id) continue;  // stale entry
    syms[p] = top.new_id;
    alive[q] = 0;
    next[p] = next[q];
    if (next[q] >= 0) prev[next[q]] = p;
    if (prev[p] >= 0) {
      if (const int32_t* m = merges_.find(PairMap::key(syms[prev[p]], syms[p]))) {
        heap.push_back({m[0], prev[p], m[1]});
        std::push_heap(heap.begin(), heap.end());
      }
    }
    if (next[p] >= 0) {
      if (const int32_t* m = merges_.find(PairMap::key(syms[p], syms[next[p]]))) {
        heap.push_back({m[0], p, m[1]});
        std::push_heap(heap.begin(), heap.end());
      }
    }
  }
  for (int32_t i = 0; i >= 0; i = next[i]) out.push_back(syms[i]);
}

}  // namespace lathe::tok
