// Consistency of a recipe's model, tokenizer and data, checked by `lathe check RECIPE` and at the
// start of `lathe train`, before any work:
//   * model.vocab_size >= the tokenizer's size (every id the tokenizer emits has an embedding row)
//   * the BOS/EOS/PAD ids of the model config exist in the tokenizer, and the tokenizer's own
//     special ids fit in the model's vocabulary
//   * the largest token id in each dataset is below model.vocab_size
// Every failure says which numbers disagree and how to fix it.
#pragma once
#include <string>
#include <vector>

#include "config/recipe.h"

namespace lathe {

struct ConsistencyReport {
  std::vector<std::string> passed;    // one line per check that held, with its numbers
  std::vector<std::string> failures;  // one line per check that failed
};

ConsistencyReport check_consistency(const Recipe& recipe);

// Throws lathe::Error listing every failure (no-op when all checks hold).
void require_consistency(const Recipe& recipe);

}  // namespace lathe
