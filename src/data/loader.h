// Training batches from an indexed dataset. The token stream is the concatenation of all sequences
// (documents are separated by the EOD token written at preprocessing time). Sample i is the window
// of S+1 tokens [i*S, i*S+S]: inputs = its first S tokens, targets = its last S. Consecutive samples
// overlap by one token and freely span document boundaries, as Megatron's GPTDataset samples do
// (shared/reference/megatron-indexed-dataset.md section 4); num_samples = (total_tokens - 1) / S.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "data/blend.h"
#include "data/indexed_dataset.h"

namespace lathe::data {

inline int64_t num_samples(int64_t total_tokens, int64_t seq_len) {
  return total_tokens > 0 ? (total_tokens - 1) / seq_len : 0;
}

struct SampleSplit {
  std::vector<int64_t> train, valid;
};
// The LAST round(valid_fraction * num_samples) samples are validation (contiguous, Megatron-style
// split: no shuffling across the boundary, so train and valid windows share at most one token),
// the rest train. valid_fraction in [0, 1). Throws when train would be empty, or when
// valid_fraction > 0 but rounds to zero samples.
SampleSplit split_samples(int64_t num_samples, double valid_fraction);
std::vector<int64_t> all_samples(int64_t num_samples);  // 0 .. num_samples-1

// Where the consumer is: `position` indexes this epoch's sample order (in samples, a multiple of
// the batch size in practice). Saved in checkpoints; restore() resumes bit-identically.
struct LoaderState {
  int64_t epoch = 0;
  int64_t position = 0;
};

// A resume that changes training.seq_len (--force-resume-changes: a long-context continuation):
// the checkpoint's `st`, in samples of `from_len` tokens, mapped onto this run's samples of `to_len`
// tokens: the same epoch, as many tokens into it as the checkpoint had consumed (position x
// from_len), rounded down to whole batches of `batch_size` (so at most one batch of tokens is seen
// again), and at most `num_samples` (the end of the epoch: the loader moves to the next one). The
// epoch's order is a permutation of the new samples, so the rest of the epoch is the same share of
// the data but not exactly the tokens the old order had left.
LoaderState remap_seq_len(const LoaderState& st, int64_t from_len, int64_t to_len, int64_t batch_size,
                          int64_t num_samples);

class DataLoader {
 public:
  // sample_ids: the samples this loader draws from (e.g. SampleSplit::train). Each epoch visits
  // batches_per_epoch() * batch_size of them: in order, or (shuffle) in a permutation drawn with
  // lathe::Rng (Fisher-Yates) seeded from (seed, epoch). The tail that does not fill a batch is
  // dropped for that epoch (a different tail every epoch when shuffled).
  // prefetch: batches prepared ahead on a background thread (0 = prepared in next()).
  // rows: [row_begin, row_begin + row_count) of every batch are read and handed out (a data-parallel
  // rank's part of the global batch); row_count 0 = the whole batch. The sample order, epochs and
  // LoaderState are those of the whole batch, so they do not depend on how it is split.
  DataLoader(std::shared_ptr<const IndexedDataset> ds, std::vector<int64_t> sample_ids, int64_t batch_size,
             int64_t seq_len, uint64_t seed, bool shuffle, int prefetch, int64_t row_begin = 0, int64_t row_count = 0);
  // A blend (data/blend.h): global sample g of the run is sample plan->sample[g] of
  // datasets[plan->dataset[g]], and batch k holds global samples [k*batch_size, (k+1)*batch_size).
  // The plan already covers the whole run (each dataset repeated and reshuffled per epoch by the
  // plan itself), so there are no loader epochs: LoaderState.epoch stays 0 and position counts the
  // samples handed out; asking beyond the plan is an error. rows, prefetch: as above.
  DataLoader(std::vector<std::shared_ptr<const IndexedDataset>> datasets, std::shared_ptr<const BlendPlan> plan,
             int64_t batch_size, int64_t seq_len, int prefetch, int64_t row_begin = 0, int64_t row_count = 0);
  ~DataLoader();
  DataLoader(const DataLoader&) = delete;
  DataLoader& operator=(const DataLoader&) = delete;

  // inputs, targets: [rows, S] row-major int32 (rows = row_count, or batch_size). Moves to the next (reshuffled) epoch
  // when the current one is exhausted. Returns the seconds spent waiting for data.
  double next(int32_t* inputs, int32_t* targets);
  LoaderState state() const;  // batches handed out so far, not what the prefetcher is working on
  void restore(const LoaderState& st);
  int64_t batches_per_epoch() const { return batches_per_epoch_; }  // blend: batches in the plan
  int64_t batch_size() const { return batch_size_; }
  int64_t seq_len() const { return seq_len_; }

  // The sample order of `epoch` (all sample_ids, permuted when shuffling). Exposed for tests.
  std::vector<int64_t> epoch_order(int64_t epoch) const;

 private:
  struct Batch {
    std::vector<int32_t> inputs, targets;
    LoaderState after;  // consumer state once this batch is handed out
  };
  // Builds the batch at `st` and advances `st` (normalised: a finished epoch moves to the next).
  void produce(LoaderState& st, Batch& b);
  LoaderState normalise(LoaderState st) const;
  void start_worker();
  void stop_worker();
  void worker_loop();

  void check_shape() const;

  std::shared_ptr<const IndexedDataset> ds_;
  std::vector<int64_t> sample_ids_;
  std::vector<std::shared_ptr<const IndexedDataset>> blend_ds_;  // blend mode: plan_ != nullptr
  std::shared_ptr<const BlendPlan> plan_;
  int64_t batch_size_, seq_len_, row_begin_, row_count_;
  uint64_t seed_;
  bool shuffle_;
  int prefetch_;
  int64_t batches_per_epoch_;

  // Producer side (worker thread, or next() when prefetch == 0).
  LoaderState prod_state_;
  int64_t order_epoch_ = -1;
  std::vector<int64_t> order_;   // sample order of order_epoch_
  std::vector<int32_t> window_;  // S+1 tokens

  // Consumer side and the queue between them.
  mutable std::mutex mu_;
  std::condition_variable cv_not_full_, cv_not_empty_;
  std::deque<Batch> queue_;
  std::vector<Batch> free_;  // recycled buffers
  bool stop_ = false;
  std::exception_ptr error_;
  LoaderState cons_state_;
  std::thread worker_;
  Batch sync_batch_;
};

}  // namespace lathe::data
