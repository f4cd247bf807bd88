#include "train/preflight.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <limits>

#include "core/checked.h"
#include "core/error.h"
#include "data/blend_cache.h"
#include "data/loader.h"
#include "dist/comm.h"
#include "interop/hf_weights.h"
#include "io/json.h"
#include "io/xxh64.h"
#include "kernels/backend.h"
#include "kernels/backend_select.h"
#include "kernels/cpu/ops_bf16.h"
#include "models/memory.h"
#include "models/recompute.h"
#include "optim/schedule.h"
#include "parallel/parallelize.h"
#include "parallel/pipeline_stage.h"
#include "parallel/tensor_parallel.h"
#include "train/consistency.h"
#include "train/preflight_resume.h"

namespace lathe {

namespace fs = std::filesystem;

namespace {

constexpr int kMoments = 2;  // AdamW and LAMB keep two fp32 moments per parameter

// Path as the user wrote it in output.dir, for messages.
std::string out_field(const Recipe& r) { return fmt::format("output.dir {}", r.output.dir); }

// Creates output.dir when missing and proves that files can be created in it (the checkpoint,
// metrics and model directory all go there): a probe file created with O_EXCL and removed at once.
// check_only: the directories created here are removed again (deepest first, only if empty).
void probe_output_dir(const Recipe& r, bool check_only) {
  const fs::path dir = r.output.dir.empty() ? fs::path(".") : fs::path(r.output.dir);
  std::vector<fs::path> created;
  // Which ancestors are missing (to undo in check mode); a component that is a file is named.
  for (fs::path p = dir; !p.empty(); p = p.parent_path()) {
    std::error_code ec;
    const fs::file_status s = fs::status(p, ec);
    // ENOTDIR: a component above is a file; the walk up reaches it and names it.
    if (ec && ec != std::errc::no_such_file_or_directory && ec != std::errc::not_a_directory)
      throw_error("{}: cannot use {}: {} (fix output.dir or the directory above it)", out_field(r), p.string(),
                  ec.message());
    if (fs::exists(s)) {
      LATHE_CHECK(fs::is_directory(s), "{}: {} is a file, not a directory (set output.dir to a directory path)",
                  out_field(r), p.string());
      break;
    }
    created.push_back(p);
    if (p == p.parent_path()) break;
  }
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec)
    throw_error("{}: cannot create the directory: {} (set output.dir to a writable location)", out_field(r),
                ec.message());
  // Unique per call, not only per process: the ranks of an in-process (thread) group check the
  // same directory at the same time.
  static std::atomic<uint64_t> probes{0};
  const std::string probe = (dir / fmt::format(".lathe_write_probe.{}.{}", ::getpid(), probes++)).string();
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  const int err = errno;
  if (fd >= 0) {
    ::close(fd);
    ::unlink(probe.c_str());
  }
  if (check_only)
    for (const fs::path& p : created) fs::remove(p, ec);  // deepest first; a non-empty one stays
  if (fd < 0)
    throw_error("{}: cannot create files in it: {} (set output.dir to a writable directory)", out_field(r),
                std::strerror(err));
}

// data.blend: every prefix opened (one dtype), the validation set, and the plan of the whole run
// (training.steps x global batch samples) from OUTPUT/data_cache, built there by rank 0 of a
// training run when missing or stale; `lathe check` plans in memory and writes nothing.
void preflight_blend(const Recipe& r, const TrainOptions& opts, const PreflightLog& log, bool check_only,
                     Preflight& pf) {
  const int64_t T = r.training.seq_len, G = global_batch_samples(r);
  std::vector<data::BlendEntryInput> in;
  for (const auto& e : r.data.blend) in.push_back({e.prefix, e.weight, e.epochs});
  data::OpenedBlend ob = data::open_blend(in, T);
  pf.blend_ds = ob.datasets;
  if (!r.data.valid.empty()) {
    pf.valid_ds = std::make_shared<const data::IndexedDataset>(r.data.valid);
    pf.valid_samples = data::all_samples(data::num_samples(pf.valid_ds->total_tokens(), T));
  }
  const int64_t total = blend_plan_samples(r);
  const bool rank0 = opts.world == nullptr || opts.world->rank() == 0;
  const std::string cache_dir = (fs::path(r.output.dir.empty() ? "." : r.output.dir) / "data_cache").string();
  // `lathe train` polls its stop request (SIGINT / SIGTERM) while planning: a long plan is not
  // finished (nor cached) only to stop after step 1.
  data::StopFn stop;
  if (opts.handle_signals && !check_only) stop = [] { return g_stop_request.load() != 0; };
  if (total >= (int64_t{1} << 24))
    log.note(fmt::format("data.blend: the plan of {} samples ({}) is read from {} or built now (SIGINT stops it)",
                         total, format_bytes(total * kBlendPlanBytesPerSample), cache_dir));
  data::CachedPlan c;
  try {
    c = data::cached_blend_plan(ob.sources, T, static_cast<uint64_t>(r.training.seed), total, cache_dir,
                                !check_only && rank0, stop);
  } catch (const Interrupted&) {
    throw;
  } catch (const Error& e) {
    throw_error("{}: data.blend: {}", r.source, e.what());
  }
  pf.blend_plan = c.plan;
  const std::vector<double> share = data::blend_shares(ob.sources);
  for (size_t i = 0; i < ob.sources.size(); ++i) {
    const auto& s = ob.sources[i];
    log.ok(fmt::format(
        "data.blend[{}] {}: {} {} tokens, {} samples of seq_len {}; weight {} ({:.2f}%): {} samples of the run "
        "({:.2f}%), {:.3f} epochs{}",
        i, s.name, ob.datasets[i]->total_tokens(), dtype_name(ob.datasets[i]->dtype()), s.samples, T, s.weight,
        100 * share[i], c.plan->taken[i], total ? 100.0 * c.plan->taken[i] / total : 0.0, c.plan->epochs[i],
        s.max_epochs > 0 ? fmt::format(" (cap {})", s.max_epochs) : std::string()));
  }
  log.ok(fmt::format("data.blend: {} datasets, plan of {} samples ({} steps x global batch {}{}) {} in {:.3f} s{}",
                     ob.sources.size(), total, r.training.steps, G,
                     total > r.training.steps * G ? " + the samples anomaly rollbacks may skip" : "", c.status,
                     c.seconds, c.path.empty() || c.status.rfind("planned", 0) == 0 ? std::string() : ": " + c.path));
  log.ok(r.data.valid.empty()
             ? std::string("validation: none (a blend validates on data.valid only)")
             : fmt::format("validation: {} samples (data.valid {})", pf.valid_samples.size(), r.data.valid));
}

// data.mask_loss_after_eod drops every target whose input token is the EOD id: a dataset of EOD
// ids only has nothing to train or validate on (its loss would print as 0.0000). Its first 1M
// tokens are read; refused when they are the whole dataset, noted when it is larger.
void check_has_targets(const data::IndexedDataset& ds, const std::string& what, int32_t eod, const Recipe& r,
                       const PreflightLog& log) {
  // Read in chunks from the start: real data ends the check within its first chunk.
  const int64_t n = std::min<int64_t>(ds.total_tokens(), int64_t{1} << 20);
  std::vector<int32_t> chunk(4096);
  for (int64_t at = 0; at < n; at += static_cast<int64_t>(chunk.size())) {
    const int64_t len = std::min<int64_t>(n - at, static_cast<int64_t>(chunk.size()));
    ds.read_global(at, len, chunk.data());
    if (std::any_of(chunk.begin(), chunk.begin() + len, [eod](int32_t t) { return t != eod; })) return;
  }
  if (n == ds.total_tokens())
    throw_error(
        "{}: {}: every one of its {} tokens is the EOD id {}, so with data.mask_loss_after_eod: true no token is a "
        "target (no loss to train or validate on): use data that holds documents, or set data.mask_loss_after_eod: "
        "false",
        r.source, what, n, eod);
  log.note(
      fmt::format("{}: its first {} tokens are all the EOD id {}: with data.mask_loss_after_eod their samples "
                  "have no targets",
                  what, n, eod));
}

}  // namespace

