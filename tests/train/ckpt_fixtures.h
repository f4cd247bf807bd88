// What the checkpoint-layout tests share (test_checkpoint_shards.cpp, test_reshard.cpp): a fresh
// scratch directory per case, and resealing state.json after editing its body (so that the edit
// passes the checksum and reaches the field-by-field validation behind it).
#pragma once

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>

#include "io/fs.h"
#include "train/checkpoint.h"

namespace lathe::ckpt_test {

// An empty directory TMP/PREFIX TAG PID (removed first if a crashed run left it).
inline std::string fresh_temp_dir(const std::string& prefix, const std::string& tag) {
  const std::filesystem::path p = std::filesystem::temp_directory_path() / (prefix + tag + std::to_string(::getpid()));
  std::filesystem::remove_all(p);
  std::filesystem::create_directories(p);
  return p.string();
}

// Rewrites state.json's body with `edit` and reseals its checksum.
inline void reseal(const std::string& dir, const std::function<void(nlohmann::json&)>& edit) {
  const std::string path = (std::filesystem::path(dir) / "state.json").string();
  nlohmann::json doc = nlohmann::json::parse(io::read_file(path));
  edit(doc["body"]);
  const std::string text = doc["body"].dump();
  doc["body_xxh64"] = hex64(Xxh64::hash(text.data(), text.size()));
  std::ofstream(path) << doc.dump();
}

}  // namespace lathe::ckpt_test
