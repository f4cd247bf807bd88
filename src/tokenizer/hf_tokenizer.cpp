#include "tokenizer/hf_tokenizer.h"

#include <filesystem>
#include <fstream>
#include <sstream>
#include <unordered_map>

#include "core/error.h"
#include "tokenizer/bpe.h"
#include "tokenizer/hf_components.h"
#include "tokenizer/utf8.h"

namespace lathe::tok {

using nlohmann::json;
namespace fs = std::filesystem;

namespace {

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  LATHE_CHECK(f.good(), "tokenizer file {}: cannot be opened", path);
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

json parse_json_file(const std::string& path) {
  std::string text = read_file(path);
  try {
    return json::parse(text);
  } catch (const json::exception& e) {
    throw_error("tokenizer file {}: invalid JSON: {}", path, e.what());
  }
}

class HfTokenizer : public Tokenizer {
 public:
  HfTokenizer(const json& cfg, const std::string& where, const std::string& kind_override,
              std::vector<std::string> files, const std::string& dir)
      : files_(std::move(files)) {
    LATHE_CHECK(cfg.is_object(), "{}: the top level must be a JSON object", where);
    LATHE_CHECK(cfg.contains("model") && cfg["model"].is_object(), "{}: missing the \"model\" object", where);
    const json& m = cfg["model"];
    std::string mtype = m.value("type", std::string());
    if (mtype.empty() && m.contains("merges")) mtype = "BPE";  // very old files omit the type
    LATHE_CHECK(mtype == "BPE",
                "{}: model type '{}' is not supported by lathe (only BPE; Unigram/WordPiece/WordLevel "
                "tokenizer.json files are not implemented)",
                where, mtype);

    if (cfg.contains("pre_tokenizer") && !cfg["pre_tokenizer"].is_null())
      pre_ = make_pre_tokenizer(cfg["pre_tokenizer"], where, &byte_level_);
    if (cfg.contains("normalizer") && !cfg["normalizer"].is_null())
      normalizer_ = make_normalizer(cfg["normalizer"], where);
    if (cfg.contains("decoder") && !cfg["decoder"].is_null()) decoder_ = make_decoder(cfg["decoder"], where);

    // --- model
    BpeOptions opt;
    opt.byte_units = byte_level_;
    if (m.contains("unk_token") && m["unk_token"].is_string()) opt.unk_token = m["unk_token"].get<std::string>();
    if (m.contains("continuing_subword_prefix") && m["continuing_subword_prefix"].is_string())
      opt.continuing_subword_prefix = m["continuing_subword_prefix"].get<std::string>();
    if (m.contains("end_of_word_suffix") && m["end_of_word_suffix"].is_string())
      opt.end_of_word_suffix = m["end_of_word_suffix"].get<std::string>();
    opt.fuse_unk = m.value("fuse_unk", false);
    opt.byte_fallback = m.value("byte_fallback", false);
    opt.ignore_merges = m.value("ignore_merges", false);
    LATHE_CHECK(!m.contains("dropout") || m["dropout"].is_null() || m["dropout"].get<double>() == 0.0,
                "{}: model.dropout is set (BPE-dropout is for training only); set it to null for encoding", where);
    LATHE_CHECK(m.contains("vocab") && m["vocab"].is_object(), "{}: model.vocab must be an object token -> id", where);
    StringIdMap vocab;
    vocab.reserve(m["vocab"].size());
    for (auto it = m["vocab"].begin(); it != m["vocab"].end(); ++it) {
      LATHE_CHECK(it.value().is_number_integer(), "{}: model.vocab['{}'] is not an integer id", where, it.key());
      vocab.emplace(it.key(), it.value().get<int32_t>());
    }
    LATHE_CHECK(m.contains("merges") && m["merges"].is_array(), "{}: model.merges must be a list", where);
    std::vector<std::pair<std::string, std::string>> merges;
    merges.reserve(m["merges"].size());
    for (const json& e : m["merges"]) {
      if (e.is_string()) {
        std::string s = e.get<std::string>();
        if (s.rfind("#version", 0) == 0) continue;
        size_t sp = s.find(' ');
        LATHE_CHECK(sp != std::string::npos && s.find(' ', sp + 1) == std::string::npos,
                    "{}: merge \"{}\" must be two tokens separated by one space", where, s);
        merges.emplace_back(s.substr(0, sp), s.substr(sp + 1));
      } else {
        LATHE_CHECK(e.is_array() && e.size() == 2 && e[0].is_string() && e[1].is_string(),
                    "{}: merge {} must be \"a b\" or [\"a\", \"b\"]", where, e.dump());
        merges.emplace_back(e[0].get<std::string>(), e[1].get<std::string>());
      }
    }
    model_ = std::make_unique<BpeModel>(std::move(vocab), merges, opt, where);
    vocab_size_ = model_->size();

    // --- added tokens
    if (cfg.contains("added_tokens") && cfg["added_tokens"].is_array()) {
      const json& at = cfg["added_tokens"];
      added_.reserve(at.size());
      for (const json& t : at) {
        AddedToken a;
        LATHE_CHECK(t.contains("id") && t.contains("content"), "{}: added token {} needs \"id\" and \"content\"", where,
                    t.dump());
        a.id = t["id"].get<int32_t>();
        a.content = t["content"].get<std::string>();
        a.special = t.value("special", false);
        a.lstrip = t.value("lstrip", false);
        a.rstrip = t.value("rstrip", false);
        a.single_word = t.value("single_word", false);
        a.normalized = t.value("normalized", !a.special);
        if (a.content.empty()) continue;
        added_.push_back(std::move(a));
      }
      for (const AddedToken& a : added_) {
        added_by_id_[a.id] = &a;
        added_by_content_.emplace(a.content, a.id);
        vocab_size_ = std::max<int64_t>(vocab_size_, a.id + 1);
        if (a.normalized && normalizer_) {
          std::string n = a.content;
          normalizer_->apply(n);
          norm_matcher_.add(n, &a);
        } else if (a.normalized) {
          norm_matcher_.add(a.content, &a);
        } else {
          raw_matcher_.add(a.content, &a);
        }
      }
    }

    // --- post-processor (BOS/EOS around the single sequence)
    if (cfg.contains("post_processor") && !cfg["post_processor"].is_null()) parse_post(cfg["post_processor"], where);

    kind_ = !kind_override.empty() ? kind_override : byte_level_ ? "hf-bpe-bytelevel" : "hf-bpe-sentencepiece";
    resolve_specials(dir, where);
  }

