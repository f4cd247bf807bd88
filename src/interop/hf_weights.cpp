#include "interop/hf_weights.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <vector>

#include "config/model_keys.h"
#include "io/fs.h"
#include "io/json.h"
#include "io/safetensors.h"
#include "models/memory.h"

namespace lathe {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// ---------------------------------------------------------------------------------------------
// THE name table. The model's ParamTable names already are the canonical HF state-dict names;
// this table holds only what differs between checkpoints of one family: name aliases, buffers
// that hold no parameters, the lm_head that a tied model may carry as a copy, and the tensors
// whose rows are the vocabulary.
struct FamilyRules {
  std::vector<std::string> model_types;
  // {file prefix, canonical prefix}: the Hub's base-model gpt2 checkpoint has no "transformer.".
  std::vector<std::pair<std::string, std::string>> prefix_aliases;
  // Non-parameter buffers (suffix match; only for names that are not parameters).
  std::vector<std::string> ignored_suffixes;
  std::string embedding;                   // canonical token embedding
  std::string tied_head_in_file;           // lm_head a tied model's file may carry as a copy
  std::vector<std::string> vocab_tensors;  // rows = vocabulary, resized by resize_vocab
  // Fused q|k|v tensors (suffix match) whose HF rows are interleaved per head, [H][q, k, v][D]
  // (GPT-NeoX's query_key_value weight and bias), where lathe's are [q | k | v] = [3][H][D]: rows
  // permuted on load and back on export (qkv_rows).
  std::vector<std::string> qkv_per_head = {};
};

const std::vector<FamilyRules>& family_rules() {
  static const std::vector<FamilyRules> rules = {
      {{"gpt2"},
       {{"h.", "transformer.h."},
        {"wte.", "transformer.wte."},
        {"wpe.", "transformer.wpe."},
        {"ln_f.", "transformer.ln_f."}},
       {".attn.bias", ".attn.masked_bias"},  // causal-mask buffers of old checkpoints
       "transformer.wte.weight",
       "lm_head.weight",
       {"transformer.wte.weight"}},
      {{"llama", "qwen2", "mistral", "qwen3", "phi3", "gemma2", "mixtral",
        "olmo2", "qwen2_moe"},  // phi3: qkv_proj, gate_up_proj (models/llama.cpp); olmo2: models/olmo2.cpp
       {},
       {".rotary_emb.inv_freq"},  // rotary buffer of older checkpoints
       "model.embed_tokens.weight",
       "lm_head.weight",
       {"model.embed_tokens.weight", "lm_head.weight"}},
      {{"gpt_neox"},
       {},
       // causal-mask and rotary buffers of older checkpoints (Pythia's files carry all three)
       {".attention.bias", ".attention.masked_bias", ".rotary_emb.inv_freq"},
       "gpt_neox.embed_in.weight",
       "",  // never tied
       {"gpt_neox.embed_in.weight", "embed_out.weight"},
       {".attention.query_key_value.weight", ".attention.query_key_value.bias"}},
  };
  return rules;
}

const FamilyRules& rules_for(const ModelConfig& cfg) {
  for (const auto& r : family_rules())
    if (std::find(r.model_types.begin(), r.model_types.end(), cfg.model_type) != r.model_types.end()) return r;
  throw_error("internal: no Hugging Face name rules for model_type '{}'", cfg.model_type);
}

bool ends_with(const std::string& s, const std::string& suf) {
  return s.size() >= suf.size() && s.compare(s.size() - suf.size(), suf.size(), suf) == 0;
}

bool qkv_per_head(const FamilyRules& rules, const std::string& name) {
  for (const auto& suf : rules.qkv_per_head)
    if (ends_with(name, suf)) return true;
  return false;
}

// The rows of a fused q|k|v tensor of `heads` heads: HF's per-head order [H][3][D] (to_hf) from
// lathe's [3][H][D], or back. `n` values, rows of n / (3 * heads * D) values each.
void qkv_rows(float* dst, const float* src, int64_t n, int64_t heads, bool to_hf) {
  LATHE_CHECK(heads > 0 && n % (3 * heads) == 0, "internal: fused q|k|v tensor of {} values over {} heads", n, heads);
  const int64_t block = n / (3 * heads);  // one head's rows of one of q, k, v
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t k = 0; k < 3; ++k) {
      const int64_t hf = (h * 3 + k) * block, lathe = (k * heads + h) * block;
      std::copy_n(src + (to_hf ? lathe : hf), block, dst + (to_hf ? hf : lathe));
    }
}

