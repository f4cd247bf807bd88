// Megatron-LM / Megatron-Core indexed datasets: PREFIX.bin (all token sequences back to back, one
// integer dtype, little-endian, no header) + PREFIX.idx ("MMIDIDX\0\0", version 1, dtype code,
// counts, int32 lengths, int64 byte pointers, int64 document boundaries). Byte layout:
// shared/reference/megatron-indexed-dataset.md sections 1-3. Files written here load unchanged in
// Megatron, and Megatron's GPT preprocessing output (document = sequence) loads here.
#pragma once
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "core/dtype.h"

namespace lathe::data {

// Megatron's DType enum codes (.idx byte 17). Only integer token dtypes lathe has a DType for are
// accepted: uint8 (1), int32 (4), int64 (5), uint16 (8).
uint8_t megatron_dtype_code(DType t);                                   // throws for non-token dtypes
DType dtype_from_megatron_code(uint8_t code, const std::string& what);  // `what` names the file

// Megatron's rule (DType.optimal_dtype): uint16 if vocab_size < 65500, else int32.
DType optimal_token_dtype(int64_t vocab_size);

// Streams documents to PREFIX.bin.tmp; finalize() writes PREFIX.idx.tmp, fsyncs both, renames them
// to their final names and fsyncs the directory. Destroyed without finalize(): temp files removed,
// so a crashed or failed preprocessing run never leaves a half-written dataset behind.
class IndexedDatasetWriter {
 public:
  IndexedDatasetWriter(const std::string& prefix, DType dtype);
  ~IndexedDatasetWriter();
  IndexedDatasetWriter(const IndexedDatasetWriter&) = delete;
  IndexedDatasetWriter& operator=(const IndexedDatasetWriter&) = delete;

  // One document = one sequence (GPT preprocessing without sentence splitting). Token ids are
  // range-checked for the dtype; the error names the id, its position and the document.
  void add_document(std::span<const int32_t> tokens);
  // Several documents at once (same checks and bytes as one add_document per document):
  // `tokens` holds them back to back, lengths[i] tokens each. One write for the whole block.
  void add_documents(std::span<const int32_t> tokens, std::span<const uint32_t> lengths);
  void finalize();

  uint64_t num_documents() const { return lengths_.size(); }
  uint64_t num_tokens() const { return num_tokens_; }
  uint64_t bin_bytes() const { return num_tokens_ * dtype_size(dtype_); }

 private:
  void cleanup_temp() noexcept;
  void start_writeback(bool all);

  std::string prefix_, bin_tmp_, idx_tmp_;
  DType dtype_;
  std::FILE* bin_ = nullptr;
  std::vector<int32_t> lengths_;
  std::vector<unsigned char> scratch_;  // one document converted to the on-disk dtype
  uint64_t num_tokens_ = 0;
  uint64_t writeback_start_ = 0;  // .bin bytes already handed to writeback
  bool finalized_ = false;
};

// Read-only view of PREFIX.bin/.idx through mmap. The constructor validates everything the format
// lets it (see indexed_dataset.cpp) so later reads cannot run past the files.
class IndexedDataset {
 public:
  explicit IndexedDataset(const std::string& prefix);
  ~IndexedDataset();
  IndexedDataset(const IndexedDataset&) = delete;
  IndexedDataset& operator=(const IndexedDataset&) = delete;

  const std::string& prefix() const { return prefix_; }
  DType dtype() const { return dtype_; }
  size_t num_sequences() const { return num_sequences_; }
  size_t num_documents() const { return num_doc_indices_ - 1; }  // from document_indices
  int64_t sequence_length(size_t i) const;
  int64_t sequence_offset(size_t i) const;  // first token of sequence i in the global stream
  int64_t total_tokens() const { return total_tokens_; }

  // Tokens [start, start+count) of the concatenation of all sequences, converted to int32.
  void read_global(int64_t start, int64_t count, int32_t* out) const;
  // The tokens of sequence i in place, in dtype() (sequence_length(i) of them; nullptr when the
  // dataset is empty): a zero-copy view of the .bin mmap, valid while this object lives.
  const void* sequence_data(size_t i) const;
  // All sequence_length(i) tokens of sequence i.
  void read_sequence(size_t i, int32_t* out) const;
  // Largest token id (full scan with OpenMP, cached); -1 for an empty dataset. Throws naming the
  // .bin when an id is negative or does not fit int32 (the token-range check of check/train/eval).
  int32_t max_token_id() const;

 private:
  std::string prefix_;
  DType dtype_ = DType::U16;
  size_t num_sequences_ = 0, num_doc_indices_ = 0;
  int64_t total_tokens_ = 0;
  const unsigned char* idx_ = nullptr;  // mmap of .idx
  size_t idx_size_ = 0;
  const unsigned char* bin_ = nullptr;  // mmap of .bin (nullptr when empty)
  size_t bin_size_ = 0;
  mutable std::atomic<int64_t> max_token_{-2};  // -2: not computed yet
};

// EOD presence (lathe check with document attention): of up to `max_checked` sequences, evenly
// spaced over the dataset, how many end with token `id` (`lathe tokenize --append-eos` ends every
// document with it). Returns {ending with id, checked}. One token read per checked sequence.
std::pair<int64_t, int64_t> sequences_ending_with(const IndexedDataset& ds, int32_t id, int64_t max_checked = 4096);

}  // namespace lathe::data
