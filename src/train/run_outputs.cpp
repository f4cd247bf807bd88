#include "train/run_outputs.h"

#include <filesystem>

#include "interop/hf_weights.h"
#include "io/fs.h"

namespace lathe {

namespace fs = std::filesystem;

void write_model_dir(const Model& model, const std::string& dir, const std::string& tokenizer) {
  save_hf_model(model, dir);
  // lathe's own note of which tokenizer the model was trained with (read by generate/eval).
  nlohmann::json meta = {{"tokenizer", tokenizer}, {"lathe_version", LATHE_VERSION}};
  io::atomic_write_file((fs::path(dir) / "lathe.json").string(), meta.dump(2) + "\n");
}

void trim_metrics(const std::string& path, int64_t step) {
  if (!fs::exists(path)) return;
  std::string text = io::read_file(path), kept;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t nl = text.find('\n', pos);
    if (nl == std::string::npos) break;  // a torn last line from a crash
    const std::string line = text.substr(pos, nl - pos);
    pos = nl + 1;
    try {
      auto j = nlohmann::json::parse(line);
      if (j.value("step", int64_t{0}) <= step) kept += line + "\n";
    } catch (const nlohmann::json::exception&) {
    }
  }
  io::atomic_write_file(path, kept);
}

}  // namespace lathe