// File tensor name -> parameter, or nullptr.
const ParamSpec* canonical(const ParamTable& table, const FamilyRules& rules, const std::string& name) {
  if (const ParamSpec* p = table.find(name)) return p;
  for (const auto& [from, to] : rules.prefix_aliases)
    if (name.rfind(from, 0) == 0)
      if (const ParamSpec* p = table.find(to + name.substr(from.size()))) return p;
  return nullptr;
}

std::string file_name(const std::string& path) { return fs::path(path).filename().string(); }

// Whether anything is at `p` (a file, a directory, a dangling or looping symlink). Never throws:
// std::filesystem::exists throws on a symlink loop; opening it (io::open_input) names the loop.
bool entry_exists(const fs::path& p) {
  std::error_code ec;
  return fs::symlink_status(p, ec).type() != fs::file_type::not_found && !ec;
}

// A name from an untrusted file, bounded for an error message.
std::string short_text(const std::string& s) { return s.size() <= 120 ? s : s.substr(0, 120) + "..."; }

// std::filesystem errors (directory not creatable, permission, ...) as lathe::Error naming `what`.
template <typename Fn>
auto fs_op(const std::string& what, Fn&& fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (const fs::filesystem_error& e) {
    throw_error("{}: {}", what, e.code().message());
  }
}

// model.safetensors.index.json: the tensor -> shard file map. Shard names must be plain file names
// inside the directory (an index is untrusted: "../x" or "/dev/zero" must not be opened).
std::map<std::string, std::string> read_weight_map(const std::string& index) {
  const json j = io::read_json_file(index);
  LATHE_CHECK(j.is_object() && j.contains("weight_map") && j["weight_map"].is_object(),
              "{}: no \"weight_map\" object (expected {{\"weight_map\": {{\"tensor name\": \"shard file\", ...}}}})",
              index);
  std::map<std::string, std::string> wm;
  for (auto& [k, v] : j["weight_map"].items()) {
    LATHE_CHECK(v.is_string(), "{}: weight_map[\"{}\"] must be a shard file name, got {} '{}'", index, short_text(k),
                io::json_type_name(v), io::json_excerpt(v));
    const std::string& f = v.get_ref<const std::string&>();
    LATHE_CHECK(
        !f.empty() && f != "." && f != ".." && f.find('/') == std::string::npos && f.find('\0') == std::string::npos,
        "{}: weight_map[\"{}\"] = '{}' is not a file name in the model directory (no '/', '..')", index, short_text(k),
        short_text(f));
    wm[k] = f;
  }
  LATHE_CHECK(!wm.empty(), "{}: weight_map is empty", index);
  return wm;
}

const char* torch_dtype_name(DType d) {
  return d == DType::F32 ? "float32" : d == DType::BF16 ? "bfloat16" : "float16";
}

// One tensor to write: HF name, HF shape, fp32 data (pointing into the model or into `keep`).
struct OutTensor {
  std::string name;
  Shape shape;
  const float* data;
};

