// Fuzz target: SentencePiece .model files (the SpmTokenizer wrapper in src/tokenizer/tokenizer.cpp
// over libsentencepiece) through load_tokenizer on a .model path. A model that loads encodes and
// decodes a fixed text; every id must be below the piece count.
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "fuzz_target.h"
#include "tokenizer/tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  lathe::fuzz::TempFile file(data, size, ".model");
  lathe::fuzz::expect_clean([&] {
    auto t = lathe::tok::load_tokenizer(file.path());
    static const std::string kText = "Hello world! It's 2024:  caf\xc3\xa9 \xe2\x96\x81x <s></s> \xff\xfe a\tb\n end.";
    for (bool special : {false, true}) {
      const std::vector<int32_t> ids = t->encode(kText, special);
      for (int32_t id : ids)
        if (id < 0 || id >= t->vocab_size()) std::abort();  // encode emitted an id outside the vocabulary
      t->decode(ids, special);
    }
  });
  return 0;
}
