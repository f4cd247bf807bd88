// Fuzz target: HF tokenizer.json (src/tokenizer/hf_tokenizer.cpp + hf_components.cpp) from
// arbitrary bytes. The document goes through io::parse_json (depth check) and make_hf_tokenizer,
// as load_tokenizer does for a tokenizer.json; a tokenizer that loads is then run on a fixed text
// (normalizers, pre-tokenizers, added tokens, BPE, post-processor, decoders), and every id it emits
// must be one of its own (a post-processor id outside the vocabulary is a finding).
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "fuzz_target.h"
#include "tokenizer_check.h"
#include "io/json.h"
#include "tokenizer/hf_tokenizer.h"

namespace {

void exercise(const lathe::tok::Tokenizer& t) {
  // ASCII words, digits, runs of spaces, a tab and a newline, punctuation, the Metaspace mark,
  // multi-byte UTF-8, invalid UTF-8 and common special tokens.
  static const std::string kText =
      "Hello world! It's 2024:  caf\xc3\xa9  \xe2\x96\x81x <|endoftext|><s></s> [CLS]<mask> \xff\xfe a\tb\n end.";
  lathe::fuzz::expect_clean([&] { lathe::fuzz::encode_decode_in_vocab(t, kText); });
  // Decoding any id of the vocabulary either works or is a clean error (holes in the ids).
  const int64_t n = std::min<int64_t>(t.vocab_size(), 512);
  for (int64_t i = 0; i < n; i += 7) {
    const int32_t id = static_cast<int32_t>(i);
    lathe::fuzz::expect_clean([&] { t.decode({&id, 1}, false); });
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  lathe::fuzz::expect_clean([&] {
    const nlohmann::json cfg = lathe::io::parse_json(lathe::fuzz::as_text(data, size), "tokenizer.json");
    auto t = lathe::tok::make_hf_tokenizer(cfg, "tokenizer.json", "", {}, "");
    exercise(*t);
  });
  return 0;
}
