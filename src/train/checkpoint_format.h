// Names and constants of the checkpoint format (checkpoint.h describes the layout), shared by the
// writer (checkpoint.cpp), the state.json reader and writer (checkpoint_state.cpp) and the
// resharder (reshard.cpp). Internal to src/train.
#pragma once
#include <fmt/format.h>

#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <string>

namespace lathe {
struct CheckpointState;
}

namespace lathe::ckpt_format {

constexpr const char* kFormat = "lathe-checkpoint";
constexpr int kFormatVersion = 1;
constexpr const char* kModelFile = "model.safetensors";
constexpr const char* kOptimFile = "optimizer.safetensors";
constexpr const char* kRecipeFile = "recipe.yaml";
constexpr const char* kStateFile = "state.json";
constexpr const char* kTensorDtype = "F32";  // the only dtype format version 1 writes

// A data-parallel save: rank r of n writes the moments of its flat range to this file.
inline std::string optim_shard_file(int64_t rank, int64_t world) {
  return fmt::format("optimizer-rank{:05d}-of-{:05d}.safetensors", rank, world);
}
// True for optimizer-rankRRRRR-of-NNNNN.safetensors with RRRRR < NNNNN (rank and world filled).
inline bool parse_optim_shard_file(const std::string& name, int64_t* rank, int64_t* world) {
  const std::string pre = "optimizer-rank", mid = "-of-", suf = ".safetensors";
  if (name.size() != pre.size() + 5 + mid.size() + 5 + suf.size() || name.rfind(pre, 0) != 0) return false;
  if (name.compare(pre.size() + 5, mid.size(), mid) != 0 || name.compare(name.size() - suf.size(), suf.size(), suf))
    return false;
  int64_t v[2] = {0, 0};
  for (int k = 0; k < 2; ++k)
    for (size_t i = 0; i < 5; ++i) {
      const char c = name[(k ? pre.size() + 5 + mid.size() : pre.size()) + i];
      if (c < '0' || c > '9') return false;
      v[k] = v[k] * 10 + (c - '0');
    }
  *rank = v[0];
  *world = v[1];
  return v[0] < v[1];
}
// Files holding optimizer moments: the single-process file or a rank's shard file.
inline bool is_optim_file(const std::string& name) {
  int64_t r, w;
  return name == kOptimFile || parse_optim_shard_file(name, &r, &w);
}

// ---- checkpoint_state.cpp: state.json and the files it lists ----

// DIR/state.json.
std::string state_path(const std::string& dir);
// Throws unless `dir` is a directory (naming it and what a checkpoint directory looks like).
void require_checkpoint_dir(const std::string& dir);
// DIR/state.json parsed and validated field by field (parse_checkpoint_state); missing -> error.
CheckpointState read_state(const std::string& dir);
// Every file `cs` lists exists in `dir` with the recorded size and XXH64.
void verify_files(const std::string& dir, const CheckpointState& cs);
// The text of state.json for `st` (checkpoint_state.cpp, beside its reader): {"body": ...,
// "body_xxh64": ...} and a newline. optimizer: the optimizer's name, "" when no moments were saved;
// world_size: the number of writer ranks; files and tensors: the tables the save computed.
std::string state_json_text(const CheckpointState& st, const std::string& optimizer, int64_t world_size,
                            const nlohmann::json& files, const nlohmann::json& tensors);

}  // namespace lathe::ckpt_format
