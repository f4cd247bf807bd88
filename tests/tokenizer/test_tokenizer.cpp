// Unit tests of src/tokenizer: the byte tokenizer, load errors (each names the path and what is
// missing or wrong), BPE merging against a naive reference loop, added tokens, thread safety.
// Exactness against HF tokenizers / libsentencepiece is in test_tokenizer_exact.py.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "core/error.h"
#include "tokenizer/bpe.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/word_cache.h"

namespace fs = std::filesystem;
using lathe::tok::load_tokenizer;
using nlohmann::json;

namespace {

fs::path temp_dir(const std::string& name) {
  fs::path d = fs::temp_directory_path() / ("lathe_tok_unit_" + std::to_string(::getpid())) / name;
  fs::create_directories(d);
  return d;
}

void write(const fs::path& p, const std::string& s) {
  std::ofstream f(p, std::ios::binary);
  f << s;
}

// Message of the lathe::Error thrown by load_tokenizer(path), "" if none.
std::string load_error(const std::string& path) {
  try {
    load_tokenizer(path);
  } catch (const lathe::Error& e) {
    return e.what();
  }
  return "";
}

std::string gpt2_dir() {
  for (const char* d : {"/work/shared/data/gpt2", LATHE_SOURCE_DIR "/../shared/data/gpt2"})
    if (fs::exists(fs::path(d) / "encoder.json")) return d;
  return "";
}

}  // namespace

TEST(ByteTokenizer, EncodeDecodeAllBytes) {
  auto t = load_tokenizer("byte");
  std::string s;
  for (int b = 0; b < 256; ++b) s += static_cast<char>(b);
  auto ids = t->encode(s, true);
  ASSERT_EQ(ids.size(), 256u);
  for (int b = 0; b < 256; ++b) EXPECT_EQ(ids[b], b);
  EXPECT_EQ(t->decode(ids), s);
  EXPECT_EQ(t->vocab_size(), 256);
  EXPECT_TRUE(t->is_byte_level());
  EXPECT_EQ(t->kind(), "byte");
  EXPECT_FALSE(t->bos_id().has_value());
  EXPECT_TRUE(t->source_files().empty());
  EXPECT_EQ(t->token_to_id("A"), 65);
  std::vector<int32_t> bad{65, 256};
  EXPECT_THROW(t->decode(bad), lathe::Error);
}

TEST(LoadErrors, MissingPath) {
  std::string msg = load_error("/nonexistent/tok");
  EXPECT_NE(msg.find("/nonexistent/tok"), std::string::npos) << msg;
  EXPECT_NE(msg.find("no such file"), std::string::npos) << msg;
}

TEST(LoadErrors, EmptyDirectoryListsExpectedFiles) {
  auto d = temp_dir("empty");
  std::string msg = load_error(d.string());
  EXPECT_NE(msg.find(d.string()), std::string::npos) << msg;
  EXPECT_NE(msg.find("tokenizer.json"), std::string::npos) << msg;
  EXPECT_NE(msg.find("tokenizer.model"), std::string::npos) << msg;
}

TEST(LoadErrors, HalfOfGpt2Pair) {
  auto d = temp_dir("half");
  write(d / "encoder.json", "{\"a\": 0}");
  std::string msg = load_error(d.string());
  EXPECT_NE(msg.find("vocab.bpe"), std::string::npos) << msg;
}

TEST(LoadErrors, BadJson) {
  auto d = temp_dir("badjson");
  write(d / "tokenizer.json", "{\"model\": {\"type\": \"BPE\", ");
  std::string msg = load_error(d.string());
  EXPECT_NE(msg.find((d / "tokenizer.json").string()), std::string::npos) << msg;
  EXPECT_NE(msg.find("not valid JSON"), std::string::npos) << msg;
}

TEST(LoadErrors, UnknownModelType) {
  auto d = temp_dir("unigram");
  write(d / "tokenizer.json", R"({"model": {"type": "Unigram", "vocab": [["a", 0.0]]}})");
  std::string msg = load_error(d.string());
  EXPECT_NE(msg.find("Unigram"), std::string::npos) << msg;
  EXPECT_NE(msg.find("not supported"), std::string::npos) << msg;
}

