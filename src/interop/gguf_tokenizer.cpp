#include "interop/gguf_tokenizer.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <optional>
#include <string_view>
#include <vector>

#include "core/error.h"
#include "io/fs.h"
#include "io/json.h"
#include "tokenizer/bpe_trainer.h"
#include "tokenizer/tokenizer.h"

namespace lathe {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// ---------------------------------------------------------------------------------------------
// Pre-tokenizers. llama.cpp (llama-vocab.cpp, as shipped in llama-cpp-python 0.3.36) selects a
// regex list and a merge rule by tokenizer.ggml.pre. A tokenizer.json pre_tokenizer is reduced to
// the list of regexes it splits by (ByteLevel use_regex -> the GPT-2 regex, Split Isolated ->
// its regex, Digits -> \p{N} or \p{N}+), and that list plus model.ignore_merges must equal one
// entry here. llama.cpp rewrites (?i:...) as explicit case classes and handles the trailing \s+
// of the GPT-2 regex in custom code; the entries hold the regexes as tokenizer.json spells them.
constexpr const char* kGpt2Re = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
constexpr const char* kLlama3Re =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr const char* kQwen2Re =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

struct PreEntry {
  const char* name;
  std::vector<std::string> regexes;
  bool ignore_merges;  // llama.cpp sets ignore_merges for this name
  const char* what;
};
const std::vector<PreEntry>& pre_table() {
  static const std::vector<PreEntry> t = {
      {"gpt-2", {kGpt2Re}, false, "GPT-2 byte-level"},
      {"llama-bpe", {kLlama3Re}, true, "Llama-3 regex, whole words in the vocabulary skip the merges"},
      // Same regex as llama-bpe; llama.cpp applies the merges to every word (ignore_merges off).
      {"dbrx", {kLlama3Re}, false, "Llama-3 regex with the merges applied to every word"},
      {"qwen2", {kQwen2Re}, false, "Qwen2 regex (single digits)"},
      {"starcoder", {R"(\p{N})", kGpt2Re}, false, "single digits, then GPT-2"},
  };
  return t;
}

// Every tokenizer.ggml.pre value llama.cpp 0.3.36 (llama-cpp-python) accepts; --gguf-pre is
// checked against it so a typo is refused here instead of at load time in llama.cpp.
const std::vector<std::string>& llama_cpp_pre_names() {
  static const std::vector<std::string> v = {"default",
                                             "minicpm5",
                                             "llama3",
                                             "llama-v3",
                                             "llama-bpe",
                                             "falcon3",
                                             "falcon-h1",
                                             "pixtral",
                                             "midm-2.0",
                                             "lfm2",
                                             "jina-v5-nano",
                                             "deepseek-llm",
                                             "deepseek-coder",
                                             "deepseek-v3",
                                             "spark2_5",
                                             "youtu",
                                             "falcon",
                                             "mpt",
                                             "starcoder",
                                             "gpt-2",
                                             "phi-2",
                                             "jina-es",
                                             "jina-de",
                                             "gigachat",
                                             "jina-v2-es",
                                             "jina-v2-de",
                                             "a.x-4.0",
                                             "mellum",
                                             "modern-bert",
                                             "jais-2",
                                             "gemma4",
                                             "granite-embed-multi-311m",
                                             "sarvam-moe",
                                             "jina-v1-en",
                                             "jina-v2-code",
                                             "roberta-bpe",
                                             "whitespace",
                                             "refact",
                                             "command-r",
                                             "qwen2",
                                             "deepseek-r1-qwen",
                                             "kormo",
                                             "f2llmv2",
                                             "qwen35",
                                             "stablelm2",
                                             "olmo",
                                             "dbrx",
                                             "smaug-bpe",
                                             "poro-chat",
                                             "chatglm-bpe",
                                             "glm4",
                                             "glm5",
                                             "viking",
                                             "jais",
                                             "tekken",
                                             "smollm",
                                             "codeshell",
                                             "bloom",
                                             "gpt3-finnish",
                                             "exaone",
                                             "exaone4",
                                             "exaone-moe",
                                             "chameleon",
                                             "minerva-7b",
                                             "megrez",
                                             "gpt-4o",
                                             "llama4",
                                             "kanana2",
                                             "talkie",
                                             "granite-embed-multi-97m",
                                             "tiny_aya",
                                             "cohere2moe",
                                             "superbpe",
                                             "trillion",
                                             "granite-docling",
                                             "bailingmoe",
                                             "bailingmoe2",
                                             "llada-moe",
                                             "seed-coder",
                                             "hunyuan",
                                             "hunyuan-dense",
                                             "hy_v4",
                                             "joyai-llm",
                                             "kimi-k2",
                                             "ufakzeka",
                                             "grok-2",
                                             "afmoe",
                                             "laguna",
                                             "minimax-m2"};
  return v;
}

std::string excerpt(const json& v) { return io::json_excerpt(v); }

// The regexes a pre_tokenizer splits by, in order; throws for a component llama.cpp has no
// equivalent of. `byte_level` is set when the last stage is ByteLevel.
void collect_regexes(const json& p, const std::string& where, const std::string& path, std::vector<std::string>& out,
                     bool& byte_level) {
  LATHE_CHECK(p.is_object() && p.contains("type") && p["type"].is_string(), "{}: {} must be an object with a \"type\"",
              where, path);
  const std::string type = p["type"].get<std::string>();
  LATHE_CHECK(!byte_level, "{}: {} ({}) follows a ByteLevel stage; llama.cpp byte-encodes after splitting only", where,
              path, type);
  if (type == "Sequence") {
    LATHE_CHECK(p.contains("pretokenizers") && p["pretokenizers"].is_array(), "{}: {}.pretokenizers must be a list",
                where, path);
    for (size_t i = 0; i < p["pretokenizers"].size(); ++i)
      collect_regexes(p["pretokenizers"][i], where, fmt::format("{}.pretokenizers[{}]", path, i), out, byte_level);
  } else if (type == "ByteLevel") {
    const json aps = p.value("add_prefix_space", json(false));
    LATHE_CHECK(aps == json(false),
                "{}: {}.add_prefix_space = {}: llama.cpp's byte-level BPE never adds a prefix space, so a GGUF "
                "cannot tokenize like this tokenizer (set it to false and retrain, or keep the model in lathe)",
                where, path, excerpt(aps));
    if (p.value("use_regex", json(true)) == json(true)) out.push_back(kGpt2Re);
    byte_level = true;
  } else if (type == "Split") {
    const json behavior = p.value("behavior", json()), invert = p.value("invert", json(false));
    const json* pat = p.contains("pattern") && p["pattern"].is_object() ? &p["pattern"] : nullptr;
    LATHE_CHECK(pat && pat->contains("Regex") && (*pat)["Regex"].is_string(),
                "{}: {}.pattern must be {{\"Regex\": \"...\"}} (a String pattern has no llama.cpp pre-tokenizer)",
                where, path);
    LATHE_CHECK(behavior == json("Isolated") && invert == json(false),
                "{}: {} has behavior {} invert {}; llama.cpp splits only as behavior \"Isolated\", invert false", where,
                path, excerpt(behavior), excerpt(invert));
    out.push_back((*pat)["Regex"].get<std::string>());
  } else if (type == "Digits") {
    out.push_back(p.value("individual_digits", json(false)) == json(true) ? R"(\p{N})" : R"(\p{N}+)");
  } else {
    throw_error(
        "{}: {} is a {} pre-tokenizer; GGUF export writes byte-level BPE tokenizers whose pre-tokenizer llama.cpp "
        "names (ByteLevel, Split regex, Digits); a SentencePiece vocabulary is exported from tokenizer.model",
        where, path, type);
  }
}

}  // namespace

