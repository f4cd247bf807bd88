#include "train/model_source.h"

#include <fmt/format.h>

#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "interop/hf_weights.h"
#include "io/json.h"
#include "train/checkpoint.h"

namespace lathe {

namespace {

namespace fs = std::filesystem;

// Non-throwing probes (a symlink loop or an unreadable entry answers "no"; the reader that
// opens the file afterwards names the problem).
bool regular(const fs::path& p) {
  std::error_code ec;
  return fs::is_regular_file(p, ec);
}
bool present(const fs::path& p) {
  std::error_code ec;
  return fs::exists(p, ec);
}
bool is_checkpoint_dir(const fs::path& p) { return present(p / "state.json"); }
bool is_hf_dir(const fs::path& p) {
  return regular(p / "config.json") &&
         (present(p / "model.safetensors") || present(p / "model.safetensors.index.json"));
}

// data.tokenizer recorded by `lathe train` in DIR/lathe.json ("" when absent).
std::string recorded_tokenizer(const fs::path& meta) {
  if (!present(meta)) return "";
  const nlohmann::json j = io::read_json_file(meta.string());  // depth-checked, errors name the file
  if (!j.is_object() || !j.contains("tokenizer")) return "";
  LATHE_CHECK(j["tokenizer"].is_string(), "{}: field 'tokenizer' must be a string, got {}", meta.string(),
              io::json_type_name(j["tokenizer"]));
  return j["tokenizer"].get<std::string>();
}

}  // namespace

ModelSource load_model_source(const std::string& path, const std::function<void(const std::string&)>& on_log) {
  ModelSource s;
  fs::path p(path);
  std::error_code dir_ec;
  LATHE_CHECK(fs::is_directory(p, dir_ec),
              "{}: not a directory (expected a checkpoint, run or Hugging Face model directory)", path);
  std::string ckpt;
  if (is_checkpoint_dir(p)) {
    ckpt = p.string();
  } else if (present(p / "checkpoints")) {
    std::string log;
    ckpt = find_latest_checkpoint(p.string(), &log);
    if (!log.empty() && on_log) on_log(log);
    LATHE_CHECK(!ckpt.empty() || is_hf_dir(p / "model"),
                "{}: no complete checkpoint under {}/checkpoints and no final model directory {}/model", path, path,
                path);
  }
  if (!ckpt.empty()) {
    CheckpointState st = read_checkpoint_state(ckpt);
    auto model = build_model(checkpoint_model_config(ckpt));
    load_checkpoint(ckpt, *model, nullptr);
    s.model = std::move(model);
    if (st.recipe.contains("data") && st.recipe["data"].contains("tokenizer") &&
        st.recipe["data"]["tokenizer"].is_string())
      s.tokenizer = st.recipe["data"]["tokenizer"].get<std::string>();
    s.desc = fmt::format("checkpoint {} (step {})", ckpt, st.step);
    s.read_dir = ckpt;
    return s;
  }
  const fs::path hf = is_hf_dir(p) ? p : p / "model";
  LATHE_CHECK(is_hf_dir(hf),
              "{}: neither a checkpoint (state.json), a run directory (checkpoints/ or model/) nor a Hugging Face "
              "model directory (config.json + model.safetensors)",
              path);
  std::string report;
  s.model = load_hf_model(hf.string(), &report);
  s.hf_dir = hf.string();
  s.read_dir = s.hf_dir;
  s.tokenizer = recorded_tokenizer(hf / "lathe.json");
  s.desc = fmt::format("Hugging Face directory {} ({})", hf.string(), report);
  return s;
}


}  // namespace lathe
