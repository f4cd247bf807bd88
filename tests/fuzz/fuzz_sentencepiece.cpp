// Fuzz target: SentencePiece .model files (the SpmTokenizer wrapper in src/tokenizer/tokenizer.cpp
// over libsentencepiece) through load_tokenizer on a .model path. A model that loads encodes and
// decodes a fixed text; every id must be below the piece count.
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "fuzz_target.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer_check.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  lathe::fuzz::TempFile file(data, size, ".model");
  lathe::fuzz::expect_clean([&] {
    auto t = lathe::tok::load_tokenizer(file.path());
    static const std::string kText = "Hello world! It's 2024:  caf\xc3\xa9 \xe2\x96\x81x <s></s> \xff\xfe a\tb\n end.";
    lathe::fuzz::encode_decode_in_vocab(*t, kText);
  });
  return 0;
}