std::string gguf_pre_tokenizer_name(const json& j, const std::string& where) {
  const json norm = j.value("normalizer", json());
  if (!norm.is_null()) {
    const json t = norm.is_object() ? norm.value("type", json()) : json();
    LATHE_CHECK(t == json("NFC"),
                "{}: normalizer {} has no llama.cpp equivalent (llama.cpp normalizes nothing for byte-level BPE; only "
                "NFC, which leaves NFC text unchanged, is accepted)",
                where, excerpt(norm));
  }
  const json pre = j.value("pre_tokenizer", json());
  LATHE_CHECK(!pre.is_null(), "{}: no pre_tokenizer; llama.cpp's byte-level BPE needs one (e.g. ByteLevel)", where);
  std::vector<std::string> res;
  bool byte_level = false;
  collect_regexes(pre, where, "pre_tokenizer", res, byte_level);
  LATHE_CHECK(byte_level, "{}: pre_tokenizer has no ByteLevel stage; GGUF's \"gpt2\" tokenizer is byte-level BPE",
              where);
  const json model = j.value("model", json::object());
  const bool ignore_merges = model.is_object() && model.value("ignore_merges", json(false)) == json(true);
  for (const PreEntry& e : pre_table())
    if (e.regexes == res && e.ignore_merges == ignore_merges) return e.name;
  std::string got;
  for (const auto& r : res) got += fmt::format("\n    {}", io::json_excerpt(json(r)));
  std::string known;
  for (const PreEntry& e : pre_table())
    known += fmt::format("\n    {} ({}{})", e.name, e.what, e.ignore_merges ? ", ignore_merges true" : "");
  throw_error(
      "{}: llama.cpp has no pre-tokenizer that splits like this one (model.ignore_merges {}), regexes:{}\n  "
      "known equivalents:{}\n  If you know llama.cpp's name for it, pass --gguf-pre NAME (llama.cpp then "
      "tokenizes with that name's rules)",
      where, ignore_merges, got.empty() ? " (none)" : got, known);
}

