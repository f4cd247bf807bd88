#include "train/reshard.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <set>

#include "core/error.h"
#include "core/stop_signal.h"
#include "dist/comm.h"
#include "io/fs.h"
#include "io/safetensors.h"
#include "optim/chunks.h"
#include "parallel/flat_shards.h"
#include "parallel/pipeline_schedule.h"
#include "parallel/tensor_parallel.h"
#include "train/checkpoint_dir.h"
#include "train/checkpoint_format.h"

namespace lathe {

namespace fs = std::filesystem;
using json = nlohmann::json;
using namespace ckpt_format;

namespace {

int64_t parallel_field(const json& recipe, const char* key, int64_t dflt) {
  if (!recipe.is_object() || !recipe.contains("parallel") || !recipe["parallel"].is_object()) return dflt;
  const json& p = recipe["parallel"];
  return p.contains(key) && p[key].is_number_integer() ? p[key].get<int64_t>() : dflt;
}

// Values must be finite (a NaN weight or moment would poison the first step) and second moments
// >= 0 (their square root is taken). `first` is the global element index of v[0].
void check_values(const std::string& dir, const std::string& name, const float* v, int64_t n, int64_t first) {
  const bool nonneg = name.rfind("exp_avg_sq/", 0) == 0;
  for (int64_t i = 0; i < n; ++i)
    if (!std::isfinite(v[i]) || (nonneg && v[i] < 0))
      throw_error(
          "{}: tensor '{}' holds {} at element {}{} (the checkpoint is damaged or the run had diverged; resume "
          "from an earlier checkpoint)",
          dir, name, v[i], first + i, nonneg ? " (second moments must be finite and >= 0)" : "");
}

}  // namespace

CheckpointLayout checkpoint_layout(const CheckpointState& st) {
  CheckpointLayout l;
  l.tensor = parallel_field(st.recipe, "tensor", 1);
  l.pipeline = parallel_field(st.recipe, "pipeline", 1);
  l.data = parallel_field(st.recipe, "data", 0);
  l.zero = parallel_field(st.recipe, "zero", 0);
  l.context = parallel_field(st.recipe, "context", 1);
  if (l.data <= 0) l.data = std::max<int64_t>(1, st.world_size / std::max<int64_t>(1, l.context));
  return l;
}

// ---- CheckpointPieces ----------------------------------------------------------------------

CheckpointPieces::~CheckpointPieces() = default;

CheckpointPieces::CheckpointPieces(const std::string& ckpt_dir) : dir_(ckpt_dir) {
  st_ = read_checkpoint_state(ckpt_dir);
  const std::string sp = state_path(ckpt_dir);
  for (const auto& [file, list] : st_.tensors) {
    const std::string path = (fs::path(ckpt_dir) / file).string();
    files_.push_back(std::make_unique<io::SafetensorsFile>(path));
    file_names_.push_back(file);
    const size_t fi = files_.size() - 1;
    const io::SafetensorsFile& f = *files_.back();
    std::set<std::string> listed;
    for (const CheckpointTensor& t : list) {
      const io::StTensorInfo* info = f.find(t.name);
      LATHE_CHECK(info != nullptr, "{}: tensor '{}' listed in {} (field 'tensors.{}') is missing from the file", path,
                  t.name, sp, file);
      LATHE_CHECK(info->dtype == DType::F32 && info->dtype_supported, "{}: tensor '{}' has dtype {}, expected F32",
                  path, t.name, info->dtype_code);
      listed.insert(t.name);
      auto [it, fresh] = index_.try_emplace(t.name);
      Entry& e = it->second;
      if (fresh) {
        e.shape = t.global_shape;
        names_.push_back(t.name);
      }
      LATHE_CHECK(e.shape == t.global_shape,
                  "{}: tensor '{}' is recorded with global shape {} in 'tensors.{}' but {} elsewhere (pieces of one "
                  "tensor must agree)",
                  sp, t.name, shape_str(t.global_shape), file, shape_str(e.shape));
      ++e.pieces;
      const char* base = static_cast<const char*>(f.data(*info));
      const int64_t total = numel(t.global_shape);
      if (t.flat) {
        LATHE_CHECK(info->shape == Shape{t.flat_end - t.flat_begin},
                    "{}: tensor '{}' has shape {} but {} records the piece [{}, {}) of its flattened tensor", path,
                    t.name, shape_str(info->shape), sp, t.flat_begin, t.flat_end);
        LATHE_CHECK(t.flat_begin >= 0 && t.flat_begin <= t.flat_end && t.flat_end <= total,
                    "{}: tensor '{}': the piece [{}, {}) is outside its {} elements", sp, t.name, t.flat_begin,
                    t.flat_end, total);
        if (t.flat_end > t.flat_begin) e.runs.push_back({t.flat_begin, t.flat_end, fi, base});
        continue;
      }
      // A box: one run per row of its last dimension, merged where global and file order agree.
      const size_t nd = t.global_shape.size();
      LATHE_CHECK(t.slice.size() == nd, "{}: tensor '{}': 'slice' has {} ranges for a {}-dimensional tensor", sp,
                  t.name, t.slice.size(), nd);
      Shape box(nd);
      for (size_t d = 0; d < nd; ++d) {
        const auto [a, b] = t.slice[d];
        LATHE_CHECK(0 <= a && a <= b && b <= t.global_shape[d],
                    "{}: tensor '{}': slice [{}, {}) of dimension {} is outside its size {}", sp, t.name, a, b, d,
                    t.global_shape[d]);
        box[d] = b - a;
      }
      LATHE_CHECK(info->shape == box, "{}: tensor '{}' has shape {} but {} records a slice of shape {}", path, t.name,
                  shape_str(info->shape), sp, shape_str(box));
      const int64_t n = numel(box);
      if (n == 0) continue;
      if (nd == 0) {
        e.runs.push_back({0, 1, fi, base});
        continue;
      }
      const int64_t row = box[nd - 1];
      std::vector<int64_t> gstride(nd, 1), idx(nd - 1, 0);
      for (size_t d = nd - 1; d-- > 0;) gstride[d] = gstride[d + 1] * t.global_shape[d + 1];
      for (int64_t local = 0; local < n; local += row) {
        int64_t g = t.slice[nd - 1].first;
        for (size_t d = 0; d + 1 < nd; ++d) g += (t.slice[d].first + idx[d]) * gstride[d];
        const char* src = base + static_cast<size_t>(local) * sizeof(float);
        Run* last = e.runs.empty() ? nullptr : &e.runs.back();
        if (last && last->file == fi && last->g1 == g &&
            last->src + static_cast<size_t>(last->g1 - last->g0) * sizeof(float) == src)
          last->g1 = g + row;
        else
          e.runs.push_back({g, g + row, fi, src});
        for (size_t d = nd - 1; d-- > 0;) {  // next row of the box (odometer over dims 0..nd-2)
          if (++idx[d] < box[d]) break;
          idx[d] = 0;
        }
      }
    }
    for (const auto& t : f.tensors())
      LATHE_CHECK(listed.count(t.name) || io::is_st_pad(t.name),
                  "{}: field 'tensors.{}' does not list tensor '{}' of the file (the table and the file disagree)", sp,
                  file, t.name);
  }
  for (auto& [name, e] : index_)
    std::sort(e.runs.begin(), e.runs.end(), [](const Run& a, const Run& b) { return a.g0 < b.g0; });
}

const Shape& CheckpointPieces::global_shape(const std::string& name) const {
  auto it = index_.find(name);
  LATHE_CHECK(it != index_.end(), "{}: no tensor '{}' in this checkpoint", state_path(dir_), name);
  return it->second.shape;
}

size_t CheckpointPieces::pieces(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? 0 : it->second.pieces;
}

void CheckpointPieces::check(const std::string& name, const Shape& expect) const {
  const std::string sp = state_path(dir_);
  auto it = index_.find(name);
  LATHE_CHECK(it != index_.end(),
              "{}: tensor '{}' is in no file of the checkpoint (it was written for another model or optimizer; its "
              "recipe is in recipe.yaml beside it)",
              sp, name);
  const Entry& e = it->second;
  LATHE_CHECK(e.shape == expect,
              "{}: tensor '{}' has global shape {} but the model expects {} (the checkpoint was written for another "
              "model configuration)",
              sp, name, shape_str(e.shape), shape_str(expect));
  int64_t pos = 0;
  const Run* prev = nullptr;
  for (const Run& r : e.runs) {
    LATHE_CHECK(r.g0 >= pos, "{}: elements [{}, {}) of '{}' are held by two pieces ({} and {}: the pieces overlap)", sp,
                r.g0, std::min(r.g1, pos), name, file_names_[prev->file], file_names_[r.file]);
    LATHE_CHECK(r.g0 == pos, "{}: elements [{}, {}) of '{}' are in no file of the checkpoint (a piece is missing)", sp,
                pos, r.g0, name);
    pos = r.g1;
    prev = &r;
  }
  LATHE_CHECK(pos == numel(e.shape),
              "{}: elements [{}, {}) of '{}' are in no file of the checkpoint (a piece is missing)", sp, pos,
              numel(e.shape), name);
}

void CheckpointPieces::read(const std::string& name, int64_t g, int64_t n, float* dst) const {
  auto it = index_.find(name);
  LATHE_CHECK(it != index_.end(), "{}: no tensor '{}' in this checkpoint", state_path(dir_), name);
  const std::vector<Run>& runs = it->second.runs;
  const int64_t end = g + n;
  // The first run that may hold g: the last one starting at or before it.
  auto r = std::upper_bound(runs.begin(), runs.end(), g, [](int64_t v, const Run& x) { return v < x.g0; });
  if (r != runs.begin()) --r;
  int64_t pos = g;
  for (; r != runs.end() && pos < end; ++r) {
    if (r->g1 <= pos) continue;
    LATHE_CHECK(r->g0 <= pos, "{}: elements [{}, {}) of '{}' are in no file of the checkpoint (a piece is missing)",
                state_path(dir_), pos, std::min(r->g0, end), name);
    const int64_t hi = std::min(r->g1, end);
    const size_t bytes = static_cast<size_t>(hi - pos) * sizeof(float);
    std::memcpy(dst + (pos - g), r->src + static_cast<size_t>(pos - r->g0) * sizeof(float), bytes);
    bytes_read_ += static_cast<int64_t>(bytes);
    pos = hi;
  }
  LATHE_CHECK(pos == end, "{}: elements [{}, {}) of '{}' are in no file of the checkpoint (a piece is missing)",
              state_path(dir_), pos, end, name);
}

// ---- loading a rank's share ----------------------------------------------------------------

void load_moments_sharded(const CheckpointPieces& ck, const ParamTable& global, const ParamTable& local, int rank,
                          int tp, const MomentSlice& slice) {
  const std::string sp = state_path(ck.dir());
  bool any = false;
  for (const CheckpointFile& cf : ck.state().files) any = any || is_optim_file(cf.name);
  LATHE_CHECK(any, "{}: no optimizer state in this checkpoint (it was saved without one); resuming needs the moments",
              (fs::path(ck.dir()) / kOptimFile).string());
  std::set<std::string> moments;
  for (const auto& b : slice.buffers) moments.insert(b.first);
  for (const std::string& name : ck.names()) {  // nothing the model does not have
    const size_t slash = name.find('/');
    if (slash == std::string::npos) continue;  // a weight
    LATHE_CHECK(moments.count(name.substr(0, slash)) && global.find(name.substr(slash + 1)) != nullptr,
                "{}: unexpected tensor '{}' (state of another optimizer or model? the checkpoint was written by '{}')",
                sp, name, ck.state().optimizer);
  }
  for (const auto& [moment, data] : slice.buffers)
    for (const ParamSpec& l : local.specs()) {
      const ParamSpec* g = global.find(l.name);
      LATHE_CHECK(g != nullptr, "internal: the rank's model has '{}', which the global model has not", l.name);
      const std::string name = moment + "/" + l.name;
      if (g->numel() == 0) continue;
      ck.check(name, g->shape);
      for (const parallel::SliceRun& r : parallel::shard_runs(*g, l, rank, tp)) {
        const size_t b = l.offset + static_cast<size_t>(r.local), e = b + static_cast<size_t>(r.count);
        const size_t lo = std::max(b, slice.begin), hi = std::min(e, slice.end);
        if (lo >= hi) continue;
        const int64_t first = r.global + static_cast<int64_t>(lo - b);
        float* out = data + (lo - slice.begin);
        ck.read(name, first, static_cast<int64_t>(hi - lo), out);
        check_values(ck.dir(), name, out, static_cast<int64_t>(hi - lo), first);
      }
    }
}

void load_weights_sharded(const CheckpointPieces& ck, const ParamTable& global, const ParamTable& local, int rank,
                          int tp, float* out) {
  for (const ParamSpec& l : local.specs()) {
    const ParamSpec* g = global.find(l.name);
    LATHE_CHECK(g != nullptr, "internal: the rank's model has '{}', which the global model has not", l.name);
    if (g->numel() == 0) continue;
    ck.check(l.name, g->shape);
    for (const parallel::SliceRun& r : parallel::shard_runs(*g, l, rank, tp)) {
      float* dst = out + l.offset + static_cast<size_t>(r.local);
      ck.read(l.name, r.global, r.count, dst);
      check_values(ck.dir(), l.name, dst, r.count, r.global);
    }
  }
}

void load_weights_range(const CheckpointPieces& ck, const ParamTable& table, size_t begin, size_t end, float* out) {
  for (const ParamSpec& s : table.specs()) {
    const size_t lo = std::max(begin, s.offset), hi = std::min(end, s.offset + static_cast<size_t>(s.numel()));
    if (lo >= hi) continue;
    ck.check(s.name, s.shape);
    ck.read(s.name, static_cast<int64_t>(lo - s.offset), static_cast<int64_t>(hi - lo), out + lo);
    check_values(ck.dir(), s.name, out + lo, static_cast<int64_t>(hi - lo), static_cast<int64_t>(lo - s.offset));
  }
}

// ---- offline resharding --------------------------------------------------------------------

void validate_layout(const ModelConfig& cfg, const CheckpointLayout& to) {
  constexpr int64_t kMaxRanks = int64_t{1} << 20;
  auto in_range = [](const char* opt, int64_t v, int64_t lo, int64_t hi, const char* why) {
    LATHE_CHECK(v >= lo && v <= hi, "{} {}: must be in [{}, {}]{}", opt, v, lo, hi, why);
  };
  in_range("--tensor", to.tensor, 1, kMaxRanks, "");
  in_range("--pipeline", to.pipeline, 1, kMaxRanks, "");
  in_range("--data", to.data, 1, kMaxRanks, "");
  in_range("--context", to.context, 1, kMaxRanks, "");
  in_range("--zero", to.zero, 0, 3,
           " (0: replicated optimizer, 1: sharded moments, 2: also gradients, 3: also weights)");
  LATHE_CHECK(to.zero != 3 || to.context == 1,
              "--zero 3 with --context {}: a run refuses ZeRO 3 with context parallelism; give --context 1, or "
              "--zero 2 or less",
              to.context);
  // Each degree is at most 2^20: the product of two fits in int64, checked before the next.
  LATHE_CHECK(
      to.tensor * to.pipeline <= kMaxRanks && to.tensor * to.pipeline * to.data <= kMaxRanks && to.world() <= kMaxRanks,
      "--tensor {} x --pipeline {} x --data {} x --context {} is more than {} ranks", to.tensor, to.pipeline, to.data,
      to.context, kMaxRanks);
  if (to.tensor > 1) {
    try {
      parallel::shard_config(cfg, static_cast<int>(to.tensor));
    } catch (const Error& e) {
      throw_error("--tensor {}: {}", to.tensor, e.what());
    }
  }
  if (to.pipeline > 1) {
    try {
      pipeline::assign_layers(cfg.num_hidden_layers, to.pipeline, 1, {}, "lathe checkpoint reshard");
    } catch (const Error& e) {
      throw_error("--pipeline {}: {}", to.pipeline, e.what());
    }
    LATHE_CHECK(to.pipeline <= cfg.num_hidden_layers,
                "--pipeline {}: the model has {} layers (num_hidden_layers); each stage needs at least one",
                to.pipeline, cfg.num_hidden_layers);
  }
}

ReshardResult reshard_checkpoint(const std::string& src, const std::string& dst_run_dir, const CheckpointLayout& to) {
  verify_checkpoint(src);  // sizes and checksums of every file, before anything is read
  CheckpointPieces ck(src);
  const CheckpointState& st = ck.state();
  const ModelConfig cfg = checkpoint_model_config(src);
  validate_layout(cfg, to);
  ReshardResult res;
  res.from = checkpoint_layout(st);
  res.to = to;
  const fs::path out = fs::path(dst_run_dir) / "checkpoints" / ckpt_dir::step_name(st.step);
  // The output run directory: not empty (that is the current directory), not inside the source
  // checkpoint (S11), and the checkpoint it gets is not the source itself.
  io::check_output_paths({{src, "the source checkpoint", io::PathUse::Dir}}, {{dst_run_dir, "--to", io::PathUse::Dir}});
  std::error_code ec;
  LATHE_CHECK(!fs::exists(out, ec),
              "{}: already exists (lathe checkpoint reshard never overwrites a checkpoint); remove it or choose "
              "another --to",
              out.string());
  res.dir = out.string();
  constexpr const char* kUndone = "nothing was written";
  throw_if_stopped("lathe checkpoint reshard", kUndone);

  // The global state: every weight whole, every moment as a flat buffer of the model's layout.
  std::unique_ptr<Model> model = build_model(cfg, ComputeSpec{nullptr, DType::F32, /*gradients=*/false});
  const ParamTable& table = model->params();
  std::set<std::string> params;
  for (const ParamSpec& s : table.specs()) {
    params.insert(s.name);
    if (s.numel() == 0) continue;
    ck.check(s.name, s.shape);
    float* dst = model->param_data() + s.offset;
    ck.read(s.name, 0, s.numel(), dst);
    check_values(src, s.name, dst, s.numel(), 0);
  }
  std::vector<std::string> moment_names;  // in the order the source lists them (exp_avg, exp_avg_sq)
  for (const std::string& name : ck.names()) {
    const size_t slash = name.find('/');
    if (slash == std::string::npos) {
      LATHE_CHECK(params.count(name), "{}: unexpected tensor '{}' (not a parameter of the model in its recipe)",
                  state_path(src), name);
      continue;
    }
    const std::string m = name.substr(0, slash);
    if (std::find(moment_names.begin(), moment_names.end(), m) == moment_names.end()) moment_names.push_back(m);
  }
  const size_t P = model->num_params();
  // Every data rank of a ZeRO run holds a share of the flat moments: more ranks than elements
  // would write empty shard files by the thousand (H1).
  LATHE_CHECK(moment_names.empty() || to.writers() <= static_cast<int64_t>(P),
              "--data {} x --context {}: the model has {} parameters, so at most {} data x context ranks can each "
              "hold a share of the optimizer moments; give a smaller --data or --context",
              to.data, to.context, P, P);
  throw_if_stopped("lathe checkpoint reshard", kUndone);
  std::vector<std::vector<float>> moments(moment_names.size(), std::vector<float>(P));
  OfflineCheckpoint parts;
  if (!moment_names.empty()) {
    MomentSlice all;
    all.begin = 0;
    all.end = P;
    for (size_t i = 0; i < moments.size(); ++i) all.buffers.push_back({moment_names[i], moments[i].data()});
    load_moments_sharded(ck, table, table, 0, 1, all);
    // The writers' cut of a run of layout `to` (see the header).
    std::vector<size_t> begin(static_cast<size_t>(to.writers()) + 1, 0);
    if (to.tensor == 1 && to.pipeline == 1) {
      const parallel::FlatShards sh(P, static_cast<int>(to.writers()), optim::kChunk);
      for (int r = 0; r < sh.ranks(); ++r) begin[static_cast<size_t>(r) + 1] = sh.end(r);
    } else {
      const std::vector<size_t> cut = dist::even_counts(P, static_cast<int>(to.writers()));
      for (size_t r = 0; r < cut.size(); ++r) begin[r + 1] = begin[r] + cut[r];
    }
    parts.shard_files = to.world() > 1;
    for (int64_t r = 0; r < to.writers(); ++r) {
      MomentSlice m;
      m.begin = begin[static_cast<size_t>(r)];
      m.end = begin[static_cast<size_t>(r) + 1];
      for (size_t i = 0; i < moments.size(); ++i) m.buffers.push_back({moment_names[i], moments[i].data() + m.begin});
      parts.parts.push_back(std::move(m));
    }
  }
  CheckpointState ns = st;
  if (!ns.recipe.is_object()) ns.recipe = json::object();
  json& par = ns.recipe["parallel"];
  if (!par.is_object()) par = json::object();
  // Per-stage settings of another pipeline degree do not apply: an even split (as the recipe
  // writes it, so that A -> B -> A gives A -> A's bytes), unless re-set.
  if (to.pipeline != res.from.pipeline) par["stage_layers"] = json::array();
  par["tensor"] = to.tensor;
  par["pipeline"] = to.pipeline;
  par["data"] = to.data;
  par["zero"] = to.zero;
  if (to.context > 1 || par.contains("context")) par["context"] = to.context;
  CheckpointSaveInfo info;
  throw_if_stopped("lathe checkpoint reshard", kUndone);
  try {
    save_checkpoint_offline(dst_run_dir, *model, parts, ns, &info);
    throw_if_stopped("lathe checkpoint reshard", "the checkpoint it had written is removed");
    verify_checkpoint(res.dir);  // what was written reads back with its checksums
  } catch (...) {
    // Our own temporary directory (save_checkpoint_offline's naming) and, when the failure or a
    // signal came after its rename, the checkpoint this call created: nothing half-done is left.
    std::error_code rec;
    fs::remove_all(fs::path(res.dir + ".tmp"), rec);
    fs::remove_all(out, rec);
    throw;
  }
  res.bytes = info.bytes;
  for (const CheckpointFile& f : read_checkpoint_state(res.dir).files) res.files.push_back(f.name);
  return res;
}

}  // namespace lathe
