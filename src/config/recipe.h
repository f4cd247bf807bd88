// Training recipe: one YAML file with sections model / data / optimizer / schedule / training /
// output. Everything is parsed and validated before any work starts, and every error names the
// file, the key path and the offending value:
//   recipe.yaml: unknown key 'optimizer.lrr' (did you mean 'optimizer.lr'?)
//   recipe.yaml: training.seq_len: expected an integer, got 'abc'
//   recipe.yaml: training.seq_len = 512 exceeds model.max_position_embeddings = 256
// Each key is one row of config/recipe_schema.cpp (its member here, whose initializer is the
// default; its bounds; its effect on a resume); the rows generate parsing, the known keys,
// the bounds checks and to_json. The optimizer, schedule and loss-scale sections are optim's
// configs (optim/optimizer.h, schedule.h, loss_scaler.h) with their defaults.
//
// Example:
//   model:    {preset: gpt2-debug, n_layer: 4}     # or init_from: HF_DIR, or config: x.json,
//                                                  # or model_type: gpt2 + HF field names
//   data:     {train: data/shakespeare_byte, valid_fraction: 0.1, tokenizer: byte}
//   optimizer:{name: adamw, lr: 1.0e-3, weight_decay: 0.1, grad_clip: 1.0}
//   schedule: {name: cosine, warmup_steps: 20, min_lr: 1.0e-4}
//   training: {micro_batch_size: 16, seq_len: 128, steps: 600}
//   precision:{compute: bf16}                      # fp32 (default) | bf16 | fp16
//   output:   {dir: runs/quickstart}
//
// model section: at most one base among `preset: NAME`, `init_from: HF_DIR` (reads
// HF_DIR/config.json; the trainer loads HF_DIR's weights) and `config: path/to/config.json`;
// explicit HF field names override the base. Without a base, `model_type` is required and missing
// fields take the HF class defaults. Unknown model keys are errors (with a suggestion).
//
// Relative paths (data.train, data.valid, data.tokenizer, model.init_from, model.config,
// output.dir) are resolved relative to the CURRENT WORKING DIRECTORY of the process, not the
// recipe file's directory; they are stored as written.
//
// The YAML is untrusted: one document only, no explicit tags (quoted scalars are strings), no
// duplicate keys or sections, at most 32 levels of nesting and 100,000 values after alias
// expansion (alias cycles are named). Every float field must be finite.
//
// Overrides: "section.key=value" (e.g. "training.steps=10", "model.n_layer=2",
// "optimizer.lr=1e-3"); the value is parsed as a YAML scalar and applied before validation. An
// unknown key in an override is reported like one in the file, mentioning --set.
#pragma once
#include <algorithm>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "config/model_config.h"
#include "optim/loss_scaler.h"
#include "optim/optimizer.h"
#include "optim/schedule.h"

