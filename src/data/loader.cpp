#include "data/loader.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/checked.h"
#include "core/error.h"
#include "core/rng.h"
#include "core/timer.h"

namespace lathe::data {

SampleSplit split_samples(int64_t num_samples, double valid_fraction) {
  LATHE_CHECK(valid_fraction >= 0.0 && valid_fraction < 1.0, "data.valid_fraction ({}) must be in [0, 1)",
              valid_fraction);
  LATHE_CHECK(num_samples > 0,
              "split_samples: the dataset has no samples (num_samples = {}); it "
              "needs more than seq_len + 1 tokens",
              num_samples);
  int64_t nvalid = std::llround(valid_fraction * static_cast<double>(num_samples));
  LATHE_CHECK(valid_fraction == 0.0 || nvalid > 0,
              "data.valid_fraction ({}) of {} samples rounds to 0 validation samples; raise it to at "
              "least {} or set it to 0",
              valid_fraction, num_samples, 0.5 / num_samples);
  LATHE_CHECK(nvalid < num_samples, "data.valid_fraction ({}) leaves no training samples out of {}", valid_fraction,
              num_samples);
  SampleSplit s;
  s.train.reserve(static_cast<size_t>(num_samples - nvalid));
  s.valid.reserve(static_cast<size_t>(nvalid));
  for (int64_t i = 0; i < num_samples - nvalid; ++i) s.train.push_back(i);
  for (int64_t i = num_samples - nvalid; i < num_samples; ++i) s.valid.push_back(i);
  return s;
}

std::vector<int64_t> all_samples(int64_t num_samples) {
  std::vector<int64_t> v(static_cast<size_t>(std::max<int64_t>(num_samples, 0)));
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<int64_t>(i);
  return v;
}

DataLoader::DataLoader(std::shared_ptr<const IndexedDataset> ds, std::vector<int64_t> sample_ids, int64_t batch_size,
                       int64_t seq_len, uint64_t seed, bool shuffle, int prefetch, int64_t row_begin, int64_t row_count)
    : ds_(std::move(ds)),
      sample_ids_(std::move(sample_ids)),
      batch_size_(batch_size),
      seq_len_(seq_len),
      row_begin_(row_begin),
      row_count_(row_count > 0 ? row_count : batch_size),
      seed_(seed),
      shuffle_(shuffle),
      prefetch_(prefetch) {
  LATHE_CHECK(ds_ != nullptr, "DataLoader: no dataset");
  check_shape();
  const int64_t n = num_samples(ds_->total_tokens(), seq_len_);
  for (int64_t id : sample_ids_)
    LATHE_CHECK(id >= 0 && id < n, "DataLoader: sample id {} out of range: {} ({} tokens) has {} samples of seq_len {}",
                id, ds_->prefix(), ds_->total_tokens(), n, seq_len_);
  batches_per_epoch_ = static_cast<int64_t>(sample_ids_.size()) / batch_size_;
  LATHE_CHECK(batches_per_epoch_ > 0,
              "DataLoader: {} samples of seq_len {} from {} do not fill one batch of {}; use a "
              "smaller batch size or seq_len, or more data",
              sample_ids_.size(), seq_len_, ds_->prefix(), batch_size_);
  window_.resize(static_cast<size_t>(seq_len_ + 1));
  start_worker();
}

DataLoader::DataLoader(std::vector<std::shared_ptr<const IndexedDataset>> datasets,
                       std::shared_ptr<const BlendPlan> plan, int64_t batch_size, int64_t seq_len, int prefetch,
                       int64_t row_begin, int64_t row_count)
    : blend_ds_(std::move(datasets)),
      plan_(std::move(plan)),
      batch_size_(batch_size),
      seq_len_(seq_len),
      row_begin_(row_begin),
      row_count_(row_count > 0 ? row_count : batch_size),
      seed_(0),
      shuffle_(false),
      prefetch_(prefetch) {
  LATHE_CHECK(plan_ != nullptr && !blend_ds_.empty(), "DataLoader: no blend plan or datasets");
  LATHE_CHECK(plan_->taken.size() == blend_ds_.size() && plan_->dataset.size() == plan_->sample.size(),
              "DataLoader: the blend plan has {} datasets, the loader {}", plan_->taken.size(), blend_ds_.size());
  check_shape();
  for (const auto& d : blend_ds_) LATHE_CHECK(d != nullptr, "DataLoader: a blended dataset is null");
  batches_per_epoch_ = static_cast<int64_t>(plan_->dataset.size()) / batch_size_;
  LATHE_CHECK(batches_per_epoch_ > 0, "DataLoader: the blend plan's {} samples do not fill one batch of {}",
              plan_->dataset.size(), batch_size_);
  window_.resize(static_cast<size_t>(seq_len_ + 1));
  start_worker();
}

void DataLoader::check_shape() const {
  LATHE_CHECK(batch_size_ > 0, "DataLoader: batch_size must be positive, got {}", batch_size_);
  LATHE_CHECK(row_begin_ >= 0 && row_begin_ + row_count_ <= batch_size_,
              "DataLoader: rows [{}, {}) outside a batch of {}", row_begin_, row_begin_ + row_count_, batch_size_);
  LATHE_CHECK(seq_len_ > 0, "DataLoader: seq_len must be positive, got {}", seq_len_);
  LATHE_CHECK(prefetch_ >= 0, "DataLoader: prefetch must be >= 0, got {}", prefetch_);
}

DataLoader::~DataLoader() { stop_worker(); }

std::vector<int64_t> DataLoader::epoch_order(int64_t epoch) const {
  std::vector<int64_t> order = sample_ids_;
  if (!shuffle_) return order;
  // Independent stream per epoch: any epoch's order is computable directly (restore needs no replay).
  uint64_t x = seed_ ^ (0x6c6174686564617aull + static_cast<uint64_t>(epoch) * 0x9e3779b97f4a7c15ull);
  Rng rng(splitmix64(x));
  for (size_t i = order.size(); i > 1; --i) std::swap(order[i - 1], order[rng.below(i)]);
  return order;
}

LoaderState remap_seq_len(const LoaderState& st, int64_t from_len, int64_t to_len, int64_t batch_size,
                          int64_t num_samples) {
  LATHE_CHECK(from_len > 0 && to_len > 0 && batch_size > 0 && st.position >= 0,
              "remap_seq_len: invalid arguments (seq_len {} -> {}, batch {}, position {})", from_len, to_len,
              batch_size, st.position);
  const int64_t tokens = checked_mul(st.position, from_len, "loader position x training.seq_len");
  const int64_t position = std::min(tokens / to_len / batch_size * batch_size, std::max<int64_t>(num_samples, 0));
  return {st.epoch, position};
}

LoaderState DataLoader::normalise(LoaderState st) const {
  if (plan_) return st;  // one pass over the plan, no epochs
  if (st.position + batch_size_ > static_cast<int64_t>(sample_ids_.size())) {
    st.epoch += 1;
    st.position = 0;
  }
  return st;
}

void DataLoader::produce(LoaderState& st, Batch& b) {
  st = normalise(st);
  const int64_t S = seq_len_;
  b.inputs.resize(static_cast<size_t>(row_count_ * S));
  b.targets.resize(static_cast<size_t>(row_count_ * S));
  if (plan_) {
    const int64_t n = static_cast<int64_t>(plan_->dataset.size());
    LATHE_CHECK(st.position + batch_size_ <= n,
                "the blend plan holds {} samples (training.steps x global batch) and the run asked for samples [{}, "
                "{}); plan for more steps",
                n, st.position, st.position + batch_size_);
    for (int64_t r = 0; r < row_count_; ++r) {
      const size_t g = static_cast<size_t>(st.position + row_begin_ + r);
      blend_ds_[plan_->dataset[g]]->read_global(plan_->sample[g] * S, S + 1, window_.data());
      std::memcpy(b.inputs.data() + r * S, window_.data(), S * sizeof(int32_t));
      std::memcpy(b.targets.data() + r * S, window_.data() + 1, S * sizeof(int32_t));
    }
    st.position += batch_size_;
    b.after = st;
    return;
  }
  if (order_epoch_ != st.epoch) {
    order_ = epoch_order(st.epoch);
    order_epoch_ = st.epoch;
  }
  for (int64_t r = 0; r < row_count_; ++r) {
    int64_t sample = order_[static_cast<size_t>(st.position + row_begin_ + r)];
    ds_->read_global(sample * S, S + 1, window_.data());
    std::memcpy(b.inputs.data() + r * S, window_.data(), S * sizeof(int32_t));
    std::memcpy(b.targets.data() + r * S, window_.data() + 1, S * sizeof(int32_t));
  }
  st.position += batch_size_;
  st = normalise(st);
  b.after = st;
}

void DataLoader::start_worker() {
  prod_state_ = cons_state_;
  if (prefetch_ == 0) return;
  stop_ = false;
  error_ = nullptr;
  worker_ = std::thread([this] { worker_loop(); });
}

void DataLoader::stop_worker() {
  if (!worker_.joinable()) return;
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_not_full_.notify_all();
  worker_.join();
  for (auto& b : queue_) free_.push_back(std::move(b));
  queue_.clear();
}

void DataLoader::worker_loop() {
  try {
    for (;;) {
      Batch b;
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_not_full_.wait(lk, [&] { return stop_ || static_cast<int>(queue_.size()) < prefetch_; });
        if (stop_) return;
        if (!free_.empty()) {
          b = std::move(free_.back());
          free_.pop_back();
        }
      }
      produce(prod_state_, b);  // outside the lock: reading tokens is the slow part
      {
        std::lock_guard<std::mutex> lk(mu_);
        if (stop_) return;
        queue_.push_back(std::move(b));
      }
      cv_not_empty_.notify_one();
    }
  } catch (...) {
    std::lock_guard<std::mutex> lk(mu_);
    error_ = std::current_exception();
    cv_not_empty_.notify_all();
  }
}

