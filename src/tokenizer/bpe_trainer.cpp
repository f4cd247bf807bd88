#define PCRE2_CODE_UNIT_WIDTH 8
#include "tokenizer/bpe_trainer.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <pcre2.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <filesystem>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>
#include <unordered_map>

#include "core/error.h"
#include "core/timer.h"

namespace lathe::tok {

// ---------------------------------------------------------------------------------------------
// Regexes and the byte-level alphabet

const std::string& pretokenizer_pattern(std::string_view name) {
  static const std::string gpt2 = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
  static const std::string llama3 =
      R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
  if (name == "gpt2") return gpt2;
  if (name == "llama3") return llama3;
  throw_error("--pretokenizer '{}': unknown; use gpt2 or llama3", name);
}

static const std::array<uint32_t, 256>& byte_table() {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    uint32_t n = 0;
    for (int b = 0; b < 256; ++b) {
      bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      t[b] = printable ? static_cast<uint32_t>(b) : 256 + n++;
    }
    return t;
  }();
  return table;
}

uint32_t byte_to_unicode(uint8_t b) { return byte_table()[b]; }

static void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

std::string bytes_to_token_string(std::string_view bytes) {
  std::string s;
  s.reserve(bytes.size() * 2);
  for (unsigned char b : bytes) append_utf8(s, byte_to_unicode(b));
  return s;
}

// ---------------------------------------------------------------------------------------------
// Pre-tokenization with PCRE2 (JIT, UTF + UCP so \s, \p{L}, \p{N} are Unicode-aware;
// MATCH_INVALID_UTF so arbitrary bytes are accepted: invalid sequences never match and become
// words of their own, the same rule lathe's encoder applies).

namespace {

class Pretokenizer {
 public:
  explicit Pretokenizer(std::string_view name) {
    const std::string& pat = pretokenizer_pattern(name);
    int err = 0;
    PCRE2_SIZE off = 0;
    code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pat.data()), pat.size(),
                          PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF, &err, &off, nullptr);
    if (!code_) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(err, msg, sizeof msg);
      throw_error("pre-tokenizer regex failed to compile at offset {}: {}", off, reinterpret_cast<char*>(msg));
    }
    jit_ = pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE) == 0;
  }
  ~Pretokenizer() { pcre2_code_free(code_); }
  Pretokenizer(const Pretokenizer&) = delete;
  Pretokenizer& operator=(const Pretokenizer&) = delete;

  // Calls fn(std::string_view word) for each pre-token of `text`, covering every byte.
  template <typename F>
  void split(std::string_view text, pcre2_match_data* md, F&& fn) const {
    const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
    size_t n = text.size(), pos = 0;
    while (pos < n) {
      int rc = jit_ ? pcre2_jit_match(code_, subject, n, pos, 0, md, nullptr)
                    : pcre2_match(code_, subject, n, pos, 0, md, nullptr);
      if (rc == PCRE2_ERROR_NOMATCH) {
        fn(text.substr(pos));
        return;
      }
      if (rc < 0) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(rc, msg, sizeof msg);
        throw_error("pre-tokenizer regex match failed: {}", reinterpret_cast<char*>(msg));
      }
      PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
      size_t s = ov[0], e = ov[1];
      if (s > pos) fn(text.substr(pos, s - pos));  // invalid UTF-8 bytes
      if (e == s) {                                // cannot happen with our patterns; be safe
        e = s + 1;
        fn(text.substr(s, 1));
      } else {
        fn(text.substr(s, e - s));
      }
      pos = e;
    }
  }
  pcre2_match_data* new_match_data() const { return pcre2_match_data_create_from_pattern(code_, nullptr); }

 private:
  pcre2_code* code_ = nullptr;
  bool jit_ = false;
};

struct MatchData {
  explicit MatchData(const Pretokenizer& p) : md(p.new_match_data()) {}
  ~MatchData() { pcre2_match_data_free(md); }
  pcre2_match_data* md;
};

inline uint64_t hash_bytes(std::string_view s) {
  uint64_t h = 0x9E3779B97F4A7C15ull ^ (s.size() * 0xff51afd7ed558ccdull);
  size_t i = 0;
  for (; i + 8 <= s.size(); i += 8) {
    uint64_t w;
    std::memcpy(&w, s.data() + i, 8);
    h = (h ^ w) * 0xbf58476d1ce4e5b9ull;
    h ^= h >> 31;
  }
  uint64_t w = 0;
  std::memcpy(&w, s.data() + i, s.size() - i);
  h = (h ^ w) * 0x94d049bb133111ebull;
  h ^= h >> 29;
  h *= 0xbf58476d1ce4e5b9ull;
  return h ^ (h >> 32);
}