int64_t blend_plan_samples(const Recipe& r) {
  const int64_t G = global_batch_samples(r);
  const int64_t run = checked_mul(r.training.steps, G, "training.steps x global batch (samples of the run)");
  int64_t total = run, skipped = 0;
  const auto& a = r.training.anomaly;
  const bool rollbacks = a.enabled && a.rollback_after > 0 && a.rollback_window > 0;
  if (rollbacks) {
    // Each rollback skips skip_samples, or by default the samples consumed since the checkpoint
    // (at most the run's); max_rollbacks of them before the run stops.
    const int64_t per = a.skip_samples >= 0 ? a.skip_samples : total;
    skipped = checked_mul(a.max_rollbacks, per, "training.anomaly.max_rollbacks x skipped samples");
    total = checked_add(total, skipped, "blend plan samples");
  }
  // The plan is held in memory whole (and written to its cache file): refused with its size and
  // the keys that make it, never left to a generic out-of-memory after minutes of planning.
  const MachineMemory mm = machine_memory();
  const int64_t cap = mm.bytes > 0 ? mm.bytes / 2 : int64_t{1} << 40;
  const int64_t per_sample = kBlendPlanBytesPerSample;
  if (total > cap / per_sample)
    throw_error(
        "{}: data.blend: the blend plan of {} samples needs {} ({} bytes a sample, in memory and in its cache file), "
        "more than half of {} ({}): training.steps {} x global batch {} (training.micro_batch_size x grad_accum_steps "
        "x parallel.data) = {} samples{}. Lower training.steps{}",
        r.source, total,
        format_bytes(total > std::numeric_limits<int64_t>::max() / per_sample ? std::numeric_limits<int64_t>::max()
                                                                              : total * per_sample),
        per_sample, mm.bytes > 0 ? mm.source : std::string("the 1 TiB limit used when the memory is unknown"),
        format_bytes(mm.bytes > 0 ? mm.bytes : int64_t{1} << 40), r.training.steps, G, run,
        rollbacks ? fmt::format(
                        " + training.anomaly.max_rollbacks {} x training.anomaly.skip_samples {} = {} samples "
                        "that rollbacks may skip",
                        a.max_rollbacks,
                        a.skip_samples >= 0 ? fmt::format("{}", a.skip_samples) : fmt::format("-1 (the run's {})", run),
                        skipped)
                  : std::string(),
        rollbacks ? " or training.anomaly.skip_samples / max_rollbacks" : "");
  return total;
}

