// The one validation path: everything `lathe train` checks before its first step, in one function
// that `lathe check` runs too, so that a recipe check passes is a recipe train starts on (issue 14).
// In order, each failure a lathe::Error naming the file / field and the fix:
//   1. datasets: data.train / data.valid open (headers, sizes, dtype), enough samples of seq_len
//      for one micro-batch; or every data.blend prefix (one dtype) and the run's blend plan (epoch
//      caps), built or taken from the cache in OUTPUT/data_cache (check never writes it);
//   2. consistency of model, tokenizer and data (train/consistency.h): vocabulary sizes, special
//      ids, every dataset's largest token id < model.vocab_size;
//   3. optimizer, schedule and loss-scale settings (optim::validate), and that this build computes
//      in precision.compute (kernels/backend.h ops_for: a missing bf16/fp16 table is named);
//      the recipe's notes (ignored keys) are passed to `note`;
//   4. the output directory: output.dir created when missing and proven writable with a probe
//      file (check removes the probe and the directories it created), checkpoints/ readable;
//   5. resume (training.resume or --resume): the checkpoint found (auto: newest complete one,
//      `latest` only as a hint), state.json valid field by field, the recipe diff (breaking
//      changes refused unless forced), the checkpoint's state against this run (step <=
//      training.steps, consumed_samples = step x micro_batch_size x grad_accum_steps, loader
//      epoch/position where this data puts them, rng = training.seed, optimizer name, world),
//      every file's checksum;
//   6. the model: built from the recipe (dimensions; the memory check of build_model), or loaded
//      from model.init_from (the strict HF loader: every tensor name, shape and dtype), or with a
//      checkpoint its tensor table matched and its weights and moments loaded (finite values).
//   7. data.tokenizer loaded; the EOD id that data.attention: document, reset_position_ids and
//      mask_loss_after_eod need (data.eod_token or the tokenizer's EOS); with mask_loss_after_eod,
//      that each training / validation dataset has targets (not every token the EOD id);
//      training.eval_tasks read and checked (the file, every line, labels, token ids, and every
//      ending shorter than the positions scored, named by line).
// A stop request (core/stop.h: SIGINT / SIGTERM to `lathe train`, opts.handle_signals) during the
// blend planning throws lathe::Interrupted (exit 75, nothing written).
// Train continues from the returned state (model, optimizer, datasets, checkpoint); check prints
// each line passed to `ok` and discards the rest.
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "config/recipe.h"
#include "core/stop.h"
#include "data/blend.h"
#include "data/indexed_dataset.h"
#include "eval/eval_tasks.h"
#include "models/documents.h"
#include "models/model.h"
#include "optim/loss_scaler.h"
#include "optim/optimizer.h"
#include "optim/schedule.h"
#include "tokenizer/tokenizer.h"
#include "train/checkpoint.h"
#include "train/trainer.h"

namespace lathe {

struct Preflight {
  std::shared_ptr<const data::IndexedDataset> train_ds, valid_ds;  // valid_ds: null for a blend without data.valid
  std::vector<int64_t> train_samples, valid_samples;
  // data.blend (train_ds null, train_samples empty): the datasets in entry order and the plan of the
  // run's training.steps x global batch samples, from OUTPUT/data_cache (data/blend_cache.h).
  std::vector<std::shared_ptr<const data::IndexedDataset>> blend_ds;
  std::shared_ptr<const data::BlendPlan> blend_plan;
  std::string ckpt;              // checkpoint this run continues from; "" = fresh start
  CheckpointState cs;            // its state (when ckpt is set)
  std::unique_ptr<Model> model;  // built; weights from init_from or the checkpoint (else to be initialised)
  // Tensor / pipeline parallelism without init_from (train, not check): `model` is the whole
  // model's table only (no parameters); the ranks initialise or read their own shares.
  bool table_only = false;
  // ZeRO 3 over several data ranks without init_from (train, not check): `model`'s buffers are
  // reserved untouched and hold no weights yet; each rank initialises or reads its weight shard
  // only (train/session.cpp), so startup holds the shard, not the whole model.
  bool shard_weights = false;
  std::string init_report;  // load report of model.init_from ("" otherwise)
  // Step 7: data.tokenizer (null when unset), the EOD settings and training.eval_tasks' items.
  std::unique_ptr<tok::Tokenizer> tokenizer;
  DocumentOptions docs;
  std::vector<McItem> mc_items;
};

struct PreflightLog {
  std::function<void(const std::string&)> ok;    // a check that held, with its figures
  std::function<void(const std::string&)> note;  // resume decisions (train prints them even when quiet)
};

// Samples the blend plan of a data.blend run holds: training.steps x global batch, plus what anomaly
// rollbacks (training.anomaly) may skip: the plan is a prefix-stable sequence, so a longer plan
// hands out the same samples first. Refused (naming the plan's size, the memory and the keys
// training.steps, the batch and training.anomaly.skip_samples / max_rollbacks) when the plan
// (12 bytes a sample, in memory and in its cache file) would take more than half this machine's
// memory (models/memory.h machine_memory; 1 TiB when unknown).
int64_t blend_plan_samples(const Recipe& r);
constexpr int64_t kBlendPlanBytesPerSample = 12;  // u32 dataset + i64 sample (data/blend_cache.h)

// data.attention: document / reset_position_ids / mask_loss_after_eod with their EOD id:
// data.eod_token, or the tokenizer's EOS id; refused naming data.eod_token when neither gives one.
DocumentOptions recipe_documents(const Recipe& r, const tok::Tokenizer* tokenizer);
// The recipe's sections in optim's terms (optimizer_config, schedule_config, loss_scale_config):
// config/recipe.h.
// precision.compute on the backend of the recipe's device (kernels/backend_select.h: refused with the reason
// when this build or machine cannot run it). Throws lathe::Error naming the recipe, precision.compute
// and the missing op (kernels/backend.h ops_for) when this build has no complete table for it.
ComputeSpec compute_spec(const Recipe& r);

// check_only: `lathe check` — no activations allocated (their size is still checked), and the
// output directory is left as it was found.
// The parallel degrees for a job of `world` processes: parallel.data 0 becomes world / (tensor x
// pipeline); the product must equal `world` (the error names every number). Before preflight.
void resolve_layout(Recipe& r, int64_t world);

Preflight preflight(const Recipe& r, const TrainOptions& opts, const PreflightLog& log, bool check_only);

// The checkpoint's state against the run that resumes it (step 5 above); `ckpt` names it in errors.
// exact: the recipe has no breaking changes, so the loader position must be exactly where
// `train_samples` samples per epoch put it (with forced changes only its range is checked, and
// consumed_samples against the checkpoint's own global batch, which may have changed).
// A blend (r.data.blend) has no loader epochs: position = step x global batch, and with `plan` the
// recorded samples taken per dataset and the plan's hash up to there must match this run's plan.
void check_resume_state(const CheckpointState& cs, const Recipe& r, int64_t train_samples, bool exact,
                        const std::string& ckpt, const data::BlendPlan* plan = nullptr);

}  // namespace lathe