// Open-addressing string -> count map with the keys in one arena (a std::unordered_map of
// std::string costs an allocation per distinct word and dominated the counting profile).
class WordCounter {
 public:
  WordCounter() { slots_.resize(1 << 16); }
  void add(std::string_view w, uint64_t c = 1) {
    if ((size_ + 1) * 10 > slots_.size() * 7) grow();
    uint64_t h = hash_bytes(w);
    size_t mask = slots_.size() - 1, i = h & mask;
    for (;;) {
      Slot& s = slots_[i];
      if (s.count == 0) {
        s = Slot{h, arena_.size(), static_cast<uint32_t>(w.size()), c};
        arena_.append(w);
        ++size_;
        return;
      }
      if (s.hash == h && s.len == w.size() && std::memcmp(arena_.data() + s.off, w.data(), w.size()) == 0) {
        s.count += c;
        return;
      }
      i = (i + 1) & mask;
    }
  }
  template <typename F>
  void for_each(F&& fn) const {
    for (const Slot& s : slots_)
      if (s.count) fn(std::string_view(arena_.data() + s.off, s.len), s.count);
  }
  size_t size() const { return size_; }

 private:
  struct Slot {
    uint64_t hash = 0;
    uint64_t off = 0;
    uint32_t len = 0;
    uint64_t count = 0;
  };
  void grow() {
    std::vector<Slot> old(slots_.size() * 2);
    old.swap(slots_);
    size_t mask = slots_.size() - 1;
    for (const Slot& s : old) {
      if (!s.count) continue;
      size_t i = s.hash & mask;
      while (slots_[i].count) i = (i + 1) & mask;
      slots_[i] = s;
    }
  }
  std::vector<Slot> slots_;
  std::string arena_;
  size_t size_ = 0;
};

WordCounts to_word_counts(const WordCounter& wc) {
  WordCounts out;
  out.words.reserve(wc.size());
  out.counts.reserve(wc.size());
  wc.for_each([&](std::string_view w, uint64_t c) {
    out.words.emplace_back(w);
    out.counts.push_back(c);
  });
  return out;
}

}  // namespace

WordCounts count_words_in_texts(const std::vector<std::string>& texts, const BpeTrainerOptions& opt) {
  double t0 = now_seconds();
  Pretokenizer pre(opt.pretokenizer);
  MatchData md(pre);
  WordCounter wc;
  uint64_t total = 0, bytes = 0;
  for (const auto& t : texts) {
    bytes += t.size();
    pre.split(t, md.md, [&](std::string_view w) {
      wc.add(w);
      ++total;
    });
  }
  WordCounts out = to_word_counts(wc);
  out.total_words = total;
  out.bytes = bytes;
  out.sequences = texts.size();
  out.seconds = now_seconds() - t0;
  return out;
}