DocumentOptions recipe_documents(const Recipe& r, const tok::Tokenizer* tokenizer) {
  DocumentOptions o;
  o.document_attention = parse_attention_mode(r.data.attention) == AttentionMode::Document;
  o.reset_positions = r.data.reset_position_ids;
  o.mask_loss = r.data.mask_loss_after_eod;
  if (!o.any()) return o;
  int64_t eod = r.data.eod_token;
  if (eod < 0 && tokenizer != nullptr && tokenizer->eos_id()) eod = *tokenizer->eos_id();
  LATHE_CHECK(eod >= 0 && eod < r.model.vocab_size,
              "{}: data.eod_token is needed by data.attention: document, data.reset_position_ids and "
              "data.mask_loss_after_eod, and {} — set data.eod_token to the id that ends each document (the one "
              "`lathe tokenize --append-eos` appended)",
              r.source,
              eod >= 0                   ? fmt::format("{} is outside the vocabulary [0, {})", eod, r.model.vocab_size)
              : r.data.tokenizer.empty() ? std::string("no data.tokenizer gives an EOS id")
                                         : fmt::format("data.tokenizer '{}' has no EOS token", r.data.tokenizer));
  o.eod = static_cast<int32_t>(eod);
  return o;
}

ComputeSpec compute_spec(const Recipe& r) {
  ComputeSpec spec;
  spec.backend = &select_backend(r.device, r.source);  // cpu | cuda, refused with the reason (kernels/backend_select.h)
  const std::string& c = r.precision.compute;
  spec.dtype = c == "bf16" ? DType::BF16 : c == "fp16" ? DType::F16 : DType::F32;
  LATHE_CHECK(compute_dtype_name(spec.dtype) == c, "{}: precision.compute '{}' is not one of fp32, bf16, fp16",
              r.source, c);
  try {
    (void)ops_for(*spec.backend, spec.dtype);
  } catch (const Error& e) {
    throw_error(
        "{}: precision.compute {}: this build cannot compute in {} on {}: {} (set precision.compute to an "
        "implemented dtype)",
        r.source, c, c, spec.backend->name(), e.what());
  }
  spec.attention_kernel = r.attention_kernel;
  try {
    (void)ops_for(*spec.backend, spec.dtype, spec.attention_kernel);
  } catch (const Error& e) {
    throw_error("{}: model.attention_kernel: {}: {} (set model.attention_kernel: lathe)", r.source, r.attention_kernel,
                e.what());
  }
  return spec;
}