double DataLoader::next(int32_t* inputs, int32_t* targets) {
  const size_t n = static_cast<size_t>(row_count_ * seq_len_);
  if (prefetch_ == 0) {
    double t0 = now_seconds();
    produce(prod_state_, sync_batch_);
    std::memcpy(inputs, sync_batch_.inputs.data(), n * sizeof(int32_t));
    std::memcpy(targets, sync_batch_.targets.data(), n * sizeof(int32_t));
    std::lock_guard<std::mutex> lk(mu_);
    cons_state_ = sync_batch_.after;
    return now_seconds() - t0;
  }
  double t0 = now_seconds();
  Batch b;
  {
    std::unique_lock<std::mutex> lk(mu_);
    cv_not_empty_.wait(lk, [&] { return !queue_.empty() || error_; });
    if (queue_.empty() && error_) std::rethrow_exception(error_);
    b = std::move(queue_.front());
    queue_.pop_front();
  }
  double waited = now_seconds() - t0;
  cv_not_full_.notify_one();
  std::memcpy(inputs, b.inputs.data(), n * sizeof(int32_t));
  std::memcpy(targets, b.targets.data(), n * sizeof(int32_t));
  std::lock_guard<std::mutex> lk(mu_);
  cons_state_ = b.after;
  free_.push_back(std::move(b));
  return waited;
}

LoaderState DataLoader::state() const {
  std::lock_guard<std::mutex> lk(mu_);
  return cons_state_;
}

void DataLoader::restore(const LoaderState& st) {
  if (plan_) {
    LATHE_CHECK(st.epoch == 0 && st.position >= 0 && st.position <= static_cast<int64_t>(plan_->dataset.size()),
                "DataLoader::restore: invalid blend position: epoch {} position {} (the plan holds {} samples in one "
                "pass); the checkpoint's data settings must match this run",
                st.epoch, st.position, plan_->dataset.size());
  } else {
    LATHE_CHECK(st.epoch >= 0 && st.position >= 0 && st.position <= static_cast<int64_t>(sample_ids_.size()),
                "DataLoader::restore: invalid state epoch {} position {} ({} samples per epoch); the "
                "checkpoint's data settings (dataset, seq_len, split) must match this run",
                st.epoch, st.position, sample_ids_.size());
  }
  stop_worker();
  cons_state_ = normalise(st);
  start_worker();
}

}  // namespace lathe::data