  std::vector<int32_t> encode(std::string_view text, bool add_special_tokens) const override {
    std::vector<int32_t> out;
    out.reserve(text.size() / 3 + 4);
    encode_append(text, out, add_special_tokens);
    return out;
  }

  void encode_append(std::string_view text, std::vector<int32_t>& out, bool add_special_tokens) const override {
    if (add_special_tokens) out.insert(out.end(), prefix_.begin(), prefix_.end());
    if (raw_matcher_.empty()) {
      encode_gap(text, true, out);
    } else {
      std::vector<AddedTokenMatcher::Match> ms;
      raw_matcher_.find(text, ms);
      size_t prev = 0;
      for (auto& mt : ms) {
        if (mt.start > prev) encode_gap(text.substr(prev, mt.start - prev), prev == 0, out);
        out.push_back(mt.tok->id);
        prev = mt.end;
      }
      if (prev < text.size()) encode_gap(text.substr(prev), prev == 0, out);
    }
    if (add_special_tokens) out.insert(out.end(), suffix_.begin(), suffix_.end());
  }

  std::string decode(std::span<const int32_t> ids, bool skip_special_tokens) const override {
    std::vector<std::string> toks;
    toks.reserve(ids.size());
    for (int32_t id : ids) {
      auto it = added_by_id_.find(id);
      if (it != added_by_id_.end()) {
        if (!(skip_special_tokens && it->second->special)) toks.push_back(it->second->content);
        continue;
      }
      const std::string* s = model_->id_to_token(id);
      LATHE_CHECK(s, "decode: token id {} is not in the vocabulary (size {})", id, vocab_size_);
      toks.push_back(*s);
    }
    if (!decoder_) {
      std::string out;
      for (size_t i = 0; i < toks.size(); ++i) {
        if (i) out += ' ';
        out += toks[i];
      }
      return out;
    }
    decoder_->apply(toks);
    std::string out;
    for (auto& t : toks) out += t;
    return out;
  }

  int64_t vocab_size() const override { return vocab_size_; }
  std::optional<int32_t> token_to_id(std::string_view token) const override {
    auto it = added_by_content_.find(std::string(token));
    if (it != added_by_content_.end()) return it->second;
    return model_->token_to_id(token);
  }
  std::optional<int32_t> bos_id() const override { return bos_; }
  std::optional<int32_t> eos_id() const override { return eos_; }
  std::optional<int32_t> pad_id() const override { return pad_; }
  bool is_byte_level() const override { return byte_level_; }
  std::string kind() const override { return kind_; }
  std::vector<std::string> source_files() const override { return files_; }