WordCounts count_words(const std::vector<std::string>& files, const BpeTrainerOptions& opt) {
  double t0 = now_seconds();
  Pretokenizer pre(opt.pretokenizer);
  const int nthreads = std::max(1, opt.threads);

  // The reading thread (this one) cuts the input into chunks of whole sequences; counting
  // threads pre-tokenize them into private counters that are summed at the end.
  struct Chunk {
    std::string data;
    std::vector<uint32_t> ends;    // end offset of each sequence in data
    std::vector<uint8_t> is_json;  // per sequence
  };
  std::mutex mu;
  std::condition_variable cv_work, cv_space;
  std::deque<Chunk> queue;
  bool done = false;
  std::exception_ptr error;
  const size_t max_queue = static_cast<size_t>(nthreads) * 2 + 2;

  std::vector<WordCounter> counters(nthreads);
  std::vector<uint64_t> totals(nthreads, 0), skipped(nthreads, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < nthreads; ++t) {
    threads.emplace_back([&, t] {
      try {
        MatchData md(pre);
        std::string text, detail;
        for (;;) {
          Chunk c;
          {
            std::unique_lock<std::mutex> lk(mu);
            cv_work.wait(lk, [&] { return !queue.empty() || done || error; });
            if (error || queue.empty()) return;
            c = std::move(queue.front());
            queue.pop_front();
          }
          cv_space.notify_one();
          uint32_t start = 0;
          for (size_t i = 0; i < c.ends.size(); ++i) {
            std::string_view seq(c.data.data() + start, c.ends[i] - start);
            start = c.ends[i];
            if (c.is_json[i]) {
              SkipReason why;
              if (!extract_json_text(seq, opt.text_key, text, why, detail)) {
                ++skipped[t];
                continue;
              }
              seq = text;
            }
            pre.split(seq, md.md, [&](std::string_view w) {
              counters[t].add(w);
              ++totals[t];
            });
          }
        }
      } catch (...) {
        std::lock_guard<std::mutex> lk(mu);
        if (!error) error = std::current_exception();
        cv_space.notify_all();
        cv_work.notify_all();
      }
    });
  }

  uint64_t bytes = 0, sequences = 0, total_file_bytes = 0, done_file_bytes = 0;
  for (auto& f : files) {
    struct stat st;
    if (::stat(f.c_str(), &st) == 0) total_file_bytes += static_cast<uint64_t>(st.st_size);
  }
  ProgressLine bar(opt.progress);
  auto push = [&](Chunk&& c) {
    std::unique_lock<std::mutex> lk(mu);
    cv_space.wait(lk, [&] { return queue.size() < max_queue || error; });
    if (error) return;
    queue.push_back(std::move(c));
    cv_work.notify_one();
  };
  try {
    Chunk cur;
    std::string line;
    for (const auto& f : files) {
      bool json = detect_format(f, opt.format) == InputFormat::Jsonl;
      LineReader lr(open_byte_source(f));
      while (lr.next(line)) {
        if (json) {
          while (!line.empty() && (line.back() == '\n' || line.back() == '\r')) line.pop_back();
          if (line.find_first_not_of(" \t") == std::string::npos) continue;
        }
        bytes += line.size();
        ++sequences;
        cur.data += line;
        cur.ends.push_back(static_cast<uint32_t>(cur.data.size()));
        cur.is_json.push_back(json);
        if (cur.data.size() >= (1u << 20)) {
          push(std::move(cur));
          cur = Chunk{};
          if (error) break;
          if (bar.due()) {
            double el = now_seconds() - t0,
                   frac = double(done_file_bytes + lr.raw_position()) / std::max<uint64_t>(1, total_file_bytes);
            bar.show(fmt::format("counting words: {:5.1f}%  {:.1f} MB/s  {} sequences  ETA {}", 100 * frac,
                                 bytes / 1e6 / std::max(el, 1e-9), format_count(double(sequences)),
                                 format_duration(el / std::max(frac, 1e-9) - el)));
          }
        }
      }
      if (error) break;
      struct stat st;
      if (::stat(f.c_str(), &st) == 0) done_file_bytes += static_cast<uint64_t>(st.st_size);
    }
    if (!cur.ends.empty()) push(std::move(cur));
  } catch (...) {
    std::lock_guard<std::mutex> lk(mu);
    if (!error) error = std::current_exception();
  }
  {
    std::lock_guard<std::mutex> lk(mu);
    done = true;
  }
  cv_work.notify_all();
  for (auto& th : threads) th.join();
  bar.finish();
  if (error) std::rethrow_exception(error);

  for (int t = 1; t < nthreads; ++t)
    counters[t].for_each([&](std::string_view w, uint64_t c) { counters[0].add(w, c); });
  WordCounts out = to_word_counts(counters[0]);
  for (int t = 0; t < nthreads; ++t) {
    out.total_words += totals[t];
    out.skipped += skipped[t];
  }
  out.bytes = bytes;
  out.sequences = sequences;
  out.seconds = now_seconds() - t0;
  return out;
}

// ---------------------------------------------------------------------------------------------
// The merge loop

