#include "data/indexed_dataset.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>

#include "core/checked.h"
#include "core/error.h"
#include "io/fs.h"

namespace lathe::data {
namespace {

constexpr unsigned char kMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', 0, 0};
constexpr size_t kHeaderBytes = 34;  // magic 9 + version 8 + dtype 1 + S 8 + D 8

// The index arrays start at byte 34, so they are not aligned: always memcpy.
template <typename T>
T load(const unsigned char* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}
void write_all(std::FILE* f, const void* data, size_t n, const std::string& path) {
  if (n && std::fwrite(data, 1, n, f) != n)
    throw_error("{}: write failed ({}); check free disk space", path, std::strerror(errno));
}

void fsync_file(std::FILE* f, const std::string& path) {
  if (std::fflush(f) != 0 || ::fsync(::fileno(f)) != 0)
    throw_error("{}: flush/fsync failed ({})", path, std::strerror(errno));
}

// Maps a whole file read-only; returns nullptr for an empty file (mmap rejects length 0). Opened
// through io::open_input: a FIFO in place of the .bin/.idx is refused instead of blocking, a
// directory or a symlink loop is named.
const unsigned char* map_file(const std::string& path, size_t& size, const char* role) {
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0 && errno == ENOENT)
    throw_error(
        "{}: {} file missing (an indexed dataset is the pair PREFIX.bin + PREFIX.idx; "
        "pass the prefix without extension)",
        path, role);
  int fd = io::open_input(path, &size);
  if (size == 0) {
    ::close(fd);
    return nullptr;
  }
  void* p = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
  const int err = errno;
  ::close(fd);
  if (p == MAP_FAILED) throw_error("{}: mmap failed ({})", path, std::strerror(err));
  return static_cast<const unsigned char*>(p);
}

// Converts `count` tokens of `dtype` at `src` to int32.
void convert_tokens(const unsigned char* src, DType dtype, int64_t count, int32_t* out, const std::string& path) {
  switch (dtype) {
    case DType::U8:
      for (int64_t i = 0; i < count; ++i) out[i] = src[i];
      return;
    case DType::U16:
      for (int64_t i = 0; i < count; ++i) out[i] = load<uint16_t>(src + 2 * i);
      return;
    case DType::I32:
      std::memcpy(out, src, static_cast<size_t>(count) * 4);
      return;
    case DType::I64:
      for (int64_t i = 0; i < count; ++i) {
        int64_t v = load<int64_t>(src + 8 * i);
        LATHE_CHECK(v >= std::numeric_limits<int32_t>::min() && v <= std::numeric_limits<int32_t>::max(),
                    "{}: token id {} does not fit in int32 (lathe token ids are int32)", path, v);
        out[i] = static_cast<int32_t>(v);
      }
      return;
    default:
      throw_error("{}: unsupported token dtype {}", path, dtype_name(dtype));
  }
}

}  // namespace

uint8_t megatron_dtype_code(DType t) {
  switch (t) {
    case DType::U8:
      return 1;
    case DType::I32:
      return 4;
    case DType::I64:
      return 5;
    case DType::U16:
      return 8;
    default:
      throw_error("indexed dataset: token dtype {} is not supported (use U16, I32, U8 or I64)", dtype_name(t));
  }
}

DType dtype_from_megatron_code(uint8_t code, const std::string& what) {
  switch (code) {
    case 1:
      return DType::U8;
    case 4:
      return DType::I32;
    case 5:
      return DType::I64;
    case 8:
      return DType::U16;
    case 2:
    case 3:
    case 6:
    case 7:
      throw_error(
          "{}: dtype code {} ({}) is not a supported token dtype (lathe reads uint8=1, "
          "int32=4, int64=5, uint16=8)",
          what, code,
          code == 2   ? "int8"
          : code == 3 ? "int16"
          : code == 6 ? "float64"
                      : "float32");
    default:
      throw_error("{}: invalid dtype code {} (Megatron codes are 1..8)", what, code);
  }
}