 private:
  // Normalize one text gap between raw added tokens, split out normalized added tokens, then
  // pre-tokenize and run the model on every piece.
  void encode_gap(std::string_view gap, bool origin, std::vector<int32_t>& out) const {
    if (gap.empty()) return;
    std::string norm;
    std::string_view s = gap;
    if (normalizer_) {
      norm.assign(gap);
      normalizer_->apply(norm);
      s = norm;
    }
    if (norm_matcher_.empty()) {
      encode_pieces(s, origin, out);
      return;
    }
    std::vector<AddedTokenMatcher::Match> ms;
    norm_matcher_.find(s, ms);
    size_t prev = 0;
    for (auto& mt : ms) {
      if (mt.start > prev) encode_pieces(s.substr(prev, mt.start - prev), origin && prev == 0, out);
      out.push_back(mt.tok->id);
      prev = mt.end;
    }
    if (prev < s.size()) encode_pieces(s.substr(prev), origin && prev == 0, out);
  }

  void encode_pieces(std::string_view s, bool origin, std::vector<int32_t>& out) const {
    if (s.empty()) return;
    if (!pre_) {
      model_->encode_word(s, out);
      return;
    }
    thread_local PieceBuf buf;
    // Long text goes through the pre-tokenizer in windows of about kWindowBytes: the pieces of a
    // whole 50 MB document would take ~16 bytes each (~0.2 GB) and page faults dominated.
    constexpr size_t kWindowBytes = 64 << 10;
    if (s.size() > kWindowBytes) {
      buf.clear();
      size_t end = pre_->apply_window(s, 0, kWindowBytes, origin, buf);
      if (end != 0) {
        for (;;) {
          for (const Piece& p : buf.pieces) model_->encode_word(p.s, out);
          if (end >= s.size()) return;
          buf.clear();
          end = pre_->apply_window(s, end, kWindowBytes, origin, buf);
        }
      }
    }
    buf.clear();
    buf.pieces.push_back({s, origin});
    pre_->apply(buf);
    for (const Piece& p : buf.pieces) model_->encode_word(p.s, out);
  }

  // Ids of a special token referenced by a post-processor.
  int32_t special_id(const std::string& tok, const std::string& where) const {
    auto id = token_to_id(tok);
    LATHE_CHECK(id.has_value(), "{}: post_processor token '{}' is not in the vocabulary", where, tok);
    return *id;
  }

  void parse_post(const json& p, const std::string& where) {
    std::string type = p.value("type", std::string());
    if (type == "Sequence") {
      for (const json& q : p.at("processors")) parse_post(q, where);
      return;
    }
    if (type == "ByteLevel") return;  // offsets only
    if (type == "TemplateProcessing") {
      const json& single = p.at("single");
      const json& specials = p.at("special_tokens");
      std::vector<int32_t> pre, post;
      bool seen_a = false;
      for (const json& piece : single) {
        if (piece.contains("Sequence")) {
          LATHE_CHECK(!seen_a, "{}: TemplateProcessing 'single' has two sequences", where);
          seen_a = true;
          continue;
        }
        LATHE_CHECK(piece.contains("SpecialToken"),
                    "{}: TemplateProcessing piece {} is neither Sequence nor SpecialToken", where, piece.dump());
        std::string key = piece["SpecialToken"].at("id").get<std::string>();
        LATHE_CHECK(specials.contains(key), "{}: TemplateProcessing special token '{}' is missing from special_tokens",
                    where, key);
        auto ids = specials[key].at("ids").get<std::vector<int32_t>>();
        (seen_a ? post : pre).insert((seen_a ? post : pre).end(), ids.begin(), ids.end());
      }
      prefix_.insert(prefix_.end(), pre.begin(), pre.end());
      suffix_.insert(suffix_.begin(), post.begin(), post.end());
      return;
    }
    if (type == "RobertaProcessing" || type == "BertProcessing") {
      const json& cls = p.at("cls");
      const json& sep = p.at("sep");
      prefix_.push_back(cls.at(1).get<int32_t>());
      suffix_.insert(suffix_.begin(), sep.at(1).get<int32_t>());
      return;
    }
    throw_error(
        "{}: post_processor type '{}' is not supported by lathe (supported: TemplateProcessing, ByteLevel, "
        "RobertaProcessing, BertProcessing, Sequence)",
        where, type);
  }