// Step 7 (train/preflight.h): the tokenizer, the EOD settings and their data, training.eval_tasks.
static void preflight_tokens_and_tasks(const Recipe& r, const PreflightLog& log, Preflight& pf) {
  if (!r.data.tokenizer.empty()) pf.tokenizer = tok::load_tokenizer(r.data.tokenizer);
  pf.docs = recipe_documents(r, pf.tokenizer.get());
  if (pf.docs.mask_loss) {
    if (pf.train_ds) check_has_targets(*pf.train_ds, "data.train " + r.data.train, pf.docs.eod, r, log);
    for (size_t i = 0; i < pf.blend_ds.size(); ++i)
      check_has_targets(*pf.blend_ds[i], fmt::format("data.blend[{}].prefix {}", i, r.data.blend[i].prefix),
                        pf.docs.eod, r, log);
    if (pf.valid_ds && pf.valid_ds != pf.train_ds)  // the final validation runs whatever eval_interval says
      check_has_targets(*pf.valid_ds, "data.valid " + r.data.valid, pf.docs.eod, r, log);
  }
  if (pf.docs.any())
    log.ok(fmt::format("documents: EOD id {} (data.attention {}, reset_position_ids {}, mask_loss_after_eod {})",
                       pf.docs.eod, r.data.attention, r.data.reset_position_ids, r.data.mask_loss_after_eod));
  if (r.training.eval_tasks.empty()) return;
  const ModelConfig& mc = pf.model->config();
  const int64_t max_t = std::min<int64_t>(r.training.seq_len, mc.max_position_embeddings);
  try {
    pf.mc_items = read_mc_tasks(r.training.eval_tasks, pf.tokenizer.get(), mc.vocab_size,
                                "set data.tokenizer in the recipe, "
                                "or give token ids");
    const int64_t longest = check_mc_items_fit(pf.mc_items, max_t, r.training.eval_tasks, "training.seq_len");
    log.ok(fmt::format("training.eval_tasks {}: {} items, longest ending {} tokens < {} positions scored",
                       r.training.eval_tasks, pf.mc_items.size(), longest, max_t));
  } catch (const Error& e) {
    throw_error("{}: training.eval_tasks: {}", r.source, e.what());
  }
}

void resolve_layout(Recipe& r, int64_t world) {
  const int64_t t = r.parallel.tensor, p = r.parallel.pipeline, c = r.parallel.context;
  const int64_t data = r.parallel.data ? r.parallel.data : world / (t * p * c);
  if (c > 1)
    LATHE_CHECK(data * t * p * c == world,
                "parallel.data {} x parallel.tensor {} x parallel.pipeline {} x parallel.context {} = {} but the job "
                "has {} process{} (mpirun -np): make the product equal the number of processes (parallel.data 0 = "
                "the rest)",
                data, t, p, c, data * t * p * c, world, world == 1 ? "" : "es");
  LATHE_CHECK(data * t * p * c == world,
              "parallel.data {} x parallel.tensor {} x parallel.pipeline {} = {} but the job has {} process{} "
              "(mpirun -np): make the product equal the number of processes (parallel.data 0 = the rest)",
              data, t, p, data * t * p, world, world == 1 ? "" : "es");
  r.parallel.data = data;
}

// Mixture of experts (issue 28; models/moe_layer.cpp): the layouts it runs in (one process or data
// parallel with ZeRO 0-3: its expert weights and gradients are slices of the flat buffers; fp32 on
// the cpu, no recompute); the rest refused naming the key.
static void check_moe_layout(const Recipe& r, const ModelConfig& m, const PreflightLog& log) {
  if (!m.moe()) return;
  auto refuse = [&](const char* key, const std::string& value, const char* fix) {
    throw_error("{}: {} {}: a mixture-of-experts model ({}) does not support it yet; {}", r.source, key, value,
                m.model_type, fix);
  };
  if (r.parallel.tensor > 1) refuse("parallel.tensor", std::to_string(r.parallel.tensor), "set parallel.tensor: 1");
  if (r.parallel.pipeline > 1)
    refuse("parallel.pipeline", std::to_string(r.parallel.pipeline), "set parallel.pipeline: 1");
  if (r.parallel.context > 1) refuse("parallel.context", std::to_string(r.parallel.context), "set parallel.context: 1");
  if (r.recompute != "none") refuse("recompute", r.recompute, "set recompute: none");
  if (r.precision.compute != "fp32")
    refuse("precision.compute", r.precision.compute, "set precision.compute: fp32 (the MoE kernels are fp32)");
  if (r.device != "cpu") refuse("device", r.device, "set device: cpu (the MoE kernels are cpu kernels)");
  log.ok(fmt::format("mixture of experts: {} experts, top-{}, aux loss coefficient {}{}", m.num_local_experts,
                     m.num_experts_per_tok, m.moe_aux_coef(),
                     m.output_router_logits ? "" : " (output_router_logits false: the aux loss is reported only)"));
}