std::vector<OutTensor> hf_layout(const Model& model, const float* flat, std::vector<std::vector<float>>& keep) {
  std::vector<OutTensor> out;
  keep.reserve(model.params().specs().size());
  const FamilyRules& rules = rules_for(model.config());
  for (const ParamSpec& s : model.params().specs()) {
    const float* src = flat + s.offset;
    if (qkv_per_head(rules, s.name)) {
      std::vector<float> t(static_cast<size_t>(s.numel()));
      qkv_rows(t.data(), src, s.numel(), model.config().num_attention_heads, true);
      keep.push_back(std::move(t));
      out.push_back({s.name, s.shape, keep.back().data()});
    } else if (s.hf_transposed) {
      const int64_t rows = s.shape[0], cols = s.shape[1];  // lathe [out, in] -> HF Conv1D [in, out]
      std::vector<float> t(static_cast<size_t>(rows * cols));
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c) t[c * rows + r] = src[r * cols + c];
      keep.push_back(std::move(t));
      out.push_back({s.name, Shape{cols, rows}, keep.back().data()});
    } else {
      out.push_back({s.name, s.shape, src});
    }
  }
  return out;
}

void write_tensors(const std::vector<OutTensor>& ts, const std::string& path, DType dtype,
                   const std::function<void()>& on_tensor = {}) {
  std::vector<io::StWriteF32> entries;
  for (const auto& t : ts) entries.push_back({t.name, t.shape, t.data});
  io::write_safetensors_f32(path, entries, dtype, {{"format", "pt"}}, on_tensor);
}

}  // namespace

// ------------------------------------------------------------------------------------- saving

void save_hf_tensors(const Model& model, const float* flat, const std::string& path, DType dtype) {
  std::vector<std::vector<float>> keep;
  write_tensors(hf_layout(model, flat, keep), path, dtype);
}

void save_hf_model(const Model& model, const std::string& dir, DType dtype) {
  HfSaveOptions o;
  o.dtype = dtype;
  save_hf_model(model, dir, o);
}

void save_hf_model(const Model& model, const std::string& dir, const HfSaveOptions& opts) {
  LATHE_CHECK(opts.dtype == DType::F32 || opts.dtype == DType::BF16 || opts.dtype == DType::F16,
              "export dtype must be fp32, bf16 or fp16, not {}", dtype_name(opts.dtype));
  LATHE_CHECK(opts.max_shard_bytes > 0, "max shard size must be > 0");
  for (const auto& f : opts.extra_files) io::require_regular_file(f);  // names a missing file, FIFO, loop
  fs_op(fmt::format("{}: cannot create the output directory", dir), [&] { fs::create_directories(dir); });
  std::vector<std::vector<float>> keep;
  const std::vector<OutTensor> ts = hf_layout(model, model.param_data(), keep);

  // Greedy shards in state-dict order, as transformers' save_pretrained does.
  const size_t esize = dtype_size(opts.dtype);
  std::vector<std::vector<OutTensor>> shards(1);
  uint64_t cur = 0, total = 0;
  for (const auto& t : ts) {
    const uint64_t nb = static_cast<uint64_t>(lathe::numel(t.shape)) * esize;
    if (cur > 0 && cur + nb > opts.max_shard_bytes) {
      shards.emplace_back();
      cur = 0;
    }
    shards.back().push_back(t);
    cur += nb;
    total += nb;
  }
  // Stale weight files of another layout would make the directory ambiguous to loaders.
  static const std::regex shard_re(R"(model-\d{5}-of-\d{5}\.safetensors)");
  fs_op(fmt::format("{}: cannot remove stale weight files", dir), [&] {
    for (const auto& e : fs::directory_iterator(dir)) {
      const std::string n = e.path().filename().string();
      if (n == "model.safetensors" || n == "model.safetensors.index.json" || std::regex_match(n, shard_re))
        fs::remove(e.path());
    }
  });
  int64_t written = 0;
  const std::function<void()> on_tensor = [&] {
    if (opts.on_tensor) opts.on_tensor(++written, static_cast<int64_t>(ts.size()));
  };
  if (shards.size() == 1) {
    write_tensors(shards[0], (fs::path(dir) / "model.safetensors").string(), opts.dtype, on_tensor);
  } else {
    json wm = json::object();
    for (size_t i = 0; i < shards.size(); ++i) {
      const std::string name = fmt::format("model-{:05d}-of-{:05d}.safetensors", i + 1, shards.size());
      write_tensors(shards[i], (fs::path(dir) / name).string(), opts.dtype, on_tensor);
      for (const auto& t : shards[i]) wm[t.name] = name;
    }
    json index = {{"metadata", {{"total_size", total}}}, {"weight_map", wm}};
    io::atomic_write_file((fs::path(dir) / "model.safetensors.index.json").string(), index.dump(2) + "\n");
  }
  json cfg = model.config().to_hf_json();
  cfg["torch_dtype"] = torch_dtype_name(opts.dtype);
  io::atomic_write_file((fs::path(dir) / "config.json").string(), cfg.dump(2) + "\n");
  json gen = {{"_from_model_config", true}};
  const ModelConfig& c = model.config();
  if (c.bos_token_id >= 0) gen["bos_token_id"] = c.bos_token_id;
  if (c.eos_token_ids.size() > 1)
    gen["eos_token_id"] = c.eos_token_ids;
  else if (c.eos_token_id >= 0)
    gen["eos_token_id"] = c.eos_token_id;
  if (c.pad_token_id >= 0) gen["pad_token_id"] = c.pad_token_id;
  if (!opts.generation_config.empty()) gen = io::read_json_file(opts.generation_config);  // the source's, as it is
  io::atomic_write_file((fs::path(dir) / "generation_config.json").string(), gen.dump(2) + "\n");
  for (const auto& f : opts.extra_files) {
    const fs::path dst = fs::path(dir) / fs::path(f).filename();
    std::error_code ec;
    if (fs::equivalent(dst, f, ec) && !ec) continue;
    io::atomic_write_file(dst.string(), io::read_file(f));
  }
}