DType optimal_token_dtype(int64_t vocab_size) {
  LATHE_CHECK(vocab_size > 0, "optimal_token_dtype: vocab_size must be positive, got {}", vocab_size);
  return vocab_size < 65500 ? DType::U16 : DType::I32;
}

// ---------------------------------------------------------------------------------------------
// Writer

IndexedDatasetWriter::IndexedDatasetWriter(const std::string& prefix, DType dtype)
    : prefix_(prefix), bin_tmp_(prefix + ".bin.tmp"), idx_tmp_(prefix + ".idx.tmp"), dtype_(dtype) {
  megatron_dtype_code(dtype);  // validates the dtype
  bin_ = std::fopen(bin_tmp_.c_str(), "wb");
  if (!bin_) throw_error("{}: cannot create ({}); does the output directory exist?", bin_tmp_, std::strerror(errno));
}

IndexedDatasetWriter::~IndexedDatasetWriter() {
  if (!finalized_) cleanup_temp();
}

void IndexedDatasetWriter::cleanup_temp() noexcept {
  if (bin_) {
    std::fclose(bin_);
    bin_ = nullptr;
  }
  ::unlink(bin_tmp_.c_str());
  ::unlink(idx_tmp_.c_str());
}

void IndexedDatasetWriter::add_document(std::span<const int32_t> tokens) {
  const uint32_t len = static_cast<uint32_t>(std::min<size_t>(tokens.size(), std::numeric_limits<uint32_t>::max()));
  LATHE_CHECK(tokens.size() <= static_cast<size_t>(std::numeric_limits<int32_t>::max()),
              "{}: document {} has {} tokens; the .idx stores lengths as int32", prefix_, lengths_.size(),
              tokens.size());
  add_documents(tokens, std::span<const uint32_t>(&len, 1));
}

namespace {
template <typename T>
void narrow_tokens(const int32_t* src, size_t n, unsigned char* dst) {
  T* d = reinterpret_cast<T*>(dst);  // dst comes from a vector<unsigned char>: malloc-aligned
  for (size_t i = 0; i < n; ++i) d[i] = static_cast<T>(src[i]);
}
}  // namespace

void IndexedDatasetWriter::add_documents(std::span<const int32_t> tokens, std::span<const uint32_t> lengths) {
  LATHE_CHECK(!finalized_, "{}: add_document after finalize()", prefix_);
  uint64_t total = 0;
  for (uint32_t len : lengths) {
    LATHE_CHECK(len <= static_cast<uint32_t>(std::numeric_limits<int32_t>::max()),
                "{}: a document has {} tokens; the .idx stores lengths as int32", prefix_, len);
    total += len;
  }
  LATHE_CHECK(total == tokens.size(), "{}: add_documents: lengths sum to {} but {} tokens were given", prefix_, total,
              tokens.size());
  const int64_t hi = dtype_ == DType::U8 ? 255 : dtype_ == DType::U16 ? 65535 : std::numeric_limits<int32_t>::max();
  int32_t lo_seen = 0, hi_seen = 0;
  for (int32_t t : tokens) {  // vectorised min/max; the slow search below runs only on an error
    lo_seen = std::min(lo_seen, t);
    hi_seen = std::max(hi_seen, t);
  }
  if (lo_seen < 0 || hi_seen > hi) {
    size_t doc = 0, start = 0;
    for (size_t i = 0; i < tokens.size(); ++i) {
      while (i >= start + lengths[doc]) start += lengths[doc++];
      const int32_t t = tokens[i];
      if (t < 0 || t > hi)
        throw_error(
            "{}: token id {} (document {}, position {}) does not fit the dataset dtype {} "
            "(valid ids 0..{}); use optimal_token_dtype(vocab_size) to pick the dtype",
            prefix_, t, lengths_.size() + doc, i - start, dtype_name(dtype_), hi);
    }
  }
  const size_t item = dtype_size(dtype_);
  scratch_.resize(tokens.size() * item);
  unsigned char* dst = scratch_.data();
  switch (dtype_) {
    case DType::U8:
      narrow_tokens<uint8_t>(tokens.data(), tokens.size(), dst);
      break;
    case DType::U16:
      narrow_tokens<uint16_t>(tokens.data(), tokens.size(), dst);
      break;
    case DType::I32:
      narrow_tokens<int32_t>(tokens.data(), tokens.size(), dst);
      break;
    case DType::I64:
      narrow_tokens<int64_t>(tokens.data(), tokens.size(), dst);
      break;
    default:
      break;
  }
  write_all(bin_, scratch_.data(), scratch_.size(), bin_tmp_);
  start_writeback(false);
  for (uint32_t len : lengths) lengths_.push_back(static_cast<int32_t>(len));
  num_tokens_ += tokens.size();
}