// Expert parallelism (parallel.expert; parallel/expert_parallel.h): groups of `expert` data ranks
// share each MoE layer's experts. Runs with data parallelism alone and ZeRO 0/1 so far.
static void check_expert_layout(const Recipe& r, const ModelConfig& m, int64_t data) {
  const int64_t ep = r.parallel.expert;
  if (ep <= 1) return;
  auto refuse = [&](const std::string& why, const std::string& fix) {
    throw_error("{}: parallel.expert = {}: {}; {}", r.source, ep, why, fix);
  };
  if (!m.moe()) refuse(fmt::format("the model ({}) has no experts", m.model_type), "set parallel.expert: 1");
  if (m.num_local_experts % ep != 0)
    refuse(fmt::format("does not divide the model's {} experts (num_local_experts)", m.num_local_experts),
           fmt::format("choose a divisor of {}", m.num_local_experts));
  if (data % ep != 0)
    refuse(fmt::format("does not divide the data degree {} (expert groups are carved from the data ranks)", data),
           fmt::format("choose a divisor of {} or run {} x k processes", data, ep));
  auto refuse_with = [&](const char* key, int64_t v) {
    if (v > 1)
      refuse(fmt::format("{} = {} with expert parallelism is not supported yet (it runs with data parallelism alone)",
                         key, v),
             fmt::format("set {}: 1 or parallel.expert: 1", key));
  };
  refuse_with("parallel.tensor", r.parallel.tensor);
  refuse_with("parallel.pipeline", r.parallel.pipeline);
  refuse_with("parallel.context", r.parallel.context);
  if (r.parallel.zero >= 2)
    refuse(fmt::format("parallel.zero = {} with expert parallelism is not supported yet (tested: ZeRO 0 and 1)",
                       r.parallel.zero),
           "set parallel.zero: 0 or 1, or parallel.expert: 1");
  if (r.device != "cpu")
    refuse(fmt::format("device: {} is not supported yet (the expert dispatch runs on host buffers)", r.device),
           "set device: cpu or parallel.expert: 1");
}

// One rank's memory figure (parameters, gradients, two moments, activations for micro_batch_size x
// seq_len), refused with the numbers before anything is allocated. Per process: ZeRO 1/2 divide the
// moments by the data degree, ZeRO 3 also the weights and gradients.
static void check_rank_memory(const Recipe& r, int64_t B, int64_t T, int64_t data, Recompute rc, DType dtype,
                              bool sharded, const PreflightLog& log) {
  // Tensor / pipeline parallelism: one rank's share, not the whole model (which no rank holds):
  // its tensor shard with the most layers a pipeline rank gets (embedding and head counted as if
  // every stage had them; one micro-batch's activations; `lathe plan` has the exact per-stage figure).
  ModelConfig per_rank = r.model;
  TensorShard per_rank_shard;
  if (r.parallel.tensor > 1) {
    per_rank = parallel::shard_config(r.model, static_cast<int>(r.parallel.tensor));
    per_rank_shard = parallel::tensor_shard(r.model, static_cast<int>(r.parallel.tensor), r.parallel.sequence);
  }
  if (r.parallel.pipeline > 1) {
    const int64_t chunks = r.parallel.pipeline * r.parallel.virtual_stages;
    int64_t most = (r.model.num_hidden_layers + chunks - 1) / chunks * r.parallel.virtual_stages;
    if (!r.parallel.stage_layers.empty())
      most =
          *std::max_element(r.parallel.stage_layers.begin(), r.parallel.stage_layers.end()) * r.parallel.virtual_stages;
    per_rank.num_hidden_layers = std::max<int64_t>(1, std::min(most, r.model.num_hidden_layers));
  }
  // Context parallelism: activations of T / context rows per rank (RoPE tables of T positions); ZeRO
  // shards over data x context ranks. Not counted: the ring's / all-gather's K/V buffers.
  const int64_t cp = r.parallel.context, T_rank = T / std::max<int64_t>(1, cp);
  if (cp > 1) per_rank_shard.context_T = T;
  MemoryEstimate est = estimate_memory(per_rank, B, T_rank, kMoments, r.parallel.zero > 0 ? data * cp : 1, dtype,
                                       rc, per_rank_shard);
  if (r.parallel.zero == 3) {  // the recipe refuses ZeRO 3 with context > 1
    LATHE_CHECK(r.parallel.shard_group == 0 || data % r.parallel.shard_group == 0,
                "{}: parallel.shard_group = {} does not divide the data degree {} of this job: choose a divisor (0 = "
                "all data ranks)",
                r.source, r.parallel.shard_group, data);
    shard_parameters(est, per_rank, data, static_cast<int>(r.parallel.prefetch), r.parallel.shard_group,
                     static_cast<int64_t>(std::max(1.0, r.parallel.bucket_mb * (1 << 20) / 4)));
    // Pipeline: the stage's gradients stay whole through the step (reduced once after the schedule).
    if (r.parallel.pipeline > 1) est.grad_bytes = checked_mul(est.num_params, 4, "ZeRO 3 memory");
  }
  check_memory_fits(est, per_rank, r.source);
  const MachineMemory mm = machine_memory();
  log.ok(fmt::format("memory{}: {} fits ({} {})", sharded || cp > 1 || r.parallel.zero == 3 ? " per rank" : "",
                     est.breakdown(), mm.source,
                     mm.bytes > 0 ? format_bytes(mm.bytes) : std::string("unknown")));
}