namespace {

inline uint64_t pair_key(int32_t a, int32_t b) { return (uint64_t(uint32_t(a)) << 32) | uint32_t(b); }

// pair -> count, open addressing; keys are < 2^63 so ~0 marks an empty slot. Never shrinks
// (pairs whose count drops to 0 stay, as in HF's HashMap).
class PairCounts {
 public:
  PairCounts() : keys_(1 << 16, kEmpty), vals_(1 << 16, 0) {}
  int64_t& operator[](uint64_t k) {
    if ((size_ + 1) * 2 > keys_.size()) grow();
    size_t i = slot(k);
    if (keys_[i] == kEmpty) {
      keys_[i] = k;
      vals_[i] = 0;
      ++size_;
    }
    return vals_[i];
  }
  int64_t get(uint64_t k) const {
    size_t i = slot(k);
    return keys_[i] == kEmpty ? 0 : vals_[i];
  }

 private:
  static constexpr uint64_t kEmpty = ~0ull;
  size_t slot(uint64_t k) const {
    size_t mask = keys_.size() - 1;
    uint64_t h = k * 0x9E3779B97F4A7C15ull;
    size_t i = (h ^ (h >> 29)) & mask;
    while (keys_[i] != kEmpty && keys_[i] != k) i = (i + 1) & mask;
    return i;
  }
  void grow() {
    std::vector<uint64_t> ok(keys_.size() * 2, kEmpty);
    std::vector<int64_t> ov(keys_.size() * 2, 0);
    ok.swap(keys_);
    ov.swap(vals_);
    for (size_t j = 0; j < ok.size(); ++j)
      if (ok[j] != kEmpty) {
        size_t i = slot(ok[j]);
        keys_[i] = ok[j];
        vals_[i] = ov[j];
      }
  }
  std::vector<uint64_t> keys_;
  std::vector<int64_t> vals_;
  size_t size_ = 0;
};

// One candidate merge: HF's `Merge { pair, count, pos }`. Max-heap on count, then on the
// smallest pair; equal entries (same pair, same count) pop in insertion order.
struct Candidate {
  int64_t count;
  uint64_t pair;
  uint64_t seq;
  std::vector<uint32_t> pos;  // indices of words that (may) contain the pair, ascending
};
struct CandidateLess {
  bool operator()(const Candidate& a, const Candidate& b) const {
    if (a.count != b.count) return a.count < b.count;
    if (a.pair != b.pair) return a.pair > b.pair;
    return a.seq > b.seq;
  }
};

// HF Word::merge: replaces every non-overlapping (c1, c2), left to right, and reports the pair
// count changes (neighbour pairs lost and gained; the merged pair itself is not reported).
void merge_word(std::vector<int32_t>& w, int32_t c1, int32_t c2, int32_t rep,
                std::vector<std::pair<uint64_t, int>>& changes) {
  size_t i = 0;
  while (i < w.size()) {
    if (w[i] == c1 && i + 1 < w.size() && w[i + 1] == c2) {
      if (i > 0) {
        changes.emplace_back(pair_key(w[i - 1], c1), -1);
        changes.emplace_back(pair_key(w[i - 1], rep), 1);
      }
      w[i] = rep;
      w.erase(w.begin() + static_cast<std::ptrdiff_t>(i) + 1);
      if (i + 1 < w.size()) {
        changes.emplace_back(pair_key(c2, w[i + 1]), -1);
        changes.emplace_back(pair_key(rep, w[i + 1]), 1);
      }
    }
    ++i;
  }
}

}  // namespace

std::string BpeModel::token_string(int32_t id) const {
  if (id >= 0 && static_cast<size_t>(id) < special_tokens.size()) return vocab[id];
  return bytes_to_token_string(vocab.at(id));
}

