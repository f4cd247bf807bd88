// Documents packed into fixed-length samples (issue 11): the per-token arrays the model's
// document-causal attention and restarted positions read (Model::set_documents), built from the
// EOD tokens of a batch, and the loss mask after EOD.
//
// Convention (Megatron's): a document ends AT its EOD token, so the EOD belongs to the document it
// closes and the token after it starts a new one. A sample's first token always starts a document
// in that sample (a document spanning a sample boundary is cut there: its second part attends only
// within this sample and its positions restart at 0).
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace lathe {

// data.attention of a recipe.
enum class AttentionMode : uint8_t { Causal, Document };
// "causal" | "document"; anything else throws naming the valid values.
AttentionMode parse_attention_mode(std::string_view s);
std::string attention_mode_name(AttentionMode m);

// For tokens [B, T]: doc_start[b,t] = index in row b of the first token of t's document, and,
// when positions != nullptr, positions[b,t] = t - doc_start[b,t] (positions restarting at 0 in
// each document). Both outputs are [B, T].
void documents_from_eod(const int32_t* tokens, int64_t B, int64_t T, int32_t eod, int32_t* doc_start,
                        int32_t* positions);

// targets[i] = -1 (ignored by the loss) where tokens[i] == eod: the prediction of the token that
// follows an EOD, i.e. the first token of the next document, is not trained. tokens and targets
// are [n]; returns the number of targets that are not ignored afterwards (target >= 0).
int64_t mask_loss_after_eod(const int32_t* tokens, int32_t* targets, int64_t n, int32_t eod);

// What a recipe's data section asks of the samples, with the EOD id resolved (train/preflight.h recipe_documents).
struct DocumentOptions {
  bool document_attention = false;  // data.attention: document
  bool reset_positions = false;     // data.reset_position_ids
  bool mask_loss = false;           // data.mask_loss_after_eod
  int32_t eod = -1;
  // Whether the model needs per-batch documents (the loss mask alone does not).
  bool model_needs_documents() const { return document_attention || reset_positions; }
  bool any() const { return document_attention || reset_positions || mask_loss; }
};

class Model;
// Before a pass over tokens [B, T]: sets the model's documents as `o` asks (doc_start and/or
// positions from the EOD tokens; buffers reused between calls), or nothing when `o` needs none.
void set_batch_documents(Model& model, const DocumentOptions& o, const int32_t* tokens, int64_t B, int64_t T,
                         std::vector<int32_t>& doc_start, std::vector<int32_t>& positions);

}  // namespace lathe
