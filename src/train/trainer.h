// The single-process training loop: recipe -> model, data, optimizer, schedule; per step
// gradient accumulation over micro-batches, global-norm clipping, the optimizer update, a log
// line and a JSONL metrics record; periodic validation; HF model directory at the end.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "config/recipe.h"
#include "data/indexed_dataset.h"
#include "data/loader.h"
#include "models/model.h"

namespace lathe {

struct TrainResult {
  std::vector<double> losses;  // per optimizer step
  double final_val_loss = -1;  // -1 when there is no validation data
  std::string model_dir;       // HF directory written at the end
};

struct TrainOptions {
  bool quiet = false;        // no per-step log lines (tests)
  bool sample_at_end = true; // print a short generated sample when a tokenizer is known
};

TrainResult train(const Recipe& recipe, const TrainOptions& opts = {});

// Mean next-token loss of `model` over the given samples of `ds`, in order, batched by B.
// Returns {loss, tokens}.
std::pair<double, int64_t> evaluate_samples(Model& model, const data::IndexedDataset& ds,
                                            const std::vector<int64_t>& samples, int64_t B, int64_t T);

}  // namespace lathe
