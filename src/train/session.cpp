#include "train/session.h"

#include <fmt/format.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <thread>

#include "core/sysinfo.h"
#include "core/trace.h"
#include "eval/generate.h"
#include "parallel/context_parallel.h"
#include "parallel/expert_parallel.h"
#include "parallel/plan.h"
#include "parallel/tensor_parallel.h"
#include "tokenizer/tokenizer.h"
#include "train/checkpoint.h"
#include "train/consistency.h"
#include "train/reshard.h"
#include "train/run_dir.h"

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

TrainSession::CleanupJoin::~CleanupJoin() { wait_for_checkpoint_cleanup(); }

TrainSession::TrainSession(const Recipe& recipe, const TrainOptions& opts)
    : opts_(opts),
      own_world_(opts.world ? nullptr : dist::make_local_communicator()),
      world_(opts.world ? *opts.world : *own_world_),
      r_(recipe),
      log_(r_, world_.rank() == 0, opts.quiet) {
  log_.set_metrics_hook(opts.on_metrics);
  check_layout(r_, world_);
  topo_ = std::make_unique<Topology>(world_, r_.parallel);
  const int dp = topo_->lay.samples_dp();  // data ranks proper (context ranks share their samples)
  control_ = std::make_unique<RunControl>(opts, r_, world_, dp, log_);
  if (r_.training.threads > 0) omp_set_num_threads(r_.training.threads);
  threads_ = omp_get_max_threads();
  control_->fix_threads(threads_);  // reduction parts; the thread count may follow the load from here on
  geo_.B = r_.training.micro_batch_size;
  geo_.T = r_.training.seq_len;
  geo_.accum = r_.training.grad_accum_steps;
  geo_.G = geo_.B * geo_.accum * dp;
  try {
    open_inputs();
    open_model();
    restore_counters();
    open_optimizer();
    open_resume();
    report_startup();
    open_data();
    open_parts();
  } catch (const std::exception& e) {
    log_.fail(e);  // into train.log once it is open (main() prints it to stderr)
    throw;
  }
}

TrainSession::~TrainSession() = default;

// Everything that can fail on bad input is checked before any training work, by the same function
// `lathe check` runs (train/preflight.h).
void TrainSession::open_inputs() {
  // This machine's copy bandwidth for the plan line printed at start, measured before anything
  // large is allocated (its two 64 MB buffers must not add to the run's peak memory).
  copy_gbps_ = world_.size() > 1 ? lathe::plan::measure_copy_gbps() : 100.0;
  pf_ = preflight(r_, opts_, log_.preflight_log(), /*check_only=*/false);
  // Before any write, after preflight's errors (as `lathe check` orders them): a new run never reuses
  // a directory that holds another run (--overwrite moves it aside).
  claim_run_dir(r_, opts_.resume.empty() ? r_.training.resume : opts_.resume, opts_.overwrite, world_, log_.say_fn());
  log_.open_log_file(!pf_.ckpt.empty(), pf_.ckpt.empty() ? 0 : pf_.cs.step);  // OUTPUT/train.log
  // data.tokenizer, the EOD settings and training.eval_tasks' items: loaded and checked by preflight.
  const DocumentOptions& docs = pf_.docs;
  if (docs.any())
    log_.log(fmt::format("documents: {} attention, positions {}, loss after EOD {} (EOD id {})", r_.data.attention,
                         docs.reset_positions ? "restart at each document" : "0..seq_len-1",
                         docs.mask_loss ? "masked" : "trained", docs.eod));
}