namespace {

constexpr int32_t kNormal = 1, kUnknown = 2, kControl = 3, kUserDefined = 4, kUnused = 5;

struct Vocab {
  std::vector<std::string> tokens;
  std::vector<int32_t> types;
  std::vector<float> scores;  // SPM only
  std::vector<std::string> merges;
  bool set_any = false;
};

void pad_holes(Vocab& v, std::vector<bool>& set) {
  for (size_t i = 0; i < v.tokens.size(); ++i)
    if (!set[i]) {
      v.tokens[i] = fmt::format("[PAD{}]", i);  // as llama.cpp's converter pads holes
      v.types[i] = kUnused;
    }
}

// tokenizer.json (BPE) -> tokens in id order, token types, merges. The file is untrusted: every
// field is type-checked so a malformed one is named instead of escaping as a JSON type error.
Vocab hf_json_vocab(const json& j, const std::string& path, int64_t V) {
  auto fail = [&](const std::string& field, const json& v, const char* want) {
    throw_error("{}: {} must be {}, got {} '{}'", path, field, want, io::json_type_name(v), io::json_excerpt(v));
  };
  if (!j.is_object()) fail("the top level", j, "an object");
  const json* model = j.contains("model") ? &j["model"] : nullptr;
  if (!model || !model->is_object()) fail("model", model ? *model : json(), "an object");
  const json* type = model->contains("type") ? &(*model)["type"] : nullptr;
  LATHE_CHECK(type && type->is_string() && *type == "BPE",
              "{}: model.type is {}; GGUF export writes BPE tokenizer.json files (gpt2) and SentencePiece "
              "tokenizer.model files (llama)",
              path, type ? io::json_excerpt(*type) : "missing");
  if (!model->contains("vocab") || !(*model)["vocab"].is_object())
    fail("model.vocab", model->value("vocab", json()), "an object");
  Vocab v;
  v.tokens.resize(static_cast<size_t>(V));
  v.types.assign(static_cast<size_t>(V), kNormal);
  std::vector<bool> set(static_cast<size_t>(V), false);
  auto id_of = [&](const json& id) -> int64_t {
    return id.is_number_unsigned() && id.get<uint64_t>() > INT64_MAX ? -1 : id.get<int64_t>();
  };
  for (auto& [tok, id] : (*model)["vocab"].items()) {
    if (!id.is_number_integer()) fail(fmt::format("model.vocab[{}]", io::json_excerpt(json(tok))), id, "an integer");
    const int64_t i = id_of(id);
    LATHE_CHECK(i >= 0 && i < V, "{}: token id {} of {} is outside the model's vocab_size {}", path,
                io::json_excerpt(id), io::json_excerpt(json(tok)), V);
    v.tokens[i] = tok;
    set[i] = true;
  }
  if (j.contains("added_tokens") && !j["added_tokens"].is_null()) {
    if (!j["added_tokens"].is_array()) fail("added_tokens", j["added_tokens"], "a list");
    size_t n = 0;
    for (const auto& a : j["added_tokens"]) {
      const std::string where = fmt::format("added_tokens[{}]", n++);
      if (!a.is_object()) fail(where, a, "an object");
      const json id = a.value("id", json()), content = a.value("content", json());
      if (!id.is_number_integer()) fail(where + ".id", id, "an integer");
      if (!content.is_string()) fail(where + ".content", content, "a string");
      const int64_t i = id_of(id);
      LATHE_CHECK(i >= 0 && i < V, "{}: added token id {} is outside the model's vocab_size {}", path,
                  io::json_excerpt(id), V);
      const json special = a.value("special", json(false));
      if (!special.is_boolean()) fail(where + ".special", special, "true or false");
      v.tokens[i] = content.get<std::string>();
      set[i] = true;
      // As llama.cpp's converter: special -> CONTROL, other added tokens -> USER_DEFINED (both are
      // matched in text before the BPE, as HF matches added tokens).
      v.types[i] = special.get<bool>() ? kControl : kUserDefined;
    }
  }
  pad_holes(v, set);
  const json merges_j = model->value("merges", json::array());
  if (!merges_j.is_array()) fail("model.merges", merges_j, "a list");
  size_t n = 0;
  for (const auto& m : merges_j) {
    const std::string where = fmt::format("model.merges[{}]", n++);
    if (m.is_string())
      v.merges.push_back(m.get<std::string>());
    else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string())
      v.merges.push_back(m[0].get<std::string>() + " " + m[1].get<std::string>());
    else
      fail(where, m, "a string \"a b\" or a pair [\"a\", \"b\"]");
  }
  return v;
}