TEST(LoadErrors, UnknownComponentAndBadMerge) {
  auto d = temp_dir("component");
  json j = {{"model", {{"type", "BPE"}, {"vocab", {{"a", 0}, {"b", 1}, {"ab", 2}}}, {"merges", {"a b"}}}},
            {"pre_tokenizer", {{"type", "UnicodeScripts"}}}};
  write(d / "tokenizer.json", j.dump());
  std::string msg = load_error(d.string());
  EXPECT_NE(msg.find("UnicodeScripts"), std::string::npos) << msg;

  j.erase("pre_tokenizer");
  j["model"]["merges"] = {"a c"};
  write(d / "tokenizer.json", j.dump());
  msg = load_error(d.string());
  EXPECT_NE(msg.find("'c' is not in the vocab"), std::string::npos) << msg;

  j["model"]["merges"] = {"a b c"};
  write(d / "tokenizer.json", j.dump());
  msg = load_error(d.string());
  EXPECT_NE(msg.find("a b c"), std::string::npos) << msg;
}

// Naive GPT-2 style BPE (openai encoder.py `bpe`): repeatedly take the lowest-ranked adjacent pair
// and merge all its occurrences left to right.
static std::vector<std::string> naive_bpe(const std::string& w,
                                          const std::map<std::pair<std::string, std::string>, int>& ranks) {
  std::vector<std::string> word;
  for (char c : w) word.push_back(std::string(1, c));
  while (word.size() > 1) {
    int best = INT32_MAX;
    std::pair<std::string, std::string> bp;
    for (size_t i = 0; i + 1 < word.size(); ++i) {
      auto it = ranks.find({word[i], word[i + 1]});
      if (it != ranks.end() && it->second < best) {
        best = it->second;
        bp = it->first;
      }
    }
    if (best == INT32_MAX) break;
    std::vector<std::string> nw;
    for (size_t i = 0; i < word.size();) {
      if (i + 1 < word.size() && word[i] == bp.first && word[i + 1] == bp.second) {
        nw.push_back(bp.first + bp.second);
        i += 2;
      } else {
        nw.push_back(word[i++]);
      }
    }
    word = nw;
  }
  return word;
}

TEST(Bpe, MatchesNaiveMergeLoop) {
  // Vocabulary over {a,b,c}: all strings up to length 4, merges in a random but fixed order.
  std::vector<std::string> toks = {"a", "b", "c"};
  for (size_t k = 0; k < toks.size() && toks.size() < 120; ++k)
    for (const char* c : {"a", "b", "c"})
      if (toks[k].size() < 4) toks.push_back(toks[k] + c);
  json vocab = json::object();
  for (size_t i = 0; i < toks.size(); ++i) vocab[toks[i]] = static_cast<int>(i);
  std::vector<std::pair<std::string, std::string>> merges;
  for (auto& t : toks)
    if (t.size() >= 2) merges.push_back({t.substr(0, 1 + t.size() / 3), t.substr(1 + t.size() / 3)});
  std::mt19937 g(7);
  // A random order, constrained as real merge lists are (a merge's parts are created by earlier
  // merges): the naive loop is only equivalent to HF's priority-queue merging under that condition.
  std::shuffle(merges.begin(), merges.end(), g);
  std::stable_sort(merges.begin(), merges.end(), [](auto& x, auto& y) {
    return x.first.size() + x.second.size() < y.first.size() + y.second.size();
  });
  std::map<std::pair<std::string, std::string>, int> ranks;
  json jm = json::array();
  for (size_t r = 0; r < merges.size(); ++r) {
    ranks[merges[r]] = static_cast<int>(r);
    jm.push_back({merges[r].first, merges[r].second});
  }
  auto d = temp_dir("naive");
  write(d / "tokenizer.json", json{{"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", jm}}}}.dump());
  auto t = load_tokenizer(d.string());
  EXPECT_EQ(t->kind(), "hf-bpe-sentencepiece");
  std::uniform_int_distribution<int> len(1, 30), ch(0, 2);
  for (int trial = 0; trial < 2000; ++trial) {
    std::string w;
    int n = len(g);
    for (int i = 0; i < n; ++i) w += static_cast<char>('a' + ch(g));
    std::vector<int32_t> want;
    for (auto& s : naive_bpe(w, ranks)) want.push_back(vocab[s].get<int32_t>());
    ASSERT_EQ(t->encode(w), want) << w;
    ASSERT_EQ(t->decode(t->encode(w)), [&] {
      std::string s;
      for (auto& p : naive_bpe(w, ranks)) s += (s.empty() ? "" : " ") + p;  // no decoder: join with spaces
      return s;
    }());
  }
}