BpeModel train_bpe(const WordCounts& wc, const BpeTrainerOptions& opt) {
  double t0 = now_seconds();
  BpeModel m;
  m.pretokenizer = opt.pretokenizer;
  m.bos_token = opt.bos_token;
  m.eos_token = opt.eos_token;
  m.pad_token = opt.pad_token;
  (void)pretokenizer_pattern(opt.pretokenizer);

  // token string (as in tokenizer.json) -> id, as HF's word_to_id
  std::unordered_map<std::string, int32_t> w2id;
  for (const auto& s : opt.special_tokens) {
    LATHE_CHECK(!s.empty(), "--special-tokens: empty token (remove the extra comma)");
    LATHE_CHECK(is_valid_utf8(s), "--special-tokens: '{}' is not valid UTF-8", s);
    if (w2id.count(s)) continue;
    w2id.emplace(s, static_cast<int32_t>(m.vocab.size()));
    m.vocab.push_back(s);
    m.special_tokens.push_back(s);
  }
  LATHE_CHECK(opt.vocab_size >= static_cast<int64_t>(m.special_tokens.size()) + 256,
              "--vocab-size {} is too small: it must hold the 256 byte symbols and {} special tokens ({} at least)",
              opt.vocab_size, m.special_tokens.size(), m.special_tokens.size() + 256);
  // Alphabet: the 256 byte symbols sorted by code point of their byte->unicode character.
  std::vector<int> bytes_by_cp(256);
  for (int b = 0; b < 256; ++b) bytes_by_cp[b] = b;
  std::sort(bytes_by_cp.begin(), bytes_by_cp.end(),
            [](int a, int b) { return byte_to_unicode(uint8_t(a)) < byte_to_unicode(uint8_t(b)); });
  int32_t byte_id[256];
  for (int b : bytes_by_cp) {
    std::string raw(1, static_cast<char>(b));
    std::string ts = bytes_to_token_string(raw);
    auto it = w2id.find(ts);
    if (it != w2id.end()) {  // a special token spelled like a byte symbol takes its place, as in HF
      byte_id[b] = it->second;
      continue;
    }
    byte_id[b] = static_cast<int32_t>(m.vocab.size());
    w2id.emplace(ts, byte_id[b]);
    m.vocab.push_back(raw);
  }
  // raw bytes per id for building merged tokens (specials keep their text; they never merge)
  std::vector<std::string>& raw = m.vocab;

  // Words as symbol ids.
  const size_t nw = wc.words.size();
  std::vector<std::vector<int32_t>> words(nw);
  for (size_t i = 0; i < nw; ++i) {
    const std::string& w = wc.words[i];
    words[i].resize(w.size());
    for (size_t k = 0; k < w.size(); ++k) words[i][k] = byte_id[static_cast<unsigned char>(w[k])];
  }
  const std::vector<uint64_t>& counts = wc.counts;

  // Initial pair counts and positions (HF count_pairs).
  PairCounts pair_counts;
  std::unordered_map<uint64_t, std::vector<uint32_t>> where;
  where.reserve(1 << 16);
  for (size_t i = 0; i < nw; ++i) {
    const auto& w = words[i];
    for (size_t k = 0; k + 1 < w.size(); ++k) {
      uint64_t p = pair_key(w[k], w[k + 1]);
      pair_counts[p] += static_cast<int64_t>(counts[i]);
      auto& pos = where[p];
      if (pos.empty() || pos.back() != i) pos.push_back(static_cast<uint32_t>(i));
    }
  }
  std::vector<Candidate> heap;
  heap.reserve(where.size());
  uint64_t seq = 0;
  // Sorted pair order so the insertion sequence (the last tie-breaker) is reproducible.
  {
    std::vector<uint64_t> keys;
    keys.reserve(where.size());
    for (auto& [p, pos] : where) keys.push_back(p);
    std::sort(keys.begin(), keys.end());
    for (uint64_t p : keys) {
      int64_t c = pair_counts.get(p);
      if (c > 0) heap.push_back(Candidate{c, p, seq++, std::move(where[p])});
    }
    where.clear();
  }
  std::make_heap(heap.begin(), heap.end(), CandidateLess{});

  const int64_t min_freq = static_cast<int64_t>(opt.min_frequency);
  const int64_t target = opt.vocab_size;
  ProgressLine bar(opt.progress);
  std::vector<std::pair<uint64_t, int>> changes;
  std::vector<uint64_t> new_keys;
  const int64_t total_merges = target - static_cast<int64_t>(w2id.size());
  while (static_cast<int64_t>(w2id.size()) < target && !heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), CandidateLess{});
    Candidate top = std::move(heap.back());
    heap.pop_back();
    int64_t cur = pair_counts.get(top.pair);
    if (top.count != cur) {  // stale: re-queue with the current count (HF does the same)
      top.count = cur;
      heap.push_back(std::move(top));
      std::push_heap(heap.begin(), heap.end(), CandidateLess{});
      continue;
    }
    if (top.count < 1 || min_freq > top.count) break;

    int32_t a = static_cast<int32_t>(top.pair >> 32), b = static_cast<int32_t>(top.pair & 0xffffffffu);
    std::string new_raw = raw[a] + raw[b];
    std::string new_str = bytes_to_token_string(new_raw);
    int32_t new_id;
    auto it = w2id.find(new_str);
    if (it != w2id.end()) {
      new_id = it->second;
    } else {
      new_id = static_cast<int32_t>(raw.size());
      w2id.emplace(std::move(new_str), new_id);
      raw.push_back(std::move(new_raw));
    }
    m.merges.emplace_back(a, b);

    // Merge in every listed word and apply the count changes.
    for (uint32_t iw : top.pos) {
      changes.clear();
      merge_word(words[iw], a, b, new_id, changes);
      const auto c = static_cast<int64_t>(counts[iw]);
      for (auto& [p, ch] : changes) {
        pair_counts[p] += ch * c;
        if (ch > 0) {
          auto& pos = where[p];
          if (pos.empty() || pos.back() != iw) pos.push_back(iw);
        }
      }
    }
    new_keys.clear();
    for (auto& [p, pos] : where) new_keys.push_back(p);
    std::sort(new_keys.begin(), new_keys.end());
    for (uint64_t p : new_keys) {
      int64_t c = pair_counts.get(p);
      if (c > 0) {
        auto& pos = where[p];
        if (!std::is_sorted(pos.begin(), pos.end())) {  // top.pos is ascending, so this is rare
          std::sort(pos.begin(), pos.end());
          pos.erase(std::unique(pos.begin(), pos.end()), pos.end());
        }
        heap.push_back(Candidate{c, p, seq++, std::move(pos)});
        std::push_heap(heap.begin(), heap.end(), CandidateLess{});
      }
    }
    where.clear();
    if (bar.due()) {
      double el = now_seconds() - t0;
      double frac = double(m.merges.size()) / std::max<int64_t>(1, total_merges);
      bar.show(fmt::format("merges: {}/{} ({:.1f}%)  {:.0f} merges/s  ETA {}", m.merges.size(), total_merges,
                           100 * frac, m.merges.size() / std::max(el, 1e-9),
                           format_duration(el / std::max(frac, 1e-9) - el)));
    }
  }
  bar.finish();
  m.seconds = now_seconds() - t0;
  return m;
}