// This rank's model from preflight's (whole; its weights from init_from or the checkpoint, or only
// its table under tensor/pipeline parallelism): parallel::parallelize cuts the shard and stage,
// gives them their weights and attaches the tensor-parallel hooks and the pipeline executor.
void TrainSession::open_model() {
  parallel::ParallelConfig cfg = parallel::ParallelConfig::of(r_);
  const bool on_host = opts_.faults.device_path_on_host;              // test hook (train/fault_plan.h)
  cfg.attach_tp = [on_host](Model& m, dist::Communicator& tp_host) {  // the CPU's hooks on a host model; NCCL on cuda
    return parallel::attach_tensor_parallel_on_device(m, tp_host, on_host);
  };
  cfg.stage_through_host = on_host;
  parallel::InitialWeights w;
  w.whole_has_weights = !pf_.table_only;
  w.fresh = pf_.ckpt.empty() && r_.init_from.empty();
  w.seed = static_cast<uint64_t>(r_.training.seed);
  if (!pf_.ckpt.empty())  // only this rank's runs of each weight (train/reshard.h)
    w.load_shard = [ckpt = pf_.ckpt](const ParamTable& whole, Model& local, int tp_rank, int tp) {
      load_weights_sharded(CheckpointPieces(ckpt), whole, local.params(), tp_rank, tp, local.param_data());
    };
  if (pf_.shard_weights) {  // ZeRO 3: only this rank's weight shard, drawn or read (preflight.h)
    Model& m = *pf_.model;
    const auto [b, e] = parallel::DistOptimizer::weight_shard_of(m.num_params(), topo_->data().rank(),
                                                                 topo_->data().size(),
                                                                 static_cast<int>(r_.parallel.shard_group));
    m.keep_compute_weights(b, e);
    if (pf_.ckpt.empty()) {
      m.init_weights(w.seed, b, e);
    } else {
      load_weights_range(CheckpointPieces(pf_.ckpt), m.params(), b, e, m.param_data());
      m.refresh_compute_weights();
    }
    w.fresh = false;
  }
  rm_ = parallel::parallelize(std::move(pf_.model), *topo_, cfg, w, geo_.B, geo_.T);
}

// Loss scale and skipped-step counters, and the loss-spike and NaN policy's statistics: a resume
// continues them exactly.
void TrainSession::restore_counters() {
  const std::string& ckpt = pf_.ckpt;
  const CheckpointState& cs = pf_.cs;
  // A checkpoint of a run without dynamic scaling restarts the scale at precision.loss_scale.initial.
  scaler_ = std::make_unique<optim::LossScaler>(loss_scale_config(r_));
  if (!ckpt.empty()) {
    const optim::LossScalerState ls =
        resume_loss_scale(cs, ckpt, scaler_->scale(), scaler_->dynamic(), r_.precision.loss_scale.min, log_.say_fn());
    scaler_->restore(ls, (fs::path(ckpt) / "state.json").string());
    if (scaler_->dynamic() && !cs.loss_scale_dynamic)
      log_.say(fmt::format("resume: the checkpoint's run did not scale the loss; starting at loss scale {}",
                           scaler_->scale()));
  }
  // The policy's skip count enters AdamW's step count even when the resumed recipe turns it off.
  policy_ = std::make_unique<AnomalyPolicy>(r_.training.anomaly);
  if (!ckpt.empty() && cs.has_anomaly) policy_->restore(cs.anomaly);
}

