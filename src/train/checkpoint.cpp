#include "train/checkpoint.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <future>
#include <map>
#include <numeric>
#include <set>
#include <thread>

#include "core/error.h"
#include "core/stop_signal.h"
#include "io/fs.h"
#include "io/json.h"
#include "io/safetensors.h"
#include "train/checkpoint_format.h"

namespace lathe {

namespace fs = std::filesystem;
using json = nlohmann::json;

// ---------------------------------------------------------------------------------------------

namespace {

using namespace ckpt_format;
constexpr size_t kChunk = 8u << 20;  // read size when verifying

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Removes old checkpoints on a background thread; joined by the next save, by
// wait_for_checkpoint_cleanup() and at exit.
class Cleaner {
 public:
  ~Cleaner() { join(); }
  void start(std::vector<fs::path> dirs) {
    join();
    thread_ = std::thread([dirs = std::move(dirs)] {
      for (const auto& d : dirs) {
        std::error_code ec;  // a leftover *.tmp is removed by the next save anyway
        fs::remove_all(d, ec);
      }
    });
  }
  void join() {
    if (thread_.joinable()) thread_.join();
  }

 private:
  std::thread thread_;
};
Cleaner& cleaner() {
  static Cleaner c;
  return c;
}

std::string step_name(int64_t step) { return fmt::format("step_{:08d}", step); }

// "step_00000120" -> 120; -1 for anything else (tmp dirs, `latest`, stray files).
int64_t parse_step_name(const std::string& s) {
  if (s.size() != 13 || s.rfind("step_", 0) != 0) return -1;
  int64_t v = 0;
  for (size_t i = 5; i < s.size(); ++i) {
    if (s[i] < '0' || s[i] > '9') return -1;
    v = v * 10 + (s[i] - '0');
  }
  return v;
}

void test_sleep() {
  static const int ms = [] {
    const char* e = std::getenv("LATHE_TEST_CKPT_SLEEP_MS");
    return e ? std::atoi(e) : 0;
  }();
  if (ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(ms));
}

// Writes a checkpoint file and hashes it on the way. The file lives inside the checkpoint's tmp
// directory, whose rename is the atomic step, so it is written in place (no per-file rename).
// Speed (the disk, not the CPU, should be the limit): data goes through O_DIRECT, bypassing the
// page cache, which halves large-write throughput. Large page-aligned stretches of the caller's
// memory are written straight from it (zero-copy: write_st lays the file out so that file offset
// and address agree modulo the page size); everything else goes through two 16 MB aligned
// staging buffers. One helper thread does the pwrite()s while this thread hashes the next piece,
// so hashing overlaps the disk. The tail is padded to the 4 KB block and the file truncated back
// to its length. Where the filesystem refuses O_DIRECT (tmpfs, some network mounts) the same code
// writes buffered.
class HashedWriter {
 public:
  static constexpr size_t kAlign = 4096;

  explicit HashedWriter(const std::string& path) : path_(path) {
    fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_DIRECT, 0644);
    if (fd_ < 0 && errno == EINVAL) {
      direct_ = false;
      fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    }
    if (fd_ < 0) throw_error("{}: cannot create: {}", path, std::strerror(errno));
    for (auto& b : bufs_) {
      b = static_cast<char*>(std::aligned_alloc(kAlign, kStage));
      LATHE_CHECK(b != nullptr, "{}: out of memory for a {} byte staging buffer", path, kStage);
    }
  }
  ~HashedWriter() {
    if (pending_.valid()) pending_.wait();
    for (auto& b : bufs_) std::free(b);
    if (fd_ >= 0) ::close(fd_);
    if (!committed_) ::unlink(path_.c_str());
  }
  HashedWriter(const HashedWriter&) = delete;
  HashedWriter& operator=(const HashedWriter&) = delete;

  size_t position() const { return offset_ + fill_; }

  void write(const void* p, size_t n) {
    const char* c = static_cast<const char*>(p);
    while (n > 0) {
      // Zero-copy when the address and the file position share their offset within a page and
      // the stretch is long enough to be worth it.
      const size_t head = (kAlign - position() % kAlign) % kAlign;
      if (n >= head + kDirectMin && (reinterpret_cast<uintptr_t>(c) + head) % kAlign == 0 && fill_ + head <= kStage) {
        stage(c, head);
        c += head;
        n -= head;
        if (fill_) submit(bufs_[cur_], fill_, true);  // fill_ is a multiple of kAlign here
        const size_t body = n / kAlign * kAlign;
        for (size_t i = 0; i < body; i += kDirectChunk) {
          const size_t m = std::min(kDirectChunk, body - i);
          h_.update(c + i, m);  // while the previous piece is being written
          submit(c + i, m, false);
        }
        c += body;
        n -= body;
        continue;
      }
      const size_t m = std::min(n, kStage - fill_);
      stage(c, m);
      c += m;
      n -= m;
      if (fill_ == kStage) submit(bufs_[cur_], kStage, true);
    }
  }

  json commit() {
    const size_t tail = fill_;
    if (tail) {
      const size_t padded = (tail + kAlign - 1) / kAlign * kAlign;
      std::memset(bufs_[cur_] + tail, 0, padded - tail);
      submit(bufs_[cur_], padded, true);
      total_ -= padded - tail;
    }
    wait();
    if (::ftruncate(fd_, static_cast<off_t>(total_)) != 0)
      throw_error("{}: ftruncate failed: {}", path_, std::strerror(errno));
    if (::fsync(fd_) != 0) throw_error("{}: fsync failed: {}", path_, std::strerror(errno));
    const int rc = ::close(fd_);
    fd_ = -1;
    if (rc != 0) throw_error("{}: close failed: {}", path_, std::strerror(errno));
    committed_ = true;
    return {{"bytes", total_}, {"xxh64", hex64(h_.digest())}};
  }

