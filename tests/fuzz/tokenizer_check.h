// Shared by the tokenizer fuzz targets: a loaded tokenizer must encode `text` (with and without
// special tokens) to ids inside its vocabulary and decode them back without crashing.
#pragma once
#include <cstdlib>
#include <string>
#include <vector>

#include "tokenizer/tokenizer.h"

namespace lathe::fuzz {

inline void encode_decode_in_vocab(const tok::Tokenizer& t, const std::string& text) {
  for (bool special : {false, true}) {
    const std::vector<int32_t> ids = t.encode(text, special);
    for (int32_t id : ids)
      if (id < 0 || id >= t.vocab_size()) std::abort();  // encode emitted an id outside the vocabulary
    t.decode(ids, special);
  }
}

}  // namespace lathe::fuzz