Preflight preflight(const Recipe& r, const TrainOptions& opts, const PreflightLog& log, bool check_only) {
  Preflight pf;
  const int64_t B = r.training.micro_batch_size, T = r.training.seq_len;

  // 1. datasets
  const int64_t G = global_batch_samples(r);
  if (!r.data.blend.empty()) {
    preflight_blend(r, opts, log, check_only, pf);
  } else {
    pf.train_ds = std::make_shared<const data::IndexedDataset>(r.data.train);
    if (!r.data.valid.empty()) {
      pf.valid_ds = std::make_shared<const data::IndexedDataset>(r.data.valid);
      pf.train_samples = data::all_samples(data::num_samples(pf.train_ds->total_tokens(), T));
      pf.valid_samples = data::all_samples(data::num_samples(pf.valid_ds->total_tokens(), T));
    } else {
      auto split = data::split_samples(data::num_samples(pf.train_ds->total_tokens(), T), r.data.valid_fraction);
      pf.train_samples = std::move(split.train);
      pf.valid_samples = std::move(split.valid);
      pf.valid_ds = pf.train_ds;
    }
    LATHE_CHECK(static_cast<int64_t>(pf.train_samples.size()) >= G,
                "data.train {}: {} tokens give only {} training samples of seq_len {}, fewer than one global batch: "
                "training.micro_batch_size {} x grad_accum_steps {} x parallel.data {} = {}",
                r.data.train, pf.train_ds->total_tokens(), pf.train_samples.size(), T, B, r.training.grad_accum_steps,
                std::max<int64_t>(1, r.parallel.data), G);
    log.ok(fmt::format("data.train {}: {} tokens, {} training samples of seq_len {} (>= global batch {})", r.data.train,
                       pf.train_ds->total_tokens(), pf.train_samples.size(), T, G));
    log.ok(fmt::format("validation: {} samples ({})", pf.valid_samples.size(),
                       r.data.valid.empty() ? fmt::format("data.valid_fraction {} of data.train", r.data.valid_fraction)
                                            : "data.valid " + r.data.valid));
  }

  // 2. model / tokenizer / data consistency
  ConsistencyReport rep = check_consistency(r);
  if (!rep.failures.empty()) {
    std::string msg = fmt::format("{}: model, tokenizer and data disagree:", r.source);
    for (auto& f : rep.failures) msg += "\n  - " + f;
    throw Error(msg);
  }
  for (auto& l : rep.passed) log.ok(l);

  // 3. optimizer and schedule settings
  const optim::OptimConfig ocfg = optimizer_config(r);
  optim::validate(ocfg);
  optim::ScheduleConfig sched = schedule_config(r);
  optim::validate(sched);
  const optim::LossScaleConfig lscfg = loss_scale_config(r);
  optim::validate(lscfg);
  log.ok(fmt::format("optimizer {} and schedule {} settings are valid", r.optimizer.name, r.schedule.name));
  ComputeSpec spec = compute_spec(r);
  // device: cuda runs the layouts parallel/parallelize.h lists.
  parallel::check_device_layout(
      r, static_cast<int>(std::max<int64_t>(1, r.parallel.data) * r.parallel.tensor * r.parallel.pipeline *
                          r.parallel.context));
  // With tensor or pipeline parallelism this is the whole model, which only holds weights (each
  // rank trains its shard of its stage): no gradient buffer.
  const bool sharded = r.parallel.tensor > 1 || r.parallel.pipeline > 1;
  spec.gradients = !sharded;
  // Without init_from it is even a table only: each rank initialises (the whole model's values,
  // sliced) or reads from the checkpoint its own share, so no rank ever holds every weight
  // (train/session.cpp). init_from still loads the whole HF model once per rank.
  pf.table_only = sharded && r.init_from.empty() && !check_only;
  if (pf.table_only) spec.parameters = false;
  log.ok(fmt::format(
      "precision: {} compute on {}, fp32 master weights, gradients and moments; {}", r.precision.compute,
      spec.backend->name(),
      lscfg.enabled ? fmt::format("dynamic loss scaling from {} (x{} after {} clean steps, x{} on overflow, min {})",
                                  lscfg.initial, lscfg.growth, lscfg.growth_interval, lscfg.backoff, lscfg.min)
                    : std::string("no loss scaling")));
  for (const std::string& n : r.notes) log.note(n);
  // One line (train and check alike) naming the instruction set found and the bf16/fp16 GEMM path
  // chosen for it (kernels/cpu/ops_bf16.h): on the fp32 path, that bf16 is not faster here.
  if (spec.dtype != DType::F32 && spec.backend->name() == "cpu") log.note(cpu::lowp_compute_line(r.precision.compute));

  // 4. output directory
  probe_output_dir(r, check_only);
  log.ok(fmt::format("output.dir {} is writable", r.output.dir));

  // 5. the checkpoint to resume from
  pf.ckpt = resolve_checkpoint(r, opts, log);
  bool exact = true;
  if (!pf.ckpt.empty()) {
    pf.cs = read_checkpoint_state(pf.ckpt);
    exact = check_recipe_changes(r, opts, pf, log);
    adapt_data_position(pf.cs, r, static_cast<int64_t>(pf.train_samples.size()), log);
    check_resume_state(pf.cs, r, static_cast<int64_t>(pf.train_samples.size()), exact, pf.ckpt, pf.blend_plan.get());
  }

  // 6. the model (and the optimizer it comes with): the whole memory figure first (parameters,
  // gradients, two moments, activations for micro_batch_size x seq_len), refused with the numbers
  // before anything is allocated.
  const int64_t data = std::max<int64_t>(1, r.parallel.data);
  // Before the per-rank figure (whose tensor shard of a MoE model would fail less clearly).
  const ModelConfig moe_cfg =
      pf.ckpt.empty() && !r.init_from.empty() ? init_from_config(r.model, r.init_from, r.source) : r.model;
  check_moe_layout(r, moe_cfg, log);
  check_expert_layout(r, moe_cfg, data);
  const Recompute rc = parse_recompute(r.recompute, r.source + ": recompute");
  check_rank_memory(r, B, T, data, rc, spec.dtype, sharded, log);
  pf.shard_weights = r.parallel.zero == 3 && data > 1 && r.init_from.empty() && !check_only && !sharded;
  if (pf.shard_weights) spec.touch_parameters = false;
  if (!pf.ckpt.empty()) {
    pf.model = build_model(r.model, spec);  // weights come from the checkpoint below
  } else if (!r.init_from.empty()) {
    // load_hf_model's steps, with the compute spec: the directory's config with the recipe's
    // overrides (rope_theta, rope_scaling, ...; shape keys refused), its memory checked before
    // anything is allocated, the model, the strict weight loader.
    std::vector<std::string> overrides;
    const ModelConfig hf = init_from_config(r.model, r.init_from, r.source, &overrides);
    check_memory_fits(estimate_memory(hf, 0, 0, 0, 1, spec.dtype), hf,
                      (fs::path(r.init_from) / "config.json").string());
    pf.model = build_model(hf, spec);
    pf.init_report = load_hf_weights(*pf.model, r.init_from);
    for (const std::string& o : overrides) pf.init_report += "; " + o;
    log.ok(fmt::format("model.init_from {}: {}", r.init_from, pf.init_report));
  } else {
    pf.model = build_model(r.model, spec);
  }
  log.ok(fmt::format("model {}: {} parameters", r.model.model_type, pf.model->num_params()));
  if (r.parallel.tensor > 1) {
    // Heads, KV heads and the MLP width must split evenly (the vocabulary may split unevenly); the
    // trainer builds each rank's model from this config and keeps pf.model (unallocated) as the
    // whole model for checkpoints. Rank 0's config: the largest vocabulary shard.
    const int tp = static_cast<int>(r.parallel.tensor);
    const ModelConfig shard = parallel::shard_config(pf.model->config(), tp);
    const TensorShard ts = parallel::tensor_shard(pf.model->config(), tp, r.parallel.sequence);
    const int64_t last_rows = parallel::vocab_shard(ts.vocab(shard), static_cast<int>(r.parallel.tensor),
                                                    static_cast<int>(r.parallel.tensor) - 1)
                                  .rows;
    log.ok(
        fmt::format("tensor parallel {}{}: {} of {} heads, {} of {} KV heads, MLP width {}, {} of {} vocabulary rows "
                    "per rank",
                    r.parallel.tensor, r.parallel.sequence ? " + sequence parallel" : "", shard.num_attention_heads,
                    pf.model->config().num_attention_heads, shard.num_key_value_heads,
                    pf.model->config().num_key_value_heads, shard.intermediate_size,
                    last_rows == shard.vocab_size ? fmt::format("{}", shard.vocab_size)
                                                  : fmt::format("{} (first ranks) or {}", shard.vocab_size, last_rows),
                    ts.vocab(shard)));
    // One rank's figure (its shard of the parameters, its activations; sequence parallelism's saving;
    // with context parallelism T / context rows, ZeRO over data x context).
    const int64_t ctx = std::max<int64_t>(1, r.parallel.context);
    TensorShard ts_rank = ts;
    if (ctx > 1) ts_rank.context_T = T;
    log.ok(fmt::format("memory per tensor-parallel rank: {}",
                       estimate_memory(shard, B, T / ctx, kMoments, r.parallel.zero > 0 ? data * ctx : 1, spec.dtype,
                                       rc, ts_rank)
                           .breakdown()));
  }
  if (r.parallel.pipeline > 1) {
    // The stages and the schedule must work for this model (errors name the values); the trainer
    // builds each rank's stage from pf.model (kept unallocated as the whole model).
    const parallel::PipelineLayout pl =
        parallel::pipeline_layout(r, pf.model->config().num_hidden_layers, pf.model->arch().tied_lm_head, 0);
    log.ok(parallel::describe_pipeline(pl));
  }
  if (r.parallel.context > 1)  // each rank holds T / context rows of every sample (parallel/context_parallel.h)
    log.ok(fmt::format("context parallel {} ({}): {} of {} positions per rank, 2 chunks of {}", r.parallel.context,
                       r.parallel.context_impl, T / r.parallel.context, T, T / (2 * r.parallel.context)));
  // Context parallelism: the trainer allocates the model for its rows once the context group exists.
  if (r.parallel.tensor == 1 && r.parallel.pipeline == 1 && r.parallel.context == 1 && !check_only) {
    pf.model->allocate(B, T, kMoments, rc);
  }
  if (!pf.ckpt.empty() && check_only) {
    // Everything, moments included, into a full-size optimizer that is then dropped.
    auto full = optim::make_optimizer(ocfg, pf.model->num_params());
    load_checkpoint(pf.ckpt, *pf.model, full.get());
    log.ok(fmt::format("checkpoint {}: step {}, files, tensor table, weights and moments valid", pf.ckpt, pf.cs.step));
  } else if (!pf.ckpt.empty() && (pf.table_only || pf.shard_weights)) {
    // Sizes and checksums of every file; each rank reads its own weights and moments
    // (train/session.cpp), checking each tensor's shape against the table.
    verify_checkpoint(pf.ckpt);
    log.ok(fmt::format("checkpoint {}: step {}, files valid (each rank reads its share)", pf.ckpt, pf.cs.step));
  } else if (!pf.ckpt.empty()) {
    // The weights now; each rank reads only the moments of its own shard (train/checkpointer.cpp), so no
    // rank ever holds the full moments of a ZeRO run.
    load_checkpoint(pf.ckpt, *pf.model, nullptr);
    log.ok(fmt::format("checkpoint {}: step {}, files, tensor table and weights valid", pf.ckpt, pf.cs.step));
  }
  preflight_tokens_and_tasks(r, log, pf);
  // A stop request that arrived during the checks: stop before step 1 rather than after it.
  if (opts.handle_signals && !check_only && g_stop_request.load() != 0)
    throw Interrupted(fmt::format("received {} during startup: stopped before step 1 (nothing trained, no checkpoint "
                                  "written); run the same command again to start",
                                  g_stop_request.load() == SIGTERM ? "SIGTERM" : "SIGINT"),
                      kExitStopped);
  return pf;
}

}  // namespace lathe
