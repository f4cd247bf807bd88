// Fast path for pulling one string field out of a JSONL line without building a
// DOM.
//
// extract_json_text (corpus.h) is the contract; nlohmann::json is its
// reference. Building the nlohmann DOM (a std::map, a std::string per value, a
// character-at-a-time lexer) cost about as much CPU as the BPE encoding itself
// on typical corpora, and its allocations pressure the shared cache when
// several workers run. This scanner validates the whole line with the JSON
// grammar (RFC 8259, as nlohmann applies it: UTF-8 checked in every string,
// surrogate pairs required, nothing after the value) and answers only when it
// is sure its answer equals nlohmann's:
//   - true : the line is a JSON object whose (last) member `key` is a string;
//   `out` is its
//            decoded value;
//   - false: anything else (invalid JSON, not an object, key missing, not a
//   string, or a case it
//            does not decide: a leading BOM, numbers with exponents or of > 300
//            characters, which nlohmann may reject as overflowing, nesting
//            deeper than 512). The caller then asks nlohmann, which also
//            produces the error message.
// tests/tokenizer/test_json_scan.cpp checks it against nlohmann on generated
// and mutated lines.
#pragma once
#include <string>
#include <string_view>

namespace lathe::tok {

bool fast_extract_json_string(std::string_view line, std::string_view key, std::string& out);

}  // namespace lathe::tok
