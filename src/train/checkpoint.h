// Full training-state checkpoints that survive crashes and resume bit-exactly.
//
// Layout of RUN_DIR/checkpoints/ (format "lathe-checkpoint", version 1):
//   step_00000120/             one complete checkpoint (8-digit optimizer step)
//     model.safetensors        fp32 parameters, HF names, LATHE layout: every tensor has the shape
//                              of its ParamSpec (linear weights [out, in]; GPT-2 Conv1D weights are
//                              therefore the transpose of HF's file layout). Tensors in table order.
//     optimizer.safetensors    fp32 moments "exp_avg/<param name>", "exp_avg_sq/<param name>"
//                              (same shapes as the parameters); absent keys are an error on load.
//     optimizer-rank00001-of-00004.safetensors   instead of optimizer.safetensors in a data-parallel
//                              run: rank r's flat range of the moments (its ZeRO shard); a tensor
//                              cut by a shard boundary is stored as a 1-D piece of its flattened
//                              elements, listed in state.json with "flat": [start, end). Together
//                              the N files hold every moment exactly once (checked on load).
//                              Both files may hold U8 tensors "__lathe_pad__/<next tensor>" of
//                              < 4 KB (and a space-padded JSON header) that align file offsets
//                              with buffer addresses for zero-copy O_DIRECT writes; readers skip
//                              them, state.json does not list them.
//     recipe.yaml              the resolved recipe (JSON text, which is valid YAML), for humans
//                              and `lathe train recipe.yaml`
//     state.json               {"body": {...}, "body_xxh64": "<16 hex>"}; body holds format,
//                              version, step, consumed_samples, loader {epoch, position}, rng,
//                              loss_scale (+ optional loss_scale_dynamic, loss_scale_good_steps,
//                              skipped_steps, consecutive_skipped_steps), lr, threads, recipe,
//                              (optional) health {loss, grad_norm, anomalies, healthy} and anomaly
//                              (the policy's statistics and counters, train/anomaly.h),
//                              lathe_version, optimizer name,
//                              "files": {file: {"bytes", "xxh64"}} for the three files above, and
//                              "tensors": {file: [{"name", "dtype", "global_shape",
//                              "slice": [[start, end) per dim]}]} — per-rank ready: a sharded run
//                              writes one file per rank and lists the slice each holds. body_xxh64
//                              is XXH64 (seed 0) of body.dump() (compact, sorted keys), so a flipped
//                              byte anywhere in state.json is detected too.
//   Reading at another layout (pieces intersected with what a rank needs) and rewriting offline
//   for another layout (`lathe checkpoint reshard`): train/reshard.h.
//   step_00000120.tmp/         a checkpoint being written (ignored, removed by the next save)
//   latest                     "step_00000120\n", replaced atomically after each complete save
//
// Save order: files into step_X.tmp/ (each fsync'ed; state.json with the checksums last), fsync
// the tmp dir, rename to step_X/, fsync checkpoints/, write `latest` atomically, then delete
// older checkpoints beyond keep_last. A crash at any point leaves every step_X/ complete.
#pragma once
#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "config/model_config.h"
#include "config/recipe_diff.h"  // RecipeChange, diff_recipes (its callers include this header)
#include "data/loader.h"
#include "dist/comm.h"
#include "io/xxh64.h"
#include "models/model.h"
#include "optim/optimizer.h"
#include "train/anomaly.h"

