#include "train/trainer.h"

#include <fmt/format.h>
#include <omp.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "core/blas_env.h"
#include "core/progress.h"
#include "core/sysinfo.h"
#include "core/timer.h"
#include "core/trace.h"
#include "data/blend_cache.h"
#include "io/fs.h"
#include "io/xxh64.h"
#include "kernels/cpu/isa.h"
#include "kernels/cpu/ops_bf16.h"
#include "models/hf_weights.h"
#include "models/memory.h"
#include "optim/clip.h"
#include "optim/loss_scaler.h"
#include "optim/optimizer.h"
#include "optim/schedule.h"
#include "parallel/grad_sync.h"
#include "parallel/model_parallel.h"
#include "parallel/pipeline_executor.h"
#include "parallel/plan.h"
#include "parallel/sharded_optimizer.h"
#include "parallel/tensor_parallel.h"
#include "tokenizer/tokenizer.h"
#include "train/anomaly.h"
#include "train/anomaly_rollback.h"
#include "train/checkpoint.h"
#include "train/consistency.h"
#include "train/device_select.h"
#include "train/device_step.h"
#include "train/device_tp.h"
#include "train/eval_tasks.h"
#include "train/generate.h"
#include "train/peak.h"
#include "train/preflight.h"
#include "train/reshard.h"
#include "train/run_dir.h"
#include "train/run_control.h"
#include "train/run_log.h"
#include "train/run_outputs.h"
#include "train/train_step.h"