namespace lathe {

// Documented bounds of the recipe's integer fields. Beyond them a value is a typo or hostile, and
// the products the trainer forms (steps x micro_batch_size x grad_accum_steps x seq_len) must fit
// 64 bits; the check refuses them naming the field. training.seed takes any 64-bit value; the
// model's dimensions are bounded in config/model_config.h.
constexpr int64_t kMaxMicroBatch = 65536;         // training.micro_batch_size in [1, 65536]
constexpr int64_t kMaxGradAccum = 65536;          // training.grad_accum_steps in [1, 65536]
constexpr int64_t kMaxSteps = 1'000'000'000'000;  // steps, warmup_steps, *_interval, *_every
constexpr int64_t kMaxSeqLen = int64_t{1} << 26;  // training.seq_len (also <= the model's positions)
constexpr int64_t kMaxEvalBatches = 1'000'000;    // training.eval_batches in [1, 1e6]
constexpr int64_t kMaxThreads = 4096;             // training.threads in [0, 4096]
constexpr int64_t kMaxPrefetch = 64;              // data.prefetch in [0, 64]
constexpr int64_t kMaxKeepLast = 1'000'000;       // output.keep_last in [0, 1e6]
constexpr int64_t kMaxRanks = 1 << 20;            // parallel degrees
// parallel.timeout_s: 0 (no watchdog) or in [1 s, ~116 days]; training.anomaly.min_rel_std >= 1e-6.
constexpr double kMinTimeoutS = 1, kMaxTimeoutS = 1e7;
constexpr double kMinRelStd = 1e-6;

struct Recipe {
  std::string source;  // file path (or the name given to parse_recipe)
  // Activations recomputed in backward instead of kept: none | selective | full (bit-identical
  // results; models/recompute.h). A top-level value of the recipe: `recompute: full`.
  std::string recompute = "none";
  // Where the model computes: cpu | cuda (a top-level value: `device: cuda`, `--set device=cuda`).
  // cuda needs a CUDA build and a visible GPU (kernels/backend_select.h says which is missing).
  std::string device = "cpu";
  // model.attention_kernel: lathe (default: lathe's attention kernels) | cudnn (cuDNN's fused SDPA
  // forward and backward; device: cuda with bf16/fp16 compute in a build with cuDNN; document-masked
  // passes still run lathe's kernel). Not an HF config field: a key of the recipe's model section.
  std::string attention_kernel = "lathe";
  ModelConfig model;
  std::string init_from;  // HF dir whose weights initialize the model; "" = random init

  struct Data {
    std::string train;             // Megatron prefix (without .bin/.idx); required unless `blend`
    std::string valid;             // Megatron prefix; empty -> hold out valid_fraction of train
    double valid_fraction = 0.05;  // [0, 1)
    std::string tokenizer;         // "byte", a tokenizer file path, or "" (none)
    int prefetch = 2;              // batches prepared ahead, >= 0
    // Weighted blend of prefixes instead of `train` (data/blend.h; exactly one of the two):
    // `blend: [{prefix: data/web, weight: 0.7}, {prefix: data/books, weight: 0.3, epochs: 2}]`.
    // weight > 0 (need not sum to 1); epochs > 0 caps the passes over that prefix (0 = no cap).
    // Validation needs data.valid (valid_fraction does not apply to a blend).
    struct BlendEntry {
      std::string prefix;
      double weight = 0;
      double epochs = 0;
    };
    std::vector<BlendEntry> blend;
    // Documents packed in samples (issue 11; models/documents.h): "causal" attends across the whole
    // sample, "document" only within each token's document (split after every EOD token).
    std::string attention = "causal";
    bool reset_position_ids = false;   // positions restart at 0 after every EOD (wpe / RoPE)
    bool mask_loss_after_eod = false;  // no loss on the prediction made at an EOD token
    int64_t eod_token = -1;            // -1: the tokenizer's EOS id (needed by the three above)
  } data;

  // optimizer: {name, lr, beta1, beta2, eps, weight_decay, grad_clip} (optim/optimizer.h, with the
  // defaults). grad_clip 0 = no clipping.
  using Optimizer = optim::OptimConfig;
  Optimizer optimizer;

  // schedule: {name, warmup_steps, min_lr, decay_fraction, decay_shape} (optim/schedule.h, with the
  // defaults; the peak rate is optimizer.lr and the length training.steps).
  // "cosine": linear warmup, cosine from lr to min_lr at `steps`.
  // "linear": linear warmup, linear decay to min_lr at `steps`.
  // "constant": linear warmup, then lr.
  // "wsd": warmup, stable at lr, then the last decay_fraction of steps decays to min_lr with
  //        decay_shape "linear", "cosine" or "1-sqrt".
  using Schedule = optim::ScheduleSpec;
  Schedule schedule;

