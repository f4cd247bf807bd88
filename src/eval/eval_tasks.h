// src/eval/: measuring and using a trained model, outside the training loop's own concerns. This
// room owns multiple-choice task scoring (this file) and text generation with the KV cache
// (generate.h). It builds on models/ and tokenizer/; `lathe eval`, `lathe generate` and the
// trainer's periodic evaluation and samples (train/) call it.
//
// Multiple-choice evaluation (issue 13 item 7), shared by `lathe eval --tasks` and the trainer's
// periodic in-training evaluation (recipe training.eval_tasks).
//
// Items: HellaSwag-style JSONL, one per line:
//   {"context": "...", "endings": ["...", ...], "label": 2}
// or already tokenized: {"context_ids": [...], "ending_ids": [[...], ...], "label": 2}.
// Each ending is scored by the log-likelihood of its tokens after the context (context and ending
// tokenized separately and concatenated, as lm-evaluation-harness does; the context is cut from the
// left so that context + ending fit `max_t` positions). acc picks the highest sum, acc_norm the
// highest mean per token (the length-normalised score).
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/progress.h"
#include "models/model.h"
#include "tokenizer/tokenizer.h"

namespace lathe {

struct McItem {
  std::vector<int32_t> context;               // token ids
  std::vector<std::vector<int32_t>> endings;  // token ids of each ending (>= 2 endings, none empty)
  int64_t label = 0;                          // index of the right ending
  int64_t line = 0;                           // of the JSONL file (1-based), for errors
};

// Reads and checks every item (errors name the file, the line and the key). `tok` may be null
// when every item is already tokenized; a text item then fails with `no_tokenizer_fix` as the fix.
std::vector<McItem> read_mc_tasks(const std::string& path, const tok::Tokenizer* tok, int64_t vocab,
                                  const std::string& no_tokenizer_fix = "pass --tokenizer");

// Every ending must fit the `max_t` positions scored with one context token before it (ending
// tokens < max_t; the context is cut from the left). Throws lathe::Error naming "PATH line N", the
// ending, its length and `max_t_what` (the setting that gives max_t, e.g. training.seq_len).
// Returns the longest ending's tokens.
int64_t check_mc_items_fit(const std::vector<McItem>& items, int64_t max_t, const std::string& path,
                           const std::string& max_t_what);

// The tokenizer a model directory records: DIR itself when it holds tokenizer.json, else
// lathe.json's "tokenizer"; "" when neither says.
std::string model_dir_tokenizer(const std::string& model_dir);

struct McItemScore {
  std::vector<double> loglik;  // per ending: sum of log p(ending token | everything before)
  int64_t pick = -1, pick_norm = -1, label = 0;
};

struct McScores {
  int64_t items = 0, right = 0, right_norm = 0;
  std::vector<McItemScore> per_item;  // in the order scored
  double acc() const { return items ? static_cast<double>(right) / static_cast<double>(items) : 0.0; }
  double acc_norm() const { return items ? static_cast<double>(right_norm) / static_cast<double>(items) : 0.0; }
};

// Scores items first, first + stride, ... (a data-parallel rank takes its share; the caller sums
// items/right/right_norm over ranks). The model must be allocated for at least 1 x max_t tokens;
// max_t <= max_position_embeddings. Each ending runs one forward pass of [1, <= max_t] tokens
// (logits [T, V] fp32, log-softmax in double). `bar` (optional) advances by one per item.
// `logits` (optional) replaces model.forward_logits(seq, 1, T, out) (a pipeline's stages run the pass
// together: parallel::PipelineExecutor::forward_logits).
using LogitsFn = std::function<void(const int32_t* seq, int64_t T, float* logits)>;
McScores score_mc_items(Model& model, const std::vector<McItem>& items, int64_t max_t, const std::string& path,
                        size_t first = 0, size_t stride = 1, progress::Bar* bar = nullptr,
                        const LogitsFn& logits = nullptr);

}  // namespace lathe