namespace lathe {

namespace fs = std::filesystem;

namespace {

// A validation pass whose evaluated tokens are all masked (mask_loss_after_eod) has no loss: the
// record carries val_tokens 0 and no val_loss, the log says why, instead of a loss of 0.0000.
constexpr const char* kNoValidationTargets =
    "no target tokens in the evaluated batches (every token follows an EOD under data.mask_loss_after_eod)";
nlohmann::json validation_record(int64_t step, double loss, int64_t tokens) {
  nlohmann::json j = {{"step", step}, {"val_tokens", tokens}};
  if (tokens) j["val_loss"] = loss;
  return j;
}

// The layout every rank must agree on before any work: the degrees against the number of processes,
// and the same recipe on every rank (a different --set on one host would otherwise train nonsense).
void check_layout(Recipe& r, dist::Communicator& world) {
  resolve_layout(r, world.size());
  if (world.size() == 1) return;
  std::string mine = r.to_json().dump();
  int64_t len = static_cast<int64_t>(mine.size());
  world.broadcast(&len, sizeof(len), 0);
  std::string first(static_cast<size_t>(len), '\0');
  if (world.rank() == 0) first = mine;
  world.broadcast(first.data(), first.size(), 0);
  std::string differs;
  if (first != mine)
    for (const auto& c : diff_recipes(nlohmann::json::parse(first), r.to_json()))
      differs += fmt::format("\n  {}: rank 0 has {}, rank {} has {}", c.key, c.before, world.rank(), c.after);
  int64_t bad = differs.empty() ? 0 : 1;
  world.all_reduce(&bad, 1, DType::I64, dist::ReduceOp::Max);
  if (!differs.empty())
    throw_error("the recipe differs between ranks (every process must load the same recipe and --set values):{}",
                differs);
  if (bad != 0) {
    // The ranks that found differences print them and end the job; give them the time to do so
    // first, or this rank's abort could kill them before their message (which names the keys) is out.
    std::this_thread::sleep_for(std::chrono::seconds(3));
    throw_error("the recipe differs between ranks; see the error of the rank that reports the keys");
  }
}

}  // namespace

std::pair<double, int64_t> evaluate_samples(Model& model, const data::IndexedDataset& ds,
                                            const std::vector<int64_t>& samples, int64_t B, int64_t T,
                                            const DocumentOptions* docs, const EvalForward* forward) {
  std::vector<int32_t> window(static_cast<size_t>(T + 1)), in(static_cast<size_t>(B * T)),
      tg(static_cast<size_t>(B * T)), doc_start, positions;
  double sum = 0;
  int64_t tokens = 0;
  for (size_t i = 0; i < samples.size(); i += static_cast<size_t>(B)) {
    const int64_t b = std::min<int64_t>(B, static_cast<int64_t>(samples.size() - i));
    for (int64_t r = 0; r < b; ++r) {
      ds.read_global(samples[i + r] * T, T + 1, window.data());
      std::copy(window.begin(), window.begin() + T, in.begin() + r * T);
      std::copy(window.begin() + 1, window.end(), tg.begin() + r * T);
    }
    if (docs && docs->model_needs_documents())
      set_batch_documents(model, *docs, in.data(), b, T, doc_start, positions);
    else  // plain causal attention, whatever documents an earlier pass left set
      model.set_documents(nullptr, nullptr, 0, 0);
    if (docs && docs->mask_loss)
      tokens += mask_loss_after_eod(in.data(), tg.data(), b * T, docs->eod);
    else
      tokens += b * T;
    sum +=
        forward ? (*forward)(in.data(), tg.data(), b) : model.forward_backward(in.data(), tg.data(), b, T, 0.0f, false);
  }
  return {tokens ? sum / static_cast<double>(tokens) : 0.0, tokens};
}

TrainResult train(const Recipe& recipe, const TrainOptions& opts) {
  std::unique_ptr<dist::Communicator> own_world;
  dist::Communicator* world = opts.world;
  if (!world) {
    own_world = dist::make_local_communicator();
    world = own_world.get();
  }
  const bool rank0 = world->rank() == 0;
  Recipe r = recipe;
  // Only rank 0 prints, writes metrics, recipe.yaml, checkpoints' state and the HF model.
  RunLog rlog(r, rank0, opts.quiet);
  auto log = rlog.log_fn();
  auto say = rlog.say_fn();
  check_layout(r, *world);
  // This rank's coordinates and groups (parallel/model_parallel.h: tensor fastest, then data,
  // then pipeline, so a tensor group is tp consecutive ranks: one host when ranks fill hosts in order).
  const parallel::RankLayout lay = parallel::RankLayout::of(
      world->rank(), world->size(), static_cast<int>(r.parallel.tensor), static_cast<int>(r.parallel.pipeline));
  const int tp = lay.tp, pp = lay.pp, dp = lay.dp, dp_rank = lay.dp_rank, tp_rank = lay.tp_rank, pp_rank = lay.pp_rank,
            rank = world->rank();
  parallel::ProcessGroups groups = parallel::make_process_groups(*world, lay);
  std::unique_ptr<dist::Communicator>&tp_group = groups.tp, &dp_group = groups.dp, &pp_group = groups.pp,
  &ckpt_writers = groups.ckpt_writers;
  dist::Communicator& dpc = dp_group ? *dp_group : *world;  // the data-parallel group
  RunControl control(opts, r, *world, dp, rlog);
  struct CleanupJoin {  // old checkpoints are removed in the background; done before returning
    ~CleanupJoin() { wait_for_checkpoint_cleanup(); }
  } cleanup_join;
  if (r.training.threads > 0) omp_set_num_threads(r.training.threads);
  const int threads = omp_get_max_threads();
  const int64_t B = r.training.micro_batch_size, T = r.training.seq_len, accum = r.training.grad_accum_steps;
  // Every step consumes one global batch of G samples; rank r takes rows [r*B*accum, (r+1)*B*accum)
  // of it, as `accum` micro-batches of B. The sample order does not depend on the layout.
  const int64_t G = B * accum * dp;

  // ---- everything that can fail on bad input is checked before any training work, by the same
  // function `lathe check` runs (train/preflight.h) ----
  // This machine's copy bandwidth for the plan line printed at start, measured before anything
  // large is allocated (its two 64 MB buffers must not add to the run's peak memory).
  const double copy_gbps = world->size() > 1 ? lathe::plan::measure_copy_gbps() : 100.0;
  Preflight pf = preflight(r, opts, rlog.preflight_log(), /*check_only=*/false);
  // Before any write, after preflight's errors (as `lathe check` orders them): a new run never reuses
  // a directory that holds another run (--overwrite moves it aside).
  claim_run_dir(r, opts.resume.empty() ? r.training.resume : opts.resume, opts.overwrite, *world, say);
  const std::string& ckpt = pf.ckpt;
  const CheckpointState& cs = pf.cs;
  std::unique_ptr<Model> model = std::move(pf.model);
  auto train_ds = pf.train_ds;
  auto valid_ds = pf.valid_ds;
  const std::vector<int64_t>& train_samples = pf.train_samples;
  const std::vector<int64_t>& valid_samples = pf.valid_samples;
  // data.tokenizer, the EOD settings and training.eval_tasks' items: loaded and checked by preflight.
  std::unique_ptr<tok::Tokenizer> tokenizer = std::move(pf.tokenizer);
  const DocumentOptions docs = pf.docs;
  if (docs.any())
    log(fmt::format("documents: {} attention, positions {}, loss after EOD {} (EOD id {})", r.data.attention,
                    docs.reset_positions ? "restart at each document" : "0..seq_len-1",
                    docs.mask_loss ? "masked" : "trained", docs.eod));
  const std::vector<McItem> mc_items = std::move(pf.mc_items);
  if (ckpt.empty() && r.init_from.empty() && !pf.table_only)
    model->init_weights(static_cast<uint64_t>(r.training.seed));
  // Tensor and/or pipeline parallelism: preflight's model is the whole model (init, init_from or
  // checkpoint weights, activations not allocated); each rank computes with its tensor shard of
  // its pipeline stage (parallel/model_parallel.h), the pipeline's stages run by the schedule's
  // executor, and the whole model is rebuilt when checkpoints and the HF directory need it.
  std::unique_ptr<Model> whole;
  std::vector<std::pair<size_t, size_t>> tp_owned;
  std::unique_ptr<dist::Communicator> tp_device;  // device: cuda: the hooks' NCCL group (train/device_tp.h)
  parallel::PipelineLayout pl;
  std::unique_ptr<parallel::PipelineExecutor> pipe;
  std::unique_ptr<parallel::RankShare> share;
  const bool sharded = tp > 1 || pp > 1;
  if (sharded) {
    whole = std::move(model);
    if (pp > 1)
      pl = parallel::pipeline_layout(r, whole->config().num_hidden_layers, whole->arch().tied_lm_head, pp_rank);
    model = parallel::build_rank_model(*whole, tp, tp_rank, r.parallel.sequence, pp > 1 ? &pl : nullptr);
    share = std::make_unique<parallel::RankShare>(whole->params(), model->params(), pp > 1 ? &pl : nullptr, tp_rank, tp,
                                                  tp_group.get(), pp_group.get());
    if (!pf.table_only)  // init_from: every rank loaded the whole HF model
      share->scatter(whole->param_data(), model->param_data());
    else if (!ckpt.empty())  // only this rank's runs of each weight (train/reshard.h)
      load_weights_sharded(CheckpointPieces(ckpt), whole->params(), model->params(), tp_rank, tp, model->param_data());
    else  // the values init_weights gives the whole model, drawn tensor by tensor and sliced
      parallel::init_shard(*model, whole->params(), tp_rank, tp, static_cast<uint64_t>(r.training.seed));
    model->upload_params();  // device: cuda: the shard's weights (no-op on the CPU)
    // parallel::attach_tensor_parallel on the CPU; device: cuda the hooks on an NCCL group.
    if (tp > 1) tp_device = attach_tensor_parallel_on_device(*model, *tp_group);
    const Recompute rc = parse_recompute(r.recompute, r.source + ": recompute");
    if (pp > 1)  // one activation arena per micro-batch the schedule holds at once
      pipe = std::make_unique<parallel::PipelineExecutor>(*model, pl, *pp_group, B, T, 2, rc);
    else
      model->allocate(B, T, 2, rc);
    if (pipe && device_path_on_host())  // test hook (train/device_step.h): the device staging on the CPU
      pipe->set_stage_through_host(true);
    tp_owned = share->owned_ranges();
  }
  // The ranks of one replica (tensor x pipeline): the gradient norm's group without ZeRO, and the
  // barrier after a checkpoint.
  dist::Communicator* shard_group = groups.model_group();
  // The whole model exists only while a checkpoint, an HF directory or a rollback needs it (rebuilt
  // here, without gradients): between those each rank holds its shard only, so per-rank memory
  // falls with the tensor and pipeline degrees as `lathe plan` counts it.
  const ModelConfig whole_cfg = (whole ? *whole : *model).config();
  const size_t whole_P = (whole ? *whole : *model).num_params();
  const double whole_flops_per_token = (whole ? *whole : *model).flops_per_token(T);
  auto ensure_whole = [&]() -> Model& {
    if (!whole) whole = build_model(whole_cfg, ComputeSpec{&model->backend(), model->compute_dtype(), false});
    return *whole;
  };
  auto release_whole = [&] {
    if (sharded) whole.reset();
  };
  release_whole();  // the shards hold the weights now; a resume rebuilds it to read the moments
  // A buffer laid out like the whole model's parameters from each rank's local one (collective over
  // the replica), and this rank's part of such a buffer.
  auto gather_whole = [&](const float* local, float* global) { share->gather(local, global); };
  auto scatter_local = [&](const float* global, float* local) { share->scatter(global, local); };
  // The whole model with this replica's current weights (collective over the shard group).
  auto whole_model = [&]() -> Model& {
    if (!sharded) {
      model->download_params();  // device: cuda: the host staging copy of the weights (no-op on the CPU)
      return *model;
    }
    Model& w = ensure_whole();
    model->download_params();  // device: cuda (no-op on the CPU)
    gather_whole(model->param_data(), w.param_data());
    w.upload_params();
    return w;
  };
  model->refresh_compute_weights();  // the weights are final (init, init_from or checkpoint)
  // Loss scale and skipped-step counters; a resume continues them exactly (a checkpoint of a run
  // without dynamic scaling restarts the scale at precision.loss_scale.initial).
  optim::LossScaler scaler(loss_scale_config(r));
  if (!ckpt.empty()) {
    const optim::LossScalerState ls =
        resume_loss_scale(cs, ckpt, scaler.scale(), scaler.dynamic(), r.precision.loss_scale.min, say);
    scaler.restore(ls, (fs::path(ckpt) / "state.json").string());
    if (scaler.dynamic() && !cs.loss_scale_dynamic)
      say(fmt::format("resume: the checkpoint's run did not scale the loss; starting at loss scale {}",
                      scaler.scale()));
  }
  // Loss-spike and NaN policy; a resume continues its statistics and counters (its skip count
  // enters AdamW's step count even when the resumed recipe turns the policy off).
  AnomalyPolicy anomaly(r.training.anomaly);
  if (!ckpt.empty() && cs.has_anomaly) anomaly.restore(cs.anomaly);
  std::vector<optim::ParamRange> ranges;
  for (const ParamSpec& s : model->params().specs())
    ranges.push_back({s.offset, static_cast<size_t>(s.numel()), s.decay, static_cast<int64_t>(ranges.size())});
  const optim::ScheduleConfig sched = schedule_config(r);
  const size_t P = model->num_params();
  // The optimizer over this rank's part of the flat buffer (ZeRO) and the data-parallel gradient
  // reduction, fed by the model's grads_ready hook during the last micro-batch's backward.
  parallel::ShardedOptimizer opt(dpc, optimizer_config(r), P, ranges, static_cast<int>(r.parallel.zero));
  if (tp > 1) {
    // LAMB's per-tensor norms add the shards of split tensors over the tensor group: the tensors
    // a rank other than 0 owns (owned_ranges) are exactly the split ones.
    const auto split = parallel::owned_ranges(model->params(), 1);
    std::vector<bool> sharded;
    for (const ParamSpec& s : model->params().specs())
      sharded.push_back(std::any_of(split.begin(), split.end(),
                                    [&](const auto& sp) { return s.offset >= sp.first && s.offset < sp.second; }));
    opt.set_tensor_parallel(*tp_group, std::move(sharded));
  }
  // This rank's moments from checkpoint `dir` (resume, rollback), whatever layout wrote it
  // (re-sharded by flat offset: train/checkpoint.h). Tensor parallelism: the whole model's moments,
  // then this rank's slices.
  const size_t state_b = opt.state_begin(), state_e = opt.state_end();  // this rank's moments (ZeRO shard)
  auto load_moments = [&](const std::string& dir) {
    const MomentSlice mine = moment_slice(opt.local(), state_b, state_b, state_e);
    if (!sharded) {
      load_checkpoint_moments(dir, *model, mine);
      return;
    }
    // Only the runs of each global moment that land in this rank's tensors (its stage's, its
    // tensor shard of them) and its ZeRO shard are read (train/reshard.h).
    const CheckpointPieces pieces(dir);
    load_moments_sharded(pieces, share->whole(), share->local(), tp_rank, tp, mine);
  };
  if (!ckpt.empty()) load_moments(ckpt);
  // device: cuda: norm and update on the device, moments staged through opt.local() (train/device_step.h).
  // Data parallelism: gradients and ZeRO's weight shards over NCCL, scalars over dpc (train/device_dp.h).
  std::unique_ptr<DeviceOptimizer> dev_opt = make_device_optimizer(*model, r, ranges, opt, dpc);
  if (dev_opt) dev_opt->upload_state();
  release_whole();
  // Tensor parallelism: the norm counts each element of the whole model once. With ZeRO only this
  // rank's shard of the gradient is reduced, so the squares are summed over the world.
  // Pipeline parallelism: each stage counts its own tensors (a tied wte on the first stage only).
  dist::Communicator* tp_norm_group = sharded ? (r.parallel.zero > 0 ? world : shard_group) : nullptr;
  if (sharded && r.parallel.zero > 0) {
    std::vector<std::pair<size_t, size_t>> in_shard;
    for (auto [b, e] : tp_owned)
      if (std::max(b, state_b) < std::min(e, state_e)) in_shard.push_back({std::max(b, state_b), std::min(e, state_e)});
    tp_owned = std::move(in_shard);
  }
  if (dev_opt && tp_norm_group) dev_opt->set_grad_norm_group(*tp_norm_group, tp_owned);
  const size_t bucket_elems = static_cast<size_t>(std::max(1.0, r.parallel.bucket_mb * (1 << 20) / 4));
  std::unique_ptr<parallel::GradSync> sync;
  bool sync_this_pass = false;
  if (dp > 1 && !dev_opt) {
    sync = std::make_unique<parallel::GradSync>(dpc, model->grad_data(), opt.shards(),
                                                static_cast<int>(r.parallel.zero), bucket_elems);
    model->hooks().grads_ready = [&](size_t b, size_t e) {  // keeps the tensor-parallel hook
      if (sync_this_pass) sync->ready(b, e);
    };
  }
  if (dp > 1 && dev_opt)  // device: cuda: buckets reduced over NCCL as backward fills them (train/device_dp.h)
    model->hooks().grads_ready = [&](size_t b, size_t e) {
      if (sync_this_pass) dev_opt->grads_ready(b, e);
    };

  int64_t start_step = 0;
  if (!ckpt.empty()) {
    start_step = cs.step;
    say(fmt::format("resume: loaded {} (step {}, epoch {}, position {}, {} samples consumed)", ckpt, cs.step,
                    cs.loader.epoch, cs.loader.position, cs.consumed_samples));
    if (cs.threads != threads)
      say(
          fmt::format("resume: WARNING: the checkpoint was written with {} threads, this run uses {}: losses will "
                      "not be bit-identical to an uninterrupted run (float sums change order)",
                      cs.threads, threads));
    // Newer checkpoints in this run directory belong to an abandoned timeline: moved aside.
    if (rank0) move_newer_checkpoints_aside(r.output.dir, ckpt, start_step, say);
  } else if (!r.init_from.empty()) {
    log(fmt::format("init_from {}: {}", r.init_from, pf.init_report));
  }

  // ---- outputs (output.dir exists and is writable: preflight) ----
  // A blend (data.blend) reads global sample g of the run from the plan (dataset, sample); one
  // pass, no loader epochs: the plan covers training.steps x G samples and already repeats and
  // reshuffles each dataset (data/blend.h). Ranks take their rows of each global batch as below.
  const auto& plan = pf.blend_plan;
  rlog.startup(StartupFacts{
      .model = *model,
      .whole_cfg = whole_cfg,
      .whole_params = whole_P,
      .whole_flops_per_token = whole_flops_per_token,
      .world_size = world->size(),
      .tp = tp,
      .pp = pp,
      .dp = dp,
      .threads = threads,
      .B = B,
      .T = T,
      .accum = accum,
      .G = G,
      .copy_gbps = copy_gbps,
      .moment_elems = opt.state_end() - opt.state_begin(),
      .bucket_elems = bucket_elems,
      .pipeline = pp > 1 ? &pl : nullptr,
      .scaler = scaler,
      .resumed = !ckpt.empty(),
      .start_step = start_step,
      .data_line = plan ? fmt::format("data: blend of {} datasets, {} planned samples, {} validation samples of {} tokens",
                                      pf.blend_ds.size(), plan->dataset.size(), valid_samples.size(), T)
                        : fmt::format("data: {} train samples, {} validation samples of {} tokens",
                                      train_samples.size(), valid_samples.size(), T)});

  std::unique_ptr<data::DataLoader> loader_ptr =
      plan
          ? std::make_unique<data::DataLoader>(pf.blend_ds, plan, G, T, r.data.prefetch, dp_rank * B * accum, B * accum)
          : std::make_unique<data::DataLoader>(train_ds, train_samples, G, T, static_cast<uint64_t>(r.training.seed),
                                               true, r.data.prefetch, dp_rank * B * accum, B * accum);
  data::DataLoader& loader = *loader_ptr;
  // Restarts the prefetcher at the saved position (for a blend verified against this run's plan by
  // preflight unless --force-resume-changes).
  if (!ckpt.empty()) {
    data::LoaderState at = cs.loader;
    if (plan && (at.epoch != 0 || at.position > static_cast<int64_t>(plan->dataset.size()))) {
      // --force-resume-changes from another data setting: the blend continues at step x G.
      at = {0, std::min<int64_t>(start_step * G, static_cast<int64_t>(plan->dataset.size()))};
      say(
          fmt::format("resume: the checkpoint's data position (epoch {}, position {}) is not one of this blend's "
                      "plan; continuing the blend at sample {} (step {} x global batch {})",
                      cs.loader.epoch, cs.loader.position, at.position, start_step, G));
    }
    loader.restore(at);
  }
  std::vector<int64_t> eval_subset(valid_samples.begin(),
                                   valid_samples.begin() + std::min<int64_t>(static_cast<int64_t>(valid_samples.size()),
                                                                             r.training.eval_batches * B));
  rlog.open_records(!ckpt.empty(), anomaly.enabled());
  auto write_metrics = [&](const nlohmann::json& j) { rlog.metrics(j); };
  auto audit = [&](const nlohmann::json& j, const std::string& line) { rlog.audit(j, line); };
  double last_loss = NAN, last_norm = NAN;  // of the last step: the health of a checkpoint

  std::vector<int32_t> inputs(static_cast<size_t>(B * accum * T)), targets(static_cast<size_t>(B * accum * T));
  TrainResult result;
  result.start_step = result.end_step = start_step;
  result.resumed_from = ckpt;
  auto checkpoint = [&](int64_t done, double lr) {
    if (dev_opt) {  // host fp32 checkpoints whatever the device
      model->download_params();
      dev_opt->download_state();
    }
    CheckpointState st;
    st.step = done;
    st.consumed_samples = done * G;
    st.loader = loader.state();
    if (plan) {  // which samples of which dataset the run has consumed (checked on resume)
      st.blend_taken = data::blend_taken_before(*plan, st.loader.position);
      st.blend_plan_xxh64 = io::hex64(data::blend_prefix_hash(*plan, st.loader.position));
    }
    st.rng = {static_cast<uint64_t>(r.training.seed)};  // no other RNG: the loader derives its order from it
    st.recipe = r.to_json();
    st.lathe_version = LATHE_VERSION;
    st.lr = lr;
    st.threads = threads;
    st.optimizer = r.optimizer.name;
    st.loss_scale = scaler.scale();
    st.loss_scale_dynamic = scaler.dynamic();
    st.loss_scale_good_steps = scaler.state().good_steps;
    st.skipped_steps = scaler.state().skipped_steps;
    st.consecutive_skipped_steps = scaler.state().consecutive_skipped;
    st.has_health = true;
    st.health = anomaly.health(done, last_loss, last_norm);
    st.has_anomaly = anomaly.enabled() || anomaly.state().skipped_updates > 0;
    st.anomaly = anomaly.state();
    CheckpointSaveInfo info;
    const int keep_last = static_cast<int>(r.output.keep_last);  // sparing the newest healthy one for rollback
    const bool keep_healthy = r.training.anomaly.enabled && r.training.anomaly.rollback_after > 0;
    // Every rank writes the moments of its part of the flat buffer (its ZeRO shard; with ZeRO 0 the
    // same cut, so the ranks share the writing), rank 0 the weights and state.json once all are done.
    if (sharded) {
      // The whole model's weights and moments on tensor-parallel (or pipeline) rank 0 of each
      // replica (gathered from the shards or stages), written as a checkpoint of the whole model by
      // the dp writers: it resumes at any tensor-parallel or pipeline layout, or in one process.
      Model& w = whole_model();
      const MomentSlice mine = moment_slice(opt.local(), state_b, state_b, state_e);
      std::vector<std::vector<float>> all(mine.buffers.size(), std::vector<float>(w.num_params()));
      std::vector<float> local(r.parallel.zero > 0 ? P : 0);
      for (size_t i = 0; i < all.size(); ++i) {
        const float* full = mine.buffers[i].second;  // ZeRO 0: this rank's whole local buffer
        if (r.parallel.zero > 0) {                   // ZeRO: the data ranks' shards of the local buffer first
          dpc.all_gather(mine.buffers[i].second, local.data(), opt.shards().sizes(), DType::F32);
          full = local.data();
        }
        gather_whole(full, all[i].data());
      }
      if (ckpt_writers) {
        const std::vector<size_t> cut = dist::even_counts(w.num_params(), dp);
        MomentSlice part;
        for (int i = 0; i < dp_rank; ++i) part.begin += cut[static_cast<size_t>(i)];
        part.end = part.begin + cut[static_cast<size_t>(dp_rank)];
        for (size_t i = 0; i < all.size(); ++i)
          part.buffers.push_back({mine.buffers[i].first, all[i].data() + part.begin});
        save_checkpoint_sharded(r.output.dir, w, part, st, keep_last, &info, *ckpt_writers, keep_healthy);
      }
      shard_group->barrier();  // the checkpoint is complete before any rank of the replica goes on
      release_whole();
    } else if (dp == 1) {
      save_checkpoint(r.output.dir, *model, &opt.local(), st, keep_last, &info, keep_healthy);
    } else {
      const parallel::FlatShards& sh = opt.shards();
      save_checkpoint_sharded(r.output.dir, *model,
                              moment_slice(opt.local(), opt.state_begin(), sh.begin(rank), sh.end(rank)), st, keep_last,
                              &info, *world, keep_healthy);
    }
    result.last_checkpoint = (fs::path(r.output.dir) / "checkpoints" / fmt::format("step_{:08d}", done)).string();
    if (!info.moved_aside.empty())
      say(fmt::format("moved the existing {} aside to {}", result.last_checkpoint, info.moved_aside));
    const double mb = static_cast<double>(info.bytes) / 1e6;
    log(fmt::format(
        "saved checkpoint {} ({:.1f} MB in {:.2f} s, {:.0f} MB/s{})", result.last_checkpoint, mb, info.seconds_complete,
        mb / std::max(info.seconds_complete, 1e-9),
        info.seconds_total - info.seconds_complete > 0.01
            ? fmt::format("; older checkpoints moved away in {:.2f} s", info.seconds_total - info.seconds_complete)
            : std::string()));
    write_metrics({{"step", done},
                   {"checkpoint_s", info.seconds_complete},
                   {"checkpoint_total_s", info.seconds_total},
                   {"checkpoint_mb", mb}});
  };
  // Validation: each rank takes every dp-th sample of the set; sums and token counts are all-reduced.
  auto evaluate = [&](const std::vector<int64_t>& set) -> std::pair<double, int64_t> {
    std::vector<int64_t> mine;
    for (size_t i = static_cast<size_t>(dp_rank); i < set.size(); i += static_cast<size_t>(dp)) mine.push_back(set[i]);
    // Pipeline: every stage takes part in each batch's forward (the stage model holds the documents).
    const EvalForward pipe_forward = [&](const int32_t* in, const int32_t* tg, int64_t b) {
      return pipe->forward_loss(in, tg, b, nullptr);
    };
    auto [mean, tokens] = evaluate_samples(*model, *valid_ds, mine, B, T, &docs, pipe ? &pipe_forward : nullptr);
    double st[2] = {mean * static_cast<double>(tokens), static_cast<double>(tokens)};
    if (dp > 1) dpc.all_reduce(st, 2, DType::F64);
    return {st[1] > 0 ? st[0] / st[1] : 0.0, static_cast<int64_t>(st[1])};
  };
  // Multiple-choice accuracy (train/eval_tasks.h): each data-parallel replica scores every dp-th
  // item (the tensor-parallel ranks of a replica run the same items together); the counts are
  // all-reduced, so every rank gets the accuracy of the whole file. Contexts are cut to seq_len.
  const int64_t tasks_interval =
      r.training.eval_tasks_interval > 0 ? r.training.eval_tasks_interval : r.training.eval_interval;
  auto score_tasks = [&](int64_t at) {
    trace::Scope span("eval tasks", trace::Cat::Eval, at);
    const double t0 = now_seconds();
    // Pipeline: the stages run each ending's forward together; the last one has the logits and
    // scores, its counts reach the other stages by an all-reduce (theirs are zero).
    LogitsFn pipe_logits;
    if (pipe) pipe_logits = [&](const int32_t* seq, int64_t t, float* out) { pipe->forward_logits(seq, 1, t, out); };
    const McScores sc = score_mc_items(*model, mc_items, std::min<int64_t>(T, model->config().max_position_embeddings),
                                       r.training.eval_tasks, static_cast<size_t>(dp_rank), static_cast<size_t>(dp),
                                       nullptr, pipe_logits);
    int64_t c[3] = {sc.items, sc.right, sc.right_norm};
    if (pipe) {
      if (!pl.last()) c[0] = c[1] = c[2] = 0;
      pp_group->all_reduce(c, 3, DType::I64);
    }
    if (dp > 1) dpc.all_reduce(c, 3, DType::I64);
    const double n = static_cast<double>(std::max<int64_t>(c[0], 1));
    write_metrics({{"step", at},
                   {"tasks_acc", static_cast<double>(c[1]) / n},
                   {"tasks_acc_norm", static_cast<double>(c[2]) / n},
                   {"tasks_items", c[0]}});
    log(fmt::format("step {:>6}/{} | tasks {}: acc {:.4f} | acc_norm {:.4f} ({} items, {:.1f} s)", at, r.training.steps,
                    r.training.eval_tasks, static_cast<double>(c[1]) / n, static_cast<double>(c[2]) / n, c[0],
                    now_seconds() - t0));
  };
  if (start_step == r.training.steps && start_step > 0)
    say(fmt::format("resume: the checkpoint is at the final step {}; only the end-of-run outputs remain", start_step));
  FaultPlan faults = opts.faults;  // train_step strikes a spike from it once it has fired
  StepParts parts{*model,
                  loader,
                  opt,
                  sync.get(),
                  sync_this_pass,
                  dpc,
                  tp_norm_group,
                  tp_owned,
                  sched,
                  r.optimizer.grad_clip,
                  scaler,
                  B,
                  T,
                  accum,
                  G,
                  inputs,
                  targets,
                  anomaly,
                  docs,
                  faults,
                  pipe.get(),
                  dev_opt.get()};
  // The anomaly policy's actions after step `step` (0-based) with stats `st`, each a line in
  // anomalies.jsonl and the log. Returns the step to continue from after a rollback (the healthy
  // checkpoint's), or -1. Every rank runs it with the same decision (the loss and norm are global).
  auto act_on_anomaly = [&](int64_t step, const StepStats& st) -> int64_t {
    const AnomalyDecision& d = st.anomaly;
    const auto& ac = r.training.anomaly;
    const std::string at = fmt::format("step {:>6}/{} | anomaly policy:", step + 1, r.training.steps);
    nlohmann::json base = {{"step", step + 1}, {"loss", st.loss}, {"grad_norm", st.norm}};
    auto line = [&](const char* event, nlohmann::json extra) {
      nlohmann::json j = base;
      j["event"] = event;
      j.update(extra);
      return j;
    };
    if (d.overflow) {
      audit(line("overflow", {{"reason", d.reason}}), fmt::format("{} {}", at, d.reason));
      return -1;
    }
    if (!d.anomaly) return -1;
    audit(line("anomaly", {{"reason", d.reason},
                           {"loss_z", d.loss_z},
                           {"grad_norm_z", d.grad_norm_z},
                           {"in_window", d.in_window},
                           {"anomalies", anomaly.state().anomalies}}),
          fmt::format("{} ANOMALY: {} (loss {:.4f}, z {:.1f}; grad norm {:.4f}, z {:.1f}); {} in the last {} steps "
                      "(training.anomaly.rollback_after {})",
                      at, d.reason, st.loss, d.loss_z, st.norm, d.grad_norm_z, d.in_window, ac.rollback_window,
                      ac.rollback_after));
    if (d.skip)
      audit(line("skip", nlohmann::json::object()),
            fmt::format("{} update skipped (weights and moments unchanged, batch consumed)", at));
    if (d.lower_lr)
      audit(
          line("lower_lr", {{"factor", ac.lr_factor}, {"steps", ac.lr_steps}, {"until_step", step + 1 + ac.lr_steps}}),
          fmt::format("{} learning rate x{} for steps {}-{}", at, ac.lr_factor, step + 2, step + 1 + ac.lr_steps));
    if (d.stop) {
      audit(line("stop", {{"reason", d.stop_reason}}), fmt::format("{} STOP: {}", at, d.stop_reason));
      throw_error(
          "training.anomaly: {}: training stopped. The checkpoints in {} hold the run up to here (state.json "
          "\"health\" says which are healthy); resume one with --resume DIR after lowering optimizer.lr (or "
          "optimizer.grad_clip), or raise training.anomaly.max_rollbacks",
          d.stop_reason, (fs::path(r.output.dir) / "checkpoints").string());
    }
    if (!d.rollback) return -1;
    std::vector<std::string> notes;
    const RollbackTarget target = find_healthy_checkpoint(r.output.dir, step + 1, *world, &notes);
    for (const auto& n : notes) say(fmt::format("{} {}", at, n));
    if (target.step < 0) {
      anomaly.no_rollback_target();
      audit(line("rollback_unavailable", {{"in_window", d.in_window}}),
            fmt::format("{} {} anomalies within {} steps, but no checkpoint recorded as healthy to roll back to: "
                        "continuing (the window restarts)",
                        at, d.in_window, ac.rollback_window));
      return -1;
    }
    // Tensor parallelism: the checkpoint holds the whole model; this rank keeps its shard.
    std::function<CheckpointState(const std::string&)> load_tp;
    if (sharded)
      load_tp = [&](const std::string& dir) {
        Model& w = ensure_whole();
        CheckpointState c = load_checkpoint(dir, w, nullptr);
        scatter_local(w.param_data(), model->param_data());
        load_moments(dir);
        return c;
      };
    // A blend is one pass over its plan (sized for the rollbacks by preflight): its "epoch" is the plan.
    const RollbackResult rb =
        restore_for_rollback(target, step + 1, ac.skip_samples, *model, opt, loader, scaler, anomaly,
                             static_cast<int64_t>(plan ? plan->dataset.size() : train_samples.size()), G, load_tp);
    if (dev_opt) {  // the restored moments, and the weights (a tensor-parallel shard is scattered on the host)
      model->upload_params();
      model->refresh_compute_weights();
      dev_opt->upload_state();
    }
    release_whole();
    // The curves continue from the checkpoint (as after a resume); anomalies.jsonl keeps everything.
    rlog.restart_metrics_at(target.step);
    if (rank0) move_checkpoints_after(r.output.dir, target.step);
    world->barrier();
    result.losses.resize(static_cast<size_t>(std::max<int64_t>(0, target.step - result.start_step)));
    const data::LoaderState &before = rb.before, &after = rb.after;
    audit(line("rollback", {{"to_step", target.step},
                            {"checkpoint", target.dir},
                            {"skip_samples", rb.skipped_samples},
                            {"loader_before", {{"epoch", before.epoch}, {"position", before.position}}},
                            {"loader_after", {{"epoch", after.epoch}, {"position", after.position}}},
                            {"rollbacks", anomaly.state().rollbacks},
                            {"lr_factor", ac.lr_factor},
                            {"lr_steps", anomaly.state().lr_steps_left}}),
          fmt::format("{} ROLLBACK {} of {}: {} anomalies within {} steps; weights, moments and loss scale restored "
                      "from {} (step {}); {} samples skipped (loader epoch {} position {} -> epoch {} position {}); "
                      "learning rate x{} for {} steps; newer checkpoints moved aside",
                      at, anomaly.state().rollbacks, ac.max_rollbacks, d.in_window, ac.rollback_window, target.dir,
                      target.step, rb.skipped_samples, before.epoch, before.position, after.epoch, after.position,
                      ac.lr_factor, anomaly.state().lr_steps_left));
    return target.step;
  };
  StepStats prev;
  for (int64_t step = start_step; step < r.training.steps; ++step) {
    control.before_step(step);
    const StepStats st = train_step(parts, step, prev);
    control.after_step(step);
    if (!st.skipped) prev = st;
    last_loss = st.loss;
    last_norm = st.norm;
    result.losses.push_back(st.loss);
    rlog.step(step, st, scaler, anomaly);
    if (const int64_t back = act_on_anomaly(step, st); back >= 0) {
      step = back - 1;  // the loop's ++step continues with the checkpoint's next step
      prev = StepStats{};
      continue;
    }
    const bool last = step + 1 == r.training.steps;
    if (!eval_subset.empty() && r.training.eval_interval > 0 && (step + 1) % r.training.eval_interval == 0 && !last) {
      trace::Scope span("validation", trace::Cat::Eval, step + 1);
      auto [vl, vt] = evaluate(eval_subset);
      write_metrics(validation_record(step + 1, vl, vt));
      log(vt ? fmt::format("step {:>6}/{} | validation loss {:.4f} ({} tokens)", step + 1, r.training.steps, vl, vt)
             : fmt::format("step {:>6}/{} | validation: {}", step + 1, r.training.steps, kNoValidationTargets));
    }
    if (!mc_items.empty() && tasks_interval > 0 && (step + 1) % tasks_interval == 0 && !last) score_tasks(step + 1);
    if (r.output.save_every > 0 && (step + 1) % r.output.save_every == 0 && !last) {
      const std::string dir = (fs::path(r.output.dir) / fmt::format("step_{:08d}", step + 1)).string();
      Model& w = whole_model();  // collective with tensor parallelism
      if (rank0) write_model_dir(w, dir, r.data.tokenizer);
      release_whole();
      log("saved " + dir);
    }
    result.end_step = step + 1;
    const StopRequest stop = control.stop_requested(step + 1, last);
    const bool periodic = r.output.checkpoint_every > 0 && ((step + 1) % r.output.checkpoint_every == 0 || last);
    if (periodic || stop) {
      trace::Scope span("checkpoint save", trace::Cat::Io, step + 1);
      checkpoint(step + 1, st.lr);
    }
    if (stop) {
      control.announce(stop, step + 1);
      result.interrupted = stop.signal != 0;
      return result;
    }
  }

  // The training steps' peak (before the final validation and the HF directory, which assembles a
  // copy of the weights): the figure the memory estimate and `lathe plan` predict.
  int64_t train_peak_rss = static_cast<int64_t>(peak_rss_bytes());
  if (world->size() > 1) world->all_reduce(&train_peak_rss, 1, DType::I64, dist::ReduceOp::Max);
  if (!valid_samples.empty()) {
    // Final validation on (up to 256 batches of) the whole validation split.
    std::vector<int64_t> final_set(valid_samples.begin(),
                                   valid_samples.begin() + std::min<int64_t>(valid_samples.size(), 256 * B));
    auto [vl, vt] = evaluate(final_set);
    result.final_val_loss = vl;
    write_metrics(validation_record(r.training.steps, vl, vt));
    log(vt ? fmt::format("final validation loss {:.4f} over {} tokens", vl, vt)
           : fmt::format("final validation: {}", kNoValidationTargets));
  }
  if (!mc_items.empty()) score_tasks(r.training.steps);
  result.model_dir = (fs::path(r.output.dir) / "model").string();
  Model& final_model = whole_model();  // collective with tensor parallelism
  if (rank0) write_model_dir(final_model, result.model_dir, r.data.tokenizer);
  log(fmt::format("saved Hugging Face model directory {}", result.model_dir));
  int64_t peak_rss = static_cast<int64_t>(peak_rss_bytes());
  if (world->size() > 1) world->all_reduce(&peak_rss, 1, DType::I64, dist::ReduceOp::Max);
  rlog.finish(peak_rss, train_peak_rss, world->size(), scaler.state().skipped_steps);
  world->barrier();  // the model directory is complete before any rank returns

  if (rank0 && opts.sample_at_end && tokenizer) {
    std::vector<int32_t> prompt = tokenizer->encode("\n");
    if (prompt.empty()) prompt.push_back(0);
    SamplingOptions so;
    so.max_new_tokens = 200;
    so.temperature = 0.8f;
    so.top_k = 40;
    so.seed = static_cast<uint64_t>(r.training.seed);
    so.vocab_limit = tokenizer->vocab_size();
    // The whole model: no collective on one rank. generate() clears the last batch's documents: causal.
    auto ids = generate(final_model, prompt, so);
    log("sample:\n" + tokenizer->decode(ids) + "\n");
  }
  return result;
}

}  // namespace lathe