  // BOS/EOS/PAD: tokenizer_config.json next to the tokenizer if present; else the post-processor
  // template (first prefix token = BOS, last suffix token = EOS); else well-known special names.
  void resolve_specials(const std::string& dir, const std::string& where) {
    auto from_cfg = [&](const json& c, const char* key) -> std::optional<int32_t> {
      if (!c.contains(key) || c[key].is_null()) return std::nullopt;
      std::string name = c[key].is_string() ? c[key].get<std::string>() : c[key].value("content", std::string());
      auto id = token_to_id(name);
      LATHE_CHECK(id.has_value(), "{}/tokenizer_config.json: {} '{}' is not in the tokenizer vocabulary", dir, key,
                  name);
      return id;
    };
    bool have_cfg = false;
    if (!dir.empty() && fs::exists(fs::path(dir) / "tokenizer_config.json")) {
      std::string p = (fs::path(dir) / "tokenizer_config.json").string();
      json c = parse_json_file(p);
      bos_ = from_cfg(c, "bos_token");
      eos_ = from_cfg(c, "eos_token");
      pad_ = from_cfg(c, "pad_token");
      have_cfg = true;
      files_.push_back(p);
    }
    if (have_cfg) return;
    if (!prefix_.empty()) bos_ = prefix_.front();
    if (!suffix_.empty()) eos_ = suffix_.back();
    auto first_special = [&](std::initializer_list<const char*> names) -> std::optional<int32_t> {
      for (const char* n : names) {
        auto it = added_by_content_.find(n);
        if (it != added_by_content_.end()) return it->second;
      }
      return std::nullopt;
    };
    if (!bos_) bos_ = first_special({"<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>", "<|endoftext|>"});
    if (!eos_) eos_ = first_special({"</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>"});
    if (!pad_) pad_ = first_special({"<pad>", "<|pad|>", "[PAD]"});
  }

  std::unique_ptr<BpeModel> model_;
  std::unique_ptr<Normalizer> normalizer_;
  std::unique_ptr<PreTokenizer> pre_;
  std::unique_ptr<Decoder> decoder_;
  bool byte_level_ = false;
  std::vector<AddedToken> added_;  // reserved up front: the matchers point into it
  std::unordered_map<int32_t, const AddedToken*> added_by_id_;
  std::unordered_map<std::string, int32_t> added_by_content_;
  AddedTokenMatcher raw_matcher_, norm_matcher_;
  std::vector<int32_t> prefix_, suffix_;
  int64_t vocab_size_ = 0;
  std::optional<int32_t> bos_, eos_, pad_;
  std::string kind_;
  std::vector<std::string> files_;
};

}  // namespace

std::unique_ptr<Tokenizer> make_hf_tokenizer(const json& config, const std::string& where,
                                             const std::string& kind_override, std::vector<std::string> files,
                                             const std::string& dir) {
  try {
    return std::make_unique<HfTokenizer>(config, where, kind_override, std::move(files), dir);
  } catch (const json::exception& e) {
    throw_error("{}: unexpected JSON structure: {}", where, e.what());
  }
}

std::unique_ptr<Tokenizer> load_gpt2_legacy(const std::string& vocab_path, const std::string& merges_path) {
  json vocab = parse_json_file(vocab_path);
  LATHE_CHECK(vocab.is_object(), "tokenizer file {}: expected a JSON object token -> id", vocab_path);
  std::string mtext = read_file(merges_path);
  json merges = json::array();
  size_t pos = 0, line_no = 0;
  while (pos < mtext.size()) {
    size_t e = mtext.find('\n', pos);
    if (e == std::string::npos) e = mtext.size();
    std::string line = mtext.substr(pos, e - pos);
    pos = e + 1;
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty() || line.rfind("#version", 0) == 0) continue;
    size_t sp = line.find(' ');
    LATHE_CHECK(sp != std::string::npos && line.find(' ', sp + 1) == std::string::npos,
                "tokenizer file {} line {}: a merge must be two tokens separated by one space, got \"{}\"", merges_path,
                line_no, line);
    merges.push_back(line);
  }
  json cfg;
  cfg["model"] = {{"type", "BPE"}, {"vocab", vocab}, {"merges", merges}};
  cfg["pre_tokenizer"] = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}};
  cfg["decoder"] = {{"type", "ByteLevel"}};
  cfg["added_tokens"] = json::array();
  // GPT-2's <|endoftext|> is a special token in transformers' GPT2Tokenizer(Fast).
  if (vocab.contains("<|endoftext|>"))
    cfg["added_tokens"].push_back(
        {{"id", vocab["<|endoftext|>"]}, {"content", "<|endoftext|>"}, {"special", true}, {"normalized", false}});
  fs::path dir = fs::path(vocab_path).parent_path();
  return make_hf_tokenizer(cfg, vocab_path + " + " + merges_path, "gpt2-legacy", {vocab_path, merges_path},
                           dir.string());
}

// Exposed for load_tokenizer in tokenizer.cpp.
std::unique_ptr<Tokenizer> load_hf_json(const std::string& path) {
  json cfg = parse_json_file(path);
  return make_hf_tokenizer(cfg, path, "", {path}, fs::path(path).parent_path().string());
}

}  // namespace lathe::tok
