// state.json, the checkpoint's table of contents: the reader (the text of an untrusted file ->
// CheckpointState, every field checked by type and range and named in the error ("state.json: field
// 'tensors.model.safetensors[3].slice' must be ..."), so no nlohmann type error, no recursion on a
// hostile value, no out-of-range integer reaches the trainer; see parse_checkpoint_state in
// checkpoint.h for the order of the checks), the writer (state_json_text), and the verification of
// the files it lists (sizes and XXH64).
#include <fmt/format.h>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <set>

#include "core/error.h"
#include "io/fs.h"
#include "io/json.h"
#include "io/json_fields.h"
#include "train/checkpoint.h"
#include "train/checkpoint_format.h"

namespace lathe {

namespace fs = std::filesystem;
using json = nlohmann::json;
using namespace ckpt_format;

namespace {

// Largest dimension a checkpoint tensor may declare: 2^40 elements per dimension is far beyond any
// model and keeps products of two dimensions inside int64 for the messages below.
constexpr int64_t kMaxDim = int64_t{1} << 40;
// Largest step / sample count accepted: 2^53 (exact in a double, far beyond any run).
constexpr int64_t kMaxCount = int64_t{1} << 53;

// Field-by-field access to the body with errors naming the file and the field path.
using Fields = io::JsonFields;
Fields state_fields(const std::string& path) {
  return Fields(Fields::Style::Field, [&path](const std::string& field, const std::string& what) {
    throw_error(
        "{}: field '{}' {} (the checkpoint is damaged or was edited by hand; resume from another "
        "checkpoint, or start fresh)",
        path, field, what);
  });
}

bool is_hex16(const std::string& s) {
  if (s.size() != 16) return false;
  for (char c : s)
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  return true;
}

std::vector<CheckpointFile> read_files(const Fields& f, const json& body, int64_t world) {
  const json& files = f.object(f.at(body, "files", "files"), "files");
  static const std::set<std::string> known = {kModelFile, kOptimFile, kRecipeFile};
  std::vector<CheckpointFile> out;
  std::set<int64_t> shard_ranks;
  for (auto it = files.begin(); it != files.end(); ++it) {
    const std::string field = "files." + it.key();
    // Only the checkpoint's own files: a listed "../../x" or "/etc/x" would be opened and hashed.
    int64_t rank = 0, of = 0;
    if (parse_optim_shard_file(it.key(), &rank, &of)) {
      if (of != world)
        f.fail(field, fmt::format("is the shard of rank {} of {} ranks, but world.world_size is {}", rank, of, world));
      shard_ranks.insert(rank);
    } else if (!known.count(it.key())) {
      f.fail(field, fmt::format("names a file that is not part of a lathe checkpoint (expected {}, {}, {} or {})",
                                kModelFile, kOptimFile, optim_shard_file(0, world), kRecipeFile));
    }
    const json& meta = f.object(it.value(), field);
    CheckpointFile cf;
    cf.name = it.key();
    cf.bytes =
        f.integer(f.at(meta, "bytes", field + ".bytes"), field + ".bytes", 0, std::numeric_limits<int64_t>::max());
    cf.xxh64 = f.string(f.at(meta, "xxh64", field + ".xxh64"), field + ".xxh64");
    if (!is_hex16(cf.xxh64)) f.fail(field + ".xxh64", "must be 16 lowercase hex digits");
    out.push_back(std::move(cf));
  }
  bool has_model = false, has_optim = false;
  for (const auto& cf : out) {
    has_model = has_model || cf.name == kModelFile;
    has_optim = has_optim || cf.name == kOptimFile;
  }
  if (!has_model) f.fail("files", fmt::format("has no entry for {}", kModelFile));
  // Moments are either in one file or in one file per rank, all of them (a shard may be empty).
  if (has_optim && !shard_ranks.empty())
    f.fail("files", fmt::format("lists both {} and per-rank shard files", kOptimFile));
  if (!shard_ranks.empty() && static_cast<int64_t>(shard_ranks.size()) != world)
    f.fail("files", fmt::format("lists {} of the {} per-rank optimizer shards (every rank writes one; {} is missing)",
                                shard_ranks.size(), world, [&] {
                                  int64_t r = 0;
                                  while (shard_ranks.count(r)) ++r;
                                  return optim_shard_file(r, world);
                                }()));
  return out;
}

std::map<std::string, std::vector<CheckpointTensor>> read_tensors(const Fields& f, const json& body,
                                                                  const std::vector<CheckpointFile>& files) {
  const json& tensors = f.object(f.at(body, "tensors", "tensors"), "tensors");
  std::map<std::string, std::vector<CheckpointTensor>> out;
  for (auto it = tensors.begin(); it != tensors.end(); ++it) {
    const std::string fkey = "tensors." + it.key();
    bool listed = false;
    for (const auto& cf : files) listed = listed || cf.name == it.key();
    if (!listed || it.key() == kRecipeFile) f.fail(fkey, "names a file that is not a tensor file listed in 'files'");
    const json& entries = f.array(it.value(), fkey);
    std::vector<CheckpointTensor>& v = out[it.key()];
    std::set<std::string> seen;
    for (size_t i = 0; i < entries.size(); ++i) {
      const std::string field = fmt::format("{}[{}]", fkey, i);
      const json& e = f.object(entries[i], field);
      CheckpointTensor t;
      t.name = f.string(f.at(e, "name", field + ".name"), field + ".name");
      if (t.name.empty()) f.fail(field + ".name", "is empty");
      if (!seen.insert(t.name).second)
        f.fail(field + ".name", fmt::format("lists tensor {} twice", io::json_excerpt(json(t.name), 80)));
      t.dtype = f.string(f.at(e, "dtype", field + ".dtype"), field + ".dtype");
      if (t.dtype != kTensorDtype)
        f.fail(field + ".dtype", fmt::format("is {}; checkpoint format version {} holds {} tensors only",
                                             io::json_excerpt(json(t.dtype), 40), kFormatVersion, kTensorDtype));
      const json& gs = f.array(f.at(e, "global_shape", field + ".global_shape"), field + ".global_shape");
      if (gs.size() > 8) f.fail(field + ".global_shape", fmt::format("has {} dimensions (at most 8)", gs.size()));
      for (size_t d = 0; d < gs.size(); ++d)
        t.global_shape.push_back(f.integer(gs[d], fmt::format("{}.global_shape[{}]", field, d), 0, kMaxDim));
      if (e.contains("flat")) {
        // A piece of the flattened tensor (ZeRO shards cut tensors anywhere): elements [a, b).
        const std::string ff = field + ".flat";
        int64_t n = 1;
        for (int64_t d : t.global_shape) {
          if (d != 0 && n > kMaxDim / d) f.fail(field + ".global_shape", "has more than 2^40 elements");
          n *= d;
        }
        if (!e["flat"].is_array() || e["flat"].size() != 2) f.wrong(ff, e["flat"], "a [start, end) pair");
        if (e.contains("slice")) f.fail(field, "has both 'flat' and 'slice' (one describes the piece)");
        t.flat = true;
        t.flat_begin = f.integer(e["flat"][0], ff + "[0]", 0, n);
        t.flat_end = f.integer(e["flat"][1], ff + "[1]", t.flat_begin, n);
        v.push_back(std::move(t));
        continue;
      }
      const std::string sfield = field + ".slice";
      const json& sl = f.array(f.at(e, "slice", sfield), sfield);
      if (sl.size() != gs.size())
        f.fail(sfield,
               fmt::format("has {} [start, end) pairs for a {}-dimensional global_shape", sl.size(), gs.size()));
      for (size_t d = 0; d < sl.size(); ++d) {
        const std::string pf = fmt::format("{}[{}]", sfield, d);
        if (!sl[d].is_array() || sl[d].size() != 2) f.wrong(pf, sl[d], "a [start, end) pair");
        const int64_t a = f.integer(sl[d][0], pf + "[0]", 0, t.global_shape[d]);
        const int64_t b = f.integer(sl[d][1], pf + "[1]", a, t.global_shape[d]);
        t.slice.push_back({a, b});
      }
      v.push_back(std::move(t));
    }
  }
  return out;
}

// Optional "health" and "anomaly" (train/anomaly.h), written by runs since the anomaly policy.
void read_health(const Fields& f, const json& body, CheckpointState* st) {
  // A finite number, or null for a value that was not finite at save time.
  auto finite_or_null = [&](const json& v, const std::string& field) {
    if (v.is_null()) return std::numeric_limits<double>::quiet_NaN();
    return f.number(v, field, -std::numeric_limits<double>::max(), false);
  };
  if (body.contains("health")) {
    const json& h = f.object(body["health"], "health");
    st->has_health = true;
    st->health.loss = finite_or_null(f.at(h, "loss", "health.loss"), "health.loss");
    st->health.grad_norm = finite_or_null(f.at(h, "grad_norm", "health.grad_norm"), "health.grad_norm");
    st->health.anomalies = f.integer(f.at(h, "anomalies", "health.anomalies"), "health.anomalies", 0, kMaxCount);
    const json& ok = f.at(h, "healthy", "health.healthy");
    if (!ok.is_boolean()) f.wrong("health.healthy", ok, "true or false");
    st->health.healthy = ok.get<bool>();
  }
  if (!body.contains("anomaly")) return;
  const json& a = f.object(body["anomaly"], "anomaly");
  st->has_anomaly = true;
  AnomalyState& x = st->anomaly;
  for (auto [key, stat] : {std::pair<const char*, RunningStat*>{"loss", &x.loss}, {"grad_norm", &x.grad_norm}}) {
    const std::string field = std::string("anomaly.") + key;
    const json& o = f.object(f.at(a, key, field), field);
    stat->n = f.integer(f.at(o, "n", field + ".n"), field + ".n", 0, kMaxCount);
    stat->mean =
        f.number(f.at(o, "mean", field + ".mean"), field + ".mean", -std::numeric_limits<double>::max(), false);
    stat->var = f.number(f.at(o, "var", field + ".var"), field + ".var", 0.0, false);
  }
  x.lr_steps_left = f.integer(f.at(a, "lr_steps_left", "anomaly.lr_steps_left"), "anomaly.lr_steps_left", 0, kMaxCount);
  const json& recent = f.array(f.at(a, "recent", "anomaly.recent"), "anomaly.recent");
  if (recent.size() > (size_t{1} << 24))
    f.fail("anomaly.recent", fmt::format("has {} entries (at most 2^24)", recent.size()));
  for (size_t i = 0; i < recent.size(); ++i) {
    // Steps of this run, ascending.
    const int64_t lo = x.recent.empty() ? 1 : x.recent.back() + 1;
    x.recent.push_back(f.integer(recent[i], fmt::format("anomaly.recent[{}]", i), lo, st->step));
  }
  // last_anomaly: absent in the first checkpoints with this record (the newest window entry then).
  x.last_anomaly = a.contains("last_anomaly") ? f.integer(a["last_anomaly"], "anomaly.last_anomaly", 0, st->step)
                   : x.recent.empty()         ? 0
                                              : x.recent.back();
  x.skipped_updates =
      f.integer(f.at(a, "skipped_updates", "anomaly.skipped_updates"), "anomaly.skipped_updates", 0, st->step);
  x.anomalies = f.integer(f.at(a, "anomalies", "anomaly.anomalies"), "anomaly.anomalies", 0, kMaxCount);
  x.rollbacks = f.integer(f.at(a, "rollbacks", "anomaly.rollbacks"), "anomaly.rollbacks", 0, kMaxCount);
}

}  // namespace

CheckpointState parse_checkpoint_state(std::string_view text, const std::string& path) {
  // Depth first: body.dump() (the checksum) and the error excerpts recurse on the value.
  // lathe writes state.json whole (temporary file, fsync, rename): text that does not parse was
  // damaged afterwards, so it is reported as corrupt like a checksum mismatch.
  const json doc = io::parse_json(text, path + ": corrupt");
  if (!doc.is_object() || !doc.contains("body") || !doc["body"].is_object() || !doc.contains("body_xxh64") ||
      !doc["body_xxh64"].is_string())
    throw_error("{}: corrupt: expected {{\"body\": {{...}}, \"body_xxh64\": \"...\"}}", path);
  const json& body = doc["body"];
  // body_xxh64 is XXH64 of the compact, key-sorted dump (nlohmann's std::map objects are sorted).
  const std::string canon = body.dump(-1, ' ', false, json::error_handler_t::replace);
  const std::string got = hex64(Xxh64::hash(canon.data(), canon.size()));
  const std::string want = doc["body_xxh64"].get<std::string>();
  LATHE_CHECK(got == want, "{}: corrupt: checksum mismatch (recorded xxh64 {}, computed {})", path,
              io::json_excerpt(json(want), 40), got);

  const Fields f = state_fields(path);
  const std::string format =
      body.contains("format") && body["format"].is_string() ? body["format"].get<std::string>() : std::string();
  LATHE_CHECK(format == kFormat, "{}: not a lathe checkpoint (field 'format' is {}, expected \"{}\")", path,
              body.contains("format") ? io::json_excerpt(body["format"], 60) : std::string("missing"), kFormat);
  const int64_t version = f.integer(f.at(body, "format_version", "format_version"), "format_version", 0, 1 << 30);
  LATHE_CHECK(version == kFormatVersion,
              "{}: checkpoint format version {} is not supported by lathe {} (reads version {})", path, version,
              LATHE_VERSION, kFormatVersion);

  CheckpointState st;
  st.step = f.integer(f.at(body, "step", "step"), "step", 0, kMaxCount);
  st.consumed_samples = f.integer(f.at(body, "consumed_samples", "consumed_samples"), "consumed_samples", 0, kMaxCount);
  const json& loader = f.object(f.at(body, "loader", "loader"), "loader");
  st.loader.epoch = f.integer(f.at(loader, "epoch", "loader.epoch"), "loader.epoch", 0, kMaxCount);
  st.loader.position = f.integer(f.at(loader, "position", "loader.position"), "loader.position", 0, kMaxCount);
  if (loader.contains("blend")) {  // data.blend runs only
    const json& b = f.object(loader["blend"], "loader.blend");
    const json& taken = f.array(f.at(b, "taken", "loader.blend.taken"), "loader.blend.taken");
    if (taken.empty() || taken.size() > (size_t{1} << 24))
      f.fail("loader.blend.taken", fmt::format("has {} entries (one per blended dataset)", taken.size()));
    for (size_t i = 0; i < taken.size(); ++i)
      st.blend_taken.push_back(f.integer(taken[i], fmt::format("loader.blend.taken[{}]", i), 0, st.loader.position));
    st.blend_plan_xxh64 = f.string(f.at(b, "plan_xxh64", "loader.blend.plan_xxh64"), "loader.blend.plan_xxh64");
  }
  const json& rng = f.array(f.at(body, "rng", "rng"), "rng");
  if (rng.empty()) f.fail("rng", "is empty (a checkpoint always records the trainer's RNG state)");
  if (rng.size() > 1024) f.fail("rng", fmt::format("has {} values (at most 1024)", rng.size()));
  for (size_t i = 0; i < rng.size(); ++i) st.rng.push_back(f.uint64(rng[i], fmt::format("rng[{}]", i)));
  st.loss_scale = f.number(f.at(body, "loss_scale", "loss_scale"), "loss_scale", 0.0, true);
  // What the scaler can hold: a float whose reciprocal (the gradients' unscale factor) is a finite
  // float, and at most its cap 2^100.
  if (st.loss_scale < static_cast<double>(std::numeric_limits<float>::min()) || st.loss_scale > 0x1p100)
    f.fail("loss_scale", fmt::format("is {}, outside the loss scaler's range [2^-126 (the smallest normal float), "
                                     "2^100]",
                                     st.loss_scale));
  // The loss scaler's counters (optional: absent in checkpoints written before them).
  if (body.contains("loss_scale_dynamic")) {
    if (!body["loss_scale_dynamic"].is_boolean())
      f.wrong("loss_scale_dynamic", body["loss_scale_dynamic"], "true or false");
    st.loss_scale_dynamic = body["loss_scale_dynamic"].get<bool>();
  }
  if (body.contains("loss_scale_good_steps"))
    st.loss_scale_good_steps = f.integer(body["loss_scale_good_steps"], "loss_scale_good_steps", 0, kMaxCount);
  if (body.contains("skipped_steps")) st.skipped_steps = f.integer(body["skipped_steps"], "skipped_steps", 0, st.step);
  if (body.contains("consecutive_skipped_steps"))
    st.consecutive_skipped_steps =
        f.integer(body["consecutive_skipped_steps"], "consecutive_skipped_steps", 0, st.skipped_steps);
  read_health(f, body, &st);
  st.recipe = f.object(f.at(body, "recipe", "recipe"), "recipe");
  st.lathe_version = f.string(f.at(body, "lathe_version", "lathe_version"), "lathe_version");
  // lr, threads and optimizer are informational additions: absent means "not recorded".
  if (body.contains("lr")) st.lr = f.number(body["lr"], "lr", 0.0, false);
  if (body.contains("threads")) st.threads = static_cast<int>(f.integer(body["threads"], "threads", 0, 1 << 20));
  if (body.contains("optimizer")) st.optimizer = f.string(body["optimizer"], "optimizer");
  if (body.contains("world")) {
    const json& w = f.object(body["world"], "world");
    st.world_size = f.integer(f.at(w, "world_size", "world.world_size"), "world.world_size", 1, 1 << 20);
    st.rank = f.integer(f.at(w, "rank", "world.rank"), "world.rank", 0, st.world_size - 1);
  }
  st.files = read_files(f, body, st.world_size);
  st.tensors = read_tensors(f, body, st.files);
  return st;
}

std::string ckpt_format::state_json_text(const CheckpointState& st, const std::string& optimizer, int64_t world_size,
                                         const json& files, const json& tensors) {
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
               {"optimizer", optimizer},
               {"recipe", st.recipe},
               {"world", {{"world_size", world_size}, {"rank", 0}}},
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
  return doc.dump() + "\n";
}

// ---- reading a checkpoint directory's state.json and verifying the files it lists ----------

std::string ckpt_format::state_path(const std::string& dir) { return (fs::path(dir) / kStateFile).string(); }

namespace {
constexpr size_t kChunk = 8u << 20;  // read size when verifying

uint64_t hash_file(const std::string& path, size_t* size) {
  Xxh64 h;
  *size = io::read_to_end(io::open_input(path), path, kChunk, [&](const char* p, size_t n) { h.update(p, n); });
  return h.digest();
}

}  // namespace

void ckpt_format::require_checkpoint_dir(const std::string& dir) {
  std::error_code ec;
  const bool is_dir = fs::is_directory(dir, ec);
  if (ec && ec != std::errc::no_such_file_or_directory)
    throw_error("{}: cannot read the checkpoint directory: {}", dir, ec.message());
  LATHE_CHECK(is_dir,
              "{}: not a directory (expected a checkpoint directory such as "
              "RUN_DIR/checkpoints/step_00000100)",
              dir);
}

CheckpointState ckpt_format::read_state(const std::string& dir) {
  const std::string path = state_path(dir);
  LATHE_CHECK(io::entry_present(path), "{}: missing (not a complete lathe checkpoint directory)", path);
  return parse_checkpoint_state(io::read_file(path), path);
}

void ckpt_format::verify_files(const std::string& dir, const CheckpointState& cs) {
  const std::string sp = state_path(dir);
  for (const CheckpointFile& cf : cs.files) {
    const std::string path = (fs::path(dir) / cf.name).string();
    LATHE_CHECK(io::entry_present(path), "{}: missing (listed in {}; the checkpoint is incomplete)", path, sp);
    size_t size = 0;
    const std::string got = hex64(hash_file(path, &size));
    LATHE_CHECK(size == static_cast<size_t>(cf.bytes), "{}: corrupt or truncated: {} bytes, {} records {}", path, size,
                sp, cf.bytes);
    LATHE_CHECK(got == cf.xxh64, "{}: corrupt: checksum mismatch (recorded xxh64 {}, computed {})", path, cf.xxh64,
                got);
  }
}

CheckpointState read_checkpoint_state(const std::string& ckpt_dir) {
  require_checkpoint_dir(ckpt_dir);
  return read_state(ckpt_dir);
}

void verify_checkpoint(const std::string& ckpt_dir) {
  require_checkpoint_dir(ckpt_dir);
  verify_files(ckpt_dir, read_state(ckpt_dir));
}

}  // namespace lathe