  struct Training {
    int64_t micro_batch_size = 4, seq_len = 64, grad_accum_steps = 1, steps = 100, seed = 1234,
            eval_interval = 50,  // 0 = no periodic eval
        eval_batches = 8, log_interval = 1;
    int threads = 0;         // 0 = all cores
    double peak_gflops = 0;  // 0 = measure with a GEMM probe at start
    // "" = start fresh; "auto" = newest complete checkpoint of output.dir (fresh if none);
    // otherwise a checkpoint directory. `lathe train --resume` overrides it.
    std::string resume;
    // A step whose loss or gradient norm is NaN/Inf is skipped (no update; data, step counter and
    // schedule advance). This many consecutive skipped steps stop the run; 0 = never stop.
    int64_t max_skipped_steps = optim::kDefaultMaxSkippedSteps;
    // Multiple-choice task file (eval/eval_tasks.h; JSONL context/endings/label) scored every
    // eval_tasks_interval steps (0 = at training.eval_interval) and at the end; "" = none.
    std::string eval_tasks;
    int64_t eval_tasks_interval = 0;
    // Loss-spike and NaN policy (train/anomaly.h; README "Loss spikes and NaN"). Off by default.
    struct Anomaly {
      bool enabled = false;
      int64_t warmup_steps = 100;          // observed steps before spikes are detected
      double ema_decay = 0.99;             // (0, 1): running mean/variance of the loss and the norm
      double loss_z_threshold = 6.0;       // z-score of a loss spike; 0 = the loss is not watched
      double grad_norm_z_threshold = 6.0;  // z-score of a gradient-norm spike; 0 = not watched
      double min_rel_std = 0.01;           // the deviation is at least this fraction of the mean
      bool skip = true;                    // skip the update of an anomalous step
      double lr_factor = 0.5;              // (0, 1]: learning rate multiplier after an anomaly ...
      int64_t lr_steps = 100;              // ... for this many steps (0 = never lowered)
      int64_t rollback_after = 3;          // this many anomalies within rollback_window steps roll
      int64_t rollback_window = 100;       // back to the newest healthy checkpoint (0 = never)
      int64_t skip_samples = -1;           // samples skipped after it; -1 = those consumed since it
      int64_t max_rollbacks = 3;           // one more needed rollback stops the run
    } anomaly;
  } training;

  // Mixed precision (issue 9; optim/loss_scaler.h). compute: the dtype of the model's activations
  // and GEMM operands ("fp32", "bf16", "fp16"); master weights, gradients, optimizer moments and
  // checkpoints stay fp32 whatever it is.
  struct Precision {
    std::string compute = "fp32";
    // Dynamic loss scaling (optim/loss_scaler.h, with the defaults): on for fp16 unless `enabled:
    // false`; ignored for fp32/bf16 (with a note) unless `enabled: true`, which scales the loss in
    // any precision (exact in fp32 with power-of-two scales: tests use it to exercise the scaler
    // without an fp16 model).
    using LossScale = optim::LossScaleSpec;
    LossScale loss_scale;  // enabled: resolved, true for fp16 unless set
  } precision;