TEST(Bpe, LoadU64IsTheZeroPaddedLittleEndianPrefix) {
  std::mt19937_64 g(3);
  for (int trial = 0; trial < 2000; ++trial) {
    unsigned char buf[16];
    for (auto& b : buf) b = static_cast<unsigned char>(g());
    for (size_t n = 0; n <= 12; ++n) {
      uint64_t want = 0;
      for (size_t i = 0; i < std::min<size_t>(n, 8); ++i) want |= static_cast<uint64_t>(buf[i]) << (8 * i);
      ASSERT_EQ(lathe::tok::detail::load_u64(reinterpret_cast<const char*>(buf), n), want) << "n=" << n;
    }
  }
}

// WordCache with every word hashing alike (one probe chain, equal tags): only the length, the
// 8-byte head and the arena tail tell the words apart. Also across growth and a clear when full.
TEST(Bpe, WordCacheTellsCollidingWordsApart) {
  lathe::tok::WordCache cache([](std::string_view) -> uint64_t { return 0x1234567890abcdefull; });
  std::vector<std::string> words;
  for (const std::string head : {"", "a", "abcdefg", "abcdefgh", "abcdefgi"})
    for (const std::string tail : {"", "x", "xy", "xyz1234567", "xyz1234568"}) words.push_back(head + tail);
  words.push_back(std::string(255, 'q'));  // the longest cacheable word
  std::sort(words.begin(), words.end());
  words.erase(std::unique(words.begin(), words.end()), words.end());
  words.erase(std::remove(words.begin(), words.end(), std::string()), words.end());
  auto ids_of = [](size_t i) {  // 1 id for some words (inline slots), several for others
    std::vector<int32_t> v;
    for (size_t k = 0; k <= i % 3; ++k) v.push_back(static_cast<int32_t>(1000 * i + k));
    return v;
  };
  for (size_t i = 0; i < words.size(); ++i) {
    auto v = ids_of(i);
    cache.insert(words[i], 0x1234567890abcdefull, v.data(), v.size());
  }
  for (size_t i = 0; i < words.size(); ++i) {
    std::vector<int32_t> out = {-1};
    ASSERT_TRUE(cache.lookup(words[i], 0x1234567890abcdefull, out)) << words[i];
    auto want = ids_of(i);
    want.insert(want.begin(), -1);  // appends
    EXPECT_EQ(out, want) << words[i];
  }
  std::vector<int32_t> out;
  EXPECT_FALSE(cache.lookup("abcdefgh-", 0x1234567890abcdefull, out));
  EXPECT_FALSE(cache.lookup("xyz1234569", 0x1234567890abcdefull, out));
  EXPECT_TRUE(out.empty());

  // Real hashes, enough words to grow to the largest table and clear it.
  lathe::tok::WordCache big(
      [](std::string_view s) -> uint64_t { return std::hash<std::string_view>{}(s)*0x9E3779B97F4A7C15ull; });
  auto h = [](const std::string& s) { return std::hash<std::string_view>{}(s)*0x9E3779B97F4A7C15ull; };
  const size_t n = lathe::tok::WordCache::kMaxEntries + 1000;
  for (size_t i = 0; i < n; ++i) {
    std::string w = "word" + std::to_string(i);
    int32_t id = static_cast<int32_t>(i);
    big.insert(w, h(w), &id, 1);
    if (i % 997 == 0 || i + 1 == lathe::tok::WordCache::kMaxEntries) {  // before the clear
      std::vector<int32_t> o;
      ASSERT_TRUE(big.lookup(w, h(w), o));
      ASSERT_EQ(o, std::vector<int32_t>{id});
      std::string first = "word0";
      ASSERT_EQ(big.lookup(first, h(first), o), i < lathe::tok::WordCache::kMaxEntries) << i;
    }
  }
  std::vector<int32_t> o;
  EXPECT_FALSE(big.lookup("word5", h("word5"), o));  // cleared when it was full
  std::string last = "word" + std::to_string(n - 1);
  EXPECT_TRUE(big.lookup(last, h(last), o));
}

