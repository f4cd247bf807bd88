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
#include "train/checkpointer.h"
#include "train/consistency.h"
#include "train/device_select.h"
#include "train/device_step.h"
#include "train/device_tp.h"
#include "train/eval_tasks.h"
#include "train/evaluator.h"
#include "train/generate.h"
#include "train/peak.h"
#include "train/preflight.h"
#include "train/rank_model.h"
#include "train/reshard.h"
#include "train/run_control.h"
#include "train/run_dir.h"
#include "train/run_log.h"
#include "train/run_outputs.h"
#include "train/train_step.h"

namespace lathe {

namespace fs = std::filesystem;

namespace {

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
  Topology topo(*world, r);
  const parallel::RankLayout& lay = topo.lay;
  const int tp = lay.tp, pp = lay.pp, dp = lay.dp, dp_rank = lay.dp_rank;
  dist::Communicator& dpc = topo.data();
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
  // data.tokenizer, the EOD settings and training.eval_tasks' items: loaded and checked by preflight.
  std::unique_ptr<tok::Tokenizer> tokenizer = std::move(pf.tokenizer);
  const DocumentOptions docs = pf.docs;
  if (docs.any())
    log(fmt::format("documents: {} attention, positions {}, loss after EOD {} (EOD id {})", r.data.attention,
                    docs.reset_positions ? "restart at each document" : "0..seq_len-1",
                    docs.mask_loss ? "masked" : "trained", docs.eod));
  RankModel rm(r, pf, topo, B, T);
  Model* model = &rm.model();
  const bool sharded = rm.sharded();
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
    std::vector<bool> split_tensor;
    for (const ParamSpec& s : model->params().specs())
      split_tensor.push_back(std::any_of(split.begin(), split.end(),
                                         [&](const auto& sp) { return s.offset >= sp.first && s.offset < sp.second; }));
    opt.set_tensor_parallel(*topo.groups.tp, std::move(split_tensor));
  }
  const size_t state_b = opt.state_begin(), state_e = opt.state_end();  // this rank's moments (ZeRO shard)
  if (!ckpt.empty()) load_rank_moments(ckpt, rm, opt);
  // device: cuda: norm and update on the device, moments staged through opt.local() (train/device_step.h).
  // Data parallelism: gradients and ZeRO's weight shards over NCCL, scalars over dpc (train/device_dp.h).
  std::unique_ptr<DeviceOptimizer> dev_opt = make_device_optimizer(*model, r, ranges, opt, dpc);
  if (dev_opt) dev_opt->upload_state();
  rm.release_whole();
  // Tensor parallelism: the norm counts each element of the whole model once. With ZeRO only this
  // rank's shard of the gradient is reduced, so the squares are summed over the world.
  // Pipeline parallelism: each stage counts its own tensors (a tied wte on the first stage only).
  dist::Communicator* tp_norm_group = sharded ? (r.parallel.zero > 0 ? world : topo.replica()) : nullptr;
  std::vector<std::pair<size_t, size_t>> tp_owned = rm.owned();
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
      .whole_cfg = rm.whole_config(),
      .whole_params = rm.whole_params(),
      .whole_flops_per_token = rm.whole_flops_per_token(),
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
      .pipeline = pp > 1 ? &rm.stage() : nullptr,
      .scaler = scaler,
      .resumed = !ckpt.empty(),
      .start_step = start_step,
      .data_line =
          plan ? fmt::format("data: blend of {} datasets, {} planned samples, {} validation samples of {} tokens",
                             pf.blend_ds.size(), plan->dataset.size(), pf.valid_samples.size(), T)
               : fmt::format("data: {} train samples, {} validation samples of {} tokens", pf.train_samples.size(),
                             pf.valid_samples.size(), T)});

  std::unique_ptr<data::DataLoader> loader_ptr =
      plan
          ? std::make_unique<data::DataLoader>(pf.blend_ds, plan, G, T, r.data.prefetch, dp_rank * B * accum, B * accum)
          : std::make_unique<data::DataLoader>(pf.train_ds, pf.train_samples, G, T,
                                               static_cast<uint64_t>(r.training.seed), true, r.data.prefetch,
                                               dp_rank * B * accum, B * accum);
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
  Evaluator evaluator(r, topo, rm, pf.valid_ds, std::move(pf.valid_samples), std::move(pf.mc_items), docs, B, T, rlog);
  rlog.open_records(!ckpt.empty(), anomaly.enabled());

  std::vector<int32_t> inputs(static_cast<size_t>(B * accum * T)), targets(static_cast<size_t>(B * accum * T));
  TrainResult result;
  result.start_step = result.end_step = start_step;
  result.resumed_from = ckpt;
  Checkpointer checkpointer({r, topo, rm, opt, dev_opt.get(), loader, plan.get(), scaler, anomaly, G, threads, rlog});
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
                  rm.pipe(),
                  dev_opt.get()};
  // A blend is one pass over its plan (sized for the rollbacks by preflight): its "epoch" is the plan.
  const int64_t epoch_samples = static_cast<int64_t>(plan ? plan->dataset.size() : pf.train_samples.size());
  AnomalyResponder responder({r, topo, rm, opt, dev_opt.get(), loader, scaler, anomaly, checkpointer, epoch_samples, G,
                              result.losses, result.start_step, rlog});
  StepStats prev;
  for (int64_t step = start_step; step < r.training.steps; ++step) {
    control.before_step(step);
    const StepStats st = train_step(parts, step, prev);
    control.after_step(step);
    if (!st.skipped) prev = st;
    checkpointer.note_step(st);
    result.losses.push_back(st.loss);
    rlog.step(step, st, scaler, anomaly);
    if (const std::optional<int64_t> back = responder.act(step, st)) {
      step = *back - 1;  // the loop's ++step continues with the checkpoint's next step
      prev = StepStats{};
      continue;
    }
    const bool last = step + 1 == r.training.steps;
    evaluator.maybe(step + 1, last);
    checkpointer.maybe_export_hf(step + 1, last);
    result.end_step = step + 1;
    const StopRequest stop = control.stop_requested(step + 1, last);
    if (checkpointer.due(step + 1, last) || stop) {
      trace::Scope span("checkpoint save", trace::Cat::Io, step + 1);
      checkpointer.save(step + 1, st.lr);
    }
    result.last_checkpoint = checkpointer.last_saved();
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
  result.final_val_loss = evaluator.final();
  result.model_dir = (fs::path(r.output.dir) / "model").string();
  Model& final_model = checkpointer.export_final(result.model_dir);
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
