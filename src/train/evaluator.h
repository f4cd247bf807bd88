// Validation loss and multiple-choice task accuracy during and at the end of a run: every data
// replica takes every dp-th sample or item (the tensor and pipeline ranks of a replica work on the
// same ones together) and the sums are all-reduced, so every rank gets the figures of the whole
// set. Records go to metrics.jsonl and the log (train/run_log.h). Internal to src/train.
#pragma once
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "config/recipe.h"
#include "data/indexed_dataset.h"
#include "eval/eval_tasks.h"
#include "models/documents.h"
#include "parallel/parallelize.h"
#include "train/run_log.h"

namespace lathe {

class Evaluator {
 public:
  // `valid_samples` (of `valid_ds`) and `mc_items` (training.eval_tasks) are the run's sets;
  // periodic validation uses the first training.eval_batches x B samples.
  Evaluator(const Recipe& r, Topology& topo, RankModel& rm, std::shared_ptr<const data::IndexedDataset> valid_ds,
            std::vector<int64_t> valid_samples, std::vector<McItem> mc_items, const DocumentOptions& docs, int64_t B,
            int64_t T, RunLog& log);

  // After step `done` (1-based) but the last: validation every training.eval_interval steps, the
  // tasks every training.eval_tasks_interval (default: eval_interval).
  void maybe(int64_t done, bool last);
  bool due(int64_t done, bool last) const;  // maybe() evaluates something
  // The end of the run: validation on (up to 256 batches of) the whole split, then the tasks.
  // Returns the validation loss (-1 without validation data).
  double final();

 private:
  // {mean loss, target tokens} over `set`, every rank's share summed.
  std::pair<double, int64_t> evaluate(const std::vector<int64_t>& set);
  void score_tasks(int64_t at);
  // Context parallelism: the model the tasks are scored with (see score_tasks).
  Model& context_scorer();

  const Recipe& r_;
  Topology& topo_;
  RankModel& rm_;
  std::shared_ptr<const data::IndexedDataset> valid_ds_;
  std::vector<int64_t> valid_samples_, subset_;
  std::vector<McItem> mc_items_;
  const DocumentOptions& docs_;
  const int64_t B_, T_, tasks_interval_;
  RunLog& log_;
  std::unique_ptr<Model> context_copy_;  // context parallelism's scorer, made at the first scoring
};

}  // namespace lathe