// Hands written .bin bytes to the kernel's writeback every 16 MB (sync_file_range, no waiting), so
// the fsync in finalize() waits for the tail only instead of the whole file: with small documents
// finalize() was a tenth of a preprocessing run, on one thread while the others idle.
void IndexedDatasetWriter::start_writeback(bool all) {
  constexpr uint64_t kStep = 16ull << 20;
  const uint64_t written = num_tokens_ * dtype_size(dtype_);
  if (!all && written < writeback_start_ + kStep) return;
  if (std::fflush(bin_) != 0)
    throw_error("{}: write failed ({}); check free disk space", bin_tmp_, std::strerror(errno));
#ifdef SYNC_FILE_RANGE_WRITE
  // Advisory: an error here (e.g. a file system without support) is left to the final fsync.
  ::sync_file_range(::fileno(bin_), static_cast<off64_t>(writeback_start_),
                    static_cast<off64_t>(written - writeback_start_), SYNC_FILE_RANGE_WRITE);
#endif
  writeback_start_ = written;
}

void IndexedDatasetWriter::finalize() {
  LATHE_CHECK(!finalized_, "{}: finalize() called twice", prefix_);
  start_writeback(true);  // the .bin tail goes to disk while the .idx is built and written

  // .idx: header, lengths (int32), byte pointers (int64), document indices 0..S (int64).
  const uint64_t S = lengths_.size(), D = S + 1;
  std::vector<unsigned char> idx(kHeaderBytes + 12 * S + 8 * D);
  unsigned char* o = idx.data();
  auto put = [&o](const void* src, size_t n) {
    if (n) std::memcpy(o, src, n);  // src may be null for an empty dataset
    o += n;
  };
  const uint64_t version = 1, s64 = S, d64 = D;
  const uint8_t code = megatron_dtype_code(dtype_);
  put(kMagic, 9);
  put(&version, 8);
  put(&code, 1);
  put(&s64, 8);
  put(&d64, 8);
  put(lengths_.data(), 4 * S);
  std::vector<int64_t> tmp(std::max<uint64_t>(S, D));
  const int64_t item = static_cast<int64_t>(dtype_size(dtype_));
  int64_t ptr = 0;
  for (uint64_t i = 0; i < S; ++i) {
    tmp[i] = ptr;
    ptr += static_cast<int64_t>(lengths_[i]) * item;
  }
  put(tmp.data(), 8 * S);
  for (uint64_t d = 0; d < D; ++d) tmp[d] = static_cast<int64_t>(d);
  put(tmp.data(), 8 * D);

  std::FILE* f = std::fopen(idx_tmp_.c_str(), "wb");
  if (!f) throw_error("{}: cannot create ({})", idx_tmp_, std::strerror(errno));
  try {
    write_all(f, idx.data(), idx.size(), idx_tmp_);
    if (std::fflush(f) != 0) throw_error("{}: write failed ({})", idx_tmp_, std::strerror(errno));
#ifdef SYNC_FILE_RANGE_WRITE
    ::sync_file_range(::fileno(f), 0, 0, SYNC_FILE_RANGE_WRITE);  // in flight beside the .bin
#endif
    fsync_file(bin_, bin_tmp_);
    fsync_file(f, idx_tmp_);
  } catch (...) {
    std::fclose(f);
    throw;
  }
  if (std::fclose(f) != 0) throw_error("{}: close failed ({})", idx_tmp_, std::strerror(errno));
  if (std::fclose(bin_) != 0) {
    bin_ = nullptr;
    throw_error("{}: close failed ({})", bin_tmp_, std::strerror(errno));
  }
  bin_ = nullptr;

  // .bin first: a reader that finds the new .idx then always finds the matching .bin.
  for (auto [tmp, fin] : {std::pair{bin_tmp_, prefix_ + ".bin"}, std::pair{idx_tmp_, prefix_ + ".idx"}})
    if (std::rename(tmp.c_str(), fin.c_str()) != 0)
      throw_error("{}: rename to {} failed ({})", tmp, fin, std::strerror(errno));
  finalized_ = true;
  io::fsync_dir(io::parent_dir(prefix_ + ".idx"));
}