// ---------------------------------------------------------------------------------------------
// Output

static std::string jstr(const std::string& s) { return nlohmann::json(s).dump(); }

std::string hf_tokenizer_json(const BpeModel& m) {
  std::string o;
  o.reserve(m.vocab.size() * 40 + m.merges.size() * 40);
  o += "{\n  \"version\": \"1.0\",\n  \"truncation\": null,\n  \"padding\": null,\n  \"added_tokens\": [";
  for (size_t i = 0; i < m.special_tokens.size(); ++i) {
    o += i ? ",\n" : "\n";
    o += fmt::format(
        "    {{\n      \"id\": {},\n      \"content\": {},\n      \"single_word\": false,\n      \"lstrip\": false,\n"
        "      \"rstrip\": false,\n      \"normalized\": false,\n      \"special\": true\n    }}",
        i, jstr(m.special_tokens[i]));
  }
  o += m.special_tokens.empty() ? "],\n" : "\n  ],\n";
  o += "  \"normalizer\": null,\n";
  if (m.pretokenizer == "gpt2") {
    o += "  \"pre_tokenizer\": {\n    \"type\": \"ByteLevel\",\n    \"add_prefix_space\": false,\n"
         "    \"trim_offsets\": true,\n    \"use_regex\": true\n  },\n";
  } else {
    o += fmt::format(
        "  \"pre_tokenizer\": {{\n    \"type\": \"Sequence\",\n    \"pretokenizers\": [\n      {{\n"
        "        \"type\": \"Split\",\n        \"pattern\": {{\n          \"Regex\": {}\n        }},\n"
        "        \"behavior\": \"Isolated\",\n        \"invert\": false\n      }},\n      {{\n"
        "        \"type\": \"ByteLevel\",\n        \"add_prefix_space\": false,\n        \"trim_offsets\": true,\n"
        "        \"use_regex\": false\n      }}\n    ]\n  }},\n",
        jstr(pretokenizer_pattern(m.pretokenizer)));
  }
  o += "  \"post_processor\": null,\n";
  o += "  \"decoder\": {\n    \"type\": \"ByteLevel\",\n    \"add_prefix_space\": true,\n"
       "    \"trim_offsets\": true,\n    \"use_regex\": true\n  },\n";
  o += "  \"model\": {\n    \"type\": \"BPE\",\n    \"dropout\": null,\n    \"unk_token\": null,\n"
       "    \"continuing_subword_prefix\": null,\n    \"end_of_word_suffix\": null,\n    \"fuse_unk\": false,\n"
       "    \"byte_fallback\": false,\n    \"ignore_merges\": false,\n    \"vocab\": {";
  for (size_t i = 0; i < m.vocab.size(); ++i) {
    o += i ? ",\n      " : "\n      ";
    o += jstr(m.token_string(static_cast<int32_t>(i)));
    o += ": ";
    o += std::to_string(i);
  }
  o += "\n    },\n    \"merges\": [";
  for (size_t i = 0; i < m.merges.size(); ++i) {
    o += i ? ",\n      [" : "\n      [";
    o += jstr(m.token_string(m.merges[i].first));
    o += ", ";
    o += jstr(m.token_string(m.merges[i].second));
    o += "]";
  }
  o += m.merges.empty() ? "]\n  }\n}\n" : "\n    ]\n  }\n}\n";
  return o;
}

