// Names and constants of the checkpoint format (checkpoint.h describes the layout), shared by the
// writer (checkpoint.cpp) and the state.json reader (checkpoint_state.cpp). Internal to src/train.
#pragma once

namespace lathe::ckpt_format {

constexpr const char* kFormat = "lathe-checkpoint";
constexpr int kFormatVersion = 1;
constexpr const char* kModelFile = "model.safetensors";
constexpr const char* kOptimFile = "optimizer.safetensors";
constexpr const char* kRecipeFile = "recipe.yaml";
constexpr const char* kStateFile = "state.json";
constexpr const char* kTensorDtype = "F32";  // the only dtype format version 1 writes

}  // namespace lathe::ckpt_format