// ---------------------------------------------------------------------------------------------
// Reader

IndexedDataset::IndexedDataset(const std::string& prefix) : prefix_(prefix) {
  const std::string idx_path = prefix + ".idx", bin_path = prefix + ".bin";
  try {
    idx_ = map_file(idx_path, idx_size_, "index (.idx)");
    bin_ = map_file(bin_path, bin_size_, "token (.bin)");

    LATHE_CHECK(idx_size_ >= kHeaderBytes, "{}: truncated header: expected at least {} bytes got {}", idx_path,
                kHeaderBytes, idx_size_);
    LATHE_CHECK(std::memcmp(idx_, kMagic, 9) == 0,
                "{}: bad magic (expected \"MMIDIDX\\0\\0\"); not a Megatron indexed dataset index "
                "(regenerate it with Megatron's tools/preprocess_data.py or `lathe` preprocessing)",
                idx_path);
    uint64_t version = load<uint64_t>(idx_ + 9);
    LATHE_CHECK(version == 1, "{}: unsupported version {} (only version 1 exists)", idx_path, version);
    dtype_ = dtype_from_megatron_code(idx_[17], idx_path);
    uint64_t S = load<uint64_t>(idx_ + 18), D = load<uint64_t>(idx_ + 26);
    // Sizes beyond 2^40 entries cannot be real and would overflow the size arithmetic below.
    LATHE_CHECK(S < (1ull << 40) && D < (1ull << 40), "{}: corrupt header: sequence_count {} / document_count {}",
                idx_path, S, D);
    LATHE_CHECK(D >= 1, "{}: corrupt header: document_count is 0 (must be number of documents + 1)", idx_path);
    // S, D < 2^40: no overflow here, but every size derived from the header goes through the
    // checked helpers so that a future change of the bounds above cannot wrap silently.
    const auto expected = static_cast<uint64_t>(
        checked_add(static_cast<int64_t>(kHeaderBytes),
                    checked_add(checked_mul(12, static_cast<int64_t>(S), "sequence_count x 12 bytes"),
                                checked_mul(8, static_cast<int64_t>(D), "document_count x 8 bytes"), "index size"),
                    "index size"));
    if (idx_size_ == expected + S && S > 0)
      throw_error(
          "{}: {} bytes = expected size {} + {} sequence_modes bytes: multimodal indexed "
          "datasets are not supported",
          idx_path, idx_size_, expected, S);
    LATHE_CHECK(idx_size_ >= expected, "{}: truncated: expected {} bytes got {} (sequence_count {}, document_count {})",
                idx_path, expected, idx_size_, S, D);
    LATHE_CHECK(idx_size_ == expected,
                "{}: size mismatch: expected {} bytes got {} (trailing data; sequence_count {}, "
                "document_count {})",
                idx_path, expected, idx_size_, S, D);
    num_sequences_ = S;
    num_doc_indices_ = D;

    // Lengths non-negative and pointers contiguous from 0: sequence i then starts at global token
    // sequence_pointers[i] / itemsize, which read_global relies on.
    const int64_t item = static_cast<int64_t>(dtype_size(dtype_));
    const unsigned char* lens = idx_ + kHeaderBytes;
    const unsigned char* ptrs = lens + 4 * S;
    const unsigned char* docs = ptrs + 8 * S;
    int64_t pos = 0;
    for (uint64_t i = 0; i < S; ++i) {
      int32_t len = load<int32_t>(lens + 4 * i);
      int64_t p = load<int64_t>(ptrs + 8 * i);
      LATHE_CHECK(len >= 0, "{}: sequence_lengths[{}] = {} is negative", idx_path, i, len);
      LATHE_CHECK(p == pos,
                  "{}: sequence_pointers[{}] = {} but the sequences before it end at byte {} "
                  "(pointers must be contiguous)",
                  idx_path, i, p, pos);
      pos = checked_add(pos, checked_mul(len, item, idx_path + ": sequence length x item size"),
                        idx_path + ": end of the sequences");
    }
    total_tokens_ = pos / item;
    LATHE_CHECK(static_cast<uint64_t>(pos) <= bin_size_,
                "{}: truncated: expected {} bytes got {} ({} tokens of {} per {})", bin_path, pos, bin_size_,
                total_tokens_, dtype_name(dtype_), idx_path);
    LATHE_CHECK(static_cast<uint64_t>(pos) == bin_size_,
                "{}: size mismatch: expected {} bytes got {} ({} tokens of {} per {}); the .bin and "
                ".idx do not belong together",
                bin_path, pos, bin_size_, total_tokens_, dtype_name(dtype_), idx_path);

    int64_t prev = load<int64_t>(docs);
    LATHE_CHECK(prev == 0, "{}: document_indices[0] = {} (must be 0)", idx_path, prev);
    for (uint64_t d = 1; d < D; ++d) {
      int64_t v = load<int64_t>(docs + 8 * d);
      LATHE_CHECK(v >= prev,
                  "{}: document_indices[{}] = {} < document_indices[{}] = {} (must be "
                  "non-decreasing)",
                  idx_path, d, v, d - 1, prev);
      prev = v;
    }
    LATHE_CHECK(static_cast<uint64_t>(prev) == S,
                "{}: document_indices[-1] = {} but sequence_count = {} (must be equal)", idx_path, prev, S);
  } catch (...) {
    if (idx_) ::munmap(const_cast<unsigned char*>(idx_), idx_size_);
    if (bin_) ::munmap(const_cast<unsigned char*>(bin_), bin_size_);
    throw;
  }
}

