// load_tokenizer and the two simple tokenizers: raw bytes, and SentencePiece .model files
// through libsentencepiece.
#include "tokenizer/tokenizer.h"

#include <sentencepiece_processor.h>

#include <cstring>
#include <exception>
#include <filesystem>

#include "core/error.h"
#include "io/fs.h"
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

// ---- SentencePiece charsmap check
// libsentencepiece (0.1.97) trusts the precompiled normalization table inside a .model file: a
// darts-clone double-array trie whose leaves are offsets into a blob of NUL-terminated strings,
// read without bounds checks (and already during Load, which encodes the model's self-test
// samples). A corrupt table is an out-of-bounds read. So before the bytes reach the library the
// table(s) are located with a minimal protobuf wire reader and checked: every trie transition and
// every leaf offset must stay inside its blob.

// One field of a protobuf message: number, wire type, payload (length-delimited fields only).
struct PbField {
  uint32_t number, wire;
  std::string_view bytes;
};

bool pb_varint(std::string_view& s, uint64_t& v) {
  v = 0;
  for (int shift = 0; shift < 64 && !s.empty(); shift += 7) {
    const auto b = static_cast<uint8_t>(s[0]);
    s.remove_prefix(1);
    v |= static_cast<uint64_t>(b & 0x7F) << shift;
    if (!(b & 0x80)) return true;
  }
  return false;
}

// Splits a message into fields; false when the wire format is malformed (or uses groups, which no
// SentencePiece model does).
bool pb_fields(std::string_view s, std::vector<PbField>& out) {
  while (!s.empty()) {
    uint64_t key = 0, v = 0;
    if (!pb_varint(s, key)) return false;
    PbField f{static_cast<uint32_t>(key >> 3), static_cast<uint32_t>(key & 7), {}};
    if (f.wire == 0) {
      if (!pb_varint(s, v)) return false;
    } else if (f.wire == 1 || f.wire == 5) {
      const size_t n = f.wire == 1 ? 8 : 4;
      if (s.size() < n) return false;
      s.remove_prefix(n);
    } else if (f.wire == 2) {
      if (!pb_varint(s, v) || v > s.size()) return false;
      f.bytes = s.substr(0, v);
      s.remove_prefix(v);
    } else {
      return false;
    }
    out.push_back(f);
  }
  return true;
}