// ------------------------------------------------------------------------------------ loading

std::string generation_config_in(const std::string& dir) {
  const fs::path p = fs::path(dir) / "generation_config.json";
  return entry_exists(p.string()) ? p.string() : std::string();
}

ModelConfig load_hf_config(const std::string& dir) {
  const std::string path = (fs::path(dir) / "config.json").string();
  LATHE_CHECK(entry_exists(path), "{}: not found (a Hugging Face model directory needs config.json)", path);
  // Regular file only (a FIFO, a directory, a symlink loop is named), depth-checked JSON.
  return ModelConfig::from_hf_json(io::read_json_file(path), path, false);
}

ModelConfig init_from_config(const ModelConfig& recipe_model, const std::string& dir, std::string_view recipe_source,
                             std::vector<std::string>* changes) {
  const ModelConfig file = load_hf_config(dir);
  if (changes && !file.ignored_note().empty()) changes->push_back(file.ignored_note());
  if (recipe_model == file) return file;
  static const std::set<std::string> bookkeeping = {"architectures", "torch_dtype", "transformers_version"};
  const nlohmann::json a = file.to_hf_json(), b = recipe_model.to_hf_json();
  std::set<std::string> keys;
  for (auto it = a.begin(); it != a.end(); ++it) keys.insert(it.key());
  for (auto it = b.begin(); it != b.end(); ++it) keys.insert(it.key());
  const std::string path = (fs::path(dir) / "config.json").string();
  for (const std::string& k : keys) {
    const nlohmann::json va = a.value(k, nlohmann::json()), vb = b.value(k, nlohmann::json());
    if (va == vb || bookkeeping.count(k)) continue;
    LATHE_CHECK(!is_model_shape_key(k),  // config/model_keys.h: the loader would refuse DIR's tensors

                "{}: model.{}: {} differs from {} of model.init_from's {}: init_from loads that directory's weights, "
                "whose shapes follow its value (drop model.{} from the recipe, or start from a model of that shape)",
                recipe_source, k, vb.dump(), va.dump(), path, k);
    if (changes) changes->push_back(fmt::format("the recipe overrides {}: {} -> {}", k, va.dump(), vb.dump()));
  }
  return recipe_model;
}