IndexedDataset::~IndexedDataset() {
  if (idx_) ::munmap(const_cast<unsigned char*>(idx_), idx_size_);
  if (bin_) ::munmap(const_cast<unsigned char*>(bin_), bin_size_);
}

int64_t IndexedDataset::sequence_length(size_t i) const {
  LATHE_CHECK(i < num_sequences_, "{}.idx: sequence {} out of range (dataset has {})", prefix_, i, num_sequences_);
  return load<int32_t>(idx_ + kHeaderBytes + 4 * i);
}

int64_t IndexedDataset::sequence_offset(size_t i) const {
  LATHE_CHECK(i < num_sequences_, "{}.idx: sequence {} out of range (dataset has {})", prefix_, i, num_sequences_);
  return load<int64_t>(idx_ + kHeaderBytes + 4 * num_sequences_ + 8 * i) / static_cast<int64_t>(dtype_size(dtype_));
}

const void* IndexedDataset::sequence_data(size_t i) const {
  const int64_t off = sequence_offset(i);  // range-checked; validated against the .bin size on open
  return bin_ ? bin_ + static_cast<size_t>(off) * dtype_size(dtype_) : nullptr;
}

void IndexedDataset::read_global(int64_t start, int64_t count, int32_t* out) const {
  LATHE_CHECK(start >= 0 && count >= 0 && start + count <= total_tokens_,
              "{}.bin: read of tokens [{}, {}) out of range (dataset has {} tokens)", prefix_, start, start + count,
              total_tokens_);
  if (count == 0) return;
  convert_tokens(bin_ + start * static_cast<int64_t>(dtype_size(dtype_)), dtype_, count, out, prefix_ + ".bin");
}