// The distributed optimizer (parallel/dist_optimizer.h): the data-parallel gradient reduction,
// fed by the model's grads_ready hook during the last micro-batch's backward, the global norm and
// the update of this rank's part of the flat buffer (ZeRO), on the model's backend.
void TrainSession::open_optimizer() {
  Model& model = rm_->model();
  dist::Communicator& dpc = topo_->data();
  for (const ParamSpec& s : model.params().specs())
    ranges_.push_back({s.offset, static_cast<size_t>(s.numel()), s.decay, static_cast<int64_t>(ranges_.size())});
  sched_ = schedule_config(r_);
  parallel::DistOptimizerConfig cfg;
  cfg.optim = optimizer_config(r_);
  cfg.zero = static_cast<int>(r_.parallel.zero);
  cfg.shard_group = static_cast<int>(r_.parallel.shard_group);
  cfg.bucket_elems = static_cast<size_t>(std::max(1.0, r_.parallel.bucket_mb * (1 << 20) / 4));
  // Device models overlap the buckets with backward except under tensor parallelism: its hooks'
  // NCCL collectives (another communicator) would then run while buckets are in flight, and NCCL
  // requires the operations of communicators sharing a GPU in the same order on every rank.
  // LATHE_DEVICE_DP_OVERLAP=0 turns the overlap off (one stream synchronisation per step, not per bucket).
  const char* ov = std::getenv("LATHE_DEVICE_DP_OVERLAP");
  cfg.overlap = !(ov && std::string(ov) == "0") && topo_->lay.tp == 1;
  // Test hook (train/fault_plan.h): a CPU model through the device wiring (not LAMB under tensor
  // parallelism, which the device path refuses).
  cfg.device_path_on_host = opts_.faults.device_path_on_host && !(topo_->lay.tp > 1 && cfg.optim.name == "lamb");
  opt_ = std::make_unique<parallel::DistOptimizer>(
      parallel::FlatState{&model.backend(), model.backend_param_data(), model.backend_grad_data(), model.num_params()},
      dpc, cfg, ranges_);
  parallel::DistOptimizer& opt = *opt_;
  if (cfg.device_path_on_host && !model.on_device() && log_.rank0())  // so that a test sees the hook took effect
    fmt::print(stderr,
               "LATHE_TEST_DEVICE_PATH_ON_HOST: the cpu model trains through the device path ({} ranks, ZeRO {})\n",
               dpc.size(), opt.zero());
  if (rm_->tp() > 1) {
    // LAMB's per-tensor norms add the shards of split tensors over the tensor group: the tensors
    // a rank other than 0 owns (owned_ranges) are exactly the split ones.
    const auto split = parallel::owned_ranges(model.params(), 1);
    std::vector<bool> split_tensor;
    for (const ParamSpec& s : model.params().specs())
      split_tensor.push_back(std::any_of(split.begin(), split.end(),
                                         [&](const auto& sp) { return s.offset >= sp.first && s.offset < sp.second; }));
    opt.set_tensor_parallel(*topo_->groups.tp, std::move(split_tensor));
  }
  if (!pf_.ckpt.empty()) load_rank_moments(pf_.ckpt, *rm_, opt);
  opt.upload_state();  // device: the moments live in backend memory
  rm_->release_whole();
  // Tensor parallelism: the norm counts each element of the whole model once. With ZeRO only this
  // rank's shard of the gradient is reduced, so the squares are summed over the world.
  // Pipeline parallelism: each stage counts its own tensors (a tied wte on the first stage only).
  if (rm_->sharded()) opt.set_grad_norm_group(r_.parallel.zero > 0 ? world_ : *topo_->replica(), rm_->owned());
  if (opt.reduces())  // keeps the tensor-parallel hooks
    model.hooks().grads_ready = [&opt](size_t b, size_t e) { opt.grads_ready(b, e); };
  // ZeRO 3 (parallel/param_gather.h): each block's weights gathered before it runs.
  // bf16/fp16: the compute copy converted per gathered block; only the shard's kept current.
  parallel::ParamGather::ComputeCopy copy;
  if (model.compute_weight_bytes() > 0) {
    copy = {model.compute_weight_data(), dtype_size(model.compute_dtype()),
            [&model](size_t b, size_t e) { model.refresh_compute_weights(b, e); }, DType::F32, {}};
    // Gathered in the compute dtype (half the bytes): the GEMM weights and embeddings, which the
    // kernels read only through the compute copy (Model::cw); norms and biases stay fp32.
    copy.dtype = model.compute_dtype();
    parallel::ParamGather::Ranges low;
    Role role = Role::None;
    for (const ParamSpec& s : model.params().specs()) {
      if (s.role != Role::Continues) role = s.role;  // k/v after q, up after gate
      if (role == Role::Wte || role == Role::Wpe || role == Role::QkvW || role == Role::OW || role == Role::FcW ||
          role == Role::ProjW || role == Role::LmHead)
        low.push_back({s.offset, s.offset + static_cast<size_t>(s.numel())});
    }
    copy.compute_only.assign(model.param_ranges_by_block().size(), low);
  }
  opt.set_param_blocks(model.param_ranges_by_block(), static_cast<int>(r_.parallel.prefetch), std::move(copy));
  if (opt.gathers()) {
    model.hooks().before_block = [&opt](int64_t block, bool bwd) { opt.before_block(block, bwd); };
    if (rm_->pipe()) rm_->pipe()->set_param_gather(opt.param_gather());  // per Forward / Backward action
    model.keep_compute_weights(opt.weight_shard().first, opt.weight_shard().second);
  }
}

void TrainSession::whole_weights() { opt_->gather_whole(); }

void TrainSession::open_resume() {
  const std::string& ckpt = pf_.ckpt;
  const CheckpointState& cs = pf_.cs;
  if (ckpt.empty()) {
    if (!r_.init_from.empty()) log_.log(fmt::format("init_from {}: {}", r_.init_from, pf_.init_report));
    return;
  }
  start_step_ = cs.step;
  log_.say(fmt::format("resume: loaded {} (step {}, epoch {}, position {}, {} samples consumed)", ckpt, cs.step,
                       cs.loader.epoch, cs.loader.position, cs.consumed_samples));
  if (cs.threads != threads_)
    log_.say(
        fmt::format("resume: WARNING: the checkpoint was written with {} threads, this run uses {}: losses will "
                    "not be bit-identical to an uninterrupted run (float sums change order)",
                    cs.threads, threads_));
  // Newer checkpoints in this run directory belong to an abandoned timeline: moved aside.
  if (log_.rank0()) move_newer_checkpoints_aside(r_.output.dir, ckpt, start_step_, log_.say_fn());
}