// The per-thread word cache must return exactly what merging computes, also after it grew and
// after it was cleared for being full (65536 entries): 150k distinct words, many sharing their
// first 8 bytes, each encoded uncached first and compared with a cached encode later.
TEST(Bpe, WordCacheReturnsTheMergedIdsAcrossGrowthAndClears) {
  std::vector<std::string> toks = {"a", "b", "c", "d"};
  for (size_t k = 0; k < toks.size() && toks.size() < 300; ++k)
    for (const char* c : {"a", "b", "c", "d"})
      if (toks[k].size() < 4) toks.push_back(toks[k] + c);
  json vocab = json::object();
  for (size_t i = 0; i < toks.size(); ++i) vocab[toks[i]] = static_cast<int>(i);
  json jm = json::array();
  for (auto& t : toks)
    if (t.size() >= 2) jm.push_back({t.substr(0, t.size() - 1), t.substr(t.size() - 1)});
  auto d = temp_dir("cache");
  write(d / "tokenizer.json", json{{"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", jm}}}}.dump());
  auto t = load_tokenizer(d.string());
  std::mt19937 g(5);
  std::uniform_int_distribution<int> len(1, 40), ch(0, 3);
  std::vector<std::string> words;
  std::vector<std::vector<int32_t>> first;
  std::map<std::string, size_t> seen;
  while (words.size() < 150000) {
    std::string w = words.empty() || g() % 2 ? std::string() : words[g() % words.size()].substr(0, 8);
    for (int i = 0, n = len(g); i < n; ++i) w += static_cast<char>('a' + ch(g));
    if (!seen.emplace(w, words.size()).second) continue;
    words.push_back(w);
    first.push_back(t->encode(w));
  }
  for (size_t i = 0; i < words.size(); i += 7) {
    ASSERT_EQ(t->encode(words[i]), first[i]) << words[i];  // cached now, or recomputed after a clear
    ASSERT_EQ(t->encode(words[i]), first[i]) << words[i];  // certainly cached
  }
}

TEST(Gpt2Legacy, SpecialsAndThreads) {
  std::string dir = gpt2_dir();
  if (dir.empty()) GTEST_SKIP() << "shared GPT-2 files not found";
  auto t = load_tokenizer(dir);
  EXPECT_EQ(t->kind(), "gpt2-legacy");
  EXPECT_EQ(t->vocab_size(), 50257);
  EXPECT_EQ(t->eos_id(), 50256);
  EXPECT_TRUE(t->is_byte_level());
  EXPECT_EQ(t->source_files().size(), 2u);
  EXPECT_EQ(t->token_to_id("<|endoftext|>"), 50256);
  auto ids = t->encode("Hello world<|endoftext|>");
  EXPECT_EQ(ids, (std::vector<int32_t>{15496, 995, 50256}));  // GPT-2's published ids for these words
  // Concurrent encodes of different texts agree with the single-threaded result.
  std::vector<std::string> texts;
  for (int i = 0; i < 64; ++i)
    texts.push_back("Thread " + std::to_string(i * 7919) + " says: héllo wörld 你好 " + std::string(i % 5, ' ') +
                    "end");
  std::vector<std::vector<int32_t>> want;
  for (auto& s : texts) want.push_back(t->encode(s));
  std::vector<std::thread> th;
  std::atomic<int> bad{0};
  for (int k = 0; k < 4; ++k)
    th.emplace_back([&, k] {
      for (int rep = 0; rep < 200; ++rep)
        for (size_t i = k; i < texts.size(); i += 3)
          if (t->encode(texts[i]) != want[i] || t->decode(want[i]) != texts[i]) ++bad;
    });
  for (auto& x : th) x.join();
  EXPECT_EQ(bad.load(), 0);
}

TEST(Gpt2Legacy, VocabJsonMergesTxtPairAndFiles) {
  std::string dir = gpt2_dir();
  if (dir.empty()) GTEST_SKIP() << "shared GPT-2 files not found";
  auto d = temp_dir("vocab_merges");
  fs::copy_file(fs::path(dir) / "encoder.json", d / "vocab.json", fs::copy_options::overwrite_existing);
  fs::copy_file(fs::path(dir) / "vocab.bpe", d / "merges.txt", fs::copy_options::overwrite_existing);
  auto a = load_tokenizer(dir);
  auto b = load_tokenizer(d.string());
  auto c = load_tokenizer((d / "merges.txt").string());
  std::string text = "The quick brown fox, 1234 times!\n\n  It's 東京.";
  EXPECT_EQ(a->encode(text), b->encode(text));
  EXPECT_EQ(a->encode(text), c->encode(text));
}