void IndexedDataset::read_sequence(size_t i, int32_t* out) const {
  read_global(sequence_offset(i), sequence_length(i), out);
}

int32_t IndexedDataset::max_token_id() const {
  int64_t cached = max_token_.load(std::memory_order_acquire);
  if (cached != -2) return static_cast<int32_t>(cached);
  // Chunks of the stream are converted and reduced in parallel; max and min are order-independent.
  // The minimum matters for signed dtypes (int32/int64): a negative id passes a max-only check
  // (lathe check, eval) and fails only in the model's forward pass, without naming the file.
  const int64_t n = total_tokens_, chunk = 1 << 16;
  const int64_t nchunks = (n + chunk - 1) / chunk;
  int64_t best = -1, lowest = 0;
  bool overflow = false;
#pragma omp parallel reduction(max : best) reduction(min : lowest) reduction(|| : overflow)
  {
    std::vector<int32_t> buf;
#pragma omp for schedule(static)
    for (int64_t c = 0; c < nchunks; ++c) {
      int64_t s = c * chunk, m = std::min(chunk, n - s);
      if (dtype_ == DType::I64) {
        for (int64_t i = 0; i < m; ++i) {
          int64_t v = load<int64_t>(bin_ + 8 * (s + i));
          if (v > std::numeric_limits<int32_t>::max()) overflow = true;
          best = std::max(best, v);
          lowest = std::min(lowest, v);
        }
      } else {
        buf.resize(static_cast<size_t>(m));
        convert_tokens(bin_ + s * static_cast<int64_t>(dtype_size(dtype_)), dtype_, m, buf.data(), "");
        for (int64_t i = 0; i < m; ++i) {
          best = std::max<int64_t>(best, buf[i]);
          lowest = std::min<int64_t>(lowest, buf[i]);
        }
      }
    }
  }
  LATHE_CHECK(!overflow, "{}.bin: token id {} does not fit in int32", prefix_, best);
  if (lowest < 0) {
    int64_t at = 0;  // the error path only: find the first one for the message
    for (std::vector<int32_t> one(1); at < n; ++at) {
      if (dtype_ == DType::I64 ? load<int64_t>(bin_ + 8 * at) < 0 : (read_global(at, 1, one.data()), one[0] < 0)) break;
    }
    throw_error(
        "{}.bin: holds negative token ids (the smallest is {}, the first at token {} of the dataset); token ids "
        "index the vocabulary: the file is corrupt or was written with a wrong dtype",
        prefix_, lowest, at);
  }
  max_token_.store(best, std::memory_order_release);
  return static_cast<int32_t>(best);
}

std::pair<int64_t, int64_t> sequences_ending_with(const IndexedDataset& ds, int32_t id, int64_t max_checked) {
  const int64_t n = static_cast<int64_t>(ds.num_sequences());
  const int64_t m = std::min(n, std::max<int64_t>(max_checked, 1));
  int64_t hits = 0, checked = 0;
  for (int64_t j = 0; j < m; ++j) {
    const size_t i = static_cast<size_t>(m == n ? j : j * (n - 1) / std::max<int64_t>(m - 1, 1));
    const int64_t len = ds.sequence_length(i);
    if (len <= 0) continue;
    int32_t last = 0;
    ds.read_global(ds.sequence_offset(i) + len - 1, 1, &last);
    hits += last == id;
    ++checked;
  }
  return {hits, checked};
}

}  // namespace lathe::data
