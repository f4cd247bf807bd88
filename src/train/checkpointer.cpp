#include "train/checkpointer.h"

#include <fmt/format.h>

#include <algorithm>
#include <filesystem>

#include "data/blend_cache.h"
#include "interop/hf_weights.h"
#include "io/fs.h"
#include "io/xxh64.h"
#include "train/checkpoint.h"
#include "train/reshard.h"

namespace lathe {

namespace fs = std::filesystem;

namespace {

// The HF model directory `dir` of `model` (interop/hf_weights.h) and lathe's note of the tokenizer
// it was trained with (lathe.json, read by generate and eval); model.init_from's
// generation_config.json (stop ids, sampling defaults) carries over.
void write_model_dir(const Model& model, const std::string& dir, const Recipe& r) {
  HfSaveOptions so;
  if (!r.init_from.empty()) so.generation_config = generation_config_in(r.init_from);
  save_hf_model(model, dir, so);
  const std::string& tokenizer = r.data.tokenizer;
  nlohmann::json meta = {{"tokenizer", tokenizer}, {"lathe_version", LATHE_VERSION}};
  io::atomic_write_file((fs::path(dir) / "lathe.json").string(), meta.dump(2) + "\n");
}

}  // namespace

void load_rank_moments(const std::string& dir, RankModel& rm, parallel::DistOptimizer& opt) {
  const MomentSlice mine = moment_slice(opt.local(), opt.state_begin(), opt.state_begin(), opt.state_end());
  if (!rm.sharded()) {
    load_checkpoint_moments(dir, rm.model(), mine);
    return;
  }
  const CheckpointPieces pieces(dir);
  load_moments_sharded(pieces, rm.share().whole(), rm.share().local(), rm.tp_rank(), rm.tp(), mine);
}

bool Checkpointer::due(int64_t done, bool last) const {
  const int64_t every = p_.r.output.checkpoint_every;
  return every > 0 && (done % every == 0 || last);
}

void Checkpointer::save(int64_t done, double lr) {
  const Recipe& r = p_.r;
  Model& model = p_.rm.model();
  if (p_.opt.device_path()) {  // host fp32 checkpoints whatever the device
    model.download_params();
    p_.opt.download_state();
  }
  CheckpointState st;
  st.step = done;
  st.consumed_samples = done * p_.G;
  st.loader = p_.loader.state();
  if (p_.plan) {  // which samples of which dataset the run has consumed (checked on resume)
    st.blend_taken = data::blend_taken_before(*p_.plan, st.loader.position);
    st.blend_plan_xxh64 = io::hex64(data::blend_prefix_hash(*p_.plan, st.loader.position));
  }
  st.rng = {static_cast<uint64_t>(r.training.seed)};  // no other RNG: the loader derives its order from it
  st.recipe = r.to_json();
  st.lathe_version = LATHE_VERSION;
  st.lr = lr;
  st.threads = p_.threads;
  st.optimizer = r.optimizer.name;
  const optim::LossScaler& scaler = p_.scaler;
  st.loss_scale = scaler.scale();
  st.loss_scale_dynamic = scaler.dynamic();
  st.loss_scale_good_steps = scaler.state().good_steps;
  st.skipped_steps = scaler.state().skipped_steps;
  st.consecutive_skipped_steps = scaler.state().consecutive_skipped;
  st.has_health = true;
  st.health = p_.anomaly.health(done, last_loss_, last_norm_);
  st.has_anomaly = p_.anomaly.enabled() || p_.anomaly.state().skipped_updates > 0;
  st.anomaly = p_.anomaly.state();
  CheckpointSaveInfo info;
  const int keep_last = static_cast<int>(r.output.keep_last);  // sparing the newest healthy one for rollback
  const bool keep_healthy = r.training.anomaly.enabled && r.training.anomaly.rollback_after > 0;
  // Every rank writes the moments of its part of the flat buffer (its ZeRO shard; with ZeRO 0 the
  // same cut, so the ranks share the writing), rank 0 the weights and state.json once all are done.
  parallel::DistOptimizer& opt = p_.opt;
  if (p_.rm.sharded()) {
    save_sharded(st, info);
  } else if (p_.topo.lay.dp == 1) {
    save_checkpoint(r.output.dir, model, &opt.local(), st, keep_last, &info, keep_healthy, p_.pause_ms);
  } else {
    const parallel::FlatShards& sh = opt.shards();
    const int rank = p_.topo.rank();
    save_checkpoint_sharded(r.output.dir, model,
                            moment_slice(opt.local(), opt.state_begin(), sh.begin(rank), sh.end(rank)), st, keep_last,
                            &info, p_.topo.world, keep_healthy, p_.pause_ms);
  }
  last_saved_ = (fs::path(r.output.dir) / "checkpoints" / fmt::format("step_{:08d}", done)).string();
  if (!info.moved_aside.empty())
    p_.log.say(fmt::format("moved the existing {} aside to {}", last_saved_, info.moved_aside));
  const double mb = static_cast<double>(info.bytes) / 1e6;
  p_.log.log(fmt::format(
      "saved checkpoint {} ({:.1f} MB in {:.2f} s, {:.0f} MB/s{})", last_saved_, mb, info.seconds_complete,
      mb / std::max(info.seconds_complete, 1e-9),
      info.seconds_total - info.seconds_complete > 0.01
          ? fmt::format("; older checkpoints moved away in {:.2f} s", info.seconds_total - info.seconds_complete)
          : std::string()));
  p_.log.metrics({{"step", done},
                  {"checkpoint_s", info.seconds_complete},
                  {"checkpoint_total_s", info.seconds_total},
                  {"checkpoint_mb", mb}},
                 "checkpoint");
}

// The whole model's weights and moments on tensor-parallel (or pipeline) rank 0 of each replica
// (gathered from the shards or stages), written as a checkpoint of the whole model by the data
// ranks' writers: it resumes at any tensor-parallel or pipeline layout, or in one process.
void Checkpointer::save_sharded(const CheckpointState& st, CheckpointSaveInfo& info) {
  const Recipe& r = p_.r;
  parallel::DistOptimizer& opt = p_.opt;
  const int dp = p_.topo.lay.dp, dp_rank = p_.topo.lay.dp_rank;
  const size_t P = p_.rm.model().num_params();
  Model& w = p_.rm.current_whole();
  const MomentSlice mine = moment_slice(opt.local(), opt.state_begin(), opt.state_begin(), opt.state_end());
  std::vector<std::vector<float>> all(mine.buffers.size(), std::vector<float>(w.num_params()));
  std::vector<float> local(r.parallel.zero > 0 ? P : 0);
  for (size_t i = 0; i < all.size(); ++i) {
    const float* full = mine.buffers[i].second;  // ZeRO 0: this rank's whole local buffer
    if (r.parallel.zero > 0) {                   // ZeRO: the data ranks' shards of the local buffer first
      p_.topo.data().all_gather(mine.buffers[i].second, local.data(), opt.shards().sizes(), DType::F32);
      full = local.data();
    }
    p_.rm.gather(full, all[i].data());
  }
  if (p_.topo.groups.ckpt_writers) {
    const std::vector<size_t> cut = dist::even_counts(w.num_params(), dp);
    MomentSlice part;
    for (int i = 0; i < dp_rank; ++i) part.begin += cut[static_cast<size_t>(i)];
    part.end = part.begin + cut[static_cast<size_t>(dp_rank)];
    for (size_t i = 0; i < all.size(); ++i) part.buffers.push_back({mine.buffers[i].first, all[i].data() + part.begin});
    const bool keep_healthy = r.training.anomaly.enabled && r.training.anomaly.rollback_after > 0;
    save_checkpoint_sharded(r.output.dir, w, part, st, static_cast<int>(r.output.keep_last), &info,
                            *p_.topo.groups.ckpt_writers, keep_healthy, p_.pause_ms);
  }
  p_.topo.replica()->barrier();  // the checkpoint is complete before any rank of the replica goes on
  p_.rm.release_whole();
}

bool Checkpointer::export_due(int64_t done, bool last) const {
  const Recipe& r = p_.r;
  return r.output.save_every > 0 && done % r.output.save_every == 0 && !last;
}

void Checkpointer::maybe_export_hf(int64_t done, bool last) {
  const Recipe& r = p_.r;
  if (!export_due(done, last)) return;
  const std::string dir = (fs::path(r.output.dir) / fmt::format("step_{:08d}", done)).string();
  Model& w = p_.rm.current_whole();  // collective with tensor parallelism
  if (p_.log.rank0()) write_model_dir(w, dir, r);
  p_.rm.release_whole();
  p_.log.log("saved " + dir);
}

Model& Checkpointer::export_final(const std::string& dir) {
  Model& w = p_.rm.current_whole();  // collective with tensor parallelism
  if (p_.log.rank0()) write_model_dir(w, dir, p_.r);
  p_.log.log(fmt::format("saved Hugging Face model directory {}", dir));
  return w;
}

}  // namespace lathe
