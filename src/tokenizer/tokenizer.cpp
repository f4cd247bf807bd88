// load_tokenizer and the two simple tokenizers: raw bytes, and SentencePiece .model files
// through libsentencepiece.
#include "tokenizer/tokenizer.h"

#include <sentencepiece_processor.h>

#include <filesystem>
#include <fstream>

#include "core/error.h"
#include "tokenizer/hf_tokenizer.h"

namespace lathe::tok {

std::unique_ptr<Tokenizer> load_hf_json(const std::string& path);  // hf_tokenizer.cpp

namespace fs = std::filesystem;

namespace {

class ByteTokenizer : public Tokenizer {
 public:
  std::vector<int32_t> encode(std::string_view text, bool) const override {
    std::vector<int32_t> out(text.size());
    for (size_t i = 0; i < text.size(); ++i) out[i] = static_cast<unsigned char>(text[i]);
    return out;
  }
  std::string decode(std::span<const int32_t> ids, bool) const override {
    std::string out(ids.size(), '\0');
    for (size_t i = 0; i < ids.size(); ++i) {
      LATHE_CHECK(ids[i] >= 0 && ids[i] < 256, "decode: token id {} is not a byte (the 'byte' tokenizer has ids 0-255)",
                  ids[i]);
      out[i] = static_cast<char>(ids[i]);
    }
    return out;
  }
  int64_t vocab_size() const override { return 256; }
  std::optional<int32_t> token_to_id(std::string_view token) const override {
    if (token.size() != 1) return std::nullopt;
    return static_cast<unsigned char>(token[0]);
  }
  bool is_byte_level() const override { return true; }
  std::string kind() const override { return "byte"; }
  std::vector<std::string> source_files() const override { return {}; }
};

class SpmTokenizer : public Tokenizer {
 public:
  explicit SpmTokenizer(const std::string& path) : path_(path) {
    auto st = sp_.Load(path);
    LATHE_CHECK(st.ok(), "SentencePiece model {}: cannot be loaded: {}", path, st.ToString());
  }
  std::vector<int32_t> encode(std::string_view text, bool add_special_tokens) const override {
    std::vector<int> ids;
    auto st = sp_.Encode(text, &ids);
    LATHE_CHECK(st.ok(), "SentencePiece model {}: encode failed: {}", path_, st.ToString());
    std::vector<int32_t> out;
    out.reserve(ids.size() + 1);
    // As Llama's tokenizer (add_bos_token=true, add_eos_token=false).
    if (add_special_tokens && sp_.bos_id() >= 0) out.push_back(sp_.bos_id());
    out.insert(out.end(), ids.begin(), ids.end());
    return out;
  }
  std::string decode(std::span<const int32_t> ids, bool) const override {
    // libsentencepiece never renders control pieces (<s>, </s>), skip_special_tokens or not.
    std::vector<int> v(ids.begin(), ids.end());
    for (int id : v)
      LATHE_CHECK(id >= 0 && id < sp_.GetPieceSize(), "decode: token id {} is not in the vocabulary (size {})", id,
                  sp_.GetPieceSize());
    std::string out;
    auto st = sp_.Decode(v, &out);
    LATHE_CHECK(st.ok(), "SentencePiece model {}: decode failed: {}", path_, st.ToString());
    return out;
  }
  int64_t vocab_size() const override { return sp_.GetPieceSize(); }
  std::optional<int32_t> token_to_id(std::string_view token) const override {
    int id = sp_.PieceToId(token);  // returns unk_id for unknown pieces
    if (id < 0 || sp_.IdToPiece(id) != token) return std::nullopt;
    return id;
  }
  std::optional<int32_t> bos_id() const override { return opt(sp_.bos_id()); }
  std::optional<int32_t> eos_id() const override { return opt(sp_.eos_id()); }
  std::optional<int32_t> pad_id() const override { return opt(sp_.pad_id()); }
  bool is_byte_level() const override { return false; }
  std::string kind() const override { return "sentencepiece"; }
  std::vector<std::string> source_files() const override { return {path_}; }

 private:
  static std::optional<int32_t> opt(int id) { return id >= 0 ? std::optional<int32_t>(id) : std::nullopt; }
  std::string path_;
  sentencepiece::SentencePieceProcessor sp_;
};

}  // namespace

std::unique_ptr<Tokenizer> load_tokenizer(const std::string& path) {
  if (path == "byte") return std::make_unique<ByteTokenizer>();
  fs::path p(path);
  std::error_code ec;
  LATHE_CHECK(fs::exists(p, ec),
              "tokenizer {}: no such file or directory (give 'byte', a directory with tokenizer.json, "
              "encoder.json + vocab.bpe, vocab.json + merges.txt or tokenizer.model, or one of those files)",
              path);
  if (fs::is_directory(p)) {
    if (fs::exists(p / "tokenizer.json")) return load_hf_json((p / "tokenizer.json").string());
    for (auto [v, m] : {std::pair{"encoder.json", "vocab.bpe"}, std::pair{"vocab.json", "merges.txt"}}) {
      bool hv = fs::exists(p / v), hm = fs::exists(p / m);
      if (hv && hm) return load_gpt2_legacy((p / v).string(), (p / m).string());
      LATHE_CHECK(!(hv || hm), "tokenizer directory {}: has {} but not {} (GPT-2 style BPE needs both files)", path,
                  hv ? v : m, hv ? m : v);
    }
    if (fs::exists(p / "tokenizer.model")) return std::make_unique<SpmTokenizer>((p / "tokenizer.model").string());
    throw_error(
        "tokenizer directory {}: contains none of tokenizer.json, encoder.json + vocab.bpe, "
        "vocab.json + merges.txt, tokenizer.model",
        path);
  }
  std::string ext = p.extension().string();
  std::string name = p.filename().string();
  if (ext == ".model") return std::make_unique<SpmTokenizer>(path);
  if (name == "encoder.json" || name == "vocab.json") {
    fs::path m = p.parent_path() / (name == "encoder.json" ? "vocab.bpe" : "merges.txt");
    LATHE_CHECK(fs::exists(m), "tokenizer {}: the merges file {} is missing next to it", path, m.string());
    return load_gpt2_legacy(path, m.string());
  }
  if (ext == ".json") return load_hf_json(path);
  if (name == "vocab.bpe" || name == "merges.txt") {
    fs::path v = p.parent_path() / (name == "vocab.bpe" ? "encoder.json" : "vocab.json");
    LATHE_CHECK(fs::exists(v), "tokenizer {}: the vocabulary file {} is missing next to it", path, v.string());
    return load_gpt2_legacy(v.string(), path);
  }
  throw_error(
      "tokenizer {}: unrecognized file (expected tokenizer.json, a .model SentencePiece file, "
      "encoder.json/vocab.bpe or vocab.json/merges.txt, or a directory holding them)",
      path);
}

}  // namespace lathe::tok