// encoder.json / vocab.json (token -> id) + vocab.bpe / merges.txt ("a b" lines after an optional
// "#version" header): the original GPT-2 files; the pre-tokenizer is GPT-2's.
Vocab legacy_vocab(const std::string& vocab_path, const std::string& merges_path, int64_t V) {
  json j;
  j["model"] = {{"type", "BPE"}, {"vocab", io::read_json_file(vocab_path)}, {"merges", json::array()}};
  // As lathe's loader (and transformers' GPT2Tokenizer): <|endoftext|> is a special added token.
  if (j["model"]["vocab"].is_object() && j["model"]["vocab"].contains("<|endoftext|>"))
    j["added_tokens"] =
        json::array({{{"id", j["model"]["vocab"]["<|endoftext|>"]}, {"content", "<|endoftext|>"}, {"special", true}}});
  Vocab v = hf_json_vocab(j, vocab_path, V);
  const std::string text = io::read_file(merges_path);
  size_t pos = 0;
  while (pos < text.size()) {
    size_t e = text.find('\n', pos);
    if (e == std::string::npos) e = text.size();
    std::string line = text.substr(pos, e - pos);
    pos = e + 1;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty() || line.rfind("#version", 0) == 0) continue;
    LATHE_CHECK(std::count(line.begin(), line.end(), ' ') == 1, "{}: merge line {} is not \"a b\"", merges_path,
                io::json_excerpt(json(line)));
    v.merges.push_back(line);
  }
  return v;
}

