// Checkpoint format and save protocol (checkpoint.h): the data files' tensors and state.json
// tables, loading parameters and moments back (whole tensors or flat pieces of any number of
// shards), and the crash-safe save (tmp dir, fsync, rename, `latest`). Around it: the writers in
// io/safetensors.h (aligned mode) and io/direct_writer.h, state.json in checkpoint_state.cpp, the
// checkpoints/ directory (names, listing, leftovers, keep_last) in checkpoint_dir.cpp.
#include "train/checkpoint.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <future>
#include <map>
#include <numeric>
#include <set>
#include <thread>

#include "core/error.h"
#include "io/direct_writer.h"
#include "io/fs.h"
#include "io/safetensors.h"
#include "train/checkpoint_dir.h"
#include "train/checkpoint_format.h"

namespace lathe {

namespace fs = std::filesystem;
using json = nlohmann::json;

// ---------------------------------------------------------------------------------------------

namespace {

using namespace ckpt_format;

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// The test pause of a save (FaultPlan::checkpoint_pause_ms, passed in by the trainer).
void test_pause(int ms) {
  if (ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(ms));
}

struct StTensor {
  std::string name;
  Shape shape;
  const float* data;
  // A piece [flat_begin, flat_end) of a flattened tensor of shape global_shape (1-D `shape`).
  bool flat = false;
  Shape global_shape{};
  int64_t flat_begin = 0, flat_end = 0;
};

json file_entry(const io::WrittenFile& f) { return {{"bytes", f.bytes}, {"xxh64", hex64(f.xxh64)}}; }

// A data file (fp32 safetensors, io's aligned mode: Addresses for a run's zero-copy O_DIRECT
// writes, Canonical for offline writers) written in one pass with its checksum. Returns {state.json
// "files" entry, "tensors" entries}; the alignment pads are not listed.
std::pair<json, json> write_data_file(const std::string& path, const std::vector<StTensor>& ts, io::StAlign align) {
  std::vector<io::StWriteEntry> entries;
  json tensors = json::array();
  for (const StTensor& t : ts) {
    entries.push_back({t.name, DType::F32, t.shape, t.data});
    if (t.flat) {
      tensors.push_back({{"name", t.name},
                         {"dtype", "F32"},
                         {"global_shape", json(t.global_shape)},
                         {"flat", {t.flat_begin, t.flat_end}}});
      continue;
    }
    json slice = json::array();
    for (int64_t d : t.shape) slice.push_back({0, d});
    tensors.push_back({{"name", t.name}, {"dtype", "F32"}, {"global_shape", json(t.shape)}, {"slice", slice}});
  }
  return {file_entry(io::write_safetensors_aligned(path, entries, align, {{"lathe_layout", "lathe"}})), tensors};
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
    LATHE_CHECK(listed.count(t.name) || io::is_st_pad(t.name),
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

// ---- the save protocol ---------------------------------------------------------------------

// keep_last, and whether the newest healthy checkpoint survives it (anomaly rollback on).
struct Retention {
  int keep_last = 0;
  bool keep_healthy = false;
  int pause_ms = 0;  // the test pause (save_checkpoint's pause_ms)
};

// Collective over `group` when it is given (every rank calls it; rank 0 owns the directory).
// Or offline (`offline` set, no group): one process writes every part of offline->parts, as the
// ranks of a run would have written them, with canonical file layouts.
void save_checkpoint_impl(const std::string& run_dir, const Model& model, const MomentSlice* moments,
                          const CheckpointState& st, Retention keep, CheckpointSaveInfo* info,
                          dist::Communicator* group, const OfflineCheckpoint* offline = nullptr) {
  const auto t_start = std::chrono::steady_clock::now();
  if (info) *info = {};
  const int rank = group ? group->rank() : 0, world = group ? group->size() : 1;
  const fs::path root = fs::path(run_dir) / "checkpoints";
  const std::string name = ckpt_dir::step_name(st.step);
  const fs::path final_dir = root / name, tmp = root / (name + ".tmp");
  if (rank == 0) {
    ckpt_dir::prepare_root(root);  // joins the previous save's removals, removes *.tmp leftovers
    fs::create_directories(tmp);
  }
  if (group) group->barrier();  // tmp/ exists for every rank (output.dir is one shared directory)

  json files = json::object(), tensors = json::object();
  // Rank 0 writes the model file on a second thread while this one writes the optimizer file: two
  // streams keep the disk busier and spread the copies over two cores. Parameters are replicated
  // across data-parallel ranks, so one copy is written.
  const io::StAlign align = offline ? io::StAlign::Canonical : io::StAlign::Addresses;
  std::vector<StTensor> model_ts;
  std::future<std::pair<json, json>> model_job;
  if (rank == 0) {
    for (const ParamSpec& s : model.params().specs())
      model_ts.push_back({s.name, s.shape, model.param_data() + s.offset});
    model_job =
        std::async(std::launch::async, [&] { return write_data_file((tmp / kModelFile).string(), model_ts, align); });
  }
  if (offline) {
    const int64_t n = static_cast<int64_t>(offline->parts.size());
    for (int64_t r = 0; r < n; ++r) {
      const std::string file = offline->shard_files ? optim_shard_file(r, n) : std::string(kOptimFile);
      auto [f, t] =
          write_data_file((tmp / file).string(), moment_tensors(model, offline->parts[static_cast<size_t>(r)]), align);
      files[file] = f;
      tensors[file] = t;
    }
  }
  // Every rank writes the moments of its flat range; one process writes them all in optimizer.safetensors.
  json mine = json::object();
  if (moments) {
    const std::string file = group ? optim_shard_file(rank, world) : std::string(kOptimFile);
    auto [f, t] = write_data_file((tmp / file).string(), moment_tensors(model, *moments), align);
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
  test_pause(keep.pause_ms);  // a test kills a rank here: its shard is written, the checkpoint not yet published
  if (rank != 0) {
    group->barrier();  // until rank 0 has published the checkpoint (or the job ends on its error)
    return;
  }
  std::string opt_name = moments || (offline && !offline->parts.empty()) ? st.optimizer : std::string();
  {
    auto [f, t] = model_job.get();
    files[kModelFile] = f;
    tensors[kModelFile] = t;
    test_pause(keep.pause_ms);
  }
  {
    io::DirectWriter w((tmp / kRecipeFile).string());
    const std::string text =
        "# resolved recipe of this checkpoint (JSON, which is valid YAML)\n" + st.recipe.dump(2) + "\n";
    w.write(text.data(), text.size());
    files[kRecipeFile] = file_entry(w.commit());
    test_pause(keep.pause_ms);
  }
  const int64_t world_size = offline && offline->shard_files ? static_cast<int64_t>(offline->parts.size()) : world;
  io::atomic_write_file((tmp / kStateFile).string(), state_json_text(st, opt_name, world_size, files, tensors));
  io::fsync_dir(tmp.string());
  test_pause(keep.pause_ms);

  // Into place. A checkpoint of the same step that this save did not write (another timeline's)
  // is moved aside, never deleted.
  const std::string aside = ckpt_dir::move_aside(root, name);
  if (info && !aside.empty()) info->moved_aside = aside;
  fs::rename(tmp, final_dir);
  io::fsync_dir(root.string());
  io::atomic_write_file((root / "latest").string(), name + "\n");
  if (group) group->barrier();  // the other ranks continue once the checkpoint is complete

  if (info) {
    info->seconds_complete = seconds_since(t_start);
    for (auto& [n, f] : files.items()) info->bytes += f["bytes"].get<int64_t>();
  }
  ckpt_dir::prune(run_dir, st.step, keep.keep_last, keep.keep_healthy && !(st.has_health && st.health.healthy));
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
                     int keep_last, CheckpointSaveInfo* info, bool keep_healthy, int pause_ms) {
  const Retention keep{keep_last, keep_healthy, pause_ms};
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
                             dist::Communicator& group, bool keep_healthy, int pause_ms) {
  save_guarded(run_dir, model, &mine, st, Retention{keep_last, keep_healthy, pause_ms}, info, &group);
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
      LATHE_CHECK(used.count(t.name) || io::is_st_pad(t.name),
                  "{}: unexpected tensor '{}' (not a parameter of this model)", mpath, t.name);
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
