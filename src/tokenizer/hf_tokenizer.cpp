#include "tokenizer/hf_tokenizer.h"

#include <filesystem>
#include <unordered_map>

#include "core/error.h"
#include "core/utf8.h"
#include "io/fs.h"
#include "io/json.h"
#include "tokenizer/bpe.h"
#include "tokenizer/hf_components.h"

namespace lathe::tok {

using nlohmann::json;
using namespace json_field;
namespace fs = std::filesystem;

namespace {

// True when something (a file, a directory, a FIFO, a dangling link or a link loop) is at p: the
// reader then names what is wrong with it instead of "missing".
bool present(const fs::path& p) {
  std::error_code ec;
  auto st = fs::symlink_status(p, ec);
  return !ec && st.type() != fs::file_type::not_found;
}

class HfTokenizer : public Tokenizer {
 public:
  // `where` names the file(s) in messages; every field is read through json_field, so a wrong
  // type or a bad id names its JSON path.
  HfTokenizer(const json& cfg, const std::string& where, const std::string& kind_override,
              std::vector<std::string> files, const std::string& dir)
      : files_(std::move(files)) {
    require_object(cfg, where, "");
    const json& m = object(cfg, "model", where, "");
    std::string mtype = opt_string(m, "type", where, "model").value_or("");
    if (mtype.empty() && find(m, "merges")) mtype = "BPE";  // very old files omit the type
    LATHE_CHECK(mtype == "BPE",
                "{}: model.type {} is not supported by lathe (only BPE; Unigram/WordPiece/WordLevel "
                "tokenizer.json files are not implemented)",
                where, quote(mtype));
    const json& vj = object(m, "vocab", where, "model");
    const json* atj = find(cfg, "added_tokens");
    if (atj && !atj->is_array()) type_error(where, "added_tokens", "a list", *atj);
    // Every id of the file is bounded by its number of entries (see token_id_limit).
    const int64_t id_limit = token_id_limit(static_cast<int64_t>(vj.size() + (atj ? atj->size() : 0)));

    if (const json* p = find(cfg, "pre_tokenizer")) pre_ = make_pre_tokenizer(*p, where, &byte_level_);
    if (const json* n = find(cfg, "normalizer")) normalizer_ = make_normalizer(*n, where);
    if (const json* d = find(cfg, "decoder")) decoder_ = make_decoder(*d, where);
    probe_growth();

    // --- model
    BpeOptions opt;
    opt.byte_units = byte_level_;
    opt.unk_token = opt_string(m, "unk_token", where, "model");
    opt.continuing_subword_prefix = opt_string(m, "continuing_subword_prefix", where, "model").value_or("");
    opt.end_of_word_suffix = opt_string(m, "end_of_word_suffix", where, "model").value_or("");
    opt.fuse_unk = opt_bool(m, "fuse_unk", false, where, "model");
    opt.byte_fallback = opt_bool(m, "byte_fallback", false, where, "model");
    opt.ignore_merges = opt_bool(m, "ignore_merges", false, where, "model");
    if (const json* d = find(m, "dropout")) {
      if (!d->is_number()) type_error(where, "model.dropout", "null or a number", *d);
      LATHE_CHECK(d->get<double>() == 0.0,
                  "{}: model.dropout is set (BPE-dropout is for training only); set it to null for encoding", where);
    }
    StringIdMap vocab;
    vocab.reserve(vj.size());
    for (auto it = vj.begin(); it != vj.end(); ++it)
      vocab.emplace(it.key(), token_id(it.value(), id_limit, where, member("model.vocab", it.key())));
    const json& mj = array(m, "merges", where, "model");
    std::vector<std::pair<std::string, std::string>> merges;
    merges.reserve(mj.size());
    for (size_t i = 0; i < mj.size(); ++i) {
      const json& e = mj[i];
      if (e.is_string()) {
        const std::string& s = e.get_ref<const std::string&>();
        if (s.rfind("#version", 0) == 0) continue;
        size_t sp = s.find(' ');
        LATHE_CHECK(sp != std::string::npos && s.find(' ', sp + 1) == std::string::npos,
                    "{}: model.merges[{}] {} must be two tokens separated by one space", where, i, quote(s));
        merges.emplace_back(s.substr(0, sp), s.substr(sp + 1));
      } else {
        if (!(e.is_array() && e.size() == 2 && e[0].is_string() && e[1].is_string()))
          type_error(where, index("model.merges", i), "\"a b\" or [\"a\", \"b\"]", e);
        merges.emplace_back(e[0].get<std::string>(), e[1].get<std::string>());
      }
    }
    model_ = std::make_unique<BpeEncoder>(std::move(vocab), merges, opt, where);
    vocab_size_ = model_->size();

    // --- added tokens
    if (atj) {
      added_.reserve(atj->size());
      for (size_t i = 0; i < atj->size(); ++i) {
        const json& t = (*atj)[i];
        const std::string path = index("added_tokens", i);
        require_object(t, where, path);
        LATHE_CHECK(find(t, "id"), "{}: {}.id is missing (each added token needs \"id\" and \"content\")", where, path);
        AddedToken a;
        a.id = token_id(t["id"], id_limit, where, join(path, "id"));
        a.content = string(t, "content", where, path);
        a.special = opt_bool(t, "special", false, where, path);
        a.lstrip = opt_bool(t, "lstrip", false, where, path);
        a.rstrip = opt_bool(t, "rstrip", false, where, path);
        a.single_word = opt_bool(t, "single_word", false, where, path);
        a.normalized = opt_bool(t, "normalized", !a.special, where, path);
        if (a.content.empty()) continue;
        added_.push_back(std::move(a));
      }
      for (const AddedToken& a : added_) {
        added_by_id_[a.id] = &a;
        added_by_content_.emplace(a.content, a.id);
        vocab_size_ = std::max<int64_t>(vocab_size_, int64_t{a.id} + 1);
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
    if (const json* p = find(cfg, "post_processor")) parse_post(*p, where, "post_processor");

    kind_ = !kind_override.empty() ? kind_override : byte_level_ ? "hf-bpe-bytelevel" : "hf-bpe-sentencepiece";
    resolve_specials(dir);
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

  // Runs the normalizer and the decoder once on a short probe text at load, so that a chain that
  // expands ordinary text without bound (see GrowthBudget) is refused when the file is loaded (and
  // by `lathe check`), not at the first document that triggers it. Text-specific growth is still
  // caught at run time by the same budget.
  void probe_growth() const {
    static const std::string kProbe =
        " !\"#$%&'()*+,-./0123456789:;<=>?@ABCDEFGHIJKLMNOPQRSTUVWXYZ[\\]^_`abcdefghijklmnopqrstuvwxyz{|}~ \t\n"
        "\xC3\xA9\xC3\x9F\xE2\x96\x81\xE4\xB8\xAD\xF0\x9F\x98\x80";
    if (normalizer_) {
      std::string s = kProbe;
      normalizer_->apply(s);
    }
    if (decoder_) {
      std::vector<std::string> toks;
      for (size_t i = 0; i < kProbe.size(); i += 4) toks.push_back(kProbe.substr(i, 4));
      decoder_->apply(toks);
    }
  }

  // A token id the post-processor emits (at `path`): it must be a token of this tokenizer, or
  // encode() would hand the model an id it has no embedding for.
  int32_t special_id(const json& v, const std::string& where, const std::string& path) const {
    if (!v.is_number_integer()) type_error(where, path, "an integer token id", v);
    const bool in_range = !(v.is_number_unsigned() && v.get<uint64_t>() >= static_cast<uint64_t>(vocab_size_)) &&
                          v.get<int64_t>() >= 0 && v.get<int64_t>() < vocab_size_;
    const int32_t id = in_range ? static_cast<int32_t>(v.get<int64_t>()) : -1;
    LATHE_CHECK(in_range && (added_by_id_.count(id) || model_->id_to_token(id)),
                "{}: {}: token id {} is not a token of this tokenizer (ids 0..{}): the post-processor would emit "
                "it for every sequence; fix the id",
                where, path, io::json_excerpt(v, 40), vocab_size_ - 1);
    return id;
  }

  void parse_post(const json& p, const std::string& where, const std::string& path) {
    require_object(p, where, path);
    std::string type = string(p, "type", where, path);
    if (type == "Sequence") {
      const json& procs = array(p, "processors", where, path);
      for (size_t i = 0; i < procs.size(); ++i) parse_post(procs[i], where, index(join(path, "processors"), i));
      return;
    }
    if (type == "ByteLevel") return;  // offsets only
    if (type == "TemplateProcessing") {
      const json& single = array(p, "single", where, path);
      const json& specials = object(p, "special_tokens", where, path);
      const std::string spath = join(path, "special_tokens");
      std::vector<int32_t> pre, post;
      bool seen_a = false;
      for (size_t i = 0; i < single.size(); ++i) {
        const json& piece = single[i];
        const std::string ppath = index(join(path, "single"), i);
        require_object(piece, where, ppath);
        if (find(piece, "Sequence")) {
          LATHE_CHECK(!seen_a, "{}: {}: TemplateProcessing 'single' has two sequences", where, ppath);
          seen_a = true;
          continue;
        }
        LATHE_CHECK(find(piece, "SpecialToken"),
                    "{}: {} {} is neither {{\"Sequence\": ...}} nor {{\"SpecialToken\": ...}}", where, ppath,
                    io::json_excerpt(piece));
        std::string key = string(object(piece, "SpecialToken", where, ppath), "id", where, join(ppath, "SpecialToken"));
        LATHE_CHECK(find(specials, key), "{}: {}: special token {} is missing from {}", where, ppath, quote(key),
                    spath);
        const std::string epath = member(spath, key);
        const json& ids = array(specials[key], "ids", where, epath);
        std::vector<int32_t>& dst = seen_a ? post : pre;
        for (size_t k = 0; k < ids.size(); ++k) dst.push_back(special_id(ids[k], where, index(join(epath, "ids"), k)));
      }
      prefix_.insert(prefix_.end(), pre.begin(), pre.end());
      suffix_.insert(suffix_.begin(), post.begin(), post.end());
      return;
    }
    if (type == "RobertaProcessing" || type == "BertProcessing") {
      auto pair_id = [&](const char* key) {
        const std::string kpath = join(path, key);
        LATHE_CHECK(find(p, key), "{}: {} is missing (it must be [\"token\", id])", where, kpath);
        const json& c = p[key];
        if (!(c.is_array() && c.size() == 2 && c[0].is_string())) type_error(where, kpath, "[\"token\", id]", c);
        return special_id(c[1], where, kpath + "[1]");
      };
      prefix_.push_back(pair_id("cls"));
      suffix_.insert(suffix_.begin(), pair_id("sep"));
      return;
    }
    throw_error(
        "{}: {}: post_processor type {} is not supported by lathe (supported: TemplateProcessing, ByteLevel, "
        "RobertaProcessing, BertProcessing, Sequence)",
        where, path, quote(type));
  }

  // BOS/EOS/PAD: tokenizer_config.json next to the tokenizer if present; else the post-processor
  // template (first prefix token = BOS, last suffix token = EOS); else well-known special names.
  void resolve_specials(const std::string& dir) {
    bool have_cfg = false;
    if (!dir.empty() && present(fs::path(dir) / "tokenizer_config.json")) {
      const std::string p = (fs::path(dir) / "tokenizer_config.json").string();
      const json c = io::read_json_file(p);
      require_object(c, p, "");
      auto from_cfg = [&](const char* key) -> std::optional<int32_t> {
        const json* v = find(c, key);
        if (!v) return std::nullopt;
        std::string name;
        if (v->is_string())
          name = v->get<std::string>();
        else if (v->is_object())
          name = string(*v, "content", p, key);
        else
          type_error(p, key, "a token string or an object with \"content\"", *v);
        auto id = token_to_id(name);
        LATHE_CHECK(id.has_value(), "{}: {} {} is not in the tokenizer vocabulary", p, key, quote(name));
        return id;
      };
      bos_ = from_cfg("bos_token");
      eos_ = from_cfg("eos_token");
      pad_ = from_cfg("pad_token");
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

  std::unique_ptr<BpeEncoder> model_;
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
  json vocab = io::read_json_file(vocab_path);
  if (!vocab.is_object()) type_error(vocab_path, "", "an object token -> id", vocab);
  // Validated here so that messages name encoder.json and the token (not the converted config).
  const int64_t limit = token_id_limit(static_cast<int64_t>(vocab.size()));
  for (auto it = vocab.begin(); it != vocab.end(); ++it)
    token_id(it.value(), limit, vocab_path, "entry " + quote(it.key()));
  const std::string mtext = io::read_file(merges_path);
  json merges = json::array();
  size_t pos = 0, line_no = 0;
  while (pos < mtext.size()) {
    size_t e = mtext.find('\n', pos);
    if (e == std::string::npos) e = mtext.size();
    std::string_view line(mtext.data() + pos, e - pos);
    pos = e + 1;
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty() || line.rfind("#version", 0) == 0) continue;
    size_t sp = line.find(' ');
    LATHE_CHECK(sp != std::string::npos && line.find(' ', sp + 1) == std::string::npos,
                "{} line {}: a merge must be two tokens separated by one space, got {}", merges_path, line_no,
                quote(line));
    merges.push_back(std::string(line));
  }
  json cfg;
  cfg["added_tokens"] = json::array();
  // GPT-2's <|endoftext|> is a special token in transformers' GPT2Tokenizer(Fast).
  if (vocab.contains("<|endoftext|>"))
    cfg["added_tokens"].push_back(
        {{"id", vocab["<|endoftext|>"]}, {"content", "<|endoftext|>"}, {"special", true}, {"normalized", false}});
  cfg["model"] = {{"type", "BPE"}, {"merges", std::move(merges)}};
  cfg["model"]["vocab"] = std::move(vocab);
  cfg["pre_tokenizer"] = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}};
  cfg["decoder"] = {{"type", "ByteLevel"}};
  fs::path dir = fs::path(vocab_path).parent_path();
  return make_hf_tokenizer(cfg, vocab_path + " + " + merges_path, "gpt2-legacy", {vocab_path, merges_path},
                           dir.string());
}

// Exposed for load_tokenizer in tokenizer.cpp.
std::unique_ptr<Tokenizer> load_hf_json(const std::string& path) {
  json cfg = io::read_json_file(path);
  return make_hf_tokenizer(cfg, path, "", {path}, fs::path(path).parent_path().string());
}

}  // namespace lathe::tok