namespace lathe {

// One entry of state.json's "files" table (filled when a checkpoint is read; save computes it).
struct CheckpointFile {
  std::string name;  // a file of the checkpoint directory (model.safetensors, optimizer.safetensors, recipe.yaml)
  int64_t bytes = 0;
  std::string xxh64;  // 16 lowercase hex digits
};
// One entry of state.json's "tensors" table: which part of which global tensor a file holds.
struct CheckpointTensor {
  std::string name;
  std::string dtype;  // "F32" (the only dtype of format version 1)
  Shape global_shape;
  std::vector<std::pair<int64_t, int64_t>> slice;  // [start, end) per dimension (empty when flat)
  // Or a piece of the flattened tensor: elements [flat_begin, flat_end), stored as a 1-D tensor
  // (a ZeRO shard boundary may fall anywhere inside a tensor).
  bool flat = false;
  int64_t flat_begin = 0, flat_end = 0;
};

struct CheckpointState {
  int64_t step = 0;  // optimizer steps completed
  int64_t consumed_samples = 0;
  data::LoaderState loader;  // epoch, position
  // data.blend runs (optional in state.json: loader.blend): samples taken from each blended dataset
  // so far and the XXH64 of the plan's first `position` entries, so a resume proves it continues
  // the same sample sequence (data/blend_cache.h). Empty for data.train runs.
  std::vector<int64_t> blend_taken;
  std::string blend_plan_xxh64;
  std::vector<uint64_t> rng;  // any RNG state the trainer keeps (now: the seed)
  // Loss scaler (optim/loss_scaler.h). loss_scale: the scale for the next step (1 without
  // dynamic scaling). The rest are optional in state.json (absent in checkpoints written before
  // them: 0 / false).
  double loss_scale = 1.0;
  bool loss_scale_dynamic = false;  // the run scaled the loss (fp16 or loss_scale.enabled)
  int64_t loss_scale_good_steps = 0;
  int64_t skipped_steps = 0, consecutive_skipped_steps = 0;
  // Health at save time (optional "health" in state.json: absent in older checkpoints, which are
  // then not known to be healthy): the step's loss and gradient norm (null in the file when not
  // finite), the run's anomaly count, and whether the anomaly policy deems it a rollback target.
  bool has_health = false;
  CheckpointHealthInfo health;
  // The anomaly policy's state (optional "anomaly"; train/anomaly.h), for an exact resume.
  bool has_anomaly = false;
  AnomalyState anomaly;
  nlohmann::json recipe;  // resolved recipe (Recipe::to_json())
  std::string lathe_version;
  // Additions (informational; the trainer warns when they differ on resume).
  double lr = 0;          // learning rate used by the last step
  int threads = 0;        // OpenMP threads of the run that wrote it
  std::string optimizer;  // "adamw" | "lamb" | "" (no optimizer state)
  // Filled when a checkpoint is read (save writes world 1/0 and computes the tables itself).
  int64_t world_size = 1, rank = 0;
  std::vector<CheckpointFile> files;
  std::map<std::string, std::vector<CheckpointTensor>> tensors;  // file -> entries, in file order
};

struct CheckpointSaveInfo {
  int64_t bytes = 0;            // all files of the checkpoint
  double seconds_complete = 0;  // until the checkpoint is complete, fsynced and `latest` points to it
  double seconds_total = 0;     // including renaming old checkpoints away (keep_last)
  std::string moved_aside;      // a checkpoint of the same step found in place, moved here ("" if none)
};

// Writes RUN_DIR/checkpoints/step_XXXXXXXX/ atomically (tmp dir, fsync files + dir, rename), then
// updates RUN_DIR/checkpoints/latest atomically; keep_last > 0 deletes older complete checkpoints
// only after the new one is complete (renamed to *.deleting.tmp at once, deleted by a background
// thread; see wait_for_checkpoint_cleanup). keep_healthy (anomaly rollback on): the newest
// checkpoint whose state records it healthy is never removed by keep_last (it is the rollback
// target) while the new one is not healthy. An existing step_XXXXXXXX/ of the same step (another
// timeline's) is moved aside to step_XXXXXXXX.abandoned-<unix time> (info->moved_aside), never deleted.
// Data files go through O_DIRECT (buffered where the filesystem refuses it); model and optimizer
// files are written concurrently. Extra memory: 4 staging buffers of 16 MB.
// Test hook: pause_ms > 0 (FaultPlan::checkpoint_pause_ms) pauses that long after the data files,
// after recipe.yaml and before the rename.
void save_checkpoint(const std::string& run_dir, const Model& model, optim::Optimizer* opt, const CheckpointState& st,
                     int keep_last, CheckpointSaveInfo* info = nullptr, bool keep_healthy = false, int pause_ms = 0);

// A rank's part of the optimizer moments: flat elements [begin, end) of the model's P-element
// parameter layout; buffers[i] = {"exp_avg", pointer to flat element `begin` of that moment}.
struct MomentSlice {
  std::vector<std::pair<std::string, float*>> buffers;
  size_t begin = 0, end = 0;
};
// The moments [begin, end) of `opt`, whose buffers hold flat elements from `buffer_begin` on (0 for
// a full-size optimizer, the shard start for a ZeRO shard's optimizer).
MomentSlice moment_slice(optim::Optimizer& opt, size_t buffer_begin, size_t begin, size_t end);

// The data-parallel save, collective over `group` (every rank calls it with the same state):
// rank r writes optimizer-rankRRRRR-of-NNNNN.safetensors with the moments of `mine` (its ZeRO
// shard, or its part of replicated moments so that the ranks share the writing); rank 0 writes
// model.safetensors (parameters are replicated) and recipe.yaml, collects every shard's size,
// XXH64 and tensor table, and only then writes state.json, renames the directory and moves
// `latest`. A rank that dies mid-save leaves step_X.tmp/, which is never taken as a checkpoint.
// Each tensor is listed once per file, whole or as a flat piece (CheckpointTensor::flat); together
// the shards cover every moment exactly once. Assumes output.dir is one directory that every rank
// sees (a shared filesystem when the ranks are on several hosts).
void save_checkpoint_sharded(const std::string& run_dir, const Model& model, const MomentSlice& mine,
                             const CheckpointState& st, int keep_last, CheckpointSaveInfo* info,
                             dist::Communicator& group, bool keep_healthy = false, int pause_ms = 0);

// What one process writes in place of a run's ranks (offline resharding, train/reshard.h): parts[r]
// is writer rank r's flat range of the moments (none: a checkpoint without optimizer state), in
// optimizer-rankRRRRR-of-NNNNN.safetensors when shard_files, else in optimizer.safetensors (at
// most one part). state.json's world is the number of shard files (1 without them).
struct OfflineCheckpoint {
  std::vector<MomentSlice> parts;
  bool shard_files = false;
};
// Writes RUN_DIR/checkpoints/step_XXXXXXXX/ as save_checkpoint does (tmp dir, fsync, rename,
// `latest`; keep_last 0), with canonical file layouts: no alignment pads, so the same tensors and
// state always give byte-identical files.
void save_checkpoint_offline(const std::string& run_dir, const Model& model, const OfflineCheckpoint& parts,
                             const CheckpointState& st, CheckpointSaveInfo* info = nullptr);

// Reads the moments of flat [slice.begin, slice.end) from a checkpoint written by any number of
// ranks (one optimizer file or per-rank shards: re-sharding is the overlap of flat ranges). Checks
// that the files' tables cover every moment exactly once and that values are finite; the files'
// checksums are verify_checkpoint's job (done by find_latest_checkpoint and the resume checks).
void load_checkpoint_moments(const std::string& ckpt_dir, const Model& model, const MomentSlice& slice);

// Newest complete checkpoint dir under RUN_DIR/checkpoints (verifying checksums); skipped
// corrupt/partial ones are described in *log (one line each). "" if none. The scan decides, not
// `latest` (a crash between the rename and its update leaves it one checkpoint behind): a
// `latest` that does not hold the name of a step_XXXXXXXX directory inside checkpoints/ (garbage,
// "../..", an absolute path, a missing step) is ignored with a note in *log, never followed.
// A checkpoints/ that exists but cannot be read (symlink loop, permissions) is an error, and so
// is one whose step_XXXXXXXX checkpoints are all refused (the message names each and why).
std::string find_latest_checkpoint(const std::string& run_dir, std::string* log = nullptr);

// Verifies checksums and shapes, fills model params (and optimizer moments if opt != nullptr).
// The tensor table must list exactly the file's tensors, whole, with the model's shapes; every
// loaded value must be finite (and exp_avg_sq >= 0). Errors name the file and what is wrong.
CheckpointState load_checkpoint(const std::string& ckpt_dir, Model& model, optim::Optimizer* opt);

ModelConfig checkpoint_model_config(const std::string& ckpt_dir);  // from the saved recipe

// ---- additions ----

// Joins the background removal of old checkpoints (also done by the next save and at exit).
void wait_for_checkpoint_cleanup();

// state.json only (its own checksum verified, the data files not read).
CheckpointState read_checkpoint_state(const std::string& ckpt_dir);
// The text of a state.json -> its state, or lathe::Error naming `path` and the field. Checked in
// this order: nesting depth (before anything recurses on the value), the envelope, body_xxh64,
// then every field by type and range (integers in int64, finite numbers, non-empty rng, world
// 1/0, "files" limited to the checkpoint's own file names with sizes and 16-hex checksums,
// "tensors" entries with a string name listed once, dtype F32, non-negative global_shape and
// [start, end) slices inside it). What needs the model or the recipe is checked by
// load_checkpoint and by the trainer's resume checks.
CheckpointState parse_checkpoint_state(std::string_view text, const std::string& path);
// Throws unless state.json is intact and every file it lists exists with the recorded size and
// XXH64. The message names the file and what is wrong.
void verify_checkpoint(const std::string& ckpt_dir);
// Complete checkpoints (step_XXXXXXXX dirs, not verified) of RUN_DIR, ascending by step.
std::vector<std::pair<int64_t, std::string>> list_checkpoints(const std::string& run_dir);

// RecipeChange and diff_recipes: config/recipe_diff.h.

using io::hex64;  // the checksum of checkpoint files (io/xxh64.h)
using io::Xxh64;

}  // namespace lathe