TEST(HfJson, SpecialsFromTokenizerConfigAndTemplate) {
  auto d = temp_dir("specials");
  json j = json::parse(R"({
    "model": {"type": "BPE", "vocab": {"<s>": 0, "</s>": 1, "a": 2, "b": 3, "ab": 4}, "merges": [["a", "b"]]},
    "added_tokens": [{"id": 0, "content": "<s>", "special": true}, {"id": 1, "content": "</s>", "special": true}],
    "post_processor": {"type": "TemplateProcessing",
      "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                 {"SpecialToken": {"id": "</s>", "type_id": 0}}],
      "special_tokens": {"<s>": {"id": "<s>", "ids": [0], "tokens": ["<s>"]},
                         "</s>": {"id": "</s>", "ids": [1], "tokens": ["</s>"]}}}})");
  write(d / "tokenizer.json", j.dump());
  auto t = load_tokenizer(d.string());
  EXPECT_EQ(t->bos_id(), 0);  // from the template
  EXPECT_EQ(t->eos_id(), 1);
  EXPECT_EQ(t->encode("abab</s>a", true), (std::vector<int32_t>{0, 4, 4, 1, 2, 1}));
  EXPECT_EQ(t->decode(t->encode("abab</s>a", true), true), "ab ab a");
  EXPECT_EQ(t->vocab_size(), 5);

  write(d / "tokenizer_config.json", R"({"bos_token": {"content": "</s>"}, "eos_token": "<s>", "pad_token": null})");
  t = load_tokenizer(d.string());
  EXPECT_EQ(t->bos_id(), 1);  // tokenizer_config.json wins
  EXPECT_EQ(t->eos_id(), 0);
  EXPECT_FALSE(t->pad_id().has_value());
  EXPECT_EQ(t->source_files().size(), 2u);

  write(d / "tokenizer_config.json", R"({"eos_token": "<|eot|>"})");
  std::string msg = load_error(d.string());
  EXPECT_NE(msg.find("<|eot|>"), std::string::npos) << msg;
  EXPECT_NE(msg.find("tokenizer_config.json"), std::string::npos) << msg;
}

// The token id rule (bpe.h token_id_limit): ids lie in [0, entries + 65536), entries = vocabulary
// entries + added tokens of the file. A hole just inside the bound loads (and the id table is
// sized by it); one id past it is refused with the field and the id.
TEST(HfJson, TokenIdBoundIsEntriesPlusSlack) {
  auto d = temp_dir("idbound");
  auto make = [&](int64_t added_id) {
    json j = {{"model", {{"type", "BPE"}, {"vocab", {{"a", 0}, {"b", 1}, {"ab", 2}}}, {"merges", {"a b"}}}},
              {"added_tokens", {{{"id", added_id}, {"content", "<x>"}, {"special", true}}}}};
    write(d / "tokenizer.json", j.dump());
  };
  const int64_t limit = 3 + 1 + 65536;  // 3 vocab entries + 1 added token + slack
  make(limit - 1);
  auto t = load_tokenizer(d.string());
  EXPECT_EQ(t->vocab_size(), limit);
  EXPECT_EQ(t->encode("ab<x>"), (std::vector<int32_t>{2, static_cast<int32_t>(limit - 1)}));
  make(limit);
  std::string msg = load_error(d.string());
  EXPECT_NE(msg.find("added_tokens[0].id"), std::string::npos) << msg;
  EXPECT_NE(msg.find(std::to_string(limit)), std::string::npos) << msg;
}

// A chain of normalizers that doubles the text is refused (at load, by the probe) with the stage
// named, instead of growing until memory runs out.
TEST(HfJson, GrowingNormalizerChainIsRefused) {
  auto d = temp_dir("growth");
  json reps = json::array();
  for (int i = 0; i < 30; ++i) reps.push_back({{"type", "Replace"}, {"pattern", {{"String", "a"}}}, {"content", "aa"}});
  json j = {{"model", {{"type", "BPE"}, {"vocab", {{"a", 0}}}, {"merges", json::array()}}},
            {"normalizer", {{"type", "Sequence"}, {"normalizers", reps}}}};
  write(d / "tokenizer.json", j.dump());
  std::string msg = load_error(d.string());
  EXPECT_NE(msg.find("normalizer.normalizers["), std::string::npos) << msg;
  EXPECT_NE(msg.find("(Replace)"), std::string::npos) << msg;
  EXPECT_NE(msg.find("grow"), std::string::npos) << msg;
}