// ---- SentencePiece ModelProto (sentencepiece_model.proto), read with a minimal wire reader. The
// file was already loaded (and its normalization table checked) by lathe's SentencePiece
// tokenizer, so a malformed message here is an internal inconsistency, still reported.
struct Pb {
  std::string_view s;
  bool varint(uint64_t& v) {
    v = 0;
    for (int sh = 0; sh < 64 && !s.empty(); sh += 7) {
      const auto b = static_cast<uint8_t>(s[0]);
      s.remove_prefix(1);
      v |= static_cast<uint64_t>(b & 0x7F) << sh;
      if (!(b & 0x80)) return true;
    }
    return false;
  }
  // Next field: number, wire type, varint value or bytes (fixed32 in `v` too).
  bool next(uint32_t& num, uint32_t& wire, uint64_t& v, std::string_view& bytes) {
    uint64_t key;
    if (s.empty() || !varint(key)) return false;
    num = static_cast<uint32_t>(key >> 3), wire = static_cast<uint32_t>(key & 7);
    if (wire == 0) return varint(v);
    if (wire == 5 || wire == 1) {
      const size_t n = wire == 5 ? 4 : 8;
      if (s.size() < n) return false;
      v = 0;
      std::memcpy(&v, s.data(), n);
      s.remove_prefix(n);
      return true;
    }
    if (wire == 2) {
      if (!varint(v) || v > s.size()) return false;
      bytes = s.substr(0, v);
      s.remove_prefix(v);
      return true;
    }
    return false;
  }
};

struct SpmModel {
  struct Piece {
    std::string text;
    float score = 0;
    int32_t type = kNormal;
  };
  std::vector<Piece> pieces;
  int64_t model_type = 1;  // trainer_spec.model_type: 1 UNIGRAM (default), 2 BPE, 3 WORD, 4 CHAR
  bool treat_ws_as_suffix = false;
  std::string norm_name = "(default nmt_nfkc)";
  size_t charsmap_bytes = 0;
  bool add_dummy_prefix = true, remove_extra_ws = true, escape_ws = true;
};

SpmModel read_spm(const std::string& path) {
  const std::string bytes = io::read_file(path);
  SpmModel m;
  Pb top{bytes};
  uint32_t num, wire;
  uint64_t v;
  std::string_view b;
  auto bad = [&] { throw_error("SentencePiece model {}: malformed protobuf", path); };
  while (!top.s.empty()) {
    if (!top.next(num, wire, v, b)) bad();
    if (num == 1 && wire == 2) {  // SentencePiece piece
      SpmModel::Piece p;
      Pb pp{b};
      while (!pp.s.empty()) {
        std::string_view pb;
        uint64_t pv;
        if (!pp.next(num, wire, pv, pb)) bad();
        if (num == 1 && wire == 2) p.text = std::string(pb);
        if (num == 2 && wire == 5) {
          const auto u = static_cast<uint32_t>(pv);
          std::memcpy(&p.score, &u, 4);
        }
        if (num == 3 && wire == 0) p.type = static_cast<int32_t>(pv);
      }
      m.pieces.push_back(std::move(p));
    } else if (num == 2 && wire == 2) {  // TrainerSpec
      Pb t{b};
      while (!t.s.empty()) {
        std::string_view tb;
        uint64_t tv;
        if (!t.next(num, wire, tv, tb)) bad();
        if (num == 3 && wire == 0) m.model_type = static_cast<int64_t>(tv);
        if (num == 24 && wire == 0) m.treat_ws_as_suffix = tv != 0;
      }
    } else if (num == 3 && wire == 2) {  // NormalizerSpec
      Pb t{b};
      while (!t.s.empty()) {
        std::string_view tb;
        uint64_t tv;
        if (!t.next(num, wire, tv, tb)) bad();
        if (num == 1 && wire == 2) m.norm_name = std::string(tb);
        if (num == 2 && wire == 2) m.charsmap_bytes = tb.size();
        if (num == 3 && wire == 0) m.add_dummy_prefix = tv != 0;
        if (num == 4 && wire == 0) m.remove_extra_ws = tv != 0;
        if (num == 5 && wire == 0) m.escape_ws = tv != 0;
      }
    }
  }
  return m;
}

