// Documents in packed samples: segment arrays from EOD tokens, the loss mask after EOD, and
// Model::set_documents (the model side of document attention; see models/documents.h).
#include "models/documents.h"

#include <algorithm>

#include "core/error.h"
#include "models/model.h"

namespace lathe {

AttentionMode parse_attention_mode(std::string_view s) {
  if (s == "causal") return AttentionMode::Causal;
  if (s == "document") return AttentionMode::Document;
  throw_error(
      "attention '{}' is not known; use causal (attention across the whole sample) or document (each token "
      "attends only to its own document, split at the EOD token)",
      s);
}

std::string attention_mode_name(AttentionMode m) { return m == AttentionMode::Document ? "document" : "causal"; }

void documents_from_eod(const int32_t* tokens, int64_t B, int64_t T, int32_t eod, int32_t* doc_start,
                        int32_t* positions) {
  for (int64_t b = 0; b < B; ++b) {
    int32_t start = 0;
    for (int64_t t = 0; t < T; ++t) {
      const int64_t i = b * T + t;
      doc_start[i] = start;
      if (positions) positions[i] = static_cast<int32_t>(t - start);
      if (tokens[i] == eod) start = static_cast<int32_t>(t + 1);  // the EOD closes its document
    }
  }
}

int64_t mask_loss_after_eod(const int32_t* tokens, int32_t* targets, int64_t n, int32_t eod) {
  int64_t kept = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (tokens[i] == eod) targets[i] = -1;
    kept += targets[i] >= 0;
  }
  return kept;
}

void set_batch_documents(Model& model, const DocumentOptions& o, const int32_t* tokens, int64_t B, int64_t T,
                         std::vector<int32_t>& doc_start, std::vector<int32_t>& positions) {
  if (!o.model_needs_documents()) return;
  const size_t n = static_cast<size_t>(B * T);
  doc_start.resize(n);
  positions.resize(n);
  documents_from_eod(tokens, B, T, o.eod, doc_start.data(), o.reset_positions ? positions.data() : nullptr);
  model.set_documents(o.document_attention ? doc_start.data() : nullptr, o.reset_positions ? positions.data() : nullptr,
                      B, T);
}

void Model::set_documents(const int32_t* doc_start, const int32_t* positions, int64_t B, int64_t T,
                          int64_t positions_len) {
  doc_start_.clear();
  doc_pos_.clear();
  docs_B_ = docs_T_ = 0;
  doc_len_ = 0;
  if (doc_start == nullptr && positions == nullptr) return;
  LATHE_CHECK(B >= 1 && T >= 1 && B <= max_B_ && T <= max_T_,
              "set_documents: batch {}x{} is empty or exceeds the allocated {}x{}", B, T, max_B_, max_T_);
  const size_t n = static_cast<size_t>(B * T);
  if (doc_start) {
    // The attention kernels check the segmentation itself (kernels/cpu/ops.h); a copy here.
    doc_start_.assign(doc_start, doc_start + n);
  }
  if (positions) {
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < T; ++t) {
        const int32_t p = positions[b * T + t];
        // Context parallelism: the rows' global positions, anywhere in the whole sequence.
        const int64_t hi = shard_.context_T > 0 ? shard_.context_T - 1 : t;
        LATHE_CHECK(p >= 0 && p <= hi, "set_documents: position {} of token {} of sample {} is outside [0, {}]", p, t,
                    b, hi);
      }
    doc_pos_.assign(positions, positions + n);
    const int64_t local_len = int64_t{*std::max_element(doc_pos_.begin(), doc_pos_.end())} + 1;
    // The whole samples' length is at least these rows' and, under context parallelism, at most
    // the sequence (TensorShard::context_T; else this pass's T).
    const int64_t whole_max = shard_.context_T > 0 ? shard_.context_T : T;
    LATHE_CHECK(positions_len == 0 || (positions_len >= local_len && positions_len <= whole_max),
                "set_documents: positions_len {} is outside [{}, {}] (max position + 1 of these rows, the sequence)",
                positions_len, local_len, whole_max);
    doc_len_ = positions_len > 0 ? positions_len : local_len;
  }
  docs_B_ = B;
  docs_T_ = T;
  if (on_device()) {  // the kernels read them from device memory: [doc_start | positions], max_B x max_T each
    auto* d = static_cast<int32_t*>(ddocs_.data());
    const size_t half = static_cast<size_t>(max_B_ * max_T_);
    // Staged (Backend::stage_upload): ordered after the passes already issued, which may still read
    // the previous documents; the passes issued next wait for it on the device, the host does not.
    if (doc_start) backend_->wait_staged(backend_->stage_upload(d, doc_start, n * sizeof(int32_t)));
    if (positions) backend_->wait_staged(backend_->stage_upload(d + half, positions, n * sizeof(int32_t)));
  }
}

void Model::check_documents_shape(int64_t B, int64_t T) const {
  if (doc_start_.empty() && doc_pos_.empty()) return;
  LATHE_CHECK(B == docs_B_ && T == docs_T_,
              "a {}x{} pass while documents for {}x{} are set: call set_documents for this batch (or with nullptr "
              "for plain causal attention)",
              B, T, docs_B_, docs_T_);
}

void Model::check_context_attention() const {
  LATHE_CHECK(!on_device(),
              "parallel.context: context-parallel attention runs on CPU models only for now; use device: cpu, or "
              "parallel.context: 1");
  LATHE_CHECK(shard_.context_T > 0, "context attention hooks set on a model without TensorShard::context_T");
  LATHE_CHECK(!arch_.learned_pos || shard_.context_T <= cfg_.max_position_embeddings,
              "parallel.context: the sequence of {} tokens exceeds the learned position table of {} rows",
              shard_.context_T, cfg_.max_position_embeddings);
}

}  // namespace lathe
