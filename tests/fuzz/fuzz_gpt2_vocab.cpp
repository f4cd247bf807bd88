// Fuzz target: the GPT-2 file pair encoder.json + vocab.bpe (load_gpt2_legacy through
// load_tokenizer on a directory). The input is the encoder.json bytes, a NUL byte, then the
// vocab.bpe bytes (no NUL: vocab.bpe is empty). Both files go to a private directory under /tmp,
// so no tokenizer_config.json is picked up. A tokenizer that loads encodes and decodes a fixed
// text; every id it emits must be one of its own.
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "fuzz_target.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer_check.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string dir = [] {
    std::string d = "/tmp/lathe_fuzz_" + std::to_string(::getpid()) + "_gpt2";
    ::mkdir(d.c_str(), 0700);
    return d;
  }();
  const void* nul = size ? std::memchr(data, 0, size) : nullptr;
  const size_t n_enc = nul ? static_cast<size_t>(static_cast<const uint8_t*>(nul) - data) : size;
  const size_t n_bpe = nul ? size - n_enc - 1 : 0;
  lathe::fuzz::TempFile enc(data, n_enc, "_gpt2/encoder.json");
  lathe::fuzz::TempFile bpe(data + size - n_bpe, n_bpe, "_gpt2/vocab.bpe");
  lathe::fuzz::expect_clean([&] {
    auto t = lathe::tok::load_tokenizer(dir);
    static const std::string kText = "Hello world! It's 2024:  caf\xc3\xa9 <|endoftext|> \xff\xfe a\tb\n end.";
    lathe::fuzz::encode_decode_in_vocab(*t, kText);
  });
  return 0;
}