 private:
  static constexpr size_t kStage = 16u << 20, kDirectChunk = 32u << 20, kDirectMin = 1u << 20;

  void stage(const char* c, size_t m) {
    if (!m) return;
    std::memcpy(bufs_[cur_] + fill_, c, m);
    h_.update(bufs_[cur_] + fill_, m);
    fill_ += m;
  }
  // Hands n bytes (a multiple of kAlign, already hashed) to the writer thread. One write is in
  // flight at a time, so a staging buffer is free again once the next submit() returns.
  void submit(const char* buf, size_t n, bool staging) {
    // Under a StopSignalGuard (lathe checkpoint reshard) a SIGINT/SIGTERM stops between pieces of
    // at most 32 MB; the destructor removes the file. lathe train has its own handler and finishes
    // the checkpoint it is writing (stop_signal() is 0 there).
    if (const int sig = stop_signal())
      throw_error("{}: interrupted by {} while writing it; the partial file is removed", path_, signal_name(sig));
    wait();
    const off_t at = static_cast<off_t>(offset_);
    pending_ = std::async(std::launch::async, [this, buf, n, at] { return pwrite_all(buf, n, at); });
    offset_ += n;
    total_ += n;
    if (staging) {
      cur_ ^= 1;
      fill_ = 0;
    }
  }
  void wait() {
    if (!pending_.valid()) return;
    const std::string err = pending_.get();
    if (!err.empty()) throw Error(err);
  }
  std::string pwrite_all(const char* p, size_t n, off_t at) {
    while (n > 0) {
      ssize_t w = ::pwrite(fd_, p, n, at);
      if (w < 0 && errno == EINTR) continue;
      if (w < 0 && errno == EINVAL && direct_) {
        // The filesystem accepted O_DIRECT at open but refuses the I/O: continue buffered.
        direct_ = false;
        ::fcntl(fd_, F_SETFL, ::fcntl(fd_, F_GETFL) & ~O_DIRECT);
        continue;
      }
      if (w < 0) return fmt::format("{}: write failed: {}", path_, std::strerror(errno));
      p += w;
      n -= static_cast<size_t>(w);
      at += w;
    }
    return {};
  }

  std::string path_;
  int fd_ = -1;
  bool direct_ = true, committed_ = false;
  char* bufs_[2] = {nullptr, nullptr};
  int cur_ = 0;
  size_t fill_ = 0, offset_ = 0, total_ = 0;
  std::future<std::string> pending_;
  Xxh64 h_;
};

struct StTensor {
  std::string name;
  Shape shape;
  const float* data;
  // A piece [flat_begin, flat_end) of a flattened tensor of shape global_shape (1-D `shape`).
  bool flat = false;
  Shape global_shape{};
  int64_t flat_begin = 0, flat_end = 0;
};

constexpr const char* kPadPrefix = "__lathe_pad__/";
bool is_pad(const std::string& name) { return name.rfind(kPadPrefix, 0) == 0; }

// fp32 safetensors written in one pass with its checksum. Returns {file entry, tensor entries}.
// For zero-copy direct I/O, the data section starts at a file offset congruent to the first
// tensor's address modulo 4096 (the JSON header is padded with spaces), and where a tensor does
// not follow the previous one in memory (exp_avg -> exp_avg_sq) a U8 tensor
// "__lathe_pad__/<next name>" of < 4096 bytes restores that congruence. Readers ignore the pads;
// state.json does not list them. (So the file bytes depend on buffer addresses; the tensors do not.)
// canonical (offline writers, train/reshard.h): no pads and the data section at a 4 KB multiple, so
// the bytes depend on the tensors only.
std::pair<json, json> write_st(const std::string& path, const std::vector<StTensor>& ts, bool canonical = false) {
  constexpr size_t A = HashedWriter::kAlign;
  struct Entry {
    std::string name;
    const char* dtype;
    Shape shape;
    const void* data;
    size_t bytes;
  };
  std::vector<Entry> entries;
  std::vector<char> zeros(A, 0);
  const uintptr_t first = ts.empty() || canonical ? 0 : reinterpret_cast<uintptr_t>(ts[0].data);
  size_t off = 0;  // data-section offset
  for (size_t i = 0; i < ts.size(); ++i) {
    const auto& t = ts[i];
    const size_t nb = static_cast<size_t>(numel(t.shape)) * 4;
    if (!canonical && i > 0 && t.data != ts[i - 1].data + numel(ts[i - 1].shape)) {
      // Want (data_start + off) % A == addr % A with data_start % A == first % A.
      const size_t pad = (reinterpret_cast<uintptr_t>(t.data) - first - off) % A;
      if (pad) {
        entries.push_back({kPadPrefix + t.name, "U8", Shape{static_cast<int64_t>(pad)}, zeros.data(), pad});
        off += pad;
      }
    }
    entries.push_back({t.name, "F32", t.shape, t.data, nb});
    off += nb;
  }
  std::string h = R"({"__metadata__":{"format":"pt","lathe_layout":"lathe"})";
  json tensors = json::array();
  std::map<std::string, const StTensor*> pieces;
  for (const auto& t : ts)
    if (t.flat) pieces[t.name] = &t;
  off = 0;
  for (const auto& e : entries) {
    json shape = e.shape;
    // Appended piece by piece (gcc 12 warns falsely about "," + std::string temporaries).
    h += ',';
    h += json(e.name).dump();
    h += R"(:{"dtype":")";
    h += e.dtype;
    h += R"(","shape":)";
    h += shape.dump();
    h += R"(,"data_offsets":[)";
    h += std::to_string(off);
    h += ',';
    h += std::to_string(off + e.bytes);
    h += "]}";
    off += e.bytes;
    if (is_pad(e.name)) continue;
    if (auto it = pieces.find(e.name); it != pieces.end()) {
      const StTensor& t = *it->second;
      tensors.push_back({{"name", e.name},
                         {"dtype", "F32"},
                         {"global_shape", json(t.global_shape)},
                         {"flat", {t.flat_begin, t.flat_end}}});
      continue;
    }
    json slice = json::array();
    for (int64_t d : e.shape) slice.push_back({0, d});
    tensors.push_back({{"name", e.name}, {"dtype", "F32"}, {"global_shape", shape}, {"slice", slice}});
  }
  h += "}";
  while ((8 + h.size()) % A != first % A) h += ' ';  // first is 8-aligned, so this ends
  HashedWriter w(path);
  unsigned char len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>(static_cast<uint64_t>(h.size()) >> (8 * i));
  w.write(len, 8);
  w.write(h.data(), h.size());
  for (const auto& e : entries) w.write(e.data, e.bytes);
  return {w.commit(), tensors};
}

