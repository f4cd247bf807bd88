#include "data/blend_cache.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/checked.h"
#include "core/error.h"
#include "core/timer.h"
#include "data/loader.h"
#include "io/fs.h"
#include "io/xxh64.h"

namespace lathe::data {

namespace fs = std::filesystem;

namespace {

constexpr char kMagic[8] = {'L', 'A', 'T', 'H', 'E', 'B', 'L', 'D'};
constexpr uint64_t kFormatVersion = 1;
// Bump when plan_blend's output for the same inputs changes (interleaving or permutation).
constexpr uint64_t kPlanAlgorithm = 1;
constexpr size_t kHeaderBytes = 8 + 4 * 8;

struct FileStamp {
  int64_t size = -1, mtime_ns = -1;
};
FileStamp stamp(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return {};
  return {static_cast<int64_t>(st.st_size),
          static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + static_cast<int64_t>(st.st_mtim.tv_nsec)};
}

// Reads exactly n bytes at `off` (pread loops over short reads); false at end of file or on error.
bool read_at(int fd, void* dst, size_t n, uint64_t off) {
  auto* p = static_cast<unsigned char*>(dst);
  while (n > 0) {
    const ssize_t got = ::pread(fd, p, n, static_cast<off_t>(off));
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return false;
    p += got;
    n -= static_cast<size_t>(got);
    off += static_cast<uint64_t>(got);
  }
  return true;
}

struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

}  // namespace

OpenedBlend open_blend(const std::vector<BlendEntryInput>& entries, int64_t seq_len) {
  LATHE_CHECK(!entries.empty(), "data.blend: no datasets (give at least one {{prefix, weight}} entry)");
  OpenedBlend ob;
  for (size_t i = 0; i < entries.size(); ++i) {
    const auto& e = entries[i];
    std::shared_ptr<const IndexedDataset> ds;
    try {
      ds = std::make_shared<const IndexedDataset>(e.prefix);
    } catch (const Error& err) {
      throw_error("data.blend[{}].prefix {}: {} (fix the prefix: the path of PREFIX.bin/.idx without the extension)", i,
                  e.prefix, err.what());
    }
    if (i > 0 && ds->dtype() != ob.datasets[0]->dtype())
      throw_error(
          "data.blend[{}].prefix {}: token dtype {} differs from data.blend[0] {} ({}); the datasets of a blend come "
          "from one tokenizer: re-tokenize them with the same tokenizer (lathe tokenize picks the dtype from its "
          "vocabulary size)",
          i, e.prefix, dtype_name(ds->dtype()), entries[0].prefix, dtype_name(ob.datasets[0]->dtype()));
    // One dataset twice (however its path is spelled) would repeat its samples: refused, both named.
    std::error_code ec;
    const fs::path bin = fs::weakly_canonical(fs::absolute(e.prefix + ".bin", ec), ec);
    for (size_t j = 0; j < i && !ec; ++j) {
      std::error_code ec2;
      if (fs::equivalent(bin, fs::path(entries[j].prefix + ".bin"), ec2) && !ec2)
        throw_error(
            "data.blend[{}].prefix {} is the same dataset as data.blend[{}].prefix {} ({}): its samples would be "
            "planned twice and repeat; merge the two entries into one (with the sum of their weights)",
            i, e.prefix, j, entries[j].prefix, bin.string());
    }
    const int64_t n = num_samples(ds->total_tokens(), seq_len);
    LATHE_CHECK(n >= 1,
                "data.blend[{}].prefix {}: {} tokens give no sample of training.seq_len {} (a sample needs seq_len + 1 "
                "tokens); remove the entry or use more data",
                i, e.prefix, ds->total_tokens(), seq_len);
    ob.sources.push_back({e.prefix, e.weight, n, e.epochs});
    ob.datasets.push_back(std::move(ds));
  }
  return ob;
}

uint64_t blend_inputs_hash(const std::vector<BlendSource>& sources, int64_t seq_len, uint64_t seed, int64_t total) {
  nlohmann::json j = {{"algorithm", kPlanAlgorithm}, {"seq_len", seq_len}, {"seed", seed}, {"total", total}};
  nlohmann::json src = nlohmann::json::array();
  for (const auto& s : sources) {
    std::error_code ec;
    fs::path abs = fs::absolute(s.name, ec);
    const std::string p = ec ? s.name : abs.lexically_normal().string();
    const FileStamp idx = stamp(s.name + ".idx"), bin = stamp(s.name + ".bin");
    // Doubles as their exact bits: 0.1 and 0.1000000000000001 are different inputs.
    uint64_t wbits = 0, ebits = 0;
    std::memcpy(&wbits, &s.weight, 8);
    std::memcpy(&ebits, &s.max_epochs, 8);
    src.push_back({{"prefix", p},
                   {"weight", wbits},
                   {"epochs", ebits},
                   {"samples", s.samples},
                   {"idx", {idx.size, idx.mtime_ns}},
                   {"bin", {bin.size, bin.mtime_ns}}});
  }
  j["sources"] = src;
  const std::string text = j.dump();
  return io::Xxh64::hash(text.data(), text.size());
}

std::string blend_cache_path(const std::string& cache_dir, uint64_t inputs_hash) {
  return (fs::path(cache_dir) / fmt::format("blend-{}.bin", io::hex64(inputs_hash))).string();
}

std::shared_ptr<BlendPlan> read_blend_cache(const std::string& path, uint64_t inputs_hash,
                                            const std::vector<BlendSource>& sources, int64_t total, std::string* why) {
  auto fail = [&](const std::string& w) -> std::shared_ptr<BlendPlan> {
    *why = w;
    return nullptr;
  };
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return fail("no cache file");
  if (!S_ISREG(st.st_mode)) return fail("not a regular file");
  const uint64_t D = sources.size(), N = static_cast<uint64_t>(total);
  // Expected size from the inputs (overflow-checked: the total comes from the recipe).
  const int64_t want = checked_add(static_cast<int64_t>(kHeaderBytes + 8 + 8 * D),
                                   checked_mul(total, 12, "blend cache size"), "blend cache size");
  if (static_cast<int64_t>(st.st_size) != want)
    return fail(fmt::format("{} bytes, expected {} (truncated or for other inputs)", st.st_size, want));
  Fd f;
  f.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (f.fd < 0) return fail(std::strerror(errno));
  io::Xxh64 h;
  unsigned char head[kHeaderBytes];
  if (!read_at(f.fd, head, sizeof(head), 0)) return fail("cannot read the header");
  h.update(head, sizeof(head));
  uint64_t fields[4];
  std::memcpy(fields, head + 8, sizeof(fields));
  if (std::memcmp(head, kMagic, 8) != 0) return fail("not a lathe blend plan (bad magic)");
  if (fields[0] != kFormatVersion) return fail(fmt::format("format version {}", fields[0]));
  if (fields[1] != inputs_hash) return fail("written for other inputs");
  if (fields[2] != D || fields[3] != N)
    return fail(fmt::format("{} datasets x {} samples, expected {} x {}", fields[2], fields[3], D, N));
  auto p = std::make_shared<BlendPlan>();
  p->taken.resize(D);
  p->dataset.resize(N);
  p->sample.resize(N);
  uint64_t off = kHeaderBytes;
  auto load = [&](void* dst, size_t n) {
    if (!read_at(f.fd, dst, n, off)) return false;
    h.update(dst, n);
    off += n;
    return true;
  };
  if (!load(p->taken.data(), D * 8) || !load(p->dataset.data(), N * 4) || !load(p->sample.data(), N * 8))
    return fail("truncated while reading");
  uint64_t stored = 0;
  if (!read_at(f.fd, &stored, 8, off)) return fail("no checksum");
  if (stored != h.digest()) return fail("checksum mismatch (corrupt)");
  // The checksum proves the bytes are what was written; the ranges prove they fit these datasets.
  std::vector<int64_t> count(D, 0);
  for (uint64_t k = 0; k < N; ++k) {
    const uint32_t d = p->dataset[k];
    if (d >= D || p->sample[k] < 0 || p->sample[k] >= sources[d].samples)
      return fail(fmt::format("entry {} out of range", k));
    ++count[d];
  }
  if (count != p->taken) return fail("per-dataset counts disagree with the entries");
  p->epochs.resize(D);
  for (uint64_t i = 0; i < D; ++i)
    p->epochs[i] = static_cast<double>(p->taken[i]) / static_cast<double>(sources[i].samples);
  return p;
}

void write_blend_cache(const std::string& path, uint64_t inputs_hash, const BlendPlan& plan) {
  // Written to PATH.PID (its temporary PATH.PID.tmp) and renamed to PATH: a writer killed midway
  // leaves files whose PID names no live process, which the next writer removes
  // (remove_stale_blend_files).
  const std::string staged = fmt::format("{}.{}", path, ::getpid());
  io::AtomicFileWriter w(staged);
  io::Xxh64 h;
  auto put = [&](const void* p, size_t n) {
    w.write(p, n);
    h.update(p, n);
  };
  const uint64_t fields[4] = {kFormatVersion, inputs_hash, plan.taken.size(), plan.dataset.size()};
  put(kMagic, 8);
  put(fields, sizeof(fields));
  put(plan.taken.data(), plan.taken.size() * 8);
  put(plan.dataset.data(), plan.dataset.size() * 4);
  put(plan.sample.data(), plan.sample.size() * 8);
  const uint64_t sum = h.digest();
  w.write(&sum, 8);
  w.commit();
  if (std::rename(staged.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(staged.c_str());
    throw_error(
        "{}: cannot rename the new blend plan {} into place: {} (remove what is at {}, or fix the directory's "
        "permissions)",
        path, staged, std::strerror(err), path);
  }
}

namespace {

// "blend-" + 16 hex digits + ".bin": a plan file.
bool is_plan_name(const std::string& n) {
  if (n.size() != 26 || n.rfind("blend-", 0) != 0 || n.substr(22) != ".bin") return false;
  return std::all_of(n.begin() + 6, n.begin() + 22,
                     [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
}

// A writer's leftover: PLAN.PID, PLAN.PID.tmp, or PLAN.tmp (lathe before PIDs were in the name;
// no lathe writes it now). Sets *pid (0 for PLAN.tmp). False for other names.
bool is_temp_name(const std::string& n, long* pid) {
  if (n.size() <= 26 || !is_plan_name(n.substr(0, 26)) || n[26] != '.') return false;
  std::string rest = n.substr(27);
  if (rest == "tmp") {
    *pid = 0;
    return true;
  }
  if (rest.size() > 4 && rest.substr(rest.size() - 4) == ".tmp") rest.resize(rest.size() - 4);
  if (rest.empty() || rest.size() > 10 ||
      !std::all_of(rest.begin(), rest.end(), [](char c) { return c >= '0' && c <= '9'; }))
    return false;
  *pid = std::stol(rest);
  return *pid > 0;
}

bool process_alive(long pid) {
  if (pid == static_cast<long>(::getpid())) return true;
  return ::kill(static_cast<pid_t>(pid), 0) == 0 || errno == EPERM;
}

}  // namespace

int remove_stale_blend_files(const std::string& cache_dir, const std::string& keep) {
  int removed = 0;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(cache_dir, ec)) {
    const std::string n = e.path().filename().string();
    long pid = 0;
    const bool stale = n != keep && (is_plan_name(n) || (is_temp_name(n, &pid) && (pid == 0 || !process_alive(pid))));
    std::error_code rec;
    if (stale && e.is_regular_file(rec) && fs::remove(e.path(), rec)) ++removed;
  }
  return removed;
}

CachedPlan cached_blend_plan(const std::vector<BlendSource>& sources, int64_t seq_len, uint64_t seed, int64_t total,
                             const std::string& cache_dir, bool write, const StopFn& stop) {
  CachedPlan c;
  const double t0 = now_seconds();
  const uint64_t hash = blend_inputs_hash(sources, seq_len, seed, total);
  std::string why = "no cache directory";
  if (!cache_dir.empty()) {
    c.path = blend_cache_path(cache_dir, hash);
    // What a write would trip over, refused before planning (and by `lathe check`, which never writes).
    std::error_code ec;
    const fs::file_status ds = fs::status(cache_dir, ec);
    LATHE_CHECK(!fs::exists(ds) || fs::is_directory(ds),
                "{}: the blend-plan cache directory is a {}, not a directory: remove it (lathe keeps the plan of the "
                "run's data.blend there)",
                cache_dir, fs::is_regular_file(ds) ? "file" : "special file");
    LATHE_CHECK(!fs::is_directory(fs::status(c.path, ec)),
                "{}: the blend-plan cache path is a directory, so the plan cannot be written there: remove it (lathe "
                "rebuilds the plan)",
                c.path);
    if (auto p = read_blend_cache(c.path, hash, sources, total, &why)) {
      c.plan = std::move(p);
      c.status = "reused";
      if (write) remove_stale_blend_files(cache_dir, fs::path(c.path).filename().string());
      c.seconds = now_seconds() - t0;
      return c;
    }
  }
  c.plan = std::make_shared<const BlendPlan>(plan_blend(sources, total, seed, stop));
  const bool existed = why != "no cache file" && why != "no cache directory";
  if (cache_dir.empty() || !write) {
    c.status = existed ? fmt::format("planned in memory (the cache {}: {})", c.path, why) : "planned in memory";
  } else {
    std::error_code ec;
    fs::create_directories(cache_dir, ec);
    if (ec)
      throw_error("{}: cannot create the blend-plan cache directory: {} (output.dir must be writable)", cache_dir,
                  ec.message());
    write_blend_cache(c.path, hash, *c.plan);
    c.status = existed ? fmt::format("rebuilt (the cache was unusable: {})", why) : "built";
    // Plans of earlier inputs (another seq_len, steps or changed prefixes) in this directory, and
    // the temporary files of writers that died.
    remove_stale_blend_files(cache_dir, fs::path(c.path).filename().string());
  }
  c.seconds = now_seconds() - t0;
  return c;
}

std::vector<int64_t> blend_taken_before(const BlendPlan& plan, int64_t position) {
  std::vector<int64_t> t(plan.taken.size(), 0);
  const int64_t n = std::min<int64_t>(position, static_cast<int64_t>(plan.dataset.size()));
  for (int64_t k = 0; k < n; ++k) ++t[plan.dataset[static_cast<size_t>(k)]];
  return t;
}

uint64_t blend_prefix_hash(const BlendPlan& plan, int64_t position) {
  const size_t n = static_cast<size_t>(std::clamp<int64_t>(position, 0, static_cast<int64_t>(plan.dataset.size())));
  io::Xxh64 h;
  h.update(plan.dataset.data(), n * 4);
  h.update(plan.sample.data(), n * 8);
  return h.digest();
}

}  // namespace lathe::data
