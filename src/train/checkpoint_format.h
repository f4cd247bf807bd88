// Names and constants of the checkpoint format (checkpoint.h describes the layout), shared by the
// writer (checkpoint.cpp) and the state.json reader (checkpoint_state.cpp). Internal to src/train.
#pragma once
#include <fmt/format.h>

#include <cstdint>
#include <string>

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

}  // namespace lathe::ckpt_format
