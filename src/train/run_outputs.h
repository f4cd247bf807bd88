// What a training run writes into output.dir besides checkpoints: metrics.jsonl (and
// anomalies.jsonl) one JSON object per line, and the HF model directory with lathe's note of the
// tokenizer. Internal to src/train (train/trainer.cpp).
#pragma once
#include <cstdint>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>

#include "core/error.h"
#include "models/model.h"

namespace lathe {

// Appends one JSON object per line and flushes, so a crash loses at most the current line.
class MetricsWriter {
 public:
  MetricsWriter(const std::string& path, bool append) : f_(std::fopen(path.c_str(), append ? "a" : "w")) {
    LATHE_CHECK(f_ != nullptr, "{}: cannot open for writing", path);
  }
  ~MetricsWriter() { std::fclose(f_); }
  void write(const nlohmann::json& j) {
    std::string s = j.dump() + "\n";
    std::fwrite(s.data(), 1, s.size(), f_);
    std::fflush(f_);
  }

 private:
  std::FILE* f_;
};

// The HF model directory `dir` of `model` (interop/hf_weights.h) and lathe.json naming `tokenizer`.
void write_model_dir(const Model& model, const std::string& dir, const std::string& tokenizer);

// Keeps the records of steps <= `step` of the JSONL file `path` (a resumed run rewrites what came
// after its checkpoint); a torn last line from a crash is dropped. No-op when it does not exist.
void trim_metrics(const std::string& path, int64_t step);

}  // namespace lathe