uint32_t le32(const char* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Why the precompiled_charsmap `blob` would make libsentencepiece read out of bounds, "" if it is sound.
std::string charsmap_problem(std::string_view blob) {
  if (blob.empty()) return "";  // no table: the library skips the trie
  if (blob.size() < 4) return "shorter than its 4-byte header";
  const uint64_t trie_bytes = le32(blob.data());
  if (trie_bytes + 4 > blob.size()) return fmt::format("its trie ({} bytes) exceeds the table", trie_bytes);
  if (trie_bytes == 0 || trie_bytes % 4)
    return fmt::format("its trie size {} is not a positive multiple of 4", trie_bytes);
  const char* units = blob.data() + 4;
  const uint64_t n = trie_bytes / 4;
  const std::string_view strings = blob.substr(4 + trie_bytes);
  for (uint64_t i = 0; i < n; ++i) {
    const uint32_t u = le32(units + 4 * i);
    // A leaf (value) unit is never a transition source, except the root: the search starts at unit
    // 0 and follows its offset without checking a label (a fuzzed root with bit 31 set read far
    // outside the trie in libsentencepiece's NormalizePrefix).
    if ((u >> 31) && i != 0) continue;
    const uint64_t pos = i ^ ((u >> 10) << ((u & (1u << 9)) >> 6));
    // The next unit read is pos ^ c for an input byte c, and pos itself for a leaf.
    if ((pos | 0xFF) >= n) return fmt::format("trie unit {} points outside the trie", i);
    if ((u >> 8) & 1) {
      const uint32_t v = le32(units + 4 * pos) & 0x7FFFFFFFu;
      if (v >= strings.size() || std::memchr(strings.data() + v, 0, strings.size() - v) == nullptr)
        return fmt::format("trie unit {} maps to offset {}, outside its {} bytes of strings", i, v, strings.size());
    }
  }
  return "";
}

// Checks the normalizer_spec (field 3) and denormalizer_spec (field 5) tables of a ModelProto.
// Repeated occurrences of a message field merge and a bytes field keeps its last value, as protobuf does.
void check_spm_charsmaps(std::string_view model, const std::string& path) {
  std::vector<PbField> top, spec;
  LATHE_CHECK(pb_fields(model, top),
              "SentencePiece model {}: not a valid SentencePiece model (the bytes are not a well-formed protobuf "
              "message); the file is corrupt or not a .model file",
              path);
  for (uint32_t which : {3u, 5u}) {
    std::optional<std::string_view> blob;
    for (const PbField& f : top) {
      if (f.number != which || f.wire != 2) continue;
      spec.clear();
      LATHE_CHECK(pb_fields(f.bytes, spec), "SentencePiece model {}: {} is not a well-formed protobuf message", path,
                  which == 3 ? "normalizer_spec" : "denormalizer_spec");
      for (const PbField& g : spec)
        if (g.number == 2 && g.wire == 2) blob = g.bytes;
    }
    if (!blob) continue;
    const std::string why = charsmap_problem(*blob);
    LATHE_CHECK(why.empty(),
                "SentencePiece model {}: {}.precompiled_charsmap is corrupt ({}); libsentencepiece would read out "
                "of bounds with it: re-download the model or re-train it with spm_train",
                path, which == 3 ? "normalizer_spec" : "denormalizer_spec", why);
  }
}

class SpmTokenizer : public Tokenizer {
 public:
  // The bytes are read by io::read_file (a regular file only: a FIFO would block libsentencepiece's
  // ifstream forever) and handed over from memory; library statuses become messages that say
  // what is wrong with the file.
  explicit SpmTokenizer(const std::string& path) : path_(path) {
    const std::string bytes = io::read_file(path);
    LATHE_CHECK(!bytes.empty(),
                "SentencePiece model {}: the file is empty (a .model file is a serialized SentencePiece "
                "ModelProto; re-download it or re-train it with spm_train)",
                path);
    check_spm_charsmaps(bytes, path);
    sentencepiece::util::Status st;
    try {
      st = sp_.LoadFromSerializedProto(bytes);
    } catch (const std::exception& e) {
      // libsentencepiece's bundled darts-clone throws (e.g. "zero-length key" for an empty piece).
      throw_error(
          "SentencePiece model {}: not a valid SentencePiece model ({}); the file is corrupt: re-download it or "
          "re-train it with spm_train",
          path, e.what());
    }
    if (!st.ok()) {
      std::string why = st.error_message();
      if (why.find("ParseFromArray") != std::string::npos) why = "the bytes do not parse as a ModelProto";
      throw_error(
          "SentencePiece model {}: not a valid SentencePiece model ({}); the file is corrupt or not a .model "
          "file: re-download it or re-train it with spm_train",
          path, why);
    }
    LATHE_CHECK(sp_.GetPieceSize() > 0, "SentencePiece model {}: not a valid SentencePiece model (no pieces)", path);
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

// True when something is at p (a file, a directory, a FIFO, a dangling link or a link loop), so
// that the reader names what is wrong with it instead of calling it missing. No exceptions:
// std::filesystem's throwing overloads abort on a symlink loop.
static bool present(const fs::path& p) {
  std::error_code ec;
  auto st = fs::symlink_status(p, ec);
  return !ec && st.type() != fs::file_type::not_found;
}

static bool is_dir(const fs::path& p) {
  std::error_code ec;
  return fs::is_directory(p, ec);
}

std::unique_ptr<Tokenizer> load_tokenizer(const std::string& path) {
  if (path == "byte") return std::make_unique<ByteTokenizer>();
  fs::path p(path);
  LATHE_CHECK(present(p),
              "tokenizer {}: no such file or directory (give 'byte', a directory with tokenizer.json, "
              "encoder.json + vocab.bpe, vocab.json + merges.txt or tokenizer.model, or one of those files)",
              path);
  if (is_dir(p)) {
    if (present(p / "tokenizer.json")) return load_hf_json((p / "tokenizer.json").string());
    for (auto [v, m] : {std::pair{"encoder.json", "vocab.bpe"}, std::pair{"vocab.json", "merges.txt"}}) {
      bool hv = present(p / v), hm = present(p / m);
      if (hv && hm) return load_gpt2_legacy((p / v).string(), (p / m).string());
      LATHE_CHECK(!(hv || hm), "tokenizer directory {}: has {} but not {} (GPT-2 style BPE needs both files)", path,
                  hv ? v : m, hv ? m : v);
    }
    if (present(p / "tokenizer.model")) return std::make_unique<SpmTokenizer>((p / "tokenizer.model").string());
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
    LATHE_CHECK(present(m), "tokenizer {}: the merges file {} is missing next to it", path, m.string());
    return load_gpt2_legacy(path, m.string());
  }
  if (ext == ".json") return load_hf_json(path);
  if (name == "vocab.bpe" || name == "merges.txt") {
    fs::path v = p.parent_path() / (name == "vocab.bpe" ? "encoder.json" : "vocab.json");
    LATHE_CHECK(present(v), "tokenizer {}: the vocabulary file {} is missing next to it", path, v.string());
    return load_gpt2_legacy(v.string(), path);
  }
  throw_error(
      "tokenizer {}: unrecognized file (expected tokenizer.json, a .model SentencePiece file, "
      "encoder.json/vocab.bpe or vocab.json/merges.txt, or a directory holding them)",
      path);
}

}  // namespace lathe::tok