// Output (output.dir exists and is writable: preflight).
void TrainSession::report_startup() {
  const auto& plan = pf_.blend_plan;
  const auto& lay = topo_->lay;
  log_.startup(StartupFacts{
      .model = rm_->model(),
      .whole_cfg = rm_->whole_config(),
      .whole_params = rm_->whole_params(),
      .whole_flops_per_token = rm_->whole_flops_per_token(),
      .world_size = world_.size(),
      .tp = lay.tp,
      .pp = lay.pp,
      .dp = lay.samples_dp(),
      .threads = threads_,
      .B = geo_.B,
      .T = geo_.T,
      .accum = geo_.accum,
      .G = geo_.G,
      .copy_gbps = copy_gbps_,
      .moment_elems = opt_->state_end() - opt_->state_begin(),
      .bucket_elems = opt_->bucket_elems(),
      .pipeline = lay.pp > 1 ? &rm_->stage() : nullptr,
      .scaler = *scaler_,
      .resumed = !pf_.ckpt.empty(),
      .start_step = start_step_,
      .data_line =
          plan ? fmt::format("data: blend of {} datasets, {} planned samples, {} validation samples of {} tokens",
                             pf_.blend_ds.size(), plan->dataset.size(), pf_.valid_samples.size(), geo_.T)
               : fmt::format("data: {} train samples, {} validation samples of {} tokens", pf_.train_samples.size(),
                             pf_.valid_samples.size(), geo_.T)});
}

// A blend (data.blend) reads global sample g of the run from the plan (dataset, sample); one pass,
// no loader epochs: the plan covers training.steps x G samples and already repeats and reshuffles
// each dataset (data/blend.h). Ranks take their rows of each global batch.
void TrainSession::open_data() {
  const auto& plan = pf_.blend_plan;
  const int64_t first_row = topo_->lay.samples_dp_rank() * geo_.B * geo_.accum;
  loader_ = plan ? std::make_unique<data::DataLoader>(pf_.blend_ds, plan, geo_.G, geo_.T, r_.data.prefetch, first_row,
                                                      geo_.B * geo_.accum)
                 : std::make_unique<data::DataLoader>(pf_.train_ds, pf_.train_samples, geo_.G, geo_.T,
                                                      static_cast<uint64_t>(r_.training.seed), true, r_.data.prefetch,
                                                      first_row, geo_.B * geo_.accum);
  if (pf_.ckpt.empty()) return;
  // Restarts the prefetcher at the saved position (for a blend verified against this run's plan by
  // preflight unless --force-resume-changes).
  const CheckpointState& cs = pf_.cs;
  data::LoaderState at = cs.loader;
  if (plan && (at.epoch != 0 || at.position > static_cast<int64_t>(plan->dataset.size()))) {
    // --force-resume-changes from another data setting: the blend continues at step x G.
    at = {0, std::min<int64_t>(start_step_ * geo_.G, static_cast<int64_t>(plan->dataset.size()))};
    log_.say(
        fmt::format("resume: the checkpoint's data position (epoch {}, position {}) is not one of this blend's "
                    "plan; continuing the blend at sample {} (step {} x global batch {})",
                    cs.loader.epoch, cs.loader.position, at.position, start_step_, geo_.G));
  }
  loader_->restore(at);
}