  // Multi-process layout (issue 8). The product of the degrees is the number of processes
  // (mpirun -np); checked against the world size when training starts.
  struct Parallel {
    int64_t data = 0;        // data-parallel degree; 0 = world size / (tensor x pipeline)
    int64_t tensor = 1;      // tensor-parallel degree (parallel/tensor_parallel.h)
    bool sequence = false;   // sequence parallelism over the tensor-parallel ranks (needs tensor > 1)
    // Ranks are ordered tensor fastest, then data, then pipeline (Megatron's order): world rank =
    // (pipeline_rank x data + data_rank) x tensor + tensor_rank.
    int64_t pipeline = 1;        // pipeline stages (parallel/pipeline_executor.h); tensor must be 1 with it for now
    int64_t virtual_stages = 1;  // model chunks per pipeline rank; > 1 runs interleaved 1F1B
    // Decoder layers per virtual stage (pipeline x virtual_stages entries, summing to the layer
    // count; virtual stage k on pipeline rank k % pipeline); empty = even (pipeline x
    // virtual_stages must divide the layers then).
    std::vector<int64_t> stage_layers;
    int64_t zero = 0;        // 0: replicated optimizer; 1, 2: moments sharded, gradients reduce-scattered;
                             // 2: only the gradient shard kept after the reduction (parallel/grad_sync.h)
                             // (2 does not free the rest of the gradient buffer yet);
                             // 3: also the fp32 weights sharded, gathered per block (parallel/param_gather.h)
    int64_t prefetch = 1;    // ZeRO 3: blocks whose all-gather is issued ahead of the block computing (0..2)
    int64_t shard_group = 0;  // ZeRO 3: weights sharded over groups of this many data ranks (0: all)
    double bucket_mb = 25;   // gradient reduction bucket size (fp32 MB), > 0
    double timeout_s = 300;  // a collective not done after this long aborts the job (0 = never)
    // Context parallelism (parallel/context_parallel.h, issue 27): each sample's sequence cut over
    // `context` ranks (2 x context load-balanced chunks); ranks ordered tensor, context, data,
    // pipeline. context_impl: how attention reaches the other ranks' keys (ring | allgather).
    int64_t context = 1;
    std::string context_impl = "ring";
    // Expert parallelism (parallel/expert_parallel.h, issue 28): each MoE layer's experts spread over
    // groups of `expert` consecutive data ranks (1 = every rank runs every expert).
    int64_t expert = 1;
  } parallel;
  struct Output {
    std::string dir = "runs/default";
    int64_t save_every = 0;  // HF model dir every N steps; 0 = only at the end
    // Full training-state checkpoint (src/train/checkpoint.h) into dir/checkpoints/ every N steps
    // and at the end; 0 = none (a SIGTERM/SIGINT still writes one).
    int64_t checkpoint_every = 0;
    int64_t keep_last = 0;  // keep the newest N checkpoints; 0 = keep all
    bool tensorboard = false;  // TensorBoard event files in dir/tensorboard/ (train/tensorboard.h)
  } output;

  // Things the recipe says that lathe accepts but ignores (e.g. precision.loss_scale for bf16):
  // one line each, printed by `lathe train` and `lathe check`. Not part of to_json().
  std::vector<std::string> notes;

  nlohmann::json to_json() const;  // fully resolved (model as HF fields)
  std::string to_yaml() const;     // resolved recipe, printable and re-loadable
};

// Samples per optimizer step: micro_batch_size x grad_accum_steps x parallel.data (0 counts as 1:
// the degree is resolved against the world size when training starts).
inline int64_t global_batch_samples(const Recipe& r) {
  return r.training.micro_batch_size * r.training.grad_accum_steps * std::max<int64_t>(1, r.parallel.data);
}

// The recipe's settings in optim's terms: the optimizer section itself; the schedule section with
// the peak rate (optimizer.lr) and the run's length (training.steps); precision.loss_scale with
// training.max_skipped_steps.
inline const optim::OptimConfig& optimizer_config(const Recipe& r) { return r.optimizer; }
inline optim::ScheduleConfig schedule_config(const Recipe& r) {
  return {r.schedule, r.optimizer.lr, r.training.steps};
}
inline optim::LossScaleConfig loss_scale_config(const Recipe& r) {
  return {r.precision.loss_scale, r.training.max_skipped_steps};
}

Recipe load_recipe(const std::string& path, const std::vector<std::string>& overrides = {});
Recipe parse_recipe(const std::string& yaml_text, const std::string& source,
                    const std::vector<std::string>& overrides = {});
// Closest candidate by Levenshtein distance (case-insensitive); "" if nothing is close (distance
// above max(2, len/3)).
std::string closest_match(std::string_view key, const std::vector<std::string>& candidates);

}  // namespace lathe
