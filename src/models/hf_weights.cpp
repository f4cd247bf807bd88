#include "models/hf_weights.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "io/fs.h"
#include "io/safetensors.h"

namespace lathe {

namespace fs = std::filesystem;

namespace {

// HF names of a parameter: the canonical one and, for GPT-2, the unprefixed base-model form
// that the Hub's gpt2 checkpoint uses ("h.0.attn.c_attn.weight").
std::vector<std::string> accepted_names(const std::string& name) {
  std::vector<std::string> v{name};
  const std::string prefix = "transformer.";
  if (name.rfind(prefix, 0) == 0) v.push_back(name.substr(prefix.size()));
  return v;
}

bool ignorable_file_tensor(const std::string& name) {
  // Causal-mask and rotary buffers that older checkpoints carry; they hold no parameters.
  auto ends_with = [&](const std::string& s) {
    return name.size() >= s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0;
  };
  return ends_with(".attn.bias") || ends_with(".attn.masked_bias") || ends_with("rotary_emb.inv_freq");
}

}  // namespace

void save_hf_tensors(const Model& model, const float* flat, const std::string& path, DType dtype) {
  const ParamTable& table = model.params();
  // Transposed copies for GPT-2 Conv1D weights live here until the file is written.
  std::vector<std::vector<float>> transposed;
  std::vector<io::StWriteF32> entries;
  for (const ParamSpec& s : table.specs()) {
    const float* src = flat + s.offset;
    if (s.hf_transposed) {
      const int64_t rows = s.shape[0], cols = s.shape[1];
      std::vector<float> t(static_cast<size_t>(rows * cols));
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c) t[c * rows + r] = src[r * cols + c];
      transposed.push_back(std::move(t));
      entries.push_back({s.name, Shape{cols, rows}, transposed.back().data()});
    } else {
      entries.push_back({s.name, s.shape, src});
    }
  }
  io::write_safetensors_f32(path, entries, dtype, {{"format", "pt"}});
}

void save_hf_model(const Model& model, const std::string& dir, DType dtype) {
  fs::create_directories(dir);
  save_hf_tensors(model, model.param_data(), (fs::path(dir) / "model.safetensors").string(), dtype);
  nlohmann::json cfg = model.config().to_hf_json();
  cfg["torch_dtype"] = dtype == DType::F32 ? "float32" : dtype == DType::BF16 ? "bfloat16" : "float16";
  io::atomic_write_file((fs::path(dir) / "config.json").string(), cfg.dump(2) + "\n");
}

ModelConfig load_hf_config(const std::string& dir) {
  const std::string path = (fs::path(dir) / "config.json").string();
  LATHE_CHECK(fs::exists(path), "{}: not found (a Hugging Face model directory needs config.json)", path);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(io::read_file(path));
  } catch (const nlohmann::json::exception& e) {
    throw_error("{}: invalid JSON: {}", path, e.what());
  }
  return ModelConfig::from_hf_json(j, path, false);
}

std::string load_hf_weights(Model& model, const std::string& dir) {
  std::vector<std::string> files;
  const fs::path single = fs::path(dir) / "model.safetensors";
  const fs::path index = fs::path(dir) / "model.safetensors.index.json";
  if (fs::exists(single)) {
    files.push_back(single.string());
  } else if (fs::exists(index)) {
    nlohmann::json j = nlohmann::json::parse(io::read_file(index.string()));
    std::set<std::string> uniq;
    for (auto& [k, v] : j.at("weight_map").items()) uniq.insert(v.get<std::string>());
    for (auto& f : uniq) files.push_back((fs::path(dir) / f).string());
  } else if (fs::exists(fs::path(dir) / "pytorch_model.bin")) {
    throw_error("{}: only pytorch_model.bin found; lathe reads safetensors. Convert it with: python3 -c \"import "
                "transformers as t; t.AutoModelForCausalLM.from_pretrained('{}').save_pretrained('{}', "
                "safe_serialization=True)\"",
                dir, dir, dir);
  } else {
    throw_error("{}: no model.safetensors or model.safetensors.index.json", dir);
  }

  const ParamTable& table = model.params();
  std::map<std::string, const ParamSpec*> by_file_name;
  for (const ParamSpec& s : table.specs())
    for (auto& n : accepted_names(s.name)) by_file_name[n] = &s;
  std::map<std::string, int> loaded;
  std::vector<std::string> unexpected, misshaped;
  std::map<std::string, int64_t> conversions;
  size_t bytes = 0;
  for (const std::string& f : files) {
    io::SafetensorsFile st(f);
    for (const io::StTensorInfo& info : st.tensors()) {
      auto it = by_file_name.find(info.name);
      if (it == by_file_name.end()) {
        if (!ignorable_file_tensor(info.name)) unexpected.push_back(fmt::format("{} (in {})", info.name, f));
        continue;
      }
      const ParamSpec& s = *it->second;
      Shape want = s.shape;
      if (s.hf_transposed) std::reverse(want.begin(), want.end());
      if (info.shape != want) {
        misshaped.push_back(fmt::format("{}: file has {}, model needs {}", info.name, shape_str(info.shape),
                                        shape_str(want)));
        continue;
      }
      if (++loaded[s.name] > 1) throw_error("{}: parameter {} appears more than once in the files", dir, s.name);
      float* dst = model.param_data() + s.offset;
      if (s.hf_transposed) {
        std::vector<float> tmp(static_cast<size_t>(s.numel()));
        st.read_f32(info, tmp.data());
        const int64_t rows = s.shape[0], cols = s.shape[1];  // lathe [out, in]; file [in, out]
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t c = 0; c < cols; ++c) dst[r * cols + c] = tmp[c * rows + r];
      } else {
        st.read_f32(info, dst);
      }
      bytes += info.nbytes;
      if (info.dtype != DType::F32) conversions[std::string(dtype_name(info.dtype))] += 1;
    }
  }
  std::vector<std::string> missing;
  for (const ParamSpec& s : table.specs())
    if (!loaded.count(s.name)) missing.push_back(s.name);
  if (!missing.empty() || !unexpected.empty() || !misshaped.empty()) {
    std::string msg = fmt::format("{}: weights do not match the model ({} from config.json)", dir,
                                  model.config().model_type);
    auto list = [&](const char* what, const std::vector<std::string>& v) {
      if (v.empty()) return;
      msg += fmt::format("\n  {} ({}):", what, v.size());
      for (size_t i = 0; i < v.size() && i < 20; ++i) msg += "\n    " + v[i];
      if (v.size() > 20) msg += fmt::format("\n    ... and {} more", v.size() - 20);
    };
    list("missing from the files", missing);
    list("unexpected in the files", unexpected);
    list("wrong shape", misshaped);
    throw Error(msg);
  }
  std::string conv;
  for (auto& [k, n] : conversions) conv += fmt::format(" {} tensors {}->F32;", n, k);
  return fmt::format("loaded {} tensors ({:.1f} MB) from {} file(s);{}", loaded.size(), bytes / 1e6, files.size(),
                     conv.empty() ? " no dtype conversion" : conv);
}

std::unique_ptr<Model> load_hf_model(const std::string& dir, std::string* report) {
  ModelConfig cfg = load_hf_config(dir);
  auto model = build_model(cfg);
  std::string r = load_hf_weights(*model, dir);
  if (report) *report = r;
  return model;
}

}  // namespace lathe