// Where lathe's loader takes the tokenizer from (same order as tok::load_tokenizer).
struct Source {
  enum Kind { Byte, HfJson, Legacy, Spm } kind;
  std::string file, file2;
};
Source resolve(const std::string& path) {
  std::error_code ec;
  auto has = [&](const fs::path& p) { return fs::exists(p, ec); };
  if (path == "byte") return {Source::Byte, "", ""};
  const fs::path p(path);
  if (fs::is_directory(p, ec)) {
    if (has(p / "tokenizer.json")) return {Source::HfJson, (p / "tokenizer.json").string(), ""};
    if (has(p / "encoder.json")) return {Source::Legacy, (p / "encoder.json").string(), (p / "vocab.bpe").string()};
    if (has(p / "vocab.json")) return {Source::Legacy, (p / "vocab.json").string(), (p / "merges.txt").string()};
    return {Source::Spm, (p / "tokenizer.model").string(), ""};
  }
  const std::string name = p.filename().string();
  if (p.extension() == ".model") return {Source::Spm, path, ""};
  if (name == "encoder.json") return {Source::Legacy, path, (p.parent_path() / "vocab.bpe").string()};
  if (name == "vocab.json") return {Source::Legacy, path, (p.parent_path() / "merges.txt").string()};
  if (name == "vocab.bpe") return {Source::Legacy, (p.parent_path() / "encoder.json").string(), path};
  if (name == "merges.txt") return {Source::Legacy, (p.parent_path() / "vocab.json").string(), path};
  return {Source::HfJson, path, ""};
}

// BOS/EOS/PAD from generation_config.json (an id or, for eos, a list: the first is EOS, a second
// one is recorded as EOT).
struct GenIds {
  int64_t bos = -1, eos = -1, pad = -1, eot = -1;
};
GenIds read_generation_config(const std::string& dir) {
  GenIds g;
  if (dir.empty()) return g;
  const fs::path p = fs::path(dir) / "generation_config.json";
  std::error_code ec;
  if (!fs::exists(p, ec)) return g;
  const json j = io::read_json_file(p.string());
  if (!j.is_object()) return g;
  auto get = [&](const char* key, int64_t& out, int64_t* second) {
    const json v = j.value(key, json());
    if (v.is_number_integer()) out = v.get<int64_t>();
    if (v.is_array() && !v.empty() && v[0].is_number_integer()) {
      out = v[0].get<int64_t>();
      if (second && v.size() > 1 && v[1].is_number_integer()) *second = v[1].get<int64_t>();
    }
  };
  get("bos_token_id", g.bos, nullptr);
  get("eos_token_id", g.eos, &g.eot);
  get("pad_token_id", g.pad, nullptr);
  return g;
}

// The post-processor's template adds a special token before / after the text (HF encode with
// add_special_tokens, `lathe encode --add-special-tokens`).
std::pair<bool, bool> template_adds(const json& j) {
  const json pp = j.value("post_processor", json());
  const json* single = nullptr;
  if (pp.is_object() && pp.value("type", json()) == json("TemplateProcessing") && pp.contains("single") &&
      pp["single"].is_array())
    single = &pp["single"];
  if (pp.is_object() && pp.value("type", json()) == json("Sequence") && pp.contains("processors") &&
      pp["processors"].is_array())
    for (const auto& p : pp["processors"])
      if (p.is_object() && p.value("type", json()) == json("TemplateProcessing") && p.contains("single") &&
          p["single"].is_array())
        single = &p["single"];
  if (!single || single->empty()) return {false, false};
  auto special = [](const json& e) { return e.is_object() && e.contains("SpecialToken"); };
  return {special(single->front()), special(single->back())};
}

}  // namespace