std::string state_path(const std::string& dir) { return (fs::path(dir) / kStateFile).string(); }

// True when something (even a broken or looping symlink) is at `path`; "missing" errors are only
// given when nothing is there, the rest is named by io::open_input.
bool present(const std::string& path) {
  struct stat sb;
  return ::lstat(path.c_str(), &sb) == 0 || errno != ENOENT;
}

uint64_t hash_file(const std::string& path, size_t* size) {
  int fd = io::open_input(path);  // regular files only: a FIFO would block forever
  std::vector<char> buf(kChunk);
  Xxh64 h;
  size_t total = 0;
  for (;;) {
    ssize_t r = ::read(fd, buf.data(), buf.size());
    if (r < 0) {
      if (errno == EINTR) continue;
      int err = errno;
      ::close(fd);
      throw_error("{}: read failed: {}", path, std::strerror(err));
    }
    if (r == 0) break;
    h.update(buf.data(), static_cast<size_t>(r));
    total += static_cast<size_t>(r);
  }
  ::close(fd);
  *size = total;
  return h.digest();
}

void require_checkpoint_dir(const std::string& dir) {
  std::error_code ec;
  const bool is_dir = fs::is_directory(dir, ec);
  if (ec && ec != std::errc::no_such_file_or_directory)
    throw_error("{}: cannot read the checkpoint directory: {}", dir, ec.message());
  LATHE_CHECK(is_dir,
              "{}: not a directory (expected a checkpoint directory such as "
              "RUN_DIR/checkpoints/step_00000100)",
              dir);
}

// state.json parsed and validated field by field (checkpoint_state.cpp).
CheckpointState read_state(const std::string& dir) {
  const std::string path = state_path(dir);
  LATHE_CHECK(present(path), "{}: missing (not a complete lathe checkpoint directory)", path);
  return parse_checkpoint_state(io::read_file(path), path);
}

void verify_files(const std::string& dir, const CheckpointState& cs) {
  const std::string sp = state_path(dir);
  for (const CheckpointFile& cf : cs.files) {
    const std::string path = (fs::path(dir) / cf.name).string();
    LATHE_CHECK(present(path), "{}: missing (listed in {}; the checkpoint is incomplete)", path, sp);
    size_t size = 0;
    const std::string got = hex64(hash_file(path, &size));
    LATHE_CHECK(size == static_cast<size_t>(cf.bytes), "{}: corrupt or truncated: {} bytes, {} records {}", path, size,
                sp, cf.bytes);
    LATHE_CHECK(got == cf.xxh64, "{}: corrupt: checksum mismatch (recorded xxh64 {}, computed {})", path, cf.xxh64,
                got);
  }
}

// Checks the state.json tensor table of `file` against the file itself: it must list exactly the
// file's tensors (alignment pads aside), each whole (a single-rank load) and of the file's shape.
void check_slices(const CheckpointState& cs, const std::string& file, const io::SafetensorsFile& st,
                  const std::string& sp, bool allow_flat = false) {
  auto it = cs.tensors.find(file);
  LATHE_CHECK(it != cs.tensors.end(), "{}: field 'tensors.{}' is missing", sp, file);
  std::set<std::string> listed;
  for (const CheckpointTensor& t : it->second) {
    const io::StTensorInfo* info = st.find(t.name);
    LATHE_CHECK(info != nullptr, "{}: tensor '{}' listed in {} (field 'tensors.{}') is missing from the file",
                st.path(), t.name, sp, file);
    if (t.flat) {
      LATHE_CHECK(allow_flat, "{}: tensor '{}' is listed in {} as a flat piece; only optimizer files hold pieces",
                  st.path(), t.name, sp);
      LATHE_CHECK(info->shape == Shape{t.flat_end - t.flat_begin},
                  "{}: tensor '{}' has shape {} but {} records the piece [{}, {}) of its flattened tensor", st.path(),
                  t.name, shape_str(info->shape), sp, t.flat_begin, t.flat_end);
      listed.insert(t.name);
      continue;
    }
    LATHE_CHECK(t.global_shape == info->shape, "{}: tensor '{}' has shape {} but {} records global shape {}", st.path(),
                t.name, shape_str(info->shape), sp, shape_str(t.global_shape));
    bool whole = true;
    std::string slice;
    for (size_t d = 0; d < t.slice.size(); ++d) {
      whole = whole && t.slice[d].first == 0 && t.slice[d].second == t.global_shape[d];
      slice += fmt::format("{}[{}, {}]", d ? ", " : "", t.slice[d].first, t.slice[d].second);
    }
    LATHE_CHECK(whole,
                "{}: tensor '{}' holds the slice [{}] of a sharded checkpoint; reassembling shards is not "
                "implemented yet",
                st.path(), t.name, slice);
    listed.insert(t.name);
  }
  for (const auto& t : st.tensors())
    LATHE_CHECK(listed.count(t.name) || is_pad(t.name),
                "{}: field 'tensors.{}' does not list tensor '{}' of the file (the table and the file disagree)", sp,
                file, t.name);
}