void TrainSession::open_parts() {
  eval_ = std::make_unique<Evaluator>(r_, *topo_, *rm_, pf_.valid_ds, std::move(pf_.valid_samples),
                                      std::move(pf_.mc_items), pf_.docs, geo_.B, geo_.T, log_);
  log_.open_records(!pf_.ckpt.empty(), policy_->enabled());
  result_.start_step = result_.end_step = start_step_;
  result_.resumed_from = pf_.ckpt;
  const data::BlendPlan* plan = pf_.blend_plan.get();
  ckpt_ =
      std::make_unique<Checkpointer>(Checkpointer::Parts{r_, *topo_, *rm_, *opt_, *loader_, plan, *scaler_, *policy_,
                                                         geo_.G, threads_, log_, opts_.faults.checkpoint_pause_ms});
  if (start_step_ == r_.training.steps && start_step_ > 0)
    log_.say(
        fmt::format("resume: the checkpoint is at the final step {}; only the end-of-run outputs remain", start_step_));
  faults_ = opts_.faults;
  step_ = std::make_unique<StepContext>(
      StepContext{*rm_, *loader_, *opt_, topo_->data(), *scaler_, *policy_, sched_, geo_, pf_.docs, faults_});
  const size_t rows = static_cast<size_t>(geo_.B * geo_.accum * geo_.T);
  step_->inputs.resize(rows);
  step_->targets.resize(rows);
  if (topo_->lay.cp > 1) {  // context parallelism: the rows of every sample this rank holds
    step_->cp_rows = parallel::context_rows(geo_.T, topo_->lay.cp, topo_->lay.cp_rank);
    step_->cp_rank = topo_->lay.cp_rank;
  }
  // A blend is one pass over its plan (sized for the rollbacks by preflight): its "epoch" is the plan.
  const int64_t epoch_samples = static_cast<int64_t>(plan ? plan->dataset.size() : pf_.train_samples.size());
  responder_ = std::make_unique<AnomalyResponder>(AnomalyResponder::Parts{r_, *topo_, *rm_, *opt_, *loader_, *scaler_,
                                                                          *policy_, *ckpt_, epoch_samples, geo_.G,
                                                                          result_.losses, result_.start_step, log_});
}

void TrainSession::record(int64_t step, const StepStats& st) {
  ckpt_->note_step(st);
  result_.losses.push_back(st.loss);
  log_.step(step, st, *scaler_, *policy_);
}

void TrainSession::save_checkpoint(int64_t done, double lr) {
  trace::Scope span("checkpoint save", trace::Cat::Io, done);
  ckpt_->save(done, lr);
  result_.last_checkpoint = ckpt_->last_saved();
}

TrainResult TrainSession::stopped(int64_t done, const StopRequest& stop) {
  control_->announce(stop, done);
  result_.interrupted = stop.signal != 0;
  return std::move(result_);
}

TrainResult TrainSession::finish() {
  // The training steps' peak (before the final validation and the HF directory, which assembles a
  // copy of the weights): the figure the memory estimate and `lathe plan` predict.
  int64_t train_peak_rss = static_cast<int64_t>(peak_rss_bytes());
  if (world_.size() > 1) world_.all_reduce(&train_peak_rss, 1, DType::I64, dist::ReduceOp::Max);
  whole_weights();  // ZeRO 3: the final validation and the HF directory read every weight
  result_.final_val_loss = eval_->final();
  result_.model_dir = (fs::path(r_.output.dir) / "model").string();
  Model& final_model = ckpt_->export_final(result_.model_dir);
  int64_t peak_rss = static_cast<int64_t>(peak_rss_bytes());
  if (world_.size() > 1) world_.all_reduce(&peak_rss, 1, DType::I64, dist::ReduceOp::Max);
  log_.finish(peak_rss, train_peak_rss, world_.size(), scaler_->state().skipped_steps);
  world_.barrier();  // the model directory is complete before any rank returns

  const std::unique_ptr<tok::Tokenizer>& tokenizer = pf_.tokenizer;
  if (log_.rank0() && opts_.sample_at_end && tokenizer && topo_->lay.cp > 1)
    log_.log("sample: not generated (parallel.context > 1: this rank's model holds only its rows of a sequence)");
  if (log_.rank0() && opts_.sample_at_end && tokenizer && topo_->lay.cp == 1) {
    std::vector<int32_t> prompt = tokenizer->encode("\n");
    if (prompt.empty()) prompt.push_back(0);
    SamplingOptions so;
    so.max_new_tokens = 200;
    so.temperature = 0.8f;
    so.top_k = 40;
    so.seed = static_cast<uint64_t>(r_.training.seed);
    so.vocab_limit = tokenizer->vocab_size();
    // The whole model: no collective on one rank. generate() clears the last batch's documents: causal.
    const parallel::LocalExperts local(final_model);  // expert parallelism: every expert here
    auto ids = generate(final_model, prompt, so);
    log_.log("sample:\n" + tokenizer->decode(ids) + "\n");
  }
  return std::move(result_);
}

}  // namespace lathe
