// The model of a checkpoint, a run or a Hugging Face directory, found as `lathe export` finds it
// (and the Python package's lathe.Model.from_pretrained):
//   * a checkpoint directory (state.json: checksums verified, weights loaded by load_checkpoint);
//   * a run directory (its newest complete checkpoint; corrupt ones are skipped and said so;
//     without checkpoints, RUN/model written at the end of training);
//   * a Hugging Face model directory (config.json + safetensors, e.g. RUN/model).
#pragma once
#include <functional>
#include <memory>
#include <string>

#include "models/model.h"

namespace lathe {

struct ModelSource {
  std::unique_ptr<Model> model;
  std::string tokenizer;  // data.tokenizer of the run ("", "byte" or a path)
  std::string hf_dir;     // set when the source is an HF directory (its tokenizer files are copied)
  std::string read_dir;   // the directory the weights were read from (checkpoint or HF directory)
  std::string desc;
};

// `on_log` receives what the search of a run's checkpoints says (corrupt ones skipped), if anything.
ModelSource load_model_source(const std::string& path, const std::function<void(const std::string&)>& on_log = {});

}  // namespace lathe
