// Unicode NFC normalization (canonical decomposition, canonical ordering, canonical
// composition), for tokenizer.json "NFC" normalizers (Qwen2). Tables: nfc_data.h.
// Invalid UTF-8 bytes are kept as they are and block composition.
#pragma once
#include <string>

namespace lathe::tok {

// In place; returns quickly when the text has no code point >= U+0300.
void nfc_normalize(std::string& s);

}  // namespace lathe::tok