// Copies every parameter-shaped tensor "<prefix><param name>" of `path` into flat[P]. Every value
// must be finite (a NaN weight or moment would poison the first step), and second moments >= 0
// (their square root is taken).
void load_flat(const io::SafetensorsFile& st, const Model& model, const std::string& prefix, float* flat,
               std::set<std::string>* used) {
  const std::string& path = st.path();
  const bool nonneg = prefix == "exp_avg_sq/";
  for (const ParamSpec& s : model.params().specs()) {
    const std::string name = prefix + s.name;
    const io::StTensorInfo* info = st.find(name);
    LATHE_CHECK(info != nullptr,
                "{}: tensor '{}' is missing (the checkpoint was written for another model; its recipe is in "
                "recipe.yaml beside it)",
                path, name);
    LATHE_CHECK(info->dtype == DType::F32 && info->dtype_supported, "{}: tensor '{}' has dtype {}, expected F32", path,
                name, info->dtype_code);
    LATHE_CHECK(info->shape == s.shape,
                "{}: tensor '{}' has shape {} but the model expects {} (the checkpoint was written for another "
                "model configuration)",
                path, name, shape_str(info->shape), shape_str(s.shape));
    float* dst = flat + s.offset;
    st.read_f32(*info, dst);
    const int64_t n = s.numel();
    for (int64_t i = 0; i < n; ++i)
      if (!std::isfinite(dst[i]) || (nonneg && dst[i] < 0))
        throw_error(
            "{}: tensor '{}' holds {} at element {}{} (the checkpoint is damaged or the run had diverged; "
            "resume from an earlier checkpoint)",
            path, name, dst[i], i, nonneg ? " (second moments must be finite and >= 0)" : "");
    used->insert(name);
  }
}

// The moments of flat [m.begin, m.end) as checkpoint tensors "<moment>/<param name>": tensors
// inside the range whole with their shape, tensors cut by it as 1-D pieces of the flattened tensor.
std::vector<StTensor> moment_tensors(const Model& model, const MomentSlice& m) {
  std::vector<StTensor> ts;
  for (const auto& [bname, data] : m.buffers)
    for (const ParamSpec& s : model.params().specs()) {
      const size_t n = static_cast<size_t>(s.numel());
      const size_t lo = std::max(s.offset, m.begin), hi = std::min(s.offset + n, m.end);
      if (lo >= hi) continue;
      StTensor t{bname + "/" + s.name, s.shape, data + (lo - m.begin)};
      if (hi - lo != n) {
        t.flat = true;
        t.global_shape = s.shape;
        t.flat_begin = static_cast<int64_t>(lo - s.offset);
        t.flat_end = static_cast<int64_t>(hi - s.offset);
        t.shape = {static_cast<int64_t>(hi - lo)};
      }
      ts.push_back(std::move(t));
    }
  return ts;
}