std::vector<std::string> hf_weight_files(const std::string& dir) {
  const fs::path single = fs::path(dir) / "model.safetensors";
  const fs::path index = fs::path(dir) / "model.safetensors.index.json";
  std::error_code ec;
  LATHE_CHECK(fs::is_directory(dir, ec), "{}: not a directory (expected a Hugging Face model directory)", dir);
  if (entry_exists(single)) {
    LATHE_CHECK(!entry_exists(index),
                "{}: both model.safetensors and model.safetensors.index.json exist; it is ambiguous which holds "
                "the weights (remove the stale one)",
                dir);
    return {single.string()};
  }
  if (entry_exists(index)) {
    std::set<std::string> uniq;
    for (const auto& [k, f] : read_weight_map(index.string())) uniq.insert(f);
    std::vector<std::string> files;
    for (const auto& f : uniq) {
      const fs::path p = fs::path(dir) / f;
      LATHE_CHECK(entry_exists(p), "{}: shard {} listed in weight_map does not exist", index.string(), p.string());
      files.push_back(p.string());
    }
    return files;
  }
  for (const char* bin : {"pytorch_model.bin", "pytorch_model.bin.index.json"})
    if (entry_exists(fs::path(dir) / bin))
      throw_error(
          "{}: only {} found; lathe reads safetensors only (pickle files can run code). Convert it "
          "with: /usr/bin/python3 -c \"import transformers as t; "
          "t.AutoModelForCausalLM.from_pretrained('{}').save_pretrained('{}', safe_serialization=True)\"",
          dir, bin, dir, dir);
  throw_error("{}: no model.safetensors or model.safetensors.index.json", dir);
}