std::string add_gguf_tokenizer(io::GgufWriter& w, const ModelConfig& cfg, const GgufTokenizerOptions& opts) {
  const int64_t V = cfg.vocab_size;
  // lathe's own loader first: the same checks and messages as training, and the special ids it
  // resolves (tokenizer_config.json, post-processor, well-known names).
  auto tok = tok::load_tokenizer(opts.path);
  LATHE_CHECK(tok->vocab_size() <= V,
              "tokenizer {} has {} tokens but the model's vocab_size is {}: the GGUF token list must cover every id",
              opts.path, tok->vocab_size(), V);
  const Source src = resolve(opts.path);
  Vocab v;
  std::string model = "gpt2", pre, desc, notes;
  bool add_bos = false, add_eos = false;
  if (src.kind == Source::Byte) {
    // id b = byte b; as byte-level BPE without merges every byte stays its own token, whatever
    // the regex splits.
    v.tokens.resize(static_cast<size_t>(V));
    v.types.assign(static_cast<size_t>(V), kNormal);
    std::vector<bool> set(static_cast<size_t>(V), false);
    for (int b = 0; b < 256 && b < V; ++b) {
      std::string s;
      const uint32_t cp = tok::byte_to_unicode(static_cast<uint8_t>(b));
      if (cp < 0x80) {
        s += static_cast<char>(cp);
      } else {
        s += static_cast<char>(0xC0 | (cp >> 6));
        s += static_cast<char>(0x80 | (cp & 0x3F));
      }
      v.tokens[b] = s;
      set[b] = true;
    }
    pad_holes(v, set);
    pre = "gpt-2";
    desc = "lathe byte tokenizer as byte-level BPE without merges";
  } else if (src.kind == Source::HfJson || src.kind == Source::Legacy) {
    if (src.kind == Source::HfJson) {
      const json j = io::read_json_file(src.file);
      v = hf_json_vocab(j, src.file, V);
      pre = opts.pre.empty() ? gguf_pre_tokenizer_name(j, src.file) : opts.pre;
      if (j.value("normalizer", json()).is_object())
        notes += "; note: llama.cpp does not apply the NFC normalizer (text already in NFC tokenizes the same)";
      std::tie(add_bos, add_eos) = template_adds(j);
    } else {
      v = legacy_vocab(src.file, src.file2, V);
      pre = opts.pre.empty() ? "gpt-2" : opts.pre;
    }
    desc = fmt::format("byte-level BPE from {} ({} merges), tokenizer.ggml.pre = {}{}", src.file, v.merges.size(), pre,
                       opts.pre.empty() ? "" : " (from --gguf-pre)");
  } else {
    const SpmModel m = read_spm(src.file);
    static const char* kTypes[] = {"?", "unigram", "bpe", "word", "char"};
    const char* mt = m.model_type >= 1 && m.model_type <= 4 ? kTypes[m.model_type] : "?";
    LATHE_CHECK(m.model_type == 2,
                "SentencePiece model {}: trainer_spec.model_type is {}; llama.cpp's \"llama\" (SPM) tokenizer merges "
                "pieces by score as SentencePiece's BPE does, so a {} model would tokenize differently. Train it "
                "with --model_type=bpe",
                src.file, mt, mt);
    LATHE_CHECK(m.charsmap_bytes == 0,
                "SentencePiece model {}: normalizer_spec.name is '{}' (a {}-byte normalization table); llama.cpp's "
                "\"llama\" tokenizer does not normalize text, so tokens would differ. Train it with "
                "--normalization_rule_name=identity",
                src.file, m.norm_name, m.charsmap_bytes);
    LATHE_CHECK(m.escape_ws && !m.treat_ws_as_suffix,
                "SentencePiece model {}: escape_whitespaces false or treat_whitespace_as_suffix true; llama.cpp's "
                "\"llama\" tokenizer always writes spaces as U+2581 prefixes",
                src.file);
    LATHE_CHECK(static_cast<int64_t>(m.pieces.size()) <= V,
                "SentencePiece model {}: {} pieces but the model's vocab_size is {}", src.file, m.pieces.size(), V);
    model = "llama";
    v.tokens.resize(static_cast<size_t>(V));
    v.types.assign(static_cast<size_t>(V), kNormal);
    v.scores.assign(static_cast<size_t>(V), 0.f);
    std::vector<bool> set(static_cast<size_t>(V), false);
    for (size_t i = 0; i < m.pieces.size(); ++i) {
      v.tokens[i] = m.pieces[i].text;
      v.scores[i] = m.pieces[i].score;
      v.types[i] = m.pieces[i].type;  // SentencePiece's piece types are GGUF's token types
      set[i] = true;
    }
    pad_holes(v, set);
    w.add_bool("tokenizer.ggml.add_space_prefix", m.add_dummy_prefix);
    w.add_bool("tokenizer.ggml.remove_extra_whitespaces", m.remove_extra_ws);
    if (auto unk = tok->token_to_id("<unk>"); unk && v.types[*unk] == kUnknown)
      w.add_u32("tokenizer.ggml.unknown_token_id", static_cast<uint32_t>(*unk));
    else
      for (size_t i = 0; i < m.pieces.size(); ++i)
        if (m.pieces[i].type == kUnknown) {
          w.add_u32("tokenizer.ggml.unknown_token_id", static_cast<uint32_t>(i));
          break;
        }
    add_bos = tok->bos_id().has_value();  // lathe encode --add-special-tokens prepends BOS only
    desc = fmt::format("SentencePiece BPE from {} ({} pieces, add_space_prefix {})", src.file, m.pieces.size(),
                       m.add_dummy_prefix);
  }
  if (!opts.pre.empty()) {
    const auto& names = llama_cpp_pre_names();
    LATHE_CHECK(std::find(names.begin(), names.end(), opts.pre) != names.end(),
                "--gguf-pre {}: not a pre-tokenizer llama.cpp knows (e.g. gpt-2, llama-bpe, dbrx, qwen2, starcoder, "
                "default; the full list is in llama.cpp's src/llama-vocab.cpp)",
                io::json_excerpt(json(opts.pre)));
    LATHE_CHECK(model == "gpt2", "--gguf-pre applies to byte-level BPE tokenizers; {} is a SentencePiece model",
                opts.path);
  }

  // Special ids: config.json, else generation_config.json, else the tokenizer's.
  const GenIds gen = read_generation_config(opts.model_dir);
  auto pick = [](int64_t a, int64_t b, std::optional<int32_t> c) -> int64_t {
    return a >= 0 ? a : b >= 0 ? b : c ? *c : -1;
  };
  const int64_t bos = pick(cfg.bos_token_id, gen.bos, tok->bos_id());
  const int64_t eos = pick(cfg.eos_token_id, gen.eos, tok->eos_id());
  const int64_t pad = pick(cfg.pad_token_id, gen.pad, tok->pad_id());
  int64_t eot = gen.eot;
  for (const char* name : {"<|eot_id|>", "<|im_end|>", "<|end|>"})
    if (eot < 0)
      if (auto id = tok->token_to_id(name); id && v.types[*id] == kControl) eot = *id;
  if (src.kind != Source::Byte)
    LATHE_CHECK(eos >= 0,
                "tokenizer {}: no end-of-text id (config.json and generation_config.json have no eos_token_id, "
                "tokenizer_config.json no eos_token, and no </s>, <|endoftext|>, <|end_of_text|> token); llama.cpp "
                "would stop generating at an arbitrary token. Set \"eos_token_id\" in config.json",
                opts.path);
  else if (eos < 0)
    notes +=
        "; note: the byte tokenizer has no end-of-text token, llama.cpp's default for this vocabulary (id 11, "
        "byte 0x0B) ends its generations";
  auto id_key = [&](const char* key, int64_t id, const char* what) {
    if (id < 0) return;
    LATHE_CHECK(id < V, "{} id {} is outside the model's vocab_size {}", what, id, V);
    w.add_u32(key, static_cast<uint32_t>(id));
  };
  w.add_string("tokenizer.ggml.model", model);
  if (model == "gpt2") w.add_string("tokenizer.ggml.pre", pre);
  w.add_string_array("tokenizer.ggml.tokens", v.tokens);
  if (!v.scores.empty()) w.add_f32_array("tokenizer.ggml.scores", v.scores);
  w.add_i32_array("tokenizer.ggml.token_type", v.types);
  if (model == "gpt2") w.add_string_array("tokenizer.ggml.merges", v.merges);
  id_key("tokenizer.ggml.bos_token_id", bos, "BOS");
  id_key("tokenizer.ggml.eos_token_id", eos, "EOS");
  id_key("tokenizer.ggml.padding_token_id", pad, "PAD");
  if (eot != eos) id_key("tokenizer.ggml.eot_token_id", eot, "EOT");
  // Explicit, because llama.cpp's defaults depend on the pre-tokenizer name (llama-bpe adds BOS).
  w.add_bool("tokenizer.ggml.add_bos_token", add_bos);
  w.add_bool("tokenizer.ggml.add_eos_token", add_eos);
  return fmt::format("{}; bos {} eos {} pad {}{}{}", desc, bos, eos, pad,
                     eot >= 0 && eot != eos ? fmt::format(" eot {}", eot) : "", notes);
}

}  // namespace lathe