// Reads the moments of flat [m.begin, m.end) from the checkpoint's optimizer file(s), whatever
// layout wrote them: each listed tensor or piece is mapped to its flat range [offset + a, offset + b)
// and the overlap with the wanted range is copied. Before reading, the tables of all files must
// cover every moment of every parameter exactly once (no gap, no overlap), so a lost or doubled
// shard is an error, never zeros. Values must be finite (second moments >= 0).
void load_moments(const std::string& dir, const CheckpointState& st, const Model& model, const MomentSlice& m) {
  const std::string sp = state_path(dir);
  std::vector<std::string> files;
  for (const CheckpointFile& cf : st.files)
    if (is_optim_file(cf.name)) files.push_back(cf.name);
  LATHE_CHECK(!files.empty(),
              "{}: no optimizer state in this checkpoint (it was saved without one); resuming needs the moments",
              (fs::path(dir) / kOptimFile).string());
  std::set<std::string> moments;
  for (const auto& b : m.buffers) moments.insert(b.first);
  struct Piece {
    const ParamSpec* spec;
    int64_t a, b;
    const CheckpointTensor* t;
  };
  auto piece_of = [&](const std::string& file, const CheckpointTensor& t) {
    const std::string path = (fs::path(dir) / file).string();
    const size_t slash = t.name.find('/');
    const std::string moment = slash == std::string::npos ? std::string() : t.name.substr(0, slash);
    const ParamSpec* spec = slash == std::string::npos ? nullptr : model.params().find(t.name.substr(slash + 1));
    LATHE_CHECK(moments.count(moment) && spec != nullptr,
                "{}: unexpected tensor '{}' (state of another optimizer or model? the checkpoint was written by '{}')",
                path, t.name, st.optimizer);
    LATHE_CHECK(t.global_shape == spec->shape,
                "{}: tensor '{}' has global shape {} but the model expects {} (the checkpoint was written for another "
                "model configuration)",
                path, t.name, shape_str(t.global_shape), shape_str(spec->shape));
    return t.flat ? Piece{spec, t.flat_begin, t.flat_end, &t} : Piece{spec, 0, spec->numel(), &t};
  };
  std::map<std::string, std::vector<std::pair<int64_t, int64_t>>> cover;
  for (const std::string& file : files) {
    auto it = st.tensors.find(file);
    LATHE_CHECK(it != st.tensors.end(), "{}: field 'tensors.{}' is missing", sp, file);
    for (const CheckpointTensor& t : it->second) {
      const Piece p = piece_of(file, t);
      cover[t.name].push_back({p.a, p.b});
    }
  }
  for (const std::string& moment : moments)
    for (const ParamSpec& s : model.params().specs()) {
      if (s.numel() == 0) continue;
      const std::string name = moment + "/" + s.name;
      auto& v = cover[name];
      std::sort(v.begin(), v.end());
      int64_t pos = 0;
      for (const auto& [a, b] : v) {
        LATHE_CHECK(a >= pos, "{}: elements [{}, {}) of '{}' are held by two optimizer files (the shards overlap)", sp,
                    a, std::min(b, pos), name);
        LATHE_CHECK(a == pos, "{}: elements [{}, {}) of '{}' are in no optimizer file (a shard is missing)", sp, pos, a,
                    name);
        pos = b;
      }
      LATHE_CHECK(pos == s.numel(), "{}: elements [{}, {}) of '{}' are in no optimizer file (a shard is missing)", sp,
                  pos, s.numel(), name);
    }
  std::map<std::string, float*> dst;
  for (const auto& [bname, data] : m.buffers) dst[bname] = data;
  for (const std::string& file : files) {
    io::SafetensorsFile f((fs::path(dir) / file).string());
    check_slices(st, file, f, sp, true);
    for (const CheckpointTensor& t : st.tensors.at(file)) {
      const Piece p = piece_of(file, t);
      const size_t g0 = p.spec->offset + static_cast<size_t>(p.a), g1 = p.spec->offset + static_cast<size_t>(p.b);
      const size_t lo = std::max(g0, m.begin), hi = std::min(g1, m.end);
      if (lo >= hi) continue;
      const io::StTensorInfo* info = f.find(t.name);
      LATHE_CHECK(info->dtype == DType::F32 && info->dtype_supported, "{}: tensor '{}' has dtype {}, expected F32",
                  f.path(), t.name, info->dtype_code);
      const std::string moment = t.name.substr(0, t.name.find('/'));
      float* out = dst.at(moment) + (lo - m.begin);
      std::memcpy(out, static_cast<const char*>(f.data(*info)) + (lo - g0) * sizeof(float), (hi - lo) * sizeof(float));
      const bool nonneg = moment == "exp_avg_sq";
      for (size_t i = 0; i < hi - lo; ++i)
        if (!std::isfinite(out[i]) || (nonneg && out[i] < 0))
          throw_error(
              "{}: tensor '{}' holds {} at element {}{} (the checkpoint is damaged or the run had diverged; "
              "resume from an earlier checkpoint)",
              f.path(), t.name, out[i], static_cast<size_t>(p.a) + (lo - g0) + i,
              nonneg ? " (second moments must be finite and >= 0)" : "");
    }
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------------

void wait_for_checkpoint_cleanup() { cleaner().join(); }

std::vector<std::pair<int64_t, std::string>> list_checkpoints(const std::string& run_dir) {
  std::vector<std::pair<int64_t, std::string>> out;
  const fs::path root = fs::path(run_dir) / "checkpoints";
  std::error_code ec;
  const bool is_dir = fs::is_directory(root, ec);
  if (ec && ec != std::errc::no_such_file_or_directory)
    throw_error("{}: cannot read the checkpoint directory: {} (fix or remove it; output.dir is {})", root.string(),
                ec.message(), run_dir);
  if (!is_dir) {
    LATHE_CHECK(!present(root.string()), "{}: is not a directory (output.dir {} holds a file named checkpoints)",
                root.string(), run_dir);
    return out;
  }
  fs::directory_iterator dit(root, ec);
  if (ec) throw_error("{}: cannot list the checkpoint directory: {}", root.string(), ec.message());
  for (const auto& e : dit) {
    const int64_t s = parse_step_name(e.path().filename().string());
    std::error_code ec2;  // an entry that cannot be stat'ed (a symlink loop) is not a checkpoint
    if (s >= 0 && e.is_directory(ec2)) out.push_back({s, e.path().string()});
  }
  std::sort(out.begin(), out.end());
  return out;
}

namespace {
// keep_last, and whether the newest healthy checkpoint survives it (anomaly rollback on).
struct Retention {
  int keep_last = 0;
  bool keep_healthy = false;
};

// Collective over `group` when it is given (every rank calls it; rank 0 owns the directory).
// Or offline (`offline` set, no group): one process writes every part of offline->parts, as the
// ranks of a run would have written them, with canonical file layouts.
void save_checkpoint_impl(const std::string& run_dir, const Model& model, const MomentSlice* moments,
                          const CheckpointState& st, Retention keep, CheckpointSaveInfo* info,
                          dist::Communicator* group, const OfflineCheckpoint* offline = nullptr) {
  const int keep_last = keep.keep_last;
  const auto t_start = std::chrono::steady_clock::now();
  if (info) *info = {};
  const int rank = group ? group->rank() : 0, world = group ? group->size() : 1;
  const fs::path root = fs::path(run_dir) / "checkpoints";
  const std::string name = step_name(st.step);
  const fs::path final_dir = root / name, tmp = root / (name + ".tmp");
  if (rank == 0) {
    fs::create_directories(root);
    wait_for_checkpoint_cleanup();  // the previous save's removals touch the same directory
    // Leftovers of interrupted saves (ours or a killed process's) are never complete checkpoints.
    for (const auto& e : fs::directory_iterator(root)) {
      const std::string n = e.path().filename().string();
      if (n.size() > 4 && n.compare(n.size() - 4, 4, ".tmp") == 0) fs::remove_all(e.path());
    }
    fs::create_directories(tmp);
  }
  if (group) group->barrier();  // tmp/ exists for every rank (output.dir is one shared directory)

  json files = json::object(), tensors = json::object();
  // Rank 0 writes the model file on a second thread while this one writes the optimizer file: two
  // streams keep the disk busier and spread the copies over two cores. Parameters are replicated
  // across data-parallel ranks, so one copy is written.
  std::vector<StTensor> model_ts;
  std::future<std::pair<json, json>> model_job;
  if (rank == 0) {
    for (const ParamSpec& s : model.params().specs())
      model_ts.push_back({s.name, s.shape, model.param_data() + s.offset});
    model_job = std::async(std::launch::async,
                           [&] { return write_st((tmp / kModelFile).string(), model_ts, offline != nullptr); });
  }
  if (offline) {
    const int64_t n = static_cast<int64_t>(offline->parts.size());
    for (int64_t r = 0; r < n; ++r) {
      const std::string file = offline->shard_files ? optim_shard_file(r, n) : std::string(kOptimFile);
      auto [f, t] =
          write_st((tmp / file).string(), moment_tensors(model, offline->parts[static_cast<size_t>(r)]), true);
      files[file] = f;
      tensors[file] = t;
    }
  }
  // Every rank writes the moments of its flat range; one process writes them all in optimizer.safetensors.
  json mine = json::object();
  if (moments) {
    const std::string file = group ? optim_shard_file(rank, world) : std::string(kOptimFile);
    auto [f, t] = write_st((tmp / file).string(), moment_tensors(model, *moments));
    mine = {{"file", file}, {"entry", f}, {"tensors", t}};
  }
  if (group) {
    // Rank 0 learns every shard's size, checksum and tensor table (the others only wait).
    const std::string text = mine.dump();
    std::vector<int64_t> lens(static_cast<size_t>(world));
    int64_t len = static_cast<int64_t>(text.size());
    group->all_gather(&len, lens.data(), std::vector<size_t>(static_cast<size_t>(world), 1), DType::I64);
    std::vector<size_t> counts(lens.begin(), lens.end());
    std::string all(std::accumulate(counts.begin(), counts.end(), size_t{0}), '\0');
    group->all_gather(text.data(), all.data(), counts, DType::U8);
    if (rank == 0) {
      size_t off = 0;
      for (size_t r = 0; r < counts.size(); ++r) {
        const json j = json::parse(all.substr(off, counts[r]));
        off += counts[r];
        if (j.contains("file")) {
          files[j["file"].get<std::string>()] = j["entry"];
          tensors[j["file"].get<std::string>()] = j["tensors"];
        }
      }
    }
  } else if (moments) {
    files[kOptimFile] = mine["entry"];
    tensors[kOptimFile] = mine["tensors"];
  }
  test_sleep();  // a test kills a rank here: its shard is written, the checkpoint not yet published
  if (rank != 0) {
    group->barrier();  // until rank 0 has published the checkpoint (or the job ends on its error)
    return;
  }
  std::string opt_name = moments || (offline && !offline->parts.empty()) ? st.optimizer : std::string();
  {
    auto [f, t] = model_job.get();
    files[kModelFile] = f;
    tensors[kModelFile] = t;
    test_sleep();
  }
  {
    HashedWriter w((tmp / kRecipeFile).string());
    const std::string text =
        "# resolved recipe of this checkpoint (JSON, which is valid YAML)\n" + st.recipe.dump(2) + "\n";
    w.write(text.data(), text.size());
    files[kRecipeFile] = w.commit();
    test_sleep();
  }
  json loader = {{"epoch", st.loader.epoch}, {"position", st.loader.position}};
  if (!st.blend_taken.empty()) loader["blend"] = {{"taken", st.blend_taken}, {"plan_xxh64", st.blend_plan_xxh64}};
  json body = {{"format", kFormat},
               {"format_version", kFormatVersion},
               {"lathe_version", st.lathe_version.empty() ? std::string(LATHE_VERSION) : st.lathe_version},
               {"step", st.step},
               {"consumed_samples", st.consumed_samples},
               {"loader", loader},
               {"rng", st.rng},
               {"loss_scale", st.loss_scale},
               {"loss_scale_dynamic", st.loss_scale_dynamic},
               {"loss_scale_good_steps", st.loss_scale_good_steps},
               {"skipped_steps", st.skipped_steps},
               {"consecutive_skipped_steps", st.consecutive_skipped_steps},
               {"lr", st.lr},
               {"threads", st.threads},
               {"optimizer", opt_name},
               {"recipe", st.recipe},
               {"world",
                {{"world_size", offline && offline->shard_files ? static_cast<int64_t>(offline->parts.size()) : world},
                 {"rank", 0}}},
               {"files", files},
               {"tensors", tensors}};
  if (st.has_health) {  // non-finite values are null (JSON has no NaN)
    auto fin = [](double x) { return std::isfinite(x) ? json(x) : json(nullptr); };
    body["health"] = {{"loss", fin(st.health.loss)},
                      {"grad_norm", fin(st.health.grad_norm)},
                      {"anomalies", st.health.anomalies},
                      {"healthy", st.health.healthy}};
  }
  if (st.has_anomaly) body["anomaly"] = anomaly_state_to_json(st.anomaly);
  const std::string text = body.dump();
  json doc = {{"body", body}, {"body_xxh64", hex64(Xxh64::hash(text.data(), text.size()))}};
  io::atomic_write_file((tmp / kStateFile).string(), doc.dump() + "\n");
  io::fsync_dir(tmp.string());
  test_sleep();

  // Into place. A checkpoint of the same step that this save did not write (another timeline's)
  // is moved aside, never deleted: step_X.abandoned-<unix time>[-N] (no .tmp suffix, so no later
  // save's cleanup removes it, and no step name, so no resume picks it).
  if (fs::exists(fs::symlink_status(final_dir))) {
    fs::path aside = root / (name + fmt::format(".abandoned-{}", static_cast<int64_t>(std::time(nullptr))));
    for (int n = 2; fs::exists(fs::symlink_status(aside)); ++n)
      aside = root / (name + fmt::format(".abandoned-{}-{}", static_cast<int64_t>(std::time(nullptr)), n));
    fs::rename(final_dir, aside);
    if (info) info->moved_aside = aside.string();
  }
  fs::rename(tmp, final_dir);
  io::fsync_dir(root.string());
  io::atomic_write_file((root / "latest").string(), name + "\n");
  if (group) group->barrier();  // the other ranks continue once the checkpoint is complete

  if (info) {
    info->seconds_complete = seconds_since(t_start);
    for (auto& [n, f] : files.items()) info->bytes += f["bytes"].get<int64_t>();
  }
  if (keep_last > 0) {
    // Only checkpoints up to this one count; the newest keep_last of them survive.
    std::vector<std::string> older;
    for (auto& [s, dir] : list_checkpoints(run_dir))
      if (s < st.step) older.push_back(dir);
    const size_t keep_older = static_cast<size_t>(keep_last - 1);
    // Anomaly rollback needs a healthy checkpoint: the newest one recorded healthy is kept beyond
    // keep_last while the new one is not healthy (it is the rollback target).
    std::string healthy;
    if (keep.keep_healthy && !(st.has_health && st.health.healthy))
      for (auto it = older.rbegin(); it != older.rend() && healthy.empty(); ++it) try {
          const CheckpointState c = read_checkpoint_state(*it);
          if (c.has_health && c.health.healthy) healthy = *it;
        } catch (const Error&) {  // not a rollback target either
        }
    std::vector<fs::path> doomed;
    for (size_t i = 0; i + keep_older < older.size(); ++i) {
      if (older[i] == healthy) continue;
      // Renamed first (atomic), so a crash mid-delete leaves a *.tmp leftover, never a step_X that
      // looks like a damaged checkpoint. Freeing GBs of extents takes a while: a background
      // thread does it while training continues.
      doomed.push_back(older[i] + ".deleting.tmp");
      fs::rename(older[i], doomed.back());
    }
    if (!doomed.empty()) cleaner().start(std::move(doomed));
  }
  if (info) info->seconds_total = seconds_since(t_start);
}
}  // namespace

MomentSlice moment_slice(optim::Optimizer& opt, size_t buffer_begin, size_t begin, size_t end) {
  MomentSlice m;
  m.begin = begin;
  m.end = end;
  for (auto& [bname, buf] : opt.state_buffers()) {
    LATHE_CHECK(begin >= buffer_begin && end >= begin && end - buffer_begin <= buf->size(),
                "internal: moments [{}, {}) are not inside optimizer state '{}' of {} floats starting at {}", begin,
                end, bname, buf->size(), buffer_begin);
    m.buffers.push_back({bname, buf->data() + (begin - buffer_begin)});
  }
  return m;
}

namespace {
void save_guarded(const std::string& run_dir, const Model& model, const MomentSlice* moments, const CheckpointState& st,
                  Retention keep, CheckpointSaveInfo* info, dist::Communicator* group,
                  const OfflineCheckpoint* offline = nullptr) {
  try {
    save_checkpoint_impl(run_dir, model, moments, st, keep, info, group, offline);
  } catch (const fs::filesystem_error& e) {
    // Which checkpoint and where: the library message names only the failing operation.
    throw_error("saving the checkpoint of step {} under {}/checkpoints (output.dir): {}", st.step, run_dir, e.what());
  }
}
}  // namespace

void save_checkpoint(const std::string& run_dir, const Model& model, optim::Optimizer* opt, const CheckpointState& st,
                     int keep_last, CheckpointSaveInfo* info, bool keep_healthy) {
  const Retention keep{keep_last, keep_healthy};
  if (!opt) return save_guarded(run_dir, model, nullptr, st, keep, info, nullptr);
  for (auto& [bname, buf] : opt->state_buffers())
    LATHE_CHECK(buf->size() == model.num_params(),
                "internal: optimizer state '{}' has {} floats, the model {} parameters", bname, buf->size(),
                model.num_params());
  const MomentSlice m = moment_slice(*opt, 0, 0, model.num_params());
  save_guarded(run_dir, model, &m, st, keep, info, nullptr);
}

void save_checkpoint_sharded(const std::string& run_dir, const Model& model, const MomentSlice& mine,
                             const CheckpointState& st, int keep_last, CheckpointSaveInfo* info,
                             dist::Communicator& group, bool keep_healthy) {
  save_guarded(run_dir, model, &mine, st, Retention{keep_last, keep_healthy}, info, &group);
}

void save_checkpoint_offline(const std::string& run_dir, const Model& model, const OfflineCheckpoint& parts,
                             const CheckpointState& st, CheckpointSaveInfo* info) {
  LATHE_CHECK(parts.shard_files || parts.parts.size() <= 1, "internal: {} optimizer parts need per-rank shard files",
              parts.parts.size());
  save_guarded(run_dir, model, nullptr, st, Retention{}, info, nullptr, &parts);
}

void load_checkpoint_moments(const std::string& ckpt_dir, const Model& model, const MomentSlice& slice) {
  require_checkpoint_dir(ckpt_dir);
  load_moments(ckpt_dir, read_state(ckpt_dir), model, slice);
}

CheckpointState read_checkpoint_state(const std::string& ckpt_dir) {
  require_checkpoint_dir(ckpt_dir);
  return read_state(ckpt_dir);
}

void verify_checkpoint(const std::string& ckpt_dir) {
  require_checkpoint_dir(ckpt_dir);
  verify_files(ckpt_dir, read_state(ckpt_dir));
}

namespace {
// What checkpoints/latest says, checked: "" when it is absent or names the step_XXXXXXXX directory
// `newest`; otherwise a note saying why it is ignored. It is never followed as a path: the scan of
// step_XXXXXXXX directories decides (see find_latest_checkpoint).
std::string latest_note(const fs::path& root, const std::string& newest) {
  const fs::path p = root / "latest";
  if (!present(p.string())) return "";
  std::string text;
  try {
    text = io::read_file(p.string());
  } catch (const Error& e) {
    return fmt::format("ignored {}: {}", p.string(), e.what());
  }
  std::string name = text.size() > 64 ? text.substr(0, 64) : text;
  while (!name.empty() && (name.back() == '\n' || name.back() == '\r' || name.back() == ' ')) name.pop_back();
  const std::string shown = io::json_excerpt(nlohmann::json(name), 70);  // quoted, bounded, bytes escaped
  if (parse_step_name(name) < 0)
    return fmt::format(
        "ignored {}: it holds {}, not the name of a step_XXXXXXXX directory inside checkpoints/ (lathe "
        "never follows it as a path; the newest complete checkpoint is found by scanning)",
        p.string(), shown);
  if (name != fs::path(newest).filename().string())
    return fmt::format(
        "ignored {}: it names {} but the newest complete checkpoint is {} (a save or a cleanup was "
        "interrupted; the scan decides)",
        p.string(), shown, newest.empty() ? std::string("(none)") : fs::path(newest).filename().string());
  return "";
}
}  // namespace

std::string find_latest_checkpoint(const std::string& run_dir, std::string* log) {
  auto note = [&](const std::string& s) {
    if (log) *log += s + "\n";
  };
  const fs::path root = fs::path(run_dir) / "checkpoints";
  auto all = list_checkpoints(run_dir);  // an unreadable checkpoints/ is an error, not "none"
  std::error_code ec;
  if (fs::is_directory(root, ec))
    for (const auto& e : fs::directory_iterator(root, ec)) {
      const std::string n = e.path().filename().string();
      if (n.size() > 4 && n.compare(n.size() - 4, 4, ".tmp") == 0)
        note(fmt::format("ignoring {}: incomplete (a save was interrupted)", e.path().string()));
    }
  std::string found, refused;
  for (auto it = all.rbegin(); it != all.rend() && found.empty(); ++it) {
    try {
      verify_checkpoint(it->second);
      found = it->second;
    } catch (const Error& e) {
      note(fmt::format("skipping checkpoint {}: {}", it->second, e.what()));
      refused += fmt::format("\n  {}: {}", it->second, e.what());
    }
  }
  // Checkpoints exist but none can be resumed: neither a fresh start over them nor a guess.
  if (found.empty() && !all.empty())
    throw_error(
        "{}: none of the {} checkpoint{} can be resumed:{}\nRepair or restore one and resume it with --resume "
        "DIR, or move them aside yourself; a new run in this output.dir needs --overwrite (which moves the old "
        "run aside)",
        root.string(), all.size(), all.size() == 1 ? "" : "s", refused);
  const std::string ln = latest_note(root, found);
  if (!ln.empty()) note(ln);
  return found;
}

CheckpointState load_checkpoint(const std::string& ckpt_dir, Model& model, optim::Optimizer* opt) {
  require_checkpoint_dir(ckpt_dir);
  const std::string sp = state_path(ckpt_dir);
  CheckpointState st = read_state(ckpt_dir);
  verify_files(ckpt_dir, st);

  const std::string mpath = (fs::path(ckpt_dir) / kModelFile).string();
  {
    io::SafetensorsFile f(mpath);
    check_slices(st, kModelFile, f, sp);
    std::set<std::string> used;
    load_flat(f, model, "", model.param_data(), &used);
    for (const auto& t : f.tensors())
      LATHE_CHECK(used.count(t.name) || is_pad(t.name), "{}: unexpected tensor '{}' (not a parameter of this model)",
                  mpath, t.name);
    model.upload_params();  // a device-resident model computes from its backend copy (no-op on the CPU)
  }
  if (opt) {
    for (auto& [bname, buf] : opt->state_buffers())
      LATHE_CHECK(buf->size() == model.num_params(), "internal: optimizer state '{}' has {} floats, the model {}",
                  bname, buf->size(), model.num_params());
    load_moments(ckpt_dir, st, model, moment_slice(*opt, 0, 0, model.num_params()));
  }
  return st;
}

ModelConfig checkpoint_model_config(const std::string& ckpt_dir) {
  CheckpointState st = read_checkpoint_state(ckpt_dir);
  const std::string sp = state_path(ckpt_dir);
  LATHE_CHECK(st.recipe.is_object() && st.recipe.contains("model") && st.recipe["model"].is_object(),
              "{}: the saved recipe has no model section", sp);
  json m = st.recipe["model"];
  m.erase("init_from");
  return ModelConfig::from_hf_json(m, sp + " recipe", "model.", false);
}

}  // namespace lathe