std::string load_hf_weights(Model& model, const std::string& dir, const HfLoadOptions& opts) {
  const ModelConfig& cfg = model.config();
  const FamilyRules& rules = rules_for(cfg);
  const std::vector<std::string> files = hf_weight_files(dir);
  // Sharded: the tensor -> file map of the index, checked against what each file holds.
  std::map<std::string, std::string> weight_map;
  const fs::path index = fs::path(dir) / "model.safetensors.index.json";
  const bool sharded = files.size() > 1 || file_name(files[0]) != "model.safetensors";
  if (sharded) weight_map = read_weight_map(index.string());

  const ParamTable& table = model.params();
  const int64_t C = cfg.hidden_size, Vm = cfg.vocab_size;
  // The file's vocabulary: the model's unless resizing.
  int64_t Vf = Vm;
  std::map<std::string, int> loaded;
  std::vector<std::string> unexpected, misshaped, index_errors;
  std::map<std::string, std::pair<int64_t, size_t>> conversions;  // dtype -> (tensors, bytes)
  std::vector<std::string> ignored;
  size_t bytes = 0;
  std::vector<float> tied_copy;  // a tied model's lm_head.weight found in the file
  std::string tied_copy_file;
  std::set<std::string> seen_in_files;

  for (const std::string& f : files) {
    io::SafetensorsFile st(f);
    for (const io::StTensorInfo& info : st.tensors()) {
      seen_in_files.insert(info.name);
      if (sharded) {
        auto it = weight_map.find(info.name);
        if (it == weight_map.end())
          index_errors.push_back(fmt::format("{} is in {} but not in the index's weight_map", info.name, file_name(f)));
        else if (it->second != file_name(f))
          index_errors.push_back(fmt::format("{} is in {} but the index says {}", info.name, file_name(f), it->second));
      }
      const ParamSpec* sp = canonical(table, rules, info.name);
      if (!sp) {
        if (cfg.tie_word_embeddings && info.name == rules.tied_head_in_file) {
          // Checked against the embedding once everything is loaded.
          if (info.shape.size() == 2 && info.shape[1] == C) {
            tied_copy.resize(static_cast<size_t>(lathe::numel(info.shape)));
            st.read_f32(info, tied_copy.data());
            tied_copy_file = f;
          } else {
            misshaped.push_back(
                fmt::format("{}: file has {}, the tied embedding is [V, {}]", info.name, shape_str(info.shape), C));
          }
          continue;
        }
        bool ign = false;
        for (const auto& suf : rules.ignored_suffixes) ign = ign || ends_with(info.name, suf);
        if (ign)
          ignored.push_back(info.name);
        else
          unexpected.push_back(fmt::format("{} (in {})", info.name, file_name(f)));
        continue;
      }
      const ParamSpec& s = *sp;
      const bool vocab =
          std::find(rules.vocab_tensors.begin(), rules.vocab_tensors.end(), s.name) != rules.vocab_tensors.end();
      Shape want = s.shape;
      if (s.hf_transposed) std::reverse(want.begin(), want.end());
      if (vocab && opts.resize_vocab > 0 && info.shape.size() == 2 && info.shape[1] == C) {
        // The file's vocabulary may be smaller than the model's when resizing.
        if (info.shape[0] > Vm)
          throw_error("{}: {} has {} rows but --resize-vocab is {}: shrinking the vocabulary would drop tokens", dir,
                      info.name, info.shape[0], Vm);
        Vf = info.shape[0];
        want[0] = Vf;
      }
      if (info.shape != want) {
        misshaped.push_back(
            fmt::format("{}: file has {}, model needs {}", info.name, shape_str(info.shape), shape_str(want)));
        continue;
      }
      if (++loaded[s.name] > 1) {
        misshaped.push_back(fmt::format("{}: appears more than once in the files (as {})", s.name, info.name));
        continue;
      }
      float* dst = model.param_data() + s.offset;
      if (s.hf_transposed) {
        std::vector<float> tmp(static_cast<size_t>(s.numel()));
        st.read_f32(info, tmp.data());
        const int64_t rows = s.shape[0], cols = s.shape[1];  // lathe [out, in]; file [in, out]
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t c = 0; c < cols; ++c) dst[r * cols + c] = tmp[c * rows + r];
      } else if (qkv_per_head(rules, s.name)) {
        std::vector<float> tmp(static_cast<size_t>(s.numel()));
        st.read_f32(info, tmp.data());
        qkv_rows(dst, tmp.data(), s.numel(), cfg.num_attention_heads, false);
      } else {
        st.read_f32(info, dst);  // for a resized vocabulary: the first Vf rows
      }
      if (vocab && want[0] < s.shape[0]) {
        // New rows = mean of the loaded rows (keeps the new tokens' logits near the average).
        std::vector<double> mean(static_cast<size_t>(C), 0.0);
        for (int64_t r = 0; r < want[0]; ++r)
          for (int64_t c = 0; c < C; ++c) mean[c] += dst[r * C + c];
        for (int64_t r = want[0]; r < s.shape[0]; ++r)
          for (int64_t c = 0; c < C; ++c) dst[r * C + c] = static_cast<float>(mean[c] / static_cast<double>(want[0]));
      }
      bytes += info.nbytes;
      if (info.dtype != DType::F32) {
        auto& cv = conversions[std::string(dtype_name(info.dtype))];
        cv.first += 1;
        cv.second += info.nbytes;
      }
    }
  }
  for (const auto& [k, v] : weight_map)
    if (!seen_in_files.count(k))
      index_errors.push_back(fmt::format("{} is listed in the index ({}) but not in that file", k, v));

  std::vector<std::string> missing;
  for (const ParamSpec& s : table.specs())
    if (!loaded.count(s.name)) missing.push_back(s.name);
  if (!missing.empty() || !unexpected.empty() || !misshaped.empty() || !index_errors.empty()) {
    std::string msg =
        fmt::format("{}: weights do not match the model (model_type {} from config.json)", dir, cfg.model_type);
    auto list = [&](const char* what, const std::vector<std::string>& v) {
      if (v.empty()) return;
      msg += fmt::format("\n  {} ({}):", what, v.size());
      for (size_t i = 0; i < v.size() && i < 20; ++i) msg += "\n    " + v[i];
      if (v.size() > 20) msg += fmt::format("\n    ... and {} more", v.size() - 20);
    };
    list("missing from the files", missing);
    list("unexpected in the files", unexpected);
    list("wrong shape or duplicated", misshaped);
    list("inconsistent with model.safetensors.index.json", index_errors);
    throw Error(msg);
  }

  std::string tied_note;
  if (!tied_copy_file.empty()) {
    // A tied model computes logits with the embedding; a different lm_head in the file would be
    // silently ignored, so it must be an exact copy.
    const float* emb = model.param(rules.embedding);
    const int64_t rows = static_cast<int64_t>(tied_copy.size()) / C;
    LATHE_CHECK(rows == Vf, "{}: {} in {} has {} rows but the embedding {} has {}", dir, rules.tied_head_in_file,
                tied_copy_file, rows, rules.embedding, Vf);
    double maxd = 0;
    for (size_t i = 0; i < tied_copy.size(); ++i) maxd = std::max(maxd, std::fabs(double(tied_copy[i]) - emb[i]));
    LATHE_CHECK(maxd == 0,
                "{}: config.json says tie_word_embeddings = true but {} in {} differs from {} (max abs diff {:.6g}); "
                "a tied model would ignore it. Set \"tie_word_embeddings\": false in config.json if the head is "
                "trained separately",
                dir, rules.tied_head_in_file, file_name(tied_copy_file), rules.embedding, maxd);
    tied_note = fmt::format(" tied {} present in the file and equal to {};", rules.tied_head_in_file, rules.embedding);
  } else if (cfg.tie_word_embeddings) {
    tied_note = fmt::format(" {} tied to {};", rules.tied_head_in_file, rules.embedding);
  }
  std::string conv;
  for (auto& [k, n] : conversions) conv += fmt::format(" {} tensors ({:.1f} MB) {}->F32;", n.first, n.second / 1e6, k);
  std::string rep = fmt::format("loaded {} tensors ({:.1f} MB) from {} file(s);{}{}", loaded.size(), bytes / 1e6,
                                files.size(), conv.empty() ? " no dtype conversion;" : conv, tied_note);
  if (!ignored.empty()) rep += fmt::format(" ignored {} non-parameter buffers (e.g. {});", ignored.size(), ignored[0]);
  if (opts.resize_vocab > 0) {
    if (Vf < Vm)
      rep +=
          fmt::format(" vocabulary resized {} -> {}: {} new rows initialized to the mean embedding;", Vf, Vm, Vm - Vf);
    else
      rep += fmt::format(" vocabulary already {} (no resize needed);", Vm);
  }
  rep.pop_back();
  model.upload_params();            // a device-resident model computes from its backend copy
  model.refresh_compute_weights();  // a bf16/fp16 model's GEMMs read the copies
  return rep;
}

std::unique_ptr<Model> load_hf_model(const std::string& dir, std::string* report, const HfLoadOptions& opts) {
  ModelConfig cfg = load_hf_config(dir);
  const std::string cfg_path = (fs::path(dir) / "config.json").string();
  if (opts.resize_vocab > 0) {
    LATHE_CHECK(opts.resize_vocab >= cfg.vocab_size,
                "--resize-vocab {} is smaller than the vocab_size {} of {}: shrinking would drop tokens",
                opts.resize_vocab, cfg.vocab_size, dir);
    cfg.vocab_size = opts.resize_vocab;
    cfg.validate(fmt::format("{} with --resize-vocab {}", cfg_path, opts.resize_vocab));
  }
  // Before any allocation, naming the file the dimensions came from.
  check_memory_fits(estimate_memory(cfg, 0, 0, 0), cfg, cfg_path);
  auto model = build_model(cfg);
  std::string r = load_hf_weights(*model, dir, opts);
  if (!cfg.ignored_note().empty()) r += "; " + cfg.ignored_note();
  if (report) *report = r;
  return model;
}

}  // namespace lathe
