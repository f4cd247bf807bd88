// Tokenizers: text <-> token ids, exact to the reference implementations (HF `tokenizers`,
// libsentencepiece, the original GPT-2 encoder).
//
//   auto tok = lathe::tok::load_tokenizer("path/to/dir-or-file");   // or "byte"
//   std::vector<int32_t> ids = tok->encode("Hello world");
//   std::string text = tok->decode(ids);
//
// Thread-safety: encode/decode are const and may be called concurrently from several threads on
// one Tokenizer (the preprocessing pipeline shares one instance); caches are thread_local.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace lathe::tok {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  // Token ids of `text`. add_special_tokens=true applies the post-processor template (BOS/EOS)
  // as HF's encode() does by default.
  virtual std::vector<int32_t> encode(std::string_view text, bool add_special_tokens = false) const = 0;
  // encode() appended to `out` (the preprocessing workers encode a whole batch into one vector).
  virtual void encode_append(std::string_view text, std::vector<int32_t>& out, bool add_special_tokens = false) const {
    std::vector<int32_t> ids = encode(text, add_special_tokens);
    out.insert(out.end(), ids.begin(), ids.end());
  }
  virtual std::string decode(std::span<const int32_t> ids, bool skip_special_tokens = false) const = 0;
  // Including added tokens (max id + 1).
  virtual int64_t vocab_size() const = 0;
  virtual std::optional<int32_t> token_to_id(std::string_view token) const = 0;
  virtual std::optional<int32_t> bos_id() const { return std::nullopt; }
  virtual std::optional<int32_t> eos_id() const { return std::nullopt; }
  virtual std::optional<int32_t> pad_id() const { return std::nullopt; }
  // true: any byte string round-trips through decode(encode(bytes)).
  virtual bool is_byte_level() const = 0;
  // "byte", "hf-bpe-bytelevel", "hf-bpe-sentencepiece", "gpt2-legacy", "sentencepiece"
  virtual std::string kind() const = 0;
  // Files that describe this tokenizer, to be copied next to an exported model (empty for "byte").
  virtual std::vector<std::string> source_files() const = 0;
};

// path: "byte" (ids 0-255 = the bytes; vocab_size 256; no specials), a directory (tokenizer.json,
// or encoder.json+vocab.bpe / vocab.json+merges.txt, or tokenizer.model) or a file.
// Errors (lathe::Error) name the path and what is missing.
std::unique_ptr<Tokenizer> load_tokenizer(const std::string& path);

}  // namespace lathe::tok