static void resolve_special_roles(BpeModel& m) {
  auto has = [&](const std::string& s) {
    return std::find(m.special_tokens.begin(), m.special_tokens.end(), s) != m.special_tokens.end();
  };
  auto pick = [&](std::string& role, const char* what, std::initializer_list<const char*> guesses) {
    if (!role.empty()) {
      LATHE_CHECK(has(role), "--{}-token '{}' is not among the special tokens; add it to --special-tokens", what, role);
      return;
    }
    for (const char* g : guesses)
      if (has(g)) {
        role = g;
        return;
      }
  };
  pick(m.eos_token, "eos", {"<|endoftext|>", "</s>", "<|end_of_text|>", "<|eot_id|>"});
  pick(m.bos_token, "bos", {"<s>", "<|begin_of_text|>", "<|endoftext|>"});
  pick(m.pad_token, "pad", {"<pad>", "<|pad|>"});
}

std::string hf_tokenizer_config_json(const BpeModel& m) {
  nlohmann::ordered_json j;
  j["tokenizer_class"] = "PreTrainedTokenizerFast";
  j["clean_up_tokenization_spaces"] = false;
  auto role = [&](const char* key, const std::string& v) {
    if (v.empty())
      j[key] = nullptr;
    else
      j[key] = v;
  };
  role("bos_token", m.bos_token);
  role("eos_token", m.eos_token);
  role("pad_token", m.pad_token);
  j["unk_token"] = nullptr;
  nlohmann::ordered_json dec = nlohmann::ordered_json::object();
  for (size_t i = 0; i < m.special_tokens.size(); ++i)
    dec[std::to_string(i)] = {
        {"content", m.special_tokens[i]}, {"lstrip", false}, {"normalized", false}, {"rstrip", false},
        {"single_word", false},           {"special", true}};
  j["added_tokens_decoder"] = dec;
  j["lathe_pretokenizer"] = m.pretokenizer;
  return j.dump(2) + "\n";
}

static void write_file_atomic(const std::string& path, const std::string& content) {
  std::string tmp = path + ".tmp";
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  LATHE_CHECK(fd >= 0, "cannot create '{}': {}", tmp, std::strerror(errno));
  size_t off = 0;
  while (off < content.size()) {
    ssize_t w = ::write(fd, content.data() + off, content.size() - off);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) {
      int e = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      throw_error("writing '{}' failed: {}", tmp, std::strerror(e));
    }
    off += static_cast<size_t>(w);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    ::unlink(tmp.c_str());
    throw_error("fsync/close of '{}' failed: {}", tmp, std::strerror(errno));
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    int e = errno;
    ::unlink(tmp.c_str());
    throw_error("renaming '{}' to '{}' failed: {}", tmp, path, std::strerror(e));
  }
}

void save_hf_tokenizer(BpeModel& m, const std::string& dir) {
  resolve_special_roles(m);
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  LATHE_CHECK(!ec, "--out '{}': cannot create directory: {}", dir, ec.message());
  write_file_atomic(dir + "/tokenizer.json", hf_tokenizer_json(m));
  write_file_atomic(dir + "/tokenizer_config.json", hf_tokenizer_config_json(m));
  int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

}  // namespace lathe::tok
